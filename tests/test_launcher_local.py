"""``--local``: both components as process groups on this machine with the Slurm environment contract."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.support.launcher_cli import CONTRACT, TRAINER_CONTRACT, launch, probe_overrides, read_probes

# Each test runs both components through the launcher (about 9 s on 2 cores).
pytestmark = pytest.mark.slow


def only_job_dir(runs_dir: Path) -> Path:
    (job_dir,) = [p for p in (runs_dir / "tiny").iterdir() if p.is_dir()]
    return job_dir


def test_local_probe_gives_the_environment_contract(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    # A polluted launching shell: none of this may reach the components.
    env = {
        **os.environ,
        "RANK": "99",
        "WORLD_SIZE": "77",
        "MASTER_ADDR": "10.9.9.9",
        "MASTER_PORT": "1",
        "LOCAL_RANK": "5",
        "NODE_RANK": "3",
        "DSPARK_PROBE_MEASURE": "1",  # this test checks the site measurements too
    }
    done = launch(["tiny", "--local", "--probe", *probe_overrides(runs)], env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    job_dir = only_job_dir(runs)
    probes = read_probes(job_dir)
    assert sorted(probes) == [("capture", 0), ("trainer", 0), ("trainer", 1), ("trainer", 2), ("trainer", 3)]
    for rank in range(4):
        trainer = probes[("trainer", rank)]
        assert set(trainer["env"]) >= TRAINER_CONTRACT
        assert trainer["env"]["RANK"] == str(rank) and trainer["env"]["LOCAL_RANK"] == str(rank)
        assert trainer["env"]["WORLD_SIZE"] == "4" and trainer["env"]["NODE_RANK"] == "0"
        assert trainer["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert trainer["all_reduce_sum"] == 0 + 1 + 2 + 3, "the gloo group formed from the contract"
    capture = probes[("capture", 0)]
    assert set(capture["env"]) >= CONTRACT and "RANK" not in capture["env"] and "MASTER_ADDR" not in capture["env"]
    assert capture["env"]["DSPARK_BIND_ADDRESS"] == "127.0.0.1"
    assert capture["trainer_message"] == "trainer-ok", "trainer rank 0 reached the handed Mooncake endpoint"
    assert probes[("trainer", 0)]["capture_reply"] == "capture-ok"
    # rank 0 of each component measured its site facts (CPU and loopback here) and said what it skipped
    capture_facts = json.loads((job_dir / "site_facts" / "facts_capture.json").read_text())
    assert capture_facts["measured"]["store_put_gbps"]["value"] > 0
    assert capture_facts["measured"]["capture_host_memory_available_bytes"]["value"] > 0
    if "h2d_gbps_per_gpu" in capture_facts["skipped"]:
        assert capture_facts["skipped"]["h2d_gbps_per_gpu"] == "no CUDA device here"
    trainer_facts = json.loads((job_dir / "site_facts" / "facts_trainer.json").read_text())
    assert trainer_facts["measured"]["job_dir_read_gbps"]["value"] > 0
    assert "trainer.feature_cache is off" in trainer_facts["skipped"]["cache_read_gbps"]
    assert "[probe capture/0] measured store_put_gbps" in done.stdout
    # the link: trainer rank 0 read the capture's objects through a master at the recipe's ports
    link = trainer_facts["measured"]["link_get_gbps"]
    assert link["value"] > 0 and "read by trainer rank 0 from the capture node's segment" in link["how"], link
    plan = launch(["tiny", "--plan", "--site-facts", str(job_dir / "site_facts")])
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert re.search(r"plan\.store_put_gbps +\S+ GB/s  measured on", plan.stdout), plan.stdout
    assert re.search(r"plan\.link_gbps +\S+ Gbit/s  measured on", plan.stdout), plan.stdout

    record = json.loads((job_dir / "job.json").read_text())
    status = launch(["status", record["job_id"], "--runs-dir", str(runs)])
    assert status.returncode == 0 and "'tiny': COMPLETED" in status.stdout, status.stdout
    # a healthy probe is finished in both components: the capture ended with its own exit 0 (after
    # serving the link), not a stop (STOPPED, exit -15, 0/1 ok); the run's closing table says the same
    for table in (status.stdout, done.stdout):
        assert re.search(r"^  capture +0 COMPLETED +0 +1/1 ", table, re.M), table
        assert re.search(r"^  trainer +1 COMPLETED +0 +4/4 ", table, re.M), table
    # (the rows above hold each component's exit; "-15" may appear in the job id's time stamp)
    assert "STOPPED" not in status.stdout, status.stdout
    logs = launch(["logs", str(job_dir), "--component", "capture"])
    assert "listening on 127.0.0.1" in logs.stdout


def test_local_failed_component_fails_the_job(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    done = launch(["tiny", "--local", "--probe", "--set", "job.env.DSPARK_PROBE_FAIL=trainer", *probe_overrides(runs)])
    assert done.returncode == 3, done.stdout + done.stderr
    status = launch(["status", str(only_job_dir(runs))])
    assert status.returncode == 1 and "FAILED" in status.stdout
