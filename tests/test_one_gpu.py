"""``recipes/one_gpu.yaml``: the whole pipeline on one CUDA GPU. On a CPU machine: the recipe resolves,
its plan holds, its settings are the K3 trainer's where one GPU allows, its eval set is the one its
world writes, and ``--local`` refuses in one line. On a GPU (``gpu`` mark): a shortened run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.plan import make_plan
from runtime.recipe import load_recipe
from runtime.shared.acceptance_length import POOLED_KEY
from runtime.shared.gpu_presence import visible_gpu_count
from tests.conftest import REPO_ROOT
from tests.support.launcher_cli import probe_overrides

ONE_GPU = REPO_ROOT / "recipes" / "one_gpu.yaml"
K3 = REPO_ROOT / "recipes" / "kimi_k3_v1c.yaml"


def test_the_one_gpu_recipe_resolves_plans_and_carries_the_k3_trainer_settings(tmp_path: Path) -> None:
    from tools.tiny_target import WORLDS, write_eval_set

    recipe = load_recipe(ONE_GPU).recipe
    k3 = load_recipe(K3).recipe
    plan = make_plan(recipe)
    assert not plan.blockers, [b.message for b in plan.blockers]
    trainer = recipe.trainer
    assert (trainer.device, trainer.param_dtype, trainer.attention_backend, trainer.compile_regions) == (
        "cuda",
        "bfloat16",
        "flex",
        "on",
    )
    assert recipe.job.trainer.nodes * recipe.job.trainer.tasks_per_node == 1, "FSDP2 over one rank"
    assert trainer.draft.block_size == k3.trainer.draft.block_size
    assert (trainer.loss.ce_weight, trainer.loss.l1_weight) == (k3.trainer.loss.ce_weight, k3.trainer.loss.l1_weight)
    assert recipe.capture.compute_dtype == "bfloat16" and recipe.capture.batch_size > 1
    assert recipe.eval is not None and recipe.eval.device == "cuda" and recipe.eval.after_training
    # The recipe's shapes are its world's target, and its eval set is the one that world writes.
    spec = WORLDS["one_gpu"]
    assert (recipe.capture.hidden_size, recipe.capture.num_target_layers, recipe.capture.vocab_size) == (
        spec.hidden_size,
        spec.num_layers,
        spec.vocab_size,
    )
    assert recipe.data.num_rows == spec.chat_rows
    assert recipe.eval.sets[0].sha256 == write_eval_set(spec, tmp_path / "eval.jsonl")


@pytest.mark.skipif(visible_gpu_count() > 0, reason="this machine has a GPU: the refusal is for machines without one")
def test_one_gpu_local_on_a_machine_without_a_gpu_is_refused_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "one_gpu", "--local", "--set", f"job.runs_dir={tmp_path / 'runs'}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs one NVIDIA GPU" in lines[0] and "python3 -m launcher tiny --local" in lines[0]
    assert not (tmp_path / "runs").exists(), "nothing was started"


@pytest.mark.gpu
@pytest.mark.slow
def test_a_shortened_one_gpu_run_trains_in_bf16_with_flex_and_beats_the_untrained_draft(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    command = [sys.executable, "-m", "launcher", "one_gpu", "--local", *probe_overrides(runs, short_run=False)]
    command += ["--set", "trainer.epochs=1"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800, env=dict(os.environ))
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-6000:]
    assert "bfloat16, attention flex, compiled regions" in console, console[-3000:]
    assert "peak GPU memory" in console, console[-3000:]
    (job_dir,) = (runs / "one_gpu").iterdir()
    # The checkpoint watch decoded on the GPU beside the trainer: the floor first, then the one checkpoint.
    during = [json.loads(line) for line in (job_dir / "eval" / "during_training.jsonl").read_text().splitlines()]
    assert [record["step"] for record in during] == [0, 64], during
    (results_path,) = (job_dir / "eval").glob("step_*/results.json")
    results = json.loads(results_path.read_text())
    assert results["device"] == "cuda"
    greedy = results["passes"][0]["drafts"]
    label = results["draft"]["label"]
    assert greedy[label]["overall"][POOLED_KEY] > greedy["untrained"]["overall"][POOLED_KEY]


def test_visible_gpus_are_the_drivers_less_those_cuda_visible_devices_hides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runtime.shared import gpu_presence

    driver, dev = tmp_path / "gpus", tmp_path / "dev"
    dev.mkdir()
    monkeypatch.setattr(gpu_presence, "NVIDIA_GPUS", driver)
    monkeypatch.setattr(gpu_presence, "DEVICE_NODES", dev)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (dev / "nvidiactl").touch()
    assert gpu_presence.visible_gpu_count() == 0, "a control node is no GPU"
    (dev / "nvidia0").touch()
    assert gpu_presence.visible_gpu_count() == 1, "a container without the driver's /proc folder"
    for index in range(2):
        (driver / f"0000:0{index}:00.0").mkdir(parents=True)
    assert gpu_presence.visible_gpu_count() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpu_presence.visible_gpu_count() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_presence.visible_gpu_count() == 0
    with pytest.raises(Exception, match="needs one NVIDIA GPU.*CUDA_VISIBLE_DEVICES hides every GPU"):
        gpu_presence.require_gpu("recipes/one_gpu.yaml --local")
