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
HYDRA_RECORD = ".hydra"  # what hydra.output_subdir used to name


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
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # under a regular file, or not writable
            raise ConfigError(f"output_dir={self.output_dir}: cannot write there ({exc.strerror}: "
                              f"{exc.filename}). Give a directory this user can create and write "
                              "(output_dir=PATH or hydra.run.dir=PATH)") from None
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


def claim(output_dir: Path, cfg, resume: str | None, overwrite: bool) -> None:
    """Called once the run holds `output_dir`'s lock, before anything is written into it: refuses a
    directory whose checkpoint another run wrote (this run would replace it and drop its metrics)
    unless this run resumes (`trainer.checkpoint.resume`) or is told to (`overwrite_output_dir=true`); then
    saves Hydra's record of the job there (conf/hydra/default.yaml turns Hydra's own writing off:
    it wrote before any lock was taken, into the directory of a live run too)."""
    manifest = output_dir / "checkpoint" / "manifest.json"
    if manifest.is_file() and resume is None and not overwrite:
        raise ConfigError(f"output_dir={output_dir} holds the checkpoint of an earlier run "
                          f"({manifest.parent}), which this run would replace: continue it with "
                          f"trainer.checkpoint.resume={manifest.parent}, give this run another output_dir, or "
                          "replace it (and its metrics) with overwrite_output_dir=true")
    _save_hydra_record(output_dir, cfg)


def _save_hydra_record(output_dir: Path, cfg) -> None:
    """OUTPUT_DIR/.hydra/{config,hydra,overrides}.yaml, as Hydra's run_job writes them."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    _log_to(output_dir / f"{hydra_cfg.job.name}.log", hydra_cfg.job_logging)
    record = output_dir / HYDRA_RECORD
    record.mkdir(exist_ok=True)
    for name, node in (("config.yaml", cfg), ("hydra.yaml", {"hydra": hydra_cfg}),
                       ("overrides.yaml", hydra_cfg.overrides.task)):
        OmegaConf.save(node, record / name)


_run_log: logging.Handler | None = None


def _log_to(path: Path, job_logging) -> None:
    """The root logger's file handler that Hydra's job_logging would have opened at the job's
    start (the one handler colo_rl adds: a later run in this process replaces it)."""
    global _run_log
    root = logging.getLogger()
    if _run_log is not None:
        root.removeHandler(_run_log)
        _run_log.close()
    _run_log = logging.FileHandler(path)
    fmt = job_logging.get("formatters", {}).get("simple", {}).get("format")
    _run_log.setFormatter(logging.Formatter(fmt))
    root.addHandler(_run_log)


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
