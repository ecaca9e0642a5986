"""Render one Slurm batch script from a recipe: a heterogeneous job with a group per component
(``job.layout: separate_nodes``), or a plain one-node job whose two steps share the node (``one_node``).

The same renderer produces the checked-in ``sbatch/*.sbatch`` files (manual submission: the job
folder and resolved recipe are made inside the allocation) and the script the launcher submits
through submitit (job folder made and recipe resolved before submission). The two differ only in
the defaults of the site-settings block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from launcher.environment import COMPONENTS
from launcher.jobs import CAPTURE_STOP_FILENAME
from launcher.slurm_args import JOB_DIR_IN_OUTPUT, output_pattern
from runtime.recipe import Recipe
from runtime.recipe.fit.slurm_request import PROBE_TIME_LIMIT_MIN, node_memory_gib
from runtime.recipe.schema import ComponentResources
from runtime.shared import contracts
from runtime.user_errors import shell_word

__all__ = ["shell_word"]

PREEMPT_SIGNAL = "USR2"
CAPTURE_STOP_WAIT_S = 60
"""How long the batch script waits for the capture workers to stop after the trainer ended."""
"""Signal Slurm sends ``signal_delay_s`` before the time limit (submitit's default)."""

_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")

_COMPONENT_ROLE = {
    "capture": "Mooncake master + capture engine + producer",
    "trainer": "FSDP2 DSpark trainer ranks",
}


@dataclass(frozen=True)
class RenderOptions:
    """What distinguishes one rendering of a recipe from another."""

    recipe_file: str
    """Recipe path as the script should name it (relative to the repository)."""
    job_dir: str | None = None
    """Absolute job folder (launcher submission); None renders the manual form."""
    overrides: tuple[str, ...] = ()
    """``--set`` overrides baked into the manual form's resolve step."""
    smoke: bool = False
    """Resolve with the smoke overlay."""
    probe: bool = False
    """Run the environment probe instead of the runtime in each component."""
    repo_dir: str | None = None
    """Absolute repository folder (launcher submission); None uses the submit directory."""


PROBE_READS = ("trainer.feature_cache.",)
"""The recipe fields whose site paths a probe job reads (it measures the cache disk); the target, the
data and the checkpoints it never opens."""


def environment_references(recipe: Recipe, probe: bool = False) -> dict[str, list[str]]:
    """Environment variables the recipe's strings reference as ``${NAME}``, with the fields using them;
    for a probe job only those of the fields it reads (:data:`PROBE_READS`)."""
    found: dict[str, list[str]] = {}

    def walk(value: object, path: str) -> None:
        if isinstance(value, dict):
            for key, child in value.items():
                walk(child, f"{path}.{key}" if path else str(key))
        elif isinstance(value, list):
            for index, child in enumerate(value):
                walk(child, f"{path}[{index}]")
        elif isinstance(value, str):
            for name in _ENV_REFERENCE.findall(value):
                found.setdefault(name, []).append(path)

    walk(recipe.model_dump(mode="json", exclude={"smoke", "job"}), "")
    if probe:
        found = {
            name: kept for name, fields in found.items() if (kept := [f for f in fields if f.startswith(PROBE_READS)])
        }
    return found


def render_script(recipe: Recipe, options: RenderOptions) -> str:
    """The full batch script for ``recipe``."""
    job = recipe.job
    manual = options.job_dir is None
    one_node = job.layout == "one_node"
    shape = (
        "one Slurm job on one node, two components sharing it"
        if one_node
        else "one heterogeneous Slurm job, two components"
    )
    lines = [
        "#!/bin/bash",
        f"# DSpark job '{job.name}': {shape}.",
        f"# Rendered by `python3 -m launcher render` from {comment_text(options.recipe_file)}. Do not edit by hand:",
        "# change the recipe and render again (the golden test in tests/test_launcher_units.py keeps sbatch/ equal).",
    ]
    if manual:
        lines += [
            "#",
            "# Manual submission, from the repository root:",
            f"#   sbatch sbatch/{job.name}.sbatch",
            "# Edit the site settings below, or export them before sbatch.",
        ]
    if one_node:
        roles = ", ".join(f"{component} ({_COMPONENT_ROLE[component]})" for component in COMPONENTS)
        lines.append(f"# ---- one node (job.layout: one_node): {roles} ----")
        lines += _one_node_block(recipe, options)
    else:
        for index, component in enumerate(COMPONENTS):
            if index:
                lines.append("#SBATCH hetjob")
            lines.append(f"# ---- het group {index}: {component} ({_COMPONENT_ROLE[component]}) ----")
            lines += _sbatch_block(recipe, component, options)
    lines += ["", "set -uo pipefail", ""]
    lines += _site_settings(recipe, options)
    lines += [""]
    lines += _preamble(recipe, options)
    lines += [""]
    lines += _component_launches(recipe, options)
    lines += [""]
    lines += _supervision()
    return "\n".join(lines) + "\n"


def resource_flags(
    recipe: Recipe,
    resources: ComponentResources,
    *,
    job_name: str,
    time_limit_min: int,
    nodes: int,
    tasks_per_node: int,
    mem_gib: int | None,
) -> list[tuple[str, str | None]]:
    """The ``#SBATCH`` flags that place one het group (or a one-node job) on the site: name,
    partition/account/qos, time, shape, GPUs, memory per node (``mem_gib``; None: the site's
    default), exclusivity, constraint."""
    job = recipe.job
    flags: list[tuple[str, str | None]] = [("job-name", job_name)]
    if job.partition:
        flags.append(("partition", job.partition))
    if job.account:
        flags.append(("account", job.account))
    if job.qos:
        flags.append(("qos", job.qos))
    flags += [
        ("time", str(time_limit_min)),
        ("nodes", str(nodes)),
        ("ntasks-per-node", str(tasks_per_node)),
        ("cpus-per-task", str(resources.cpus_per_task)),
    ]
    if resources.gpus_per_node:
        flags.append(("gpus-per-node", str(resources.gpus_per_node)))
    if mem_gib:
        flags.append(("mem", f"{mem_gib}G"))
    if resources.exclusive:
        flags.append(("exclusive", None))
    if resources.constraint:
        flags.append(("constraint", resources.constraint))
    return flags


def job_time_limit_min(recipe: Recipe, probe: bool) -> int:
    """The time limit of the job: the recipe's, or for a probe job :data:`PROBE_TIME_LIMIT_MIN` (never
    more than the recipe's)."""
    return min(recipe.job.time_limit_min, PROBE_TIME_LIMIT_MIN) if probe else recipe.job.time_limit_min


def sbatch_lines(flags: list[tuple[str, str | None]]) -> list[str]:
    """``#SBATCH`` lines of ``(flag, value)`` pairs (a None value is a bare flag)."""
    return [f"#SBATCH --{key}" if value is None else f"#SBATCH --{key}={shell_word(value)}" for key, value in flags]


def _sbatch_block(recipe: Recipe, component: str, options: RenderOptions) -> list[str]:
    """The ``#SBATCH`` lines of one het group. ``--mem`` comes from the plan's host memory of the node
    plus its margin (the plan shows the parts); the probe, on the same partitions and node kinds, asks
    for minutes and the memory it measures with."""
    resources: ComponentResources = getattr(recipe.job, component)
    mem_gib = node_memory_gib(recipe, options.probe)[component]
    return _job_block(recipe, options, resources, resources.nodes, resources.tasks_per_node, mem_gib)


def _one_node_block(recipe: Recipe, options: RenderOptions) -> list[str]:
    """The ``#SBATCH`` lines of a ``job.layout: one_node`` job: one node with every task of both
    components, the larger GPU and CPU counts of the two (they share them) and the sum of their memory."""
    capture, trainer = recipe.job.capture, recipe.job.trainer
    shared = trainer.model_copy(
        update={
            "cpus_per_task": max(capture.cpus_per_task, trainer.cpus_per_task),
            "gpus_per_node": max(capture.gpus_per_node, trainer.gpus_per_node),
        }
    )
    tasks = capture.tasks_per_node + trainer.tasks_per_node
    return _job_block(recipe, options, shared, 1, tasks, node_memory_gib(recipe, options.probe)["one node"])


def _job_block(
    recipe: Recipe,
    options: RenderOptions,
    resources: ComponentResources,
    nodes: int,
    tasks_per_node: int,
    mem_gib: int,
) -> list[str]:
    job = recipe.job
    flags = resource_flags(
        recipe,
        resources,
        job_name=job.name,
        time_limit_min=job_time_limit_min(recipe, options.probe),
        nodes=nodes,
        tasks_per_node=tasks_per_node,
        mem_gib=mem_gib,
    )
    flags += [
        ("signal", f"{PREEMPT_SIGNAL}@{job.signal_delay_s}"),
        ("requeue", None),
        ("open-mode", "append"),
    ]
    if options.job_dir is None:
        flags.append(("output", "slurm-%x-%j.out"))
    else:
        flags.append(("output", f"{output_pattern(options.job_dir)}/logs/batch_%j.out"))
    flags += sorted(resources.extra_sbatch.items())
    return sbatch_lines(flags)


def shell_default(variable: str, word: str) -> str:
    """``VARIABLE=${VARIABLE:-WORD}``: a site setting that an exported value overrides. ``word`` is
    shell text already quoted (:func:`shell_word`); a plain one keeps the double-quoted form."""
    if re.fullmatch(r"[A-Za-z0-9_@%./:,=+${}-]+", word):
        return f'{variable}="${{{variable}:-{word}}}"'
    return f"{variable}=${{{variable}:-{word}}}"


def comment_text(value: str) -> str:
    """``value`` as it may appear in a ``#`` comment line: no line break can end the comment."""
    return value if not re.search(r"[\x00-\x1f\x7f]", value) else repr(value)


def _manual_job_dir(recipe: Recipe) -> str:
    """The manual form's default job folder, as shell text: the runs folder (under ``$DSPARK_REPO``
    unless absolute or in ``~/``), the job name, the Slurm job id."""
    runs_dir = recipe.job.runs_dir.rstrip("/") or "/"
    tail = f"{recipe.job.name}/"
    if runs_dir == "~" or runs_dir.startswith("~/"):
        base, folder = '"$HOME"', runs_dir[2:]
    elif runs_dir.startswith("/"):
        base, folder = "", runs_dir
    else:
        base, folder = "$DSPARK_REPO", runs_dir
    path = "/".join(part for part in (folder.strip("/"), tail.rstrip("/")) if part)
    quoted = shell_word(path)
    if quoted == path and base != '"$HOME"':  # plain: the double-quoted form keeps its old spelling
        return f"{base}/{path}/$SLURM_JOB_ID"
    base = '"$DSPARK_REPO"' if base == "$DSPARK_REPO" else base
    return f'{base}/{quoted}/"$SLURM_JOB_ID"'


def _site_settings(recipe: Recipe, options: RenderOptions) -> list[str]:
    repo_default = shell_word(options.repo_dir) if options.repo_dir else "${SLURM_SUBMIT_DIR:-$PWD}"
    job_dir_default = shell_word(options.job_dir) if options.job_dir else _manual_job_dir(recipe)
    lines = [
        "# ---- site settings: edit here, or export them before sbatch ----",
        shell_default("DSPARK_REPO", repo_default),
        shell_default("DSPARK_RECIPE_FILE", shell_word(options.recipe_file)),
        shell_default("DSPARK_JOB_DIR", job_dir_default),
        f'DSPARK_RESOLVE_ARGS="${{DSPARK_RESOLVE_ARGS:-{_resolve_args(options)}}}"',
    ]
    references = environment_references(recipe, options.probe)
    if references:
        lines.append("# Site paths the recipe reads from the environment:")
        for variable, fields in sorted(references.items()):
            used = ", ".join(sorted(set(fields)))
            lines.append(f': "${{{variable}:?export {variable} before sbatch (used by {used})}}"')
    return lines


def _resolve_args(options: RenderOptions) -> str:
    args = ["--smoke"] if options.smoke else []
    for item in options.overrides:
        if re.search(r"[\s'\"$`\\]", item):
            raise ValueError(
                f"--set {item!r} cannot be baked into a batch script (whitespace, quotes or $ in it); "
                "put the value in the recipe instead"
            )
        args += ["--set", item]
    return " ".join(args)


def _preamble(recipe: Recipe, options: RenderOptions) -> list[str]:
    lines = ['cd "$DSPARK_REPO" || { echo "cannot cd to DSPARK_REPO=$DSPARK_REPO" >&2; exit 1; }']
    if recipe.job.setup:
        lines.append("# ---- environment setup (job.setup) ----")
        lines += list(recipe.job.setup)
    python = shell_word(recipe.job.python)
    lines += [
        f'export {contracts.ENV_SLURM_JOB_ID}="$SLURM_JOB_ID"',
        'mkdir -p "$DSPARK_JOB_DIR/logs"',
        f'rm -f "$DSPARK_JOB_DIR/{CAPTURE_STOP_FILENAME}"',
        "# The launcher resolves the recipe before submitting; a manual sbatch resolves it here.",
        'if [ ! -f "$DSPARK_JOB_DIR/recipe.resolved.json" ]; then',
        f'  {python} -m launcher resolve "$DSPARK_RECIPE_FILE" --job-dir "$DSPARK_JOB_DIR" '
        '--slurm-job-id "$SLURM_JOB_ID" $DSPARK_RESOLVE_ARGS || exit 1',
        "fi",
        'echo "[dspark] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) folder $DSPARK_JOB_DIR"',
    ]
    return lines


def container_args(recipe: Recipe) -> list[str]:
    """``srun`` arguments that run a step in the recipe's container image (none without one)."""
    if not recipe.job.container_image:
        return []
    args = [f"--container-image={shell_word(recipe.job.container_image)}"]
    if recipe.job.container_mounts:
        args.append(f"--container-mounts={shell_word(','.join(recipe.job.container_mounts))}")
    args.append('--container-workdir="$DSPARK_REPO"')
    return args


def _component_launches(recipe: Recipe, options: RenderOptions) -> list[str]:
    lines: list[str] = []
    python = shell_word(recipe.job.python)
    one_node = recipe.job.layout == "one_node"
    for index, component in enumerate(COMPONENTS):
        resources: ComponentResources = getattr(recipe.job, component)
        # One node: each component is a step that shares the node's GPUs with the other (a step holds
        # its GPUs alone unless it overlaps), with its own task count (not the job's).
        placement = (
            [
                "--overlap",
                "--nodes=1",
                f"--ntasks={resources.tasks_per_node}",
                f"--cpus-per-task={resources.cpus_per_task}",
            ]
            if one_node
            else [f"--het-group={index}"]
        )
        srun = [
            "srun",
            *placement,
            "--kill-on-bad-exit=1",
            "--unbuffered",
            f'--output="{JOB_DIR_IN_OUTPUT}/logs/${{SLURM_JOB_ID}}_{component}_%t.out"',
        ]
        srun += container_args(recipe)
        srun += [shell_word(a) for a in resources.srun_args]
        worker = [python, "-u", "-m", "launcher.worker", "--component", component, '--job-dir "$DSPARK_JOB_DIR"']
        if options.probe:
            worker.append("--probe")
        variable = f"{component.upper()}_PID"
        lines += [
            f"# step: {component} (shares the node)" if one_node else f"# het group {index}: {component}",
            " ".join(srun) + " \\",
            "    " + " ".join(worker) + " &",
            f"{variable}=$!",
        ]
    return lines


def _supervision() -> list[str]:
    return [
        "# The trainer decides the outcome: when it ends, the capture component is stopped; when the",
        "# capture component fails first, the trainer is stopped and the job fails.",
        "while :; do",
        '  if ! kill -0 "$TRAINER_PID" 2>/dev/null; then',
        '    wait "$TRAINER_PID"; rc=$?',
        '    echo "[dspark] trainer finished with exit code $rc; stopping capture"',
        "    # The capture workers see the stop file, stop their component and end with success; a",
        "    # signal to srun would end the step CANCELLED. Signal only if they do not end in time.",
        f'    touch "$DSPARK_JOB_DIR/{CAPTURE_STOP_FILENAME}"',
        f'    for _ in $(seq {CAPTURE_STOP_WAIT_S // 2}); do kill -0 "$CAPTURE_PID" 2>/dev/null || break; sleep 2; done',
        '    kill -TERM "$CAPTURE_PID" 2>/dev/null; wait "$CAPTURE_PID" 2>/dev/null',
        "    exit $rc",
        "  fi",
        '  if ! kill -0 "$CAPTURE_PID" 2>/dev/null; then',
        '    wait "$CAPTURE_PID"; rc=$?',
        '    if [ "$rc" -ne 0 ]; then',
        '      echo "[dspark] capture failed with exit code $rc; stopping the trainer" >&2',
        '      kill -TERM "$TRAINER_PID" 2>/dev/null; wait "$TRAINER_PID" 2>/dev/null',
        "      exit $rc",
        "    fi",
        '    wait "$TRAINER_PID"; exit $?',
        "  fi",
        "  sleep 2",
        "done",
    ]


def sbatch_path(repo_root: Path, recipe: Recipe) -> Path:
    """Where the checked-in manual script of ``recipe`` lives."""
    return repo_root / "sbatch" / f"{recipe.job.name}.sbatch"
