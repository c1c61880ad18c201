"""One writer per run directory, and a metrics.jsonl that a resumed run continues without duplicates."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
from pathlib import Path

from colo_rl.config import ConfigError

log = logging.getLogger("colo_rl")

LOCK_NAME = ".colo_rl.lock"


class RunDirInUse(ConfigError):
    """Another colo_rl run writes into this output directory."""


class RunDirLock:
    """An exclusive flock on OUTPUT_DIR/.colo_rl.lock, held for the whole run.

    The kernel drops it when the process ends, however it ends (SIGKILL included), so a dead run
    never blocks the next one; its holder's pid is in the file for the message.
    """

    def __init__(self, output_dir: str | os.PathLike):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_NAME
        self._fd: int | None = None

    def __enter__(self) -> "RunDirLock":
        self.output_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirInUse(f"output_dir={self.output_dir} is in use by another colo_rl run (pid "
                              f"{holder}, lock {self.path}): wait for it to end, or give this run "
                              "another output_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None


def drop_records_from(path: str | os.PathLike, first_step: int, step_key: str) -> int:
    """Rewrite the metrics file without the records of steps >= first_step (logged after the
    checkpoint a run resumes from, or by an earlier run into the same directory); returns how
    many were dropped. The rewrite replaces the file atomically."""
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines(keepends=True):
        try:
            step = json.loads(line).get(step_key)
        except (json.JSONDecodeError, AttributeError):
            step = None  # a line cut short when a run was killed mid-write: not a record
        if step is None or step >= first_step:
            dropped += 1
        else:
            kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        with os.fdopen(fd, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)
        log.warning("%s: dropped %d records of steps >= %d (logged after the checkpoint this run "
                    "starts from); the run logs those steps again", path, dropped, first_step)
    return dropped
