"""The patch's two 64K guards, exercised on the patched SGLang 0.5.23 source itself (taken from the
pinned wheel and patched with GNU patch at test time; nothing of SGLang is copied into this repo).

- grid.y guard (``moe_topk_sum``): on CPU, with the JIT kernel module replaced at its launch
  boundary by a stand-in that enforces CUDA's 65,535 limit on grid.y (one token per grid.y block).
- int64 guard (``_situ_and_mul_kernel``): on a GPU, at K3's EP-width shard where tokens x top-k rows
  times the row stride passes 2**31 elements.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.sglang_patching.pinned_wheel import extract_from_wheel, fetch_wheel
from runtime.sglang_patching.tree import check_tree
from runtime.shared.sglang_patch_manifest import PatchError, load_manifest

TOPK_SUM = "sglang/kernels/ops/moe/moe_topk_sum.py"
MARLIN_MOE = "sglang/srt/layers/moe/fused_moe_triton/fused_marlin_moe.py"
CUDA_MAX_GRID_Y = 65535
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def patched_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed (apt-get install patch)")
    target = load_manifest().resolve(None)[0]
    try:
        wheel = fetch_wheel(target)
    except PatchError as exc:  # a machine without network: carry .cache/sglang/<wheel> to it
        pytest.skip(f"the pinned SGLang wheel is not available here: {exc}")
    root = extract_from_wheel(wheel, target.files, tmp_path_factory.mktemp("patched"))
    report = check_tree(root, apply=True)
    assert report.ok, report.render()
    return root


def _definitions(path: Path, names: set[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute only the named top-level definitions of a source file in ``namespace``."""
    tree = ast.parse(path.read_text())

    def name_of(node: ast.stmt) -> str | None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node.name
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return node.target.id
        return None

    keep = [node for node in tree.body if name_of(node) in names]
    assert {name_of(n) for n in keep} == names, f"{path} lacks some of {names}"
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


class GridLimitedTopkSum:
    """Stands in for the JIT ``TopkSumKernel``: refuses what CUDA would refuse to launch."""

    def __init__(self) -> None:
        self.launch_rows: list[int] = []

    def run(self, x: torch.Tensor, out: torch.Tensor) -> None:
        rows = x.shape[0]
        if rows > CUDA_MAX_GRID_Y:
            raise RuntimeError(f"invalid configuration argument: grid.y = {rows} > {CUDA_MAX_GRID_Y}")
        assert x.is_contiguous() and out.is_contiguous() and out.shape[0] == rows
        self.launch_rows.append(rows)
        out.copy_(x.float().sum(dim=1).to(out.dtype))


@pytest.mark.parametrize("rows", [1, 4096, 65535, 65536, 66048, 3 * 65535 + 7])
def test_topk_sum_never_launches_more_than_65535_rows_on_grid_y(patched_root: Path, rows: int) -> None:
    kernel = GridLimitedTopkSum()
    ns = _definitions(
        patched_root / TOPK_SUM,
        {"_MAX_GRID_Y_ROWS", "moe_topk_sum"},
        {"torch": torch, "_jit_topk_sum_module": lambda: kernel},
    )
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2, 8, generator=gen).to(torch.bfloat16)
    out = torch.empty(rows, 8, dtype=torch.bfloat16)
    assert ns["moe_topk_sum"](x, out) is out
    assert torch.equal(out, x.float().sum(dim=1).to(torch.bfloat16))
    assert sum(kernel.launch_rows) == rows and max(kernel.launch_rows) <= CUDA_MAX_GRID_Y
    assert len(kernel.launch_rows) == -(-rows // CUDA_MAX_GRID_Y)  # one launch whenever it fits


def test_unpatched_topk_sum_would_exceed_grid_y_at_64k(tmp_path: Path) -> None:
    target = load_manifest().resolve(None)[0]
    root = extract_from_wheel(fetch_wheel(target), [TOPK_SUM], tmp_path)
    kernel = GridLimitedTopkSum()
    ns = _definitions(root / TOPK_SUM, {"moe_topk_sum"}, {"torch": torch, "_jit_topk_sum_module": lambda: kernel})
    x = torch.zeros(65536, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="grid.y = 65536 > 65535"):
        ns["moe_topk_sum"](x, torch.empty(65536, 8, dtype=torch.bfloat16))


def _situ_reference(x: torch.Tensor, inter: int) -> torch.Tensor:
    gate, up = x[:, :inter].float(), x[:, inter:].float()
    return 4.0 * torch.tanh(gate / 4.0) * torch.sigmoid(gate) * up


INTERPRETED = r"""
import sys, typing
import torch, triton, triton.language as tl
from pathlib import Path
from tests.test_patch_guards import MARLIN_MOE, _definitions, _situ_reference
ns = _definitions(Path(sys.argv[1]) / MARLIN_MOE, {"_tl_tanh", "_situ_and_mul_kernel", "situ_and_mul"},
                  {"torch": torch, "triton": triton, "tl": tl, "Optional": typing.Optional})
rows, inter = 37, 1500  # a partial last column block
x = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
out = torch.zeros(rows, inter, dtype=torch.bfloat16)
ns["situ_and_mul"](out, x, situ_beta=4.0, linear_beta=None)
torch.testing.assert_close(out.float(), _situ_reference(x, inter), rtol=2e-2, atol=2e-2)
print("INTERPRETED OK")
"""


def test_patched_situ_and_mul_in_the_triton_interpreter(patched_root: Path) -> None:
    pytest.importorskip("triton")
    # Triton reads TRITON_INTERPRET when it is imported: a fresh process
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETED, str(patched_root)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0 and "INTERPRETED OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
def test_patched_situ_and_mul_is_exact_past_2_31_elements(patched_root: Path) -> None:
    import triton
    import triton.language as tl

    ns = _definitions(
        patched_root / MARLIN_MOE,
        {"_tl_tanh", "_situ_and_mul_kernel", "situ_and_mul"},
        {"torch": torch, "triton": triton, "tl": tl, "Optional": __import__("typing").Optional},
    )
    # K3 at 64K tokens: 65,536 x top-16 rows; an expert-parallel (unsharded) intermediate of 3,072
    tokens, top_k, inter = 65536, 16, 3072
    rows = tokens * top_k
    assert (rows - 1) * 2 * inter > 2**31  # the last rows' offsets wrap in int32
    device = torch.device("cuda")
    x = torch.empty(rows, 2 * inter, dtype=torch.bfloat16, device=device)
    x.view(-1)[:] = 0.5
    tail = slice(rows - 64, rows)
    gen = torch.Generator(device=device).manual_seed(0)
    x[tail] = torch.randn(64, 2 * inter, generator=gen, device=device).to(torch.bfloat16)
    out = torch.zeros(rows, inter, dtype=torch.bfloat16, device=device)
    ns["situ_and_mul"](out, x, situ_beta=4.0, linear_beta=None)
    torch.cuda.synchronize()
    torch.testing.assert_close(out[tail].float(), _situ_reference(x[tail], inter), rtol=2e-2, atol=2e-2)
    head = out[: rows - 64]
    first = head[0].float()
    assert torch.all(head[-1].float() == first) and torch.all(first != 0)
