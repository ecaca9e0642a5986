"""Local experts: grouped GEMM, MXFP4 experts dequantized once per forward into a shared buffer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.moe.experts import DequantWorkspace, LocalExperts
from runtime.moe.grouped_gemm import grouped_linear
from runtime.moe.mxfp4 import dequantize_reference, quantize_mxfp4


def _per_row(rows: torch.Tensor, weights: torch.Tensor, counts: list[int]) -> torch.Tensor:
    groups = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    return torch.stack([weights[g] @ rows[i] for i, g in enumerate(groups.tolist())])


def test_grouped_linear_matches_row_by_row_with_empty_groups() -> None:
    gen = torch.Generator().manual_seed(1)
    counts = [3, 0, 5, 0, 1]
    rows = torch.randn(sum(counts), 16, generator=gen)
    weights = torch.randn(5, 8, 16, generator=gen)
    got = grouped_linear(rows, weights, torch.tensor(counts))
    torch.testing.assert_close(got, _per_row(rows, weights, counts), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="rows_per_group"):
        grouped_linear(rows, weights, torch.tensor(counts[:-1]))


def _expert_weights(
    seed: int, experts: int = 4, hidden: int = 64, inter: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(experts, 2 * inter, hidden, generator=gen) / 8, torch.randn(
        experts, hidden, inter, generator=gen
    ) / 6


def _swiglu_reference(
    tokens: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    out, start = [], 0
    for e, n in enumerate(counts):
        gate, up = F.linear(tokens[start : start + n], gate_up[e]).chunk(2, dim=-1)
        out.append(F.linear(F.silu(gate) * up, down[e]))
        start += n
    return torch.cat(out)


def test_mxfp4_layers_share_one_workspace_and_stay_correct_when_it_is_reused() -> None:
    workspace = DequantWorkspace()
    layers = []
    for seed in (1, 2):
        gate_up, down = _expert_weights(seed)
        q_gate_up, q_down = quantize_mxfp4(gate_up), quantize_mxfp4(down)
        experts = LocalExperts(q_gate_up, q_down, compute_dtype=torch.float32, workspace=workspace)
        dense = (dequantize_reference(q_gate_up, torch.float32), dequantize_reference(q_down, torch.float32))
        layers.append((experts, dense))
    counts = [4, 2, 3, 1]
    tokens = torch.randn(sum(counts), 64, generator=torch.Generator().manual_seed(3))
    for _ in range(2):  # layer 0, layer 1, layer 0 again: the buffer was overwritten in between
        for experts, (gate_up, down) in layers:
            got = experts(tokens, torch.tensor(counts))
            torch.testing.assert_close(got, _swiglu_reference(tokens, gate_up, down, counts), rtol=1e-5, atol=1e-5)
    assert len(workspace._buffers) == 2  # gate_up and down, shared by both layers
    assert workspace.nbytes == 4 * (4 * 64 * 64 + 4 * 64 * 32)
    # resident MXFP4 weights: 0.5 byte per value + one byte per 32 values
    assert layers[0][0].resident_bytes == (4 * 64 * 64 + 4 * 64 * 32) * 17 // 32


def test_only_experts_with_tokens_are_dequantized() -> None:
    gate_up, down = _expert_weights(4)
    experts = LocalExperts(quantize_mxfp4(gate_up), quantize_mxfp4(down), compute_dtype=torch.float32)
    counts = [2, 0, 0, 1]
    gate_up_buffer, down_buffer = experts.dense_weights([0, 0, 0, 0])  # allocate the buffers
    gate_up_buffer.fill_(float("nan"))
    down_buffer.fill_(float("nan"))
    tokens = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    out = experts(tokens, torch.tensor(counts))
    assert bool(out.isfinite().all())
    assert bool(gate_up_buffer[1:3].isnan().all()) and bool(gate_up_buffer[[0, 3]].isfinite().all())


def test_dense_and_quantized_weights_must_agree_on_shapes() -> None:
    gate_up, down = _expert_weights(6)
    with pytest.raises(ValueError, match=r"must be \[E, 2I, H\]"):
        LocalExperts(gate_up, down[:, :, :16])
    with pytest.raises(ValueError, match="both be MXFP4 or both dense"):
        LocalExperts(quantize_mxfp4(gate_up), down)


@pytest.mark.gpu
def test_gpu_mxfp4_experts_use_grouped_gemm_and_match_dense_bf16() -> None:
    from runtime.moe.grouped_gemm import grouped_mm_usable

    gate_up, down = _expert_weights(7, experts=8, hidden=512, inter=256)
    q_gate_up, q_down = quantize_mxfp4(gate_up).to("cuda"), quantize_mxfp4(down).to("cuda")
    experts = LocalExperts(q_gate_up, q_down, compute_dtype=torch.bfloat16)
    counts = [700, 0, 5, 1, 0, 300, 64, 2]
    tokens = torch.randn(sum(counts), 512, device="cuda", dtype=torch.bfloat16)
    assert grouped_mm_usable(tokens, experts.dense_weights()[0])
    got = experts(tokens, torch.tensor(counts, device="cuda")).float()
    dense_gate_up = dequantize_reference(q_gate_up, torch.float32)
    dense_down = dequantize_reference(q_down, torch.float32)
    expected = _swiglu_reference(tokens.float(), dense_gate_up, dense_down, counts)
    # bf16 activations round every intermediate (seen on H200: |diff| up to 0.25 on outputs of
    # magnitude ~60, i.e. one bf16 ulp), so compare per group in norm, not elementwise.
    start = 0
    for group, count in enumerate(counts):
        if count:
            part_got, part_expected = got[start : start + count], expected[start : start + count]
            relative = float((part_got - part_expected).norm() / part_expected.norm())
            assert relative < 1e-2, f"expert {group} ({count} rows): relative error {relative:.3g}"
        start += count
