"""submitit support for one heterogeneous Slurm job with a capture and a trainer component.

submitit has no hetjob support; this module extends its Slurm executor rather than replacing it:
- the submission file is our rendered script (one ``#SBATCH`` block per component separated by
  ``#SBATCH hetjob``, one ``srun --het-group=N`` per component), while submitit still pickles the
  payload, submits with sbatch, names files by job id and gives back a Job;
- task ids are unique across components (trainer ranks 0..W-1, capture tasks W..), so result
  files never collide, and only task 0 (trainer rank 0, the owner of the checkpoints) acts on a
  time-out or preemption signal;
- job state folds sacct's ``123+0`` / ``123+1`` rows (see :mod:`launcher.slurm_state`), so a
  component that dies without a result ends the wait instead of hanging it.
"""

from __future__ import annotations

import json
import typing as tp
from pathlib import Path

import submitit
from submitit.core import utils
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

from launcher.slurm_state import fold_state, parse_sacct

SUBMITIT_DIRNAME = "submitit"
TASK_LAYOUT_FILENAME = "tasks.json"


def task_index(component: str, rank: int, trainer_world_size: int) -> int:
    """Job-wide task id of a component task: trainer ranks first, then capture tasks."""
    if component == "trainer":
        return rank
    if component == "capture":
        return trainer_world_size + rank
    raise ValueError(f"unknown component {component!r}")


def task_owner(task: int, trainer_world_size: int) -> tuple[str, int]:
    """Inverse of :func:`task_index`: (component, rank within the component)."""
    if task < trainer_world_size:
        return "trainer", task
    return "capture", task - trainer_world_size


class HetInfoWatcher(SlurmInfoWatcher):
    """sacct watcher that understands ``123+0`` / ``123+1`` component rows."""

    def _make_command(self) -> list[str] | None:
        to_check = {x.split("+")[0].split("_")[0] for x in self._registered - self._finished}
        if not to_check:
            return None
        command = ["sacct", "-o", "JobID,State,ExitCode,NodeList", "--parsable2"]
        for job_id in sorted(to_check):
            command.extend(["-j", job_id])
        return command

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        text = string.decode() if isinstance(string, bytes) else string
        lines = text.splitlines()
        if len(lines) < 2:
            return {}
        ids = {line.split("|", 1)[0].partition(".")[0].partition("+")[0] for line in lines[1:]}
        info: dict[str, dict[str, str]] = {}
        for job_id in ids:
            components = parse_sacct(text, job_id)
            if not components:
                continue
            for offset, component in components.items():
                info[f"{job_id}+{offset}"] = {"JobID": f"{job_id}+{offset}", "State": component.state}
            nodes = ",".join(c.nodes for c in components.values() if c.nodes)
            info[job_id] = {"JobID": job_id, "State": fold_state(components), "NodeList": nodes}
        return info


class HetJob(SlurmJob[tp.Any]):
    """A submitit Job for one hetjob; tasks are numbered job-wide (see :func:`task_index`)."""

    watcher = HetInfoWatcher(delay_s=60)
    # A task stopped by Slurm (cancel, requeue, a failed peer) writes no result file; submitit would
    # wait 15 s for each such task. Our workers write results atomically before exiting.
    _results_timeout_s = 5

    def _component_log(self) -> Path | None:
        layout_file = Path(self.paths.folder) / TASK_LAYOUT_FILENAME
        if self.task_id is None or not layout_file.exists():
            return None
        layout = json.loads(layout_file.read_text())
        component, rank = task_owner(self.task_id, int(layout["trainer_world_size"]))
        return Path(self.paths.folder).parent / "logs" / f"{self.job_id}_{component}_{rank}.out"

    def _get_logs_string(self, name: str) -> str | None:
        path = self._component_log()
        if path is None or not path.exists():
            return super()._get_logs_string(name)
        # Components write stdout and stderr into one log per task.
        return path.read_text(errors="replace")


class HetJobExecutor(submitit.SlurmExecutor):
    """SlurmExecutor whose submission file is a rendered hetjob script."""

    job_class = HetJob

    def __init__(
        self,
        job_dir: Path,
        script_text: str,
        trainer_world_size: int,
        capture_tasks: int,
        time_limit_min: int,
        max_requeues: int,
    ) -> None:
        folder = job_dir / SUBMITIT_DIRNAME
        super().__init__(folder=folder, max_num_timeout=max_requeues)
        self._script_text = script_text
        self._total_tasks = trainer_world_size + capture_tasks
        self.update_parameters(time=time_limit_min)
        folder.mkdir(parents=True, exist_ok=True)
        layout = {"trainer_world_size": trainer_world_size, "capture_tasks": capture_tasks}
        (folder / TASK_LAYOUT_FILENAME).write_text(json.dumps(layout) + "\n")

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self._script_text

    def _num_tasks(self) -> int:
        return self._total_tasks


class ComponentJob(submitit.helpers.Checkpointable):
    """The payload submitit pickles for a hetjob. Each srun task (``launcher.worker``) loads it and
    runs its own component; on a time-out, task 0 checkpoints it (a requeue counter) and requeues.
    The trainer resumes from its run's ``latest`` checkpoint after a requeue."""

    def __init__(self, job_dir: str, probe: bool = False, requeue_count: int = 0) -> None:
        self.job_dir = job_dir
        self.probe = probe
        self.requeue_count = requeue_count

    def __call__(self) -> str:
        raise RuntimeError(
            "a hetjob payload runs through `python3 -m launcher.worker --component NAME`, one per srun task"
        )

    def checkpoint(self, *args: tp.Any, **kwargs: tp.Any) -> utils.DelayedSubmission:
        """The requeued job's payload: the same job folder, one more requeue."""
        return utils.DelayedSubmission(ComponentJob(self.job_dir, self.probe, self.requeue_count + 1))


def write_submission(job_dir: Path, job_id: str, payload: ComponentJob, timeout_min: int, max_requeues: int) -> Path:
    """Write the payload pickle a manual ``sbatch`` job needs (the launcher path lets submitit do
    it). Never overwrites one that exists: after a requeue it carries the checkpointed state."""
    paths = utils.JobPaths(job_dir / SUBMITIT_DIRNAME, job_id=job_id)
    target = paths.submitted_pickle
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    delayed = utils.DelayedSubmission(payload)
    delayed.set_timeout(timeout_min, max_requeues)
    with utils.temporary_save_path(target) as tmp:
        delayed.dump(tmp)
    return target
