"""Site facts: what ``--probe`` measures here (real disk, real ``mooncake_master`` on loopback), and
``--plan --site-facts`` putting measured facts in place of the recipe's assumptions and saying which
figures are measured and which assumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launcher.cli import main
from launcher.plan import make_plan
from runtime.probe import measure as probe_measure
from runtime.recipe import load_recipe
from runtime.recipe.site_facts import SiteFactsError, read_site_facts

K3 = Path(__file__).resolve().parent.parent / "recipes" / "kimi_k3_v1c.yaml"
MIB = 2**20


def test_host_memory_and_a_cold_read_are_measured_here(tmp_path: Path) -> None:
    available, how = probe_measure.host_memory_available_bytes()
    assert available > 0 and ("MemAvailable" in how or "cgroup" in how)
    rate, how = probe_measure.cold_read_gbps(tmp_path / "disk", 8 * MIB)
    assert rate > 0 and "8 MiB written to" in how and "posix_fadvise" in how
    assert list((tmp_path / "disk").iterdir()) == [], "the probe's file is removed"
    if not torch.cuda.is_available():
        with pytest.raises(probe_measure.Skipped, match="no CUDA device here"):
            probe_measure.h2d_gbps_per_gpu(MIB)


def test_a_mooncake_put_and_get_over_loopback(tmp_path: Path) -> None:
    put, get, how = probe_measure.store_put_get_gbps(8 * MIB, tmp_path)
    assert put > 0 and get > 0
    assert "8 MiB object" in how and "private mooncake_master on loopback" in how


def _facts(folder: Path, node_gib: int | None = None) -> Path:
    folder.mkdir()
    capture = {
        "component": "capture",
        "host": "gpu-node-7",
        "time": "2026-12-03T15:00:00Z",
        "measured": {
            "h2d_gbps_per_gpu": {"value": 30.0, "how": "8 x H200 copying 1 GiB each at once"},
            "capture_host_memory_available_bytes": {"value": 2 * 2**40, "how": "MemAvailable"},
        },
        "skipped": {"store_put_gbps": "failed: MasterStartError: ..."},
    }
    trainer = {
        "component": "trainer",
        "host": "gpu-node-8",
        "time": "2026-12-03T15:00:01Z",
        "measured": {
            "cache_read_gbps": {"value": 5.0, "how": "1 GiB read back by 8 threads"},
            "link_get_gbps": {"value": 2.5, "how": "3 objects of 1,024 MiB read by trainer rank 0"},
        },
        "skipped": {},
    }
    if node_gib is not None:  # what the probe read from Slurm and the node
        for facts in (capture, trainer):
            how = f"{node_gib} GiB, the smallest of: Slurm RealMemory {node_gib} GiB, MemTotal {node_gib + 3} GiB"
            facts["measured"][f"{facts['component']}_node_mem_cap_gib"] = {"value": node_gib, "how": how}
            facts["measured"][f"{facts['component']}_gpus_per_node"] = {"value": 8, "how": "8 CUDA device(s)"}
    (folder / "facts_capture.json").write_text(json.dumps(capture))
    (folder / "facts_trainer.json").write_text(json.dumps(trainer))
    return folder


def test_the_probe_reads_the_node_memory_cap_here() -> None:
    cap_gib, how = probe_measure.node_memory_cap_gib({})  # not in a Slurm job: the node's MemTotal alone
    assert cap_gib >= 1 and "MemTotal" in how and "Slurm's own limits were not read" in how


def test_the_plan_refuses_a_mem_above_the_measured_node_cap_and_warns_without_one(tmp_path: Path) -> None:
    facts = read_site_facts(_facts(tmp_path / "site_facts", node_gib=512))
    plan = make_plan(load_recipe(K3, facts.overrides()).recipe, facts)
    (blocker,) = plan.blockers
    assert "--mem=1900G is above the 512 GiB its node allows" in blocker.message and "gpu-node-7" in blocker.message
    assert any("segment_placement: trainer" in o for o in blocker.options)
    assert "memory cap, trainer node" in plan.render() and "no blockers" not in plan.render()
    # without facts or a stated cap: a warning naming what the site must allow, not silence
    text = make_plan(load_recipe(K3).recipe).render()
    assert "the site must allow --mem=1900G on a capture node and --mem=58G on a trainer node" in text
    # a trainer-node refusal names fixes of the trainer node, not the capture node's segment move
    with pytest.raises(ValueError, match="fewer ranks per trainer node") as refused:
        load_recipe(K3, ["plan.slurm_max_mem_per_node_gib=40", "transport.segment_placement=split"])
    assert "keep the Mooncake segment on the capture node" in str(refused.value)


def test_the_plan_uses_measured_facts_and_says_which_are_assumed(tmp_path: Path) -> None:
    facts = read_site_facts(_facts(tmp_path / "site_facts"))
    assert facts.overrides() == [
        "plan.pcie_h2d_bytes_per_s=30000000000",
        "plan.cache_read_gbps=5.0",
        "plan.link_gbps=20.0",
        "plan.capture_host_memory_bytes=2199023255552",
        "plan.link_efficiency=1",  # the measured rate is a Mooncake transfer's: no efficiency on top
    ]
    assumed = make_plan(load_recipe(K3).recipe)
    measured = make_plan(load_recipe(K3, facts.overrides()).recipe, facts)
    # slower copies and a slower cache disk move the plan's figures
    assert measured.numbers["prefill_pcie_s"] == pytest.approx(assumed.numbers["prefill_pcie_s"] * 50 / 30)
    assert measured.numbers["cache_read_s_per_sample"] == pytest.approx(assumed.numbers["cache_read_s_per_sample"] * 4)
    text = measured.render()
    assert "plan.pcie_h2d_bytes_per_s       30.0 GB/s per GPU  measured on gpu-node-7 2026-12-03T15:00:00Z" in text
    assert "plan.cache_read_gbps            5 GB/s  measured on gpu-node-8" in text
    assert "plan.store_put_gbps             5.2 GB/s  assumed (the probe skipped it: failed: MasterStartError" in text
    assert "plan.link_gbps                  20 Gbit/s  measured on gpu-node-8" in text
    assert "over 20 Gbit/s at 100%)" in text
    assert "plan.trainer_local_disk_bytes   25.47 TiB  assumed (the recipe's value)" in text
    # without facts every site figure says it is assumed
    assert (
        "measured on gpu" not in assumed.render()
        and "plan.cache_read_gbps            20 GB/s  assumed" in assumed.render()
    )


def test_site_facts_through_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _facts(tmp_path / "site_facts")
    code = main(["kimi_k3_v1c", "--plan", "--site-facts", str(folder), "--set", "plan.cache_read_gbps=8"])
    out = capsys.readouterr().out
    assert code == 0 and "measured on gpu-node-7" in out
    assert "plan.cache_read_gbps            8 GB/s  set by --set (the probe measured 5 GB/s)" in out
    assert main(["kimi_k3_v1c", "--plan", "--site-facts", str(tmp_path / "none")]) == 2
    assert "no site facts at" in capsys.readouterr().err
    (folder / "facts_bad.json").write_text("{}")
    with pytest.raises(SiteFactsError, match="facts_bad.json is not a probe facts file"):
        read_site_facts(folder)
