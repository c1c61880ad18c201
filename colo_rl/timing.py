"""Per-phase wall-clock timing and GPU memory snapshots for one step."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

GIB = 2**30


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
