"""Unit tests of runtime.shared.speedup_trust: a speed-up's spread over groups of prompts, the load it was
taken under, its verdict, and the cores a process is given."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from runtime.shared import speedup_trust as timing


@dataclass
class Decode:
    output_ids: list[int]
    seconds: float
    steps: list[int] = field(default_factory=list)


def test_group_ratios_time_each_group_at_the_runs_own_acceptance_length() -> None:
    plain = [Decode([0] * 10, 1.0) for _ in range(8)]  # 10 tokens/s throughout
    # Easy prompts (5 tokens per verify step) then hard ones (2), on a machine whose speed holds (a verify
    # step always takes 0.25 s): every group gives the run's speed-up, the content moves none of them.
    drafted = [Decode([0] * 10, 0.5, [0, 0]) for _ in range(4)] + [Decode([0] * 10, 1.25, [0] * 5) for _ in range(4)]
    overall = (80 / 7.0) / 10.0
    assert timing.group_ratios(plain, drafted) == pytest.approx([overall] * 4)
    # The machine slows to half speed for the last quarter of the draft's decodes: that group says so.
    slowed = drafted[:6] + [Decode([0] * 10, 2.5, [0] * 5) for _ in range(2)]
    ratios = timing.group_ratios(plain, slowed)
    assert ratios[-1] == pytest.approx(ratios[0] / 2)
    assert len(timing.group_ratios(plain[:3], drafted[:3])) == 3, "fewer prompts than groups: one group each"
    assert timing.group_ratios([], []) == []


def test_a_speed_up_is_steady_unsteady_or_under_load() -> None:
    steady = timing.speedup_trust([2.0, 2.2, 2.1, 2.3], load=2.4, busy_processes=2, cores=2)
    assert steady["speedup_trust"] == timing.STEADY and steady["speedup_spread"] == [2.0, 2.3]
    assert steady["other_load"] == pytest.approx(0.4) and timing.trust_note(steady) == ""
    assert timing.marked(2.15, steady) == "2.15x (2.00-2.30)"

    unsteady = timing.speedup_trust([1.0, 2.2], load=0.5, busy_processes=1, cores=16)
    assert unsteady["speedup_trust"] == timing.UNSTEADY
    assert timing.marked(1.6, unsteady).endswith("?") and "1.00x to 2.20x" in timing.trust_note(unsteady)

    # The eval's own decoding processes are not load from other work; 1.5 more on 2 cores is.
    loaded = timing.speedup_trust([2.0, 2.1], load=3.5, busy_processes=2, cores=2)
    assert loaded["speedup_trust"] == timing.UNDER_LOAD and loaded["other_load"] == pytest.approx(1.5)
    assert "under load (load average 3.5 on 2 core(s), 1.5 of it other work)" in timing.trust_note(loaded)
    assert timing.speedup_trust([], load=None, busy_processes=1, cores=1)["speedup_trust"] == timing.STEADY


def test_cores_given_honour_a_cgroup_cpu_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    affinity = timing.cores_given()
    quota = tmp_path / "cpu.max"
    monkeypatch.setattr(timing, "CGROUP_CPU_MAX", quota)
    quota.write_text("max 100000\n")
    assert timing.cores_given() == affinity
    quota.write_text("50000 100000\n")  # half a core: still one thread
    assert timing.cores_given() == 1
    quota.write_text(f"{100000 * (affinity + 4)} 100000\n")  # a quota above the affinity mask changes nothing
    assert timing.cores_given() == affinity
