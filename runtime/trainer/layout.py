"""Block layout of one sample: anchors, slots, labels, eval mask and weights.

Conventions, all index math in int64 (a 64K K3 sample times any feature width passes 2**31):

- A position ``p`` is an eligible anchor when ``mask[p]`` and ``mask[p + 1]`` are both 1
  (so ``p <= T - 2``). ``num_anchors`` anchors are drawn uniformly without replacement from the
  eligible ones, then sorted; when fewer are eligible, the rest are padded blocks (anchor 0,
  ``keep`` False, weight 0).
- Block ``i`` has ``block_size`` slots at positions ``anchor + k``; slot 0 embeds the anchor token,
  slots 1.. embed ``mask_token_id`` (a padded block embeds ``mask_token_id`` everywhere).
- Slot ``k`` predicts the token at ``label_index = anchor + k + 1``; its teacher is the target's
  lm_head applied to ``lhs[label_index - 1]``; its Markov "previous token" is the true token at
  ``anchor + k``.
- ``eval_mask`` is the contiguous valid prefix of the block: a slot counts while its label is
  inside the sequence and on an assistant token, and every earlier slot counted too.
- ``weights = eval_mask * exp(-k / loss_decay_gamma)``.

Anchors come from a generator seeded by ``(seed, g)`` alone, so a sample gets the same blocks
whatever rank, micro-step or restart processes it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass
class BlockLayout:
    """Everything about the blocks of one sample that does not depend on the draft's weights."""

    anchors: torch.Tensor
    """int64 [N]: anchor positions, sorted; 0 for padded blocks."""
    keep: torch.Tensor
    """bool [N]: real (sampled) blocks; False for padding."""
    slot_token_ids: torch.Tensor
    """int64 [N, S]: token embedded in each slot (anchor token, then mask tokens)."""
    positions: torch.Tensor
    """int64 [N, S]: RoPE position of each slot, ``anchor + k``."""
    labels: torch.Tensor
    """int64 [N, S]: the true next token each slot predicts (0 where the label is invalid)."""
    teacher_index: torch.Tensor
    """int64 [N, S]: row of ``lhs`` whose target logits teach the slot (``label_index - 1``)."""
    prev_tokens: torch.Tensor
    """int64 [N, S]: Markov head input, the true token at ``anchor + k``."""
    eval_mask: torch.Tensor
    """bool [N, S]: contiguous valid prefix of each block."""
    weights: torch.Tensor
    """float32 [N, S]: ``eval_mask * exp(-k / gamma)``."""
    supervised_rows: torch.Tensor
    """int64 [R]: flat indices (``n * S + k``) of the slots in ``eval_mask``, ascending. Built on the
    host with the rest, so the objective needs no ``nonzero`` on the GPU (a host sync per sample)."""
    weight_sum: float
    """``weights.sum()`` as a host number (the micro-step's normaliser needs it before any GPU work)."""
    num_eligible: int
    """How many anchor positions were eligible in the sample."""
    seq_len: int
    """T of the sample."""

    @property
    def num_blocks(self) -> int:
        """N: blocks per sample (``num_anchors``, including padded ones)."""
        return int(self.anchors.shape[0])

    @property
    def block_size(self) -> int:
        """S: slots per block."""
        return int(self.slot_token_ids.shape[1])

    def to(self, device: torch.device, non_blocking: bool = False) -> BlockLayout:
        """The same layout with every tensor on ``device``. ``non_blocking`` (CUDA): the tensors go
        through pinned memory and the copies are only queued on the current stream; the caller orders
        that stream before any use."""

        def move(value: torch.Tensor) -> torch.Tensor:
            if non_blocking and value.device.type == "cpu" and torch.device(device).type == "cuda":
                value = value.pin_memory()
            return value.to(device, non_blocking=non_blocking)

        moved = {
            name: move(value) if isinstance(value, torch.Tensor) else value for name, value in self.__dict__.items()
        }
        return BlockLayout(**moved)


def anchor_generator(seed: int, g: int) -> torch.Generator:
    """A CPU generator seeded from ``(seed, g)`` only (stable across ranks, restarts and world sizes)."""
    digest = hashlib.sha256(f"dspark-anchors/{seed}/{g}".encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator


def eligible_anchor_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """bool [T - 1]: position p is eligible when ``mask[p]`` and ``mask[p + 1]`` are both set."""
    if loss_mask.ndim != 1:
        raise ValueError(f"loss mask must be 1-D [T], got shape {tuple(loss_mask.shape)}")
    valid = loss_mask.to(torch.bool)
    return valid[:-1] & valid[1:]


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Draw up to ``num_anchors`` eligible anchors uniformly without replacement, sorted.

    Returns ``(anchors int64 [N], keep bool [N], number of eligible positions)``.
    """
    candidates = torch.nonzero(eligible_anchor_mask(loss_mask.cpu()), as_tuple=False).flatten().to(torch.int64)
    count = int(candidates.numel())
    if count > num_anchors:
        chosen = torch.randperm(count, generator=generator)[:num_anchors]
        picked = candidates[chosen].sort().values
    else:
        picked = candidates
    anchors = torch.zeros(num_anchors, dtype=torch.int64)
    keep = torch.zeros(num_anchors, dtype=torch.bool)
    anchors[: picked.numel()] = picked
    keep[: picked.numel()] = True
    return anchors, keep, count


def slot_decay_weights(block_size: int, loss_decay_gamma: float) -> torch.Tensor:
    """float32 [S]: ``exp(-k / gamma)`` for k = 0..S-1."""
    k = torch.arange(block_size, dtype=torch.float64)
    return torch.exp(-k / float(loss_decay_gamma)).to(torch.float32)


def build_layout(
    ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    num_anchors: int,
    block_size: int,
    mask_token_id: int,
    loss_decay_gamma: float,
    generator: torch.Generator,
) -> BlockLayout:
    """The block layout of one sample (see the module docstring for every convention)."""
    if ids.ndim != 1 or loss_mask.shape != ids.shape:
        raise ValueError(f"ids and mask must both be [T]; got ids {tuple(ids.shape)} and mask {tuple(loss_mask.shape)}")
    seq_len = int(ids.shape[0])
    if seq_len < 2:
        raise ValueError(f"a sample needs at least 2 tokens to have an anchor, got T={seq_len}")
    ids = ids.to(device="cpu", dtype=torch.int64)
    loss_mask = loss_mask.to(device="cpu")
    anchors, keep, num_eligible = sample_anchors(loss_mask, num_anchors, generator)

    offsets = torch.arange(block_size, dtype=torch.int64)
    positions = anchors[:, None] + offsets[None, :]
    label_index = positions + 1
    label_inside = label_index < seq_len
    safe_label_index = torch.where(label_inside, label_index, torch.zeros_like(label_index))
    safe_label_index = torch.where(keep[:, None], safe_label_index, torch.zeros_like(safe_label_index))
    labels = ids[safe_label_index]
    label_on_assistant = loss_mask.to(torch.bool)[safe_label_index]
    slot_valid = label_inside & label_on_assistant & keep[:, None]
    eval_mask = torch.cumprod(slot_valid.to(torch.int64), dim=1).to(torch.bool)
    labels = torch.where(eval_mask, labels, torch.zeros_like(labels))

    teacher_index = (safe_label_index - 1).clamp(min=0)
    anchor_tokens = ids[anchors]
    prev_tokens = torch.cat([anchor_tokens[:, None], ids[safe_label_index[:, :-1]]], dim=1)
    prev_tokens = torch.where(keep[:, None], prev_tokens, torch.full_like(prev_tokens, mask_token_id))

    slot_token_ids = torch.full((num_anchors, block_size), mask_token_id, dtype=torch.int64)
    slot_token_ids[:, 0] = torch.where(keep, anchor_tokens, torch.full_like(anchor_tokens, mask_token_id))

    weights = eval_mask.to(torch.float32) * slot_decay_weights(block_size, loss_decay_gamma)[None, :]
    supervised_rows = torch.nonzero(eval_mask.reshape(-1), as_tuple=False).squeeze(1)
    return BlockLayout(
        anchors=anchors,
        keep=keep,
        slot_token_ids=slot_token_ids,
        positions=positions,
        labels=labels,
        teacher_index=teacher_index,
        prev_tokens=prev_tokens,
        eval_mask=eval_mask,
        weights=weights,
        supervised_rows=supervised_rows,
        weight_sum=float(weights.sum()),
        num_eligible=num_eligible,
        seq_len=seq_len,
    )
