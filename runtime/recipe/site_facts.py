"""Site facts measured by ``--probe`` (``runtime/probe/``), and how ``--plan --site-facts FILE``
puts them in place of the recipe's assumptions (torch-free: the launcher reads them).

Each probe component writes ``{job_dir}/site_facts/facts_{component}.json``::

    {"component": "capture", "host": "node1", "time": "2026-12-03T14:40:00Z",
     "measured": {"store_put_gbps": {"value": 5.1, "how": "..."}, ...},
     "skipped": {"h2d_gbps_per_gpu": "no CUDA device here"}}

``--site-facts`` takes one such file or that folder (every ``facts_*.json`` in it). Each fact
that the plan uses replaces one ``plan`` field (:data:`PLAN_FIELD_OF_FACT`); the plan then lists
every site figure it rests on as measured (with how and where) or assumed (the recipe's value).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from runtime.user_errors import UserError, require_regular_file

SITE_FACTS_DIRNAME = "site_facts"
"""The folder of a probe job that holds its fact files."""
FACTS_GLOB = "facts_*.json"
"""Names of the probe's fact files in ``{job_dir}/site_facts/``."""

PLAN_FIELD_OF_FACT: dict[str, tuple[str, float]] = {
    "h2d_gbps_per_gpu": ("plan.pcie_h2d_bytes_per_s", 1e9),
    "cache_read_gbps": ("plan.cache_read_gbps", 1.0),
    "store_put_gbps": ("plan.store_put_gbps", 1.0),
    "link_get_gbps": ("plan.link_gbps", 8.0),
    "capture_host_memory_available_bytes": ("plan.capture_host_memory_bytes", 1.0),
    "trainer_host_memory_available_bytes": ("plan.trainer_host_memory_bytes", 1.0),
}
"""Fact name -> (the plan field it replaces, the factor from the fact's unit to the field's)."""
NODE_MEMORY_CAP_FACT = "{component}_node_mem_cap_gib"
"""The most ``--mem`` (GiB) Slurm and the node allow on one node of a component: the plan refuses a
request above it (``launcher/plan.py``)."""
GPUS_PER_NODE_FACT = "{component}_gpus_per_node"
"""The GPUs a task of a component saw on its node."""

SITE_FIELDS: tuple[str, ...] = (
    "plan.pcie_h2d_bytes_per_s",
    "plan.cache_read_gbps",
    "plan.store_put_gbps",
    "plan.capture_host_memory_bytes",
    "plan.trainer_host_memory_bytes",
    "plan.link_gbps",
    "plan.trainer_local_disk_bytes",
)
"""The plan's figures that describe the site (the rest describe the model and the software)."""


class SiteFactsError(UserError, ValueError):
    """A facts file that cannot be read; names the file and the fix."""


@dataclass
class SiteFacts:
    """Measured facts (name -> value, how, where) and what the probe skipped (name -> why)."""

    measured: dict[str, dict[str, object]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)

    def overrides(self) -> list[str]:
        """``--set`` lines that put the measured facts in place of the recipe's assumptions."""
        lines = [f"{plan_field}={self.plan_value(name)}" for name, (plan_field, _) in PLAN_FIELD_OF_FACT.items()
                 if name in self.measured]  # fmt: skip
        if "link_get_gbps" in self.measured:
            lines.append("plan.link_efficiency=1")  # the measured rate is a Mooncake transfer's already
        return lines

    def plan_value(self, name: str) -> float | int:
        """The measured fact ``name`` in its plan field's unit (bytes as an integer)."""
        plan_field, factor = PLAN_FIELD_OF_FACT[name]
        value = float(self.measured[name]["value"]) * factor  # type: ignore[arg-type]
        return int(value) if plan_field.endswith(("_bytes", "_bytes_per_s")) else round(value, 3)

    def component_fact(self, template: str, component: str) -> tuple[int, dict[str, object]] | None:
        """A per-node fact (:data:`NODE_MEMORY_CAP_FACT`, :data:`GPUS_PER_NODE_FACT`) of ``component``:
        its value and record, when the probe measured it."""
        fact = self.measured.get(template.format(component=component))
        return None if fact is None else (int(fact["value"]), fact)  # type: ignore[call-overload]

    def measured_field(self, plan_field: str) -> tuple[dict[str, object], float | int] | None:
        """The fact behind ``plan_field`` and its value in the field's unit, when it was measured."""
        for name, (target, _) in PLAN_FIELD_OF_FACT.items():
            if target == plan_field and name in self.measured:
                return self.measured[name], self.plan_value(name)
        return None


def _check_facts(file: Path, measured: object, skipped: object) -> None:
    """Every measured fact is ``{"value": <a finite number>, "how": <text>}``; every skipped one has a
    reason in text. One :class:`SiteFactsError` naming the file and the fact otherwise."""
    fix = "run the probe again (`python3 -m launcher RECIPE --probe`), or correct the file by hand"
    if not isinstance(measured, dict) or not isinstance(skipped, dict):
        raise SiteFactsError(f"{file}: 'measured' and 'skipped' must be mappings of fact name -> ...; fix: {fix}")
    for name, fact in measured.items():
        if not isinstance(fact, dict) or "value" not in fact or "how" not in fact:
            raise SiteFactsError(
                f'{file}: measured fact {name!r} is {fact!r}, not {{"value": NUMBER, "how": TEXT}}; fix: {fix}'
            )
        value = fact["value"]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise SiteFactsError(f"{file}: measured fact {name!r} has value {value!r}, not a number >= 0; fix: {fix}")
        if not isinstance(fact["how"], str):
            raise SiteFactsError(f"{file}: measured fact {name!r} has 'how' {fact['how']!r}, not text; fix: {fix}")
    for name, why in skipped.items():
        if not isinstance(why, str):
            raise SiteFactsError(f"{file}: skipped fact {name!r} gives {why!r}, not a reason in text; fix: {fix}")


def read_site_facts(path: Path) -> SiteFacts:
    """The facts of one file, or of every ``facts_*.json`` in a probe folder."""
    files = sorted(path.glob(FACTS_GLOB)) if path.is_dir() else [path]
    for file in files:
        require_regular_file(file, "site facts file", "give a facts_*.json file or a probe's site_facts folder")
    if not files or not all(f.is_file() for f in files):
        raise SiteFactsError(
            f"no site facts at {path}: give a facts_*.json file or the site_facts folder of a probe job "
            "(`python3 -m launcher RECIPE --probe` writes runs/<name>/<stamp>/site_facts/facts_*.json)"
        )
    facts = SiteFacts()
    for file in files:
        try:
            data = json.loads(file.read_text())
            measured, skipped = data["measured"], data["skipped"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SiteFactsError(f"{file} is not a probe facts file ({exc}); run the probe again") from None
        _check_facts(file, measured, skipped)
        where = f"{data.get('host', '?')} {data.get('time', '')}".strip()
        for name, fact in measured.items():
            earlier = facts.measured.get(name)
            if earlier is not None and float(earlier["value"]) != float(fact["value"]):  # type: ignore[arg-type]
                raise SiteFactsError(
                    f"{earlier['file']} and {file} disagree on {name} ({earlier['value']} against {fact['value']}); "
                    "fix: give the one file you mean, or measure again with one probe job"
                )
            facts.measured[name] = {**fact, "where": where, "file": str(file)}
        for name, why in skipped.items():
            facts.skipped.setdefault(name, str(why))
        facts.sources.append(str(file))
    for name in facts.measured:
        facts.skipped.pop(name, None)
    return facts
