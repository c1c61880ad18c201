"""Per-phase wall-clock timing and GPU memory snapshots for one step."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

GIB = 2**30
log = logging.getLogger("colo_rl")


def _sync() -> None:
    # The current stream only: the Offloader's background restore runs on a side stream, on
    # purpose past the end of the restore phase, and a device-wide sync would wait for it here.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def gpu_free_gib() -> float | None:
    """Free memory on this process's GPU as the driver sees it (other processes included)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    free, _ = torch.cuda.mem_get_info()
    return free / GIB


class StepTimer:
    """Collects `timing/<phase>_s` and `memory/free_after_<event>_gib` for one step."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}
        self.current: str | None = None

    @contextmanager
    def phase(self, name: str):
        self.current = name
        _sync()
        start = time.perf_counter()
        yield  # on an exception `current` keeps naming the phase that failed
        _sync()
        key = f"timing/{name}_s"
        self.metrics[key] = self.metrics.get(key, 0.0) + time.perf_counter() - start
        self.current = None

    def memory(self, event: str) -> None:
        free = gpu_free_gib()
        if free is not None:
            self.metrics[f"memory/free_after_{event}_gib"] = free
            # this process's share of what is not free: torch's cache (reserved) and what its live
            # tensors use (allocated); the rest is the engine's and the CUDA contexts'
            self.metrics[f"memory/trainer_reserved_after_{event}_gib"] = torch.cuda.memory_reserved() / GIB
            self.metrics[f"memory/trainer_allocated_after_{event}_gib"] = torch.cuda.memory_allocated() / GIB


def host_metrics(engine_pid: int | None) -> dict[str, float]:
    """Host resources a long run must not leak: the trainer's RSS, open file descriptors and
    child processes, and the RSS of the engine worker with its own children."""
    import psutil

    me = psutil.Process()
    metrics = {"host/trainer_rss_gib": me.memory_info().rss / GIB,
               "host/open_fds": float(me.num_fds()),
               "host/child_processes": float(len(me.children(recursive=True)))}
    if engine_pid is not None:
        try:
            worker = psutil.Process(engine_pid)
            rss = sum(p.memory_info().rss for p in [worker, *worker.children(recursive=True)])
            metrics["host/engine_rss_gib"] = rss / GIB
        except psutil.NoSuchProcess:
            pass
    return metrics


class SetupStages:
    """Set-up, stage by stage: one log line as each ends, with its seconds, and `setup/<stage>_s`
    (plus `setup/total_s`, from the run's start to its first step) for the first step's record.
    Stages follow one another: each `mark` ends the stage that began at the previous one."""

    def __init__(self) -> None:
        self.started = self._last = time.perf_counter()
        self.metrics: dict[str, float] = {}

    def mark(self, name: str, text: str) -> None:
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        self.metrics[f"setup/{name}_s"] = self.metrics.get(f"setup/{name}_s", 0.0) + seconds
        log.info("set-up: %s (%.1f s)", text, seconds)

    def finish(self) -> dict[str, float]:
        self.metrics["setup/total_s"] = time.perf_counter() - self.started
        return dict(self.metrics)


@contextmanager
def engine_log_status(text: str, log_path: Path, enabled: bool | None = None):
    """A spinner on the console while the engine starts, showing the last line of its log (vLLM
    says there when it loads, compiles, captures graphs). Only on a terminal: a log file gets the
    stage lines alone."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield
        return
    from rich.console import Console

    stop = threading.Event()
    with Console(stderr=True).status(text) as status:
        def follow() -> None:
            while not stop.wait(0.5):
                last = _last_line(log_path)
                if last:
                    status.update(f"{text}: {last[:100]}")
        thread = threading.Thread(target=follow, name="colo_rl-engine-status", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""
