"""Moves the trainer's state off its device while the engine is awake, and back, bit-exact.

Host buffers are allocated once per tensor (pinned on CUDA, so the copies can run
asynchronously) and reused every cycle: allocating pinned memory is slow, and a fresh allocation
each step would also fragment host memory. Tensors keep their identity (`t.data` is swapped), so
the optimizer's references to its parameters and its state dict stay valid.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

POLICY_PARTS = {"all": ("optimizer", "params"), "optimizer": ("optimizer",), "none": ()}
PARTS = ("optimizer", "params")


class Offloader:
    """Moves trainer state (params, buffers, grads, optimizer state) between its device and host buffers."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, policy: str = "all"):
        if policy not in POLICY_PARTS:
            raise ValueError(f"offload policy={policy!r} must be one of {', '.join(POLICY_PARTS)} "
                             "(trainer.offload)")
        params = list(model.parameters())
        if not params:
            raise ValueError("Offloader needs a model with parameters: it finds its device from them")
        self.model = model
        self.optimizer = optimizer
        self.policy = policy
        self.device = params[0].device
        self.offloaded: set[str] = set()
        self._cuda = self.device.type == "cuda"
        self._host: dict[str, torch.Tensor] = {}  # one buffer per tensor, allocated on first use
        self._moved: dict[str, list[tuple[torch.Tensor, torch.device]]] = {}  # part -> what left
        self._names = {id(p): name for name, p in model.named_parameters()}

    def offload(self, parts: tuple[str, ...] = PARTS) -> dict[str, float]:
        """Moves the named parts that the policy lets go to host buffers.

        'optimizer' covers optimizer state and gradients, 'params' parameters and buffers. Parts
        already on the host are skipped, so ("optimizer",) then ("params",) in one cycle works.
        """
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(f"offload parts {sorted(unknown)} unknown: use {', '.join(PARTS)}")
        todo = [p for p in POLICY_PARTS[self.policy] if p in parts and p not in self.offloaded]
        start = time.perf_counter()
        free_before = self._free_bytes()
        moved = self._transfer(lambda journal: sum(self._offload_part(part, journal) for part in todo))
        self.offloaded.update(todo)
        if self._cuda:
            torch.cuda.empty_cache()  # hand the freed blocks to the driver, where the engine can get them
        return {"seconds": time.perf_counter() - start, "bytes": float(moved),
                "freed_gib": (self._free_bytes() - free_before) / 2**30}

    def restore(self) -> dict[str, float]:
        """Brings back everything offloaded, bit-exact; a no-op when nothing is offloaded."""
        start = time.perf_counter()
        moved = self._transfer(lambda journal: sum(self._restore_part(part, journal)
                                                   for part in sorted(self.offloaded)))
        self.offloaded.clear()
        return {"seconds": time.perf_counter() - start, "bytes": float(moved)}

    def _transfer(self, copies: Callable[[list], int]) -> int:
        """Runs `copies`, then synchronizes once; on any error puts every swapped tensor back.

        The journal keeps each tensor's previous storage alive until the copies are done, so an
        asynchronous copy never reads freed memory and a rollback is exact.
        """
        journal: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            with torch.no_grad():
                moved = copies(journal)
            if self._cuda:
                torch.cuda.synchronize(self.device)
        except BaseException:
            for tensor, previous in reversed(journal):
                tensor.data = previous
            raise
        return moved

    def _offload_part(self, part: str, journal: list) -> int:
        moved, nbytes = [], 0
        for key, tensor in self._tensors(part):
            # CPU tensors next to CUDA ones (AdamW's `step`) are already where they would go.
            if tensor.device != self.device:
                continue
            host = self._host_buffer(key, tensor)
            host.copy_(tensor.data, non_blocking=self._cuda)
            journal.append((tensor, tensor.data))
            tensor.data = host
            moved.append((tensor, self.device))
            nbytes += host.nbytes
        self._moved[part] = moved
        return nbytes

    def _restore_part(self, part: str, journal: list) -> int:
        nbytes = 0
        for tensor, device in self._moved[part]:
            host = tensor.data
            on_device = torch.empty_like(host, device=device)
            on_device.copy_(host, non_blocking=self._cuda)
            journal.append((tensor, host))
            tensor.data = on_device
            nbytes += host.nbytes
        return nbytes

    def _tensors(self, part: str) -> Iterator[tuple[str, torch.Tensor]]:
        if part == "params":
            yield from ((f"param:{name}", p) for name, p in self.model.named_parameters())
            yield from ((f"buffer:{name}", b) for name, b in self.model.named_buffers())
            return
        for i, p in enumerate(p for group in self.optimizer.param_groups for p in group["params"]):
            name = self._names.get(id(p), f"#{i}")
            if p.grad is not None:
                yield f"grad:{name}", p.grad
            for key, value in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    yield f"state:{name}:{key}", value

    def _host_buffer(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        host = self._host.get(key)
        if host is None:
            host = torch.empty_like(tensor.data, device="cpu", pin_memory=self._cuda)
            self._host[key] = host
        elif host.shape != tensor.shape or host.dtype != tensor.dtype:
            raise RuntimeError(f"the host buffer for {key} is {tuple(host.shape)} {host.dtype} but the tensor "
                               f"is {tuple(tensor.shape)} {tensor.dtype}: the model or optimizer changed "
                               "shape after this Offloader was built; build a new Offloader")
        return host

    def _free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0] if self._cuda else 0
