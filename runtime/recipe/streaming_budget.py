"""Which MoE layers keep their routed experts resident on the GPU, and which are streamed from
host memory (torch-free: the launcher's plan and the recipe checks use it too).

The unit is one MoE layer's routed experts on one GPU (every streamed layer has the same bytes).
A streamed layer is copied into one of ``prefetch_layers + 1`` reused device buffers while the
layer before it computes, so a GPU budget must hold those buffers plus the resident layers:

    resident_layers = (budget - (prefetch_layers + 1) x layer_bytes) // layer_bytes

Resident layers are spread evenly over the depth (not bunched at the front): every streamed
layer then has resident neighbours whose compute the copies can hide behind.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.user_errors import UserError


class StreamingBudgetError(UserError, ValueError):
    """A GPU budget or host memory that cannot hold what streaming needs; names both numbers."""


def _gb(value: float) -> str:
    return f"{value / 1e9:,.2f} GB"


@dataclass(frozen=True)
class StreamingSplit:
    """The resident/streamed split of ``num_layers`` MoE layers on one GPU."""

    num_layers: int
    layer_bytes: int
    """Routed-expert bytes of one MoE layer on one GPU (in the kernel's format)."""
    resident: tuple[bool, ...]
    """Per MoE layer (in forward order): True if its experts stay on the GPU."""
    num_buffers: int
    """Device buffers for streamed layers: ``prefetch_layers + 1``, or 0 when all are resident."""

    @property
    def resident_layers(self) -> int:
        """MoE layers whose experts stay on the GPU."""
        return sum(self.resident)

    @property
    def streamed_layers(self) -> int:
        """MoE layers whose experts live in host memory."""
        return self.num_layers - self.resident_layers

    @property
    def resident_bytes(self) -> int:
        """Expert bytes held resident on the GPU (buffers not included)."""
        return self.resident_layers * self.layer_bytes

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the device buffers that streamed layers are copied into."""
        return self.num_buffers * self.layer_bytes

    @property
    def device_bytes(self) -> int:
        """Everything streaming keeps on the GPU: resident experts + buffers."""
        return self.resident_bytes + self.buffer_bytes

    @property
    def host_bytes(self) -> int:
        """Expert bytes kept in (pinned) host memory for this GPU."""
        return self.streamed_layers * self.layer_bytes

    @property
    def streamed_fraction(self) -> float:
        """Share of the expert bytes that live on the host."""
        return self.streamed_layers / self.num_layers if self.num_layers else 0.0


def spread_resident(num_layers: int, resident_layers: int) -> tuple[bool, ...]:
    """``resident_layers`` of ``num_layers`` marked True, evenly spaced over the depth."""
    if not 0 <= resident_layers <= num_layers:
        raise ValueError(f"cannot keep {resident_layers} of {num_layers} layers resident")
    return tuple((i + 1) * resident_layers // num_layers > i * resident_layers // num_layers for i in range(num_layers))


def split_layers(
    num_layers: int,
    layer_bytes: int,
    *,
    prefetch_layers: int = 1,
    gpu_budget_bytes: int | None = None,
    resident_fraction: float | None = None,
    budget_field: str = "capture.expert_streaming.gpu_budget_bytes",
) -> StreamingSplit:
    """Split ``num_layers`` MoE layers of ``layer_bytes`` each between the GPU and the host.

    Exactly one of ``gpu_budget_bytes`` (expert bytes one GPU may hold: resident layers plus the
    streaming buffers) and ``resident_fraction`` (share of layers kept resident) is given. A
    budget that cannot hold the ``prefetch_layers + 1`` buffers while some layer must be streamed
    is refused, naming both numbers and ``budget_field``.
    """
    if num_layers < 1 or layer_bytes < 1:
        raise ValueError(f"need at least one MoE layer with experts (got {num_layers} layers of {layer_bytes} B)")
    if prefetch_layers < 1:
        raise ValueError(f"prefetch_layers must be at least 1, got {prefetch_layers}")
    if (gpu_budget_bytes is None) == (resident_fraction is None):
        raise ValueError("give exactly one of gpu_budget_bytes and resident_fraction")
    buffers = prefetch_layers + 1
    total = num_layers * layer_bytes
    if resident_fraction is not None:
        if not 0.0 <= resident_fraction <= 1.0:
            raise ValueError(f"resident_fraction must be in [0, 1], got {resident_fraction}")
        resident = min(num_layers, int(resident_fraction * num_layers + 1e-9))
    elif gpu_budget_bytes >= total:  # type: ignore[operator]
        resident = num_layers
    else:
        need = buffers * layer_bytes
        if gpu_budget_bytes < need:  # type: ignore[operator]
            raise StreamingBudgetError(
                f"{budget_field} is {_gb(gpu_budget_bytes)} per GPU, below the {buffers} streaming buffers "  # type: ignore[arg-type]
                f"(prefetch_layers {prefetch_layers} + 1) of one MoE layer's experts ({_gb(layer_bytes)} each) = "
                f"{_gb(need)}; fix: raise {budget_field} to at least {need} B, or lower prefetch_layers"
            )
        resident = min(num_layers - 1, (gpu_budget_bytes - need) // layer_bytes)  # type: ignore[operator]
    if resident == num_layers:
        return StreamingSplit(num_layers, layer_bytes, (True,) * num_layers, 0)
    return StreamingSplit(num_layers, layer_bytes, spread_resident(num_layers, resident), buffers)


def check_host_memory(
    needs: dict[str, int], host_memory_bytes: int, *, node: str, host_field: str
) -> StreamingBudgetError | None:
    """An error (not raised) when what lives in one node's host memory exceeds it: ``needs`` maps
    each use (streamed experts, Mooncake segment, ...) to its bytes."""
    total = sum(needs.values())
    if total <= host_memory_bytes:
        return None
    parts = " + ".join(f"{name} {_gb(value)}" for name, value in needs.items())
    return StreamingBudgetError(
        f"the {node} node's host memory {host_field} is {_gb(host_memory_bytes)}, below what lives there: "
        f"{parts} = {_gb(total)}; fix: raise the GPU budget (fewer streamed experts), place the Mooncake "
        "segment on the other node or split it (transport.segment_placement), or use a node with more memory"
    )
