"""What each part of the fit model returns: a titled section of rows, findings and raw numbers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FindingLevel = Literal["ok", "warn", "blocker"]


@dataclass(frozen=True)
class Finding:
    """A verdict of the plan: ``ok``, ``warn`` or ``blocker`` (submission refuses blockers), with the
    options that would resolve it."""

    level: FindingLevel
    message: str
    options: tuple[str, ...] = ()


@dataclass
class FitReport:
    """One section of the plan: (label, value) rows under ``title``, findings, and raw numbers."""

    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    numbers: dict[str, float] = field(default_factory=dict)

    @property
    def blockers(self) -> list[Finding]:
        """Findings that stop a submission."""
        return [f for f in self.findings if f.level == "blocker"]
