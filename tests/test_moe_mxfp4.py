"""MXFP4: packing, quantization and dequantization against direct scalar references; the Triton
kernel (interpreted on CPU, compiled on GPU) against the torch reference; large tensors."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from runtime.moe.mxfp4 import (
    MXFP4Tensor,
    dequantize_reference,
    dequantize_reference_chunked,
    pack_e2m1,
    quantize_mxfp4,
    unpack_e2m1,
)
from runtime.moe.mxfp4_triton import MAX_PROGRAMS_PER_LAUNCH, plan_launches
from tests.conftest import REPO_ROOT

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def direct_value(nibble: int, scale_byte: int) -> float:
    """The OCP definition, one element at a time, in Python floats."""
    if scale_byte == 255:
        return math.nan
    code = nibble & 7
    exponent, mantissa = code >> 1, code & 1
    magnitude = 0.5 * mantissa if exponent == 0 else 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa)
    return (-magnitude if nibble & 8 else magnitude) * 2.0 ** (scale_byte - 127)


def direct_quantize_group(values: list[float]) -> tuple[list[int], int]:
    """Nearest E2M1 code (ties to the even code, saturating at 6) under the OCP shared exponent."""
    amax = max(abs(v) for v in values)
    exponent = -127 if amax == 0 else max(-127, min(127, math.frexp(amax)[1] - 1 - 2))
    scale = 2.0**exponent
    codes = []
    for v in values:
        y = min(abs(v) / scale, 6.0)
        distances = [abs(y - m) for m in MAGNITUDES]
        best = min(distances)
        candidates = [c for c, d in enumerate(distances) if d == best]
        code = candidates[0] if len(candidates) == 1 else next(c for c in candidates if c % 2 == 0)
        codes.append(code | (8 if v < 0 and code else 0))
    return codes, exponent + 127


def test_pack_puts_even_elements_in_the_low_nibble_and_round_trips() -> None:
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    every = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_e2m1(pack_e2m1(every)), every)


def test_dequantize_reference_equals_the_definition_for_every_byte_and_edge_scales() -> None:
    scale_bytes = [0, 1, 100, 127, 130, 254, 255]
    blocks = torch.arange(256, dtype=torch.uint8).repeat(len(scale_bytes), 1)  # 512 values per row
    scales = torch.tensor(scale_bytes, dtype=torch.uint8).unsqueeze(1).repeat(1, 16)
    got = dequantize_reference(MXFP4Tensor(blocks, scales), torch.float32)
    expected = torch.tensor(
        [[direct_value((b >> (4 * (i % 2))) & 0xF, s) for b in range(256) for i in range(2)] for s in scale_bytes],
        dtype=torch.float32,
    )
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))


def test_quantize_matches_a_direct_nearest_value_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(6, 128, generator=gen) * torch.logspace(-30, 30, 6).unsqueeze(1)
    rows[0, :32] = 0.0  # an all-zero group
    # every midpoint between E2M1 values, under scale 1 (amax 6): each must go to the even code
    rows[1, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, -3.5, 5.0, 6.0])
    quantized = quantize_mxfp4(rows)
    codes = unpack_e2m1(quantized.blocks)
    for r in range(rows.shape[0]):
        for g in range(rows.shape[1] // 32):
            want_codes, want_scale = direct_quantize_group(rows[r, 32 * g : 32 * (g + 1)].tolist())
            assert codes[r, 32 * g : 32 * (g + 1)].tolist() == want_codes, (r, g)
            assert int(quantized.scales[r, g]) == want_scale, (r, g)


def test_round_trip_of_representable_values_is_exact() -> None:
    gen = torch.Generator().manual_seed(6)
    codes = torch.randint(0, 16, (4, 8, 32), generator=gen, dtype=torch.uint8)
    codes[codes == 8] = 0  # negative zero is not canonical
    codes[..., 0] = 7  # each group holds +6, so the shared exponent is recovered exactly
    blocks = pack_e2m1(codes.reshape(4, 256))
    scales = torch.randint(10, 240, (4, 8), generator=gen, dtype=torch.uint8)
    original = MXFP4Tensor(blocks, scales)
    again = quantize_mxfp4(dequantize_reference(original, torch.float32))
    assert torch.equal(again.blocks, original.blocks) and torch.equal(again.scales, original.scales)
    # bf16 holds every MXFP4 value exactly, so the bf16 path round-trips too
    assert torch.equal(quantize_mxfp4(dequantize_reference(original, torch.bfloat16)).blocks, original.blocks)


def test_70000_row_dequantization_at_reduced_width_is_exact_and_finite() -> None:
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(70_000, 64, generator=gen)
    quantized = quantize_mxfp4(weight)
    chunked = dequantize_reference_chunked(quantized, torch.bfloat16, rows_per_chunk=16_384)
    assert chunked.shape == (70_000, 64) and bool(chunked.isfinite().all())
    assert torch.equal(chunked, dequantize_reference(quantized, torch.bfloat16))
    codes = unpack_e2m1(quantized.blocks[-1:])[0].tolist()
    last = [direct_value(c, int(quantized.scales[-1, i // 32])) for i, c in enumerate(codes)]
    assert chunked[-1].float().tolist() == last
    assert (chunked.float() - weight).abs().max() <= weight.abs().max() * 0.25


def test_launch_plan_never_exceeds_65535_programs_and_covers_a_k3_shard() -> None:
    numel = 112 * 2 * 3072 * 3584  # gate/up of 112 local experts (EP8): past 2**31 elements
    chunks = plan_launches(numel)
    assert all(1 <= c.num_programs <= MAX_PROGRAMS_PER_LAUNCH for c in chunks)
    assert sum(c.num_programs for c in chunks) * 4096 >= numel > (sum(c.num_programs for c in chunks) - 1) * 4096
    assert chunks[-1].first_element > 2**31
    starts = [c.first_element for c in chunks]
    assert starts == sorted(starts) and all(
        b - a == MAX_PROGRAMS_PER_LAUNCH * 4096 for a, b in itertools.pairwise(starts)
    )
    with pytest.raises(ValueError, match="65535"):
        plan_launches(numel, max_programs=70_000)


INTERPRETED_KERNEL_CHECK = textwrap.dedent(
    """
    import torch
    from runtime.moe.mxfp4 import MXFP4Tensor, dequantize_reference, quantize_mxfp4
    from runtime.moe.mxfp4_triton import dequantize_triton, plan_launches

    def same(a, b):
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))

    blocks = torch.arange(256, dtype=torch.uint8).repeat(7, 1)
    scales = torch.tensor([0, 1, 100, 127, 130, 254, 255], dtype=torch.uint8).unsqueeze(1).repeat(1, 16)
    edge = MXFP4Tensor(blocks, scales)
    assert same(dequantize_triton(edge, torch.float32), dequantize_reference(edge, torch.float32))
    # Scale bytes 0 and 1 make values bf16 subnormals, which the interpreter's numpy bf16 cast
    # flushes to zero (torch keeps them); real checkpoints never use such scales. bf16 from row 2:
    normal = edge[2:]
    assert same(dequantize_triton(normal, torch.bfloat16), dequantize_reference(normal, torch.bfloat16))

    weight = torch.randn(70_000, 32, generator=torch.Generator().manual_seed(8))
    big = quantize_mxfp4(weight)
    assert len(plan_launches(weight.numel(), 16384, 7)) > 1
    out = torch.full((70_000, 32), float("nan"), dtype=torch.bfloat16)
    dequantize_triton(big, torch.bfloat16, out=out, block_elements=16384, max_programs=7)
    assert torch.equal(out, dequantize_reference(big, torch.bfloat16))
    print("kernel ok")
    """
)


def test_triton_kernel_interpreted_on_cpu_matches_reference() -> None:
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", INTERPRETED_KERNEL_CHECK],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and "kernel ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.gpu
def test_triton_kernel_on_gpu_past_2_31_elements_matches_reference() -> None:
    pytest.importorskip("triton")
    from runtime.moe.mxfp4_triton import dequantize_triton

    rows, width = 70_000, 32_768  # 2.29e9 elements: int32 offsets would wrap
    gen = torch.Generator(device="cuda").manual_seed(9)
    blocks = torch.randint(0, 256, (rows, width // 2), dtype=torch.uint8, device="cuda", generator=gen)
    scales = torch.randint(100, 160, (rows, width // 32), dtype=torch.uint8, device="cuda", generator=gen)
    tensor = MXFP4Tensor(blocks, scales)
    out = torch.full((rows, width), float("nan"), dtype=torch.bfloat16, device="cuda")
    dequantize_triton(tensor, torch.bfloat16, out=out)
    for part in (slice(0, 64), slice(rows // 2, rows // 2 + 64), slice(rows - 64, rows)):
        assert torch.equal(out[part], dequantize_reference(tensor[part], torch.bfloat16)), part
    assert not bool(out[-1].isnan().any())
