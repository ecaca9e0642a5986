"""The capture component owns the Mooncake master: it watches it, and fails the job at once when the
master (or the metadata server beside it) dies under it.

Without the watch a killed master went unnoticed for minutes: the capture's puts and the trainer's gets
time out one by one, and the console fills with the survivors' tracebacks. With it the capture task
prints one line naming the process, its exit and the trainer's step, with the resume command, and
exits; the supervisor then stops the trainer and names the capture as the first to die.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from runtime.shared.contracts import resume_command_of
from runtime.shared.lifecycle import exit_text

log = logging.getLogger("dspark.capture")

WATCH_POLL_S = 0.5
"""How often the watch polls the master's process."""
EXIT_MASTER_DIED = 3
"""The capture task's exit code when its Mooncake master died under it."""


class MasterWatch:
    """A daemon thread that polls the master's processes; an unexpected exit logs one line and ends
    this process with :data:`EXIT_MASTER_DIED` (``exit`` is replaceable for tests)."""

    def __init__(
        self,
        processes: dict[str, subprocess.Popen[bytes] | None],
        job_dir: Path,
        poll_s: float = WATCH_POLL_S,
        exit: Callable[[int], object] = os._exit,
        stop_requested: threading.Event | None = None,
    ) -> None:
        self.processes = {name: p for name, p in processes.items() if p is not None}
        self.stop_requested = stop_requested
        """The capture's own stop request: a master that ends after it is no death (below)."""
        self.job_dir = job_dir
        self.poll_s = poll_s
        self._exit = exit
        self.where: Callable[[], str] = lambda: "while the capture started"
        """Where the run is, for the line (set once the producer knows the trainer's cursor)."""
        self.line = ""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="master-watch", daemon=True)

    def start(self) -> MasterWatch:
        """Start watching."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (before the master is stopped on purpose)."""
        self._stopping.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.poll_s + 1)

    def _run(self) -> None:
        while not self._stopping.wait(self.poll_s):
            for name, process in self.processes.items():
                code = process.poll()
                if code is None or self._stopping.is_set():
                    continue
                if self.stop_requested is not None and self.stop_requested.is_set():
                    # Under Slurm a stop (scancel, a requeue, preemption) signals every process of the step
                    # at once, and the master stops on that signal by itself: the job's end, not a failure.
                    log.info(
                        "%s (pid %d) %s with the job's stop; the capture stops", name, process.pid, exit_text(code)
                    )
                    self._exit(0)
                    return
                try:
                    where = self.where()
                except Exception:  # the line must come out whatever the producer's state
                    where = "at an unknown step"
                self.line = (
                    f"{name} (pid {process.pid}) {exit_text(code)} {where}; the capture fails now; "
                    f"resume with `{resume_command_of(self.job_dir)}`"
                )
                log.error("%s", self.line)
                for handler in logging.getLogger().handlers:
                    handler.flush()
                sys.stderr.flush()
                self._exit(EXIT_MASTER_DIED)
                return


def trainer_step_text(cursor: int | None, global_batch_size: int) -> str:
    """``at step S`` from the trainer's published cursor (samples consumed)."""
    if cursor is None:
        return "before the trainer's first step"
    return f"at step {cursor // global_batch_size}"
