"""Job folders and the job record: where a submitted (or local) job lives and how to find it again.

Layout of one job folder (``{runs_dir}/{name}/{stamp}`` from the launcher, ``.../{job id}`` from a
manual sbatch)::

    recipe.resolved.json   the resolved recipe (the only thing the runtime reads)
    job.json               this record: job id, mode, components, digest
    submission.sh          the exact script that was submitted (Slurm mode)
    submitit/              payload and per-task result pickles
    logs/{job}_{component}_{rank}.out   one log per component task
    local_status.json      component states of a --local run
    capture.stop           the trainer has ended: capture workers stop (Slurm mode)

``{runs_dir}/jobs/{job id}`` links to the folder so that ``status JOB`` can find it by id.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from launcher.slurm_args import job_id_problem
from runtime.files import atomic_write_text
from runtime.recipe import LoadedRecipe
from runtime.recipe.schema import JOB_NAME
from runtime.shared.checkpoint_folders import find_latest
from runtime.shared.contracts import JOB_FOLDER_SETTING, JOB_RECORD_FILENAME
from runtime.user_errors import UserError, file_kind_problem, output_place, shell_word

LOCAL_STATUS_FILENAME = "local_status.json"
CAPTURE_STOP_FILENAME = "capture.stop"
"""Written into the job folder by the batch script once the trainer has ended: the capture
workers stop their component and end successfully (the step ends COMPLETED, not CANCELLED)."""
INDEX_DIRNAME = "jobs"
LATEST_ALIAS = "latest"
"""``{runs_dir}/jobs/latest`` links to the most recently submitted job."""
DEFAULT_RUNS_DIR = Path(__file__).resolve().parent.parent / "runs"
"""The runs folder ``status``, ``logs`` and ``cancel`` look a job id up in when given no ``--runs-dir``."""


@dataclass
class JobRecord:
    """What ``status``, ``logs`` and ``cancel`` need to know about one job."""

    job_id: str
    mode: str
    """``slurm`` or ``local``."""
    name: str
    job_dir: str
    recipe_source: str
    recipe_digest: str
    smoke: bool
    probe: bool
    components: dict[str, int] = field(default_factory=dict)
    """Component name -> number of tasks, in het group order."""
    one_node: bool = False
    """``job.layout: one_node``: one plain job whose steps are both components (sacct lists the job once)."""
    submitted_at: str = ""
    supervisor_pid: int | None = None
    """The ``--local`` supervisor process."""
    eval_job_id: str | None = None
    """The Slurm eval job submitted with the training job (``eval.after_training``), if any."""
    parent: dict[str, str] | None = None
    """The job this one continues: ``kind`` (``resume``: the same run; ``fork``: a new run from its
    checkpoint), ``job_id``, ``job_dir`` and ``checkpoint``; none for a fresh run."""

    @property
    def trainer_world_size(self) -> int:
        """Trainer ranks."""
        return self.components.get("trainer", 0)

    @property
    def command_ref(self) -> str:
        """How a printed command names this job: its id where ``status ID`` finds it with no ``--runs-dir``
        (the repository's runs folder links it), else its folder; ready for a shell."""
        try:
            indexed = (DEFAULT_RUNS_DIR / INDEX_DIRNAME / self.job_id).resolve() == Path(self.job_dir).resolve()
        except (OSError, RuntimeError):  # an unreadable link, a link loop
            indexed = False
        return shell_word(self.job_id if indexed else self.job_dir)

    def log_path(self, component: str, rank: int) -> Path:
        """The log file of one component task."""
        return Path(self.job_dir) / "logs" / f"{self.job_id}_{component}_{rank}.out"


class JobLookupError(UserError):
    """A job that cannot be found, or whose folder's records cannot be read; names the file and the fix."""


def utc_stamp() -> str:
    """A sortable UTC timestamp for folder names."""
    return dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")


def runs_root(repo_root: Path, runs_dir: str) -> Path:
    """The runs folder: ``runs_dir`` relative to the repository unless absolute."""
    path = Path(os.path.expanduser(runs_dir))
    return path if path.is_absolute() else repo_root / path


def new_job_dir(repo_root: Path, loaded: LoadedRecipe) -> Path:
    """A fresh, unique job folder for a launcher submission (created)."""
    runs = runs_root(repo_root, loaded.recipe.job.runs_dir)
    output_place(runs, JOB_FOLDER_SETTING, fix="set job.runs_dir to a folder of its own, e.g. runs")
    if runs.resolve() == repo_root.resolve():
        raise UserError(
            f"{JOB_FOLDER_SETTING} {loaded.recipe.job.runs_dir!r} is the repository itself; fix: name a folder in it, "
            "e.g. runs"
        )
    base = runs / loaded.recipe.job.name
    output_place(base, "the job's folder", within=runs, fix=f"remove the link {base} or pick another job.name")
    stamp = utc_stamp() + ("-smoke" if loaded.smoke else "")
    candidate, counter = base / stamp, 1
    while candidate.exists() or candidate.is_symlink():
        counter += 1
        candidate = base / f"{stamp}-{counter}"
    candidate.mkdir(parents=True)
    (candidate / "logs").mkdir()
    return candidate


def components_of(loaded: LoadedRecipe) -> dict[str, int]:
    """Tasks per component, in het group order."""
    job = loaded.recipe.job
    return {
        "capture": job.capture.nodes * job.capture.tasks_per_node,
        "trainer": job.trainer.nodes * job.trainer.tasks_per_node,
    }


def write_record(record: JobRecord, runs_dir: Path | None) -> Path:
    """Write ``job.json`` atomically and link ``{runs_dir}/jobs/{job_id}`` to the folder."""
    job_dir = Path(record.job_dir)
    if not record.submitted_at:
        record.submitted_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    target = job_dir / JOB_RECORD_FILENAME
    atomic_write_text(target, json.dumps(asdict(record), indent=2) + "\n", JOB_FOLDER_SETTING)
    if runs_dir is not None:
        index = runs_dir / INDEX_DIRNAME
        index.mkdir(parents=True, exist_ok=True)
        link = index / record.job_id
        tmp_link = index / f".{record.job_id}.tmp{os.getpid()}"
        if tmp_link.is_symlink():
            tmp_link.unlink()
        tmp_link.symlink_to(os.path.relpath(job_dir, index))
        os.replace(tmp_link, link)
        latest = index / LATEST_ALIAS  # `status latest`, `logs latest`, `--resume latest`
        tmp_link.symlink_to(os.path.relpath(job_dir, index))
        os.replace(tmp_link, latest)
    return target


def newest_checkpoint(record: JobRecord) -> Path | None:
    """The newest complete checkpoint (``step_*`` with ``trainer_state.json``) of a job, without torch."""
    from runtime.recipe import load_resolved

    job_dir = Path(record.job_dir)
    resolved = load_resolved(job_dir / "recipe.resolved.json")
    return find_latest(resolved.checkpoint_dir(job_dir))


def find_record(job: str, runs_dir: Path, runs_dir_hint: str = "pass --runs-dir") -> JobRecord:
    """A job record from a job id (looked up in ``{runs_dir}/jobs``) or a job folder path.
    ``runs_dir_hint`` says how the caller's user names another runs folder.

    A record read from a folder describes that folder: a job folder copied or moved elsewhere is the
    copy's own job, not the original's."""
    # A bare id names the indexed job first: a folder of the current directory that happens to carry the
    # same name (a copy, a stray ``mkdir 4242``) must not win over runs/jobs/4242.
    indexed = runs_dir / INDEX_DIRNAME / job
    bare = "/" not in job and job not in (".", "..")
    candidates = [indexed, Path(job)] if bare and (indexed / JOB_RECORD_FILENAME).exists() else [Path(job), indexed]
    for folder in candidates:
        record_file = folder / JOB_RECORD_FILENAME
        if record_file.exists():
            record = _read_record(record_file)
            record.job_dir = str(folder.resolve())
            return record
    index = runs_dir / INDEX_DIRNAME
    # Links only: the index also holds lock files and a moment's temporary links (dot names).
    known = sorted(p.name for p in index.glob("[!.]*") if p.is_symlink()) if index.is_dir() else []
    listing = f" Known jobs: {', '.join(known[-10:])}." if known else ""
    raise JobLookupError(
        f"no job '{job}': neither a job folder with {JOB_RECORD_FILENAME} nor an id under "
        f"{runs_dir / INDEX_DIRNAME}.{listing} Fix: give the job folder's path, or {runs_dir_hint} if the job "
        "used another runs folder"
    )


def _read_json_object(path: Path, what: str, fix: str) -> dict[str, object]:
    """A JSON object from a file the launcher wrote, or one :class:`JobLookupError` naming the file."""
    kind = file_kind_problem(path)
    if kind is not None and kind != "a folder":
        raise JobLookupError(f"{path} is {kind}, not a regular file; it should be {what}. Fix: {fix}")
    try:
        data = json.loads(path.read_text())
    except IsADirectoryError:
        raise JobLookupError(f"{path} is a folder, where {what} should be a file; fix: {fix}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise JobLookupError(f"{path} is not readable JSON ({exc}); it is {what}. Fix: {fix}") from None
    if not isinstance(data, dict):
        raise JobLookupError(f"{path} holds a {type(data).__name__}, not {what}; fix: {fix}")
    return data


def _read_record(path: Path) -> JobRecord:
    fix = "restore it from a backup, or give the job folder of another run (the launcher writes it at submission)"
    data = _read_json_object(path, "the job record", fix)
    try:
        record = JobRecord(**data)  # type: ignore[arg-type]
    except TypeError:
        wanted = {f.name for f in fields(JobRecord)}
        unknown, missing = (
            sorted(set(data) - wanted),
            sorted(
                f.name
                for f in fields(JobRecord)
                if f.name not in data and f.default is MISSING and f.default_factory is MISSING
            ),
        )
        raise JobLookupError(
            f"{path} is not a job record (unknown fields {unknown or 'none'}, missing {missing or 'none'}); fix: {fix}"
        ) from None
    problem = _record_problem(record)
    if problem:
        raise JobLookupError(f"{path}: {problem}; it is not a job record the launcher wrote. Fix: {fix}")
    return record


MAX_RECORDED_TASKS = 100_000
"""More tasks than any Slurm job of this project has: a larger count in a record is damage."""


def _record_problem(record: JobRecord) -> str | None:
    """What in a job record read from disk has the wrong type or an impossible value, or None."""
    for name in ("job_id", "name", "job_dir", "recipe_source", "recipe_digest", "submitted_at"):
        if not isinstance(getattr(record, name), str):
            return f"field {name!r} is {getattr(record, name)!r}, not text"
    if record.mode not in ("slurm", "local"):
        return f"field 'mode' is {record.mode!r}, not 'slurm' or 'local'"
    problem = job_id_problem(record.job_id, record.mode)
    if problem:  # it reaches scancel/sacct and the terminal: never an option, a list or escape codes
        return f"field 'job_id': {problem}"
    if not JOB_NAME.fullmatch(record.name):
        return f"field 'name' is {record.name!r}, not a job name (letters, digits, _ . -)"
    if record.eval_job_id is not None and job_id_problem(str(record.eval_job_id), "slurm"):
        return f"field 'eval_job_id': {job_id_problem(str(record.eval_job_id), 'slurm')}"
    for name in ("smoke", "probe"):
        if not isinstance(getattr(record, name), bool):
            return f"field {name!r} is {getattr(record, name)!r}, not true or false"
    pid = record.supervisor_pid
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid < 1):
        return f"field 'supervisor_pid' is {pid!r}, not a process id (a positive number) or null"
    if not isinstance(record.components, dict):
        return f"field 'components' is {record.components!r}, not a mapping of component -> task count"
    for component, count in record.components.items():
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_RECORDED_TASKS:
            return f"field 'components' gives {component!r} {count!r} tasks, not a count from 0 to {MAX_RECORDED_TASKS}"
    return None


def read_local_status(job_dir: Path) -> dict[str, dict[str, object]]:
    """Component states written by the ``--local`` supervisor (empty when absent)."""
    path = job_dir / LOCAL_STATUS_FILENAME
    if not path.exists():
        return {}
    return _read_json_object(  # type: ignore[return-value]
        path,
        "the --local run's component states",
        "remove it (the component logs keep what happened: `python3 -m launcher logs JOB`)",
    )


def write_local_status(job_dir: Path, status: dict[str, dict[str, object]]) -> None:
    """Atomically record the ``--local`` component states."""
    atomic_write_text(
        job_dir / LOCAL_STATUS_FILENAME, json.dumps(status, indent=2, sort_keys=True) + "\n", JOB_FOLDER_SETTING
    )
