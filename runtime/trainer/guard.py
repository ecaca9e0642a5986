"""The finite-update guard.

Before each optimizer update every rank reports whether its loss terms are finite; the gradient
norm is global. A non-finite term or norm:

- in smoke mode aborts, naming the step, the term(s) and the rank(s);
- in a full run skips the update (gradients dropped, the samples still count as consumed) and
  counts it; ``max_consecutive_skips`` skips in a row abort.

Every rank sees the same gathered flags, so every rank takes the same decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TERMS: tuple[str, ...] = ("ce", "l1", "confidence")
"""Loss terms checked per rank, in flag order."""


class NonFiniteUpdate(RuntimeError):
    """A non-finite loss term or gradient norm where the run cannot go on."""


@dataclass
class UpdateCheck:
    """The guard's view of one optimizer step."""

    step: int
    rank_terms: list[dict[str, bool]]
    """Per rank: term -> finite."""
    grad_norm: float
    problems: list[str] = field(default_factory=list)

    @property
    def finite(self) -> bool:
        """Whether the update may be applied."""
        return not self.problems


def inspect_update(step: int, rank_terms: list[dict[str, bool]], grad_norm: float) -> UpdateCheck:
    """Collect every non-finite term (with its ranks) and the gradient norm."""
    check = UpdateCheck(step=step, rank_terms=rank_terms, grad_norm=grad_norm)
    for term in TERMS:
        bad = [rank for rank, terms in enumerate(rank_terms) if not terms[term]]
        if bad:
            check.problems.append(f"loss term '{term}' is not finite on rank(s) {bad}")
    if not math.isfinite(grad_norm):
        check.problems.append(f"gradient norm is {grad_norm}")
    return check


class FiniteGuard:
    """Decides, step by step, whether to apply, skip or abort."""

    def __init__(
        self, *, smoke: bool, max_consecutive_skips: int, skipped_total: int = 0, consecutive: int = 0
    ) -> None:
        self.smoke = smoke
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_total = skipped_total
        self.consecutive = consecutive

    def decide(self, check: UpdateCheck) -> bool:
        """True: apply the update. False: skip it. Raises :class:`NonFiniteUpdate` to abort."""
        if check.finite:
            self.consecutive = 0
            return True
        where = f"non-finite update at optimizer step {check.step} (0-based): " + "; ".join(check.problems)
        if self.smoke:
            raise NonFiniteUpdate(f"smoke gate: {where}")
        self.skipped_total += 1
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive_skips:
            raise NonFiniteUpdate(
                f"{where}; that is {self.consecutive} skipped updates in a row (trainer.max_consecutive_skips "
                f"{self.max_consecutive_skips}): aborting; fix: inspect the samples of these steps and the "
                "learning rate, then resume from the last checkpoint"
            )
        return False
