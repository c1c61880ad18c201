"""Data parallelism for the trainer (trainer.parallel): DDP's wrapper or FSDP2's shards, and
gradient synchronisation only on a step's last micro-batch."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from colo_rl.parallel import Parallel
from colo_rl.trainer.kernels import decoder_layers


def _wrap(model: torch.nn.Module, parallel: Parallel, device: str) -> torch.nn.Module:
    """DDP keeps `model` whole and wraps it; FSDP2 shards `model` in place (its parameters become
    DTensors) and returns it."""
    if parallel.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [torch.device(device).index] if torch.device(device).type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if parallel.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in decoder_layers(model):
            fully_shard(layer)
        return fully_shard(model)
    return model

@contextmanager
def _gradient_sync(forward_model: torch.nn.Module, parallel: Parallel, sync: bool):
    if parallel.mode == "ddp" and not sync:
        with forward_model.no_sync():
            yield
    elif parallel.mode == "fsdp":
        forward_model.set_requires_gradient_sync(sync)
        yield
    else:
        yield
