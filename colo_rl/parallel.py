"""Data parallelism over the GPUs of a node (or CPU processes): torchrun starts one process per
rank, torch.distributed connects them (NCCL on GPUs, gloo on CPU), and each rank owns one device,
its own sleeping vLLM engine and its shard of every step's prompts.

`trainer.parallel=none` gives `Parallel.single()`: every method is then a no-op or the identity,
so the runner reads the same either way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from statistics import mean

import torch
import torch.distributed as dist

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class ParallelError(RuntimeError):
    """Data-parallel set-up is wrong; the message says what to run instead."""


@dataclass
class Parallel:
    mode: str  # none | ddp | fsdp
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def single(cls) -> "Parallel":
        return cls("none")

    @classmethod
    def from_torchrun(cls, mode: str, device: str) -> "Parallel":
        """Join the process group torchrun set up. `device` is the trainer's device kind."""
        if mode == "none":
            return cls.single()
        missing = [k for k in TORCHRUN_ENV if k not in os.environ]
        if missing:
            raise ParallelError(
                f"trainer.parallel={mode} runs one process per rank under torchrun, but "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: run "
                f"`torchrun --nproc_per_node=N -m colo_rl.run trainer.parallel={mode} ...`")
        rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        if device == "cuda":
            if local >= torch.cuda.device_count():
                raise ParallelError(f"local rank {local} has no GPU: this node has "
                                    f"{torch.cuda.device_count()}; lower --nproc_per_node")
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device == "cuda" else "gloo")
        return cls(mode, rank, world, local)

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, kind: str) -> str:
        return f"cuda:{self.local_rank}" if kind == "cuda" and self.enabled else kind

    def engine_gpu(self) -> str | None:
        """CUDA_VISIBLE_DEVICES for this rank's engine: the one GPU the rank trains on."""
        if not self.enabled:
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        return devices[self.local_rank]

    def shard(self, items: list) -> slice:
        """This rank's contiguous share of a global batch (its length divides evenly)."""
        if len(items) % self.world_size:
            raise ParallelError(f"{len(items)} prompts per step do not split over "
                                f"{self.world_size} ranks: make trainer.prompts_per_step a multiple")
        size = len(items) // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    def all_sum(self, value: float) -> float:
        if not self.enabled:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item())

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def reduce_step_metrics(per_rank: list[dict[str, float]], rewards: list[list[float]]) -> dict[str, float]:
    """One record for the step from every rank's: the slowest rank's time per phase (what the
    step waits for), each rank's own under ranks/<r>/, the slowest rank's other seconds (the
    engine's, the weight load's, the background restore's), sums of counts and bytes, means of
    the rest, and reward statistics over every completion of the global batch."""
    if len(per_rank) == 1:
        return dict(per_rank[0])
    merged: dict[str, float] = {}
    for key in per_rank[0]:
        values = [m[key] for m in per_rank if key in m]
        if key.startswith("timing/"):
            merged[key] = max(values)
            for r, m in enumerate(per_rank):
                if key in m:
                    merged[f"ranks/{r}/{key}"] = m[key]
        elif key.endswith("_s") and not key.endswith("_per_s"):
            merged[key] = max(values)  # seconds outside timing/ (engine, sync, offloader): the slowest rank's
        elif key in ("rollout/tokens", "train/response_tokens", "sync/tensors") \
                or key.endswith("_bytes") or key.startswith("generator/"):
            merged[key] = sum(values)
        elif key.startswith("memory/free_"):
            merged[key] = min(values)
        elif key.startswith(("memory/", "host/")):
            merged[key] = max(values)
        else:
            merged[key] = mean(values)
    every = [r for rank in rewards for r in rank]
    merged.update({"reward/mean": mean(every), "reward/max": max(every), "reward/min": min(every)})
    return merged
