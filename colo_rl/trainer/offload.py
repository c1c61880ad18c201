"""Moves the trainer's state off its device while the engine is awake, and back, bit-exact.

Host buffers are allocated once per tensor (pinned on CUDA, so the copies can run
asynchronously) and reused every cycle: allocating pinned memory is slow, and a fresh allocation
each step would also fragment host memory. Tensors keep their identity (`t.data` is swapped), so
the optimizer's references to its parameters and its state dict stay valid.

On CUDA, `restore()` brings parameters, buffers and gradients back before it returns, and the
optimizer's state (AdamW's moments: two thirds of the bytes) on a side stream, so that those copies
overlap the next step's scoring and forward/backward instead of lengthening the switch
(`overlap_restore`, trainer.memory.overlap_restore). The default stream waits for them (`wait()`: on the
GPU, without blocking the host) before anything reads that state: optimizer.step and
optimizer.state_dict call it through hooks, and the next offload does. Code that reads
`optimizer.state` tensors some other way calls `wait()` first.

`restore_while_awake` lets the switch (colo_rl.switch) restore before the engine sleeps, when
`fits_beside_engine()` finds room for everything offloaded on the device. It is off for an
Offloader built by hand; runs take trainer.memory.restore_while_awake, on by default.
"""

from __future__ import annotations

import time
import weakref
from typing import Callable, Iterator

import torch

POLICY_PARTS = {"all": ("optimizer", "params"), "optimizer": ("optimizer",), "none": ()}
PARTS = ("optimizer", "params")


class Offloader:
    """Moves trainer state (params, buffers, grads, optimizer state) between its device and host buffers."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, policy: str = "all",
                 overlap_restore: bool = True, restore_while_awake: bool = False):
        if policy not in POLICY_PARTS:
            raise ValueError(f"offload policy={policy!r} must be one of {', '.join(POLICY_PARTS)} "
                             "(trainer.memory.offload)")
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
        self._moved: dict[str, list[tuple[str, torch.Tensor, torch.device]]] = {}  # part -> what left
        self._names = {id(p): name for name, p in model.named_parameters()}
        self.overlap_restore = overlap_restore  # read at each restore(); a no-op off CUDA
        self.restore_while_awake = restore_while_awake  # read by fits_beside_engine()
        # Bytes the engine needs free to wake (the memory plan's); when at least that much is free
        # after an offload, torch's cache is kept: with nothing to move, the two offloads of a step
        # (their empty_cache and free-memory readings) are a visible part of the switch, and the next step
        # allocates again what empty_cache released. None: always emptied.
        self.keep_cache_if_free: int | None = None
        self._side = torch.cuda.Stream(self.device) if self._cuda else None
        # The latest restore's side-stream copies: (start event, end event, bytes); None when it had none
        self._background: tuple[torch.cuda.Event, torch.cuda.Event, int] | None = None
        self._waited = True  # whether the current stream already waits for them
        if self._side is not None:
            # Whatever reads the optimizer's state first waits for its copies; a weak reference, so
            # the optimizer does not keep a dropped Offloader (and its pinned buffers) alive.
            hook = _weak_hook(weakref.WeakMethod(self.wait))
            optimizer.register_step_pre_hook(hook)
            optimizer.register_state_dict_pre_hook(hook)

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
        self.wait()  # the copies below read state a background restore may still be writing
        free_before = self._free_bytes()
        moved = self._transfer(lambda journal: sum(self._offload_part(part, journal) for part in todo))
        self.offloaded.update(todo)
        if self._cuda and (self.keep_cache_if_free is None or self._free_bytes() < self.keep_cache_if_free):
            torch.cuda.empty_cache()  # hand the freed blocks to the driver, where the engine can get them
        return {"seconds": time.perf_counter() - start, "bytes": float(moved),
                "freed_gib": (self._free_bytes() - free_before) / 2**30}

    def restore(self) -> dict[str, float]:
        """Brings back everything offloaded, bit-exact; a no-op when nothing is offloaded.

        "seconds" and "bytes" are what the caller waited for; "background_bytes" were queued on the
        side stream and are still arriving (see `wait()` and `background_stats()`).
        """
        start = time.perf_counter()
        entries = [entry for part in sorted(self.offloaded) for entry in self._moved[part]]
        if entries:
            self.wait()  # offload() has waited already; this keeps the invariant local
            self._background = None  # background_stats() describes this restore from here on
        if self._side is not None and self.overlap_restore:
            later = [e for e in entries if e[0].startswith("state:")]
            now = [e for e in entries if not e[0].startswith("state:")]
        else:
            later, now = [], entries
        moved = self._transfer(lambda journal: self._restore_entries(now, journal))
        background = self._restore_in_background(later)
        self.offloaded.clear()
        return {"seconds": time.perf_counter() - start, "bytes": float(moved),
                "background_bytes": float(background)}

    def offloaded_bytes(self) -> int:
        """What restore() would bring back (0 when nothing is offloaded)."""
        return sum(tensor.data.nbytes for part in self.offloaded for _, tensor, _ in self._moved[part])

    def fits_beside_engine(self, margin_bytes: int = 2**30) -> bool:
        """Whether to restore while the engine is still awake: restore_while_awake is on, something
        is offloaded, and the device's free memory holds it with `margin_bytes` to spare (always
        on the CPU, where the trainer's memory is not the engine's)."""
        if not (self.restore_while_awake and self.offloaded):
            return False
        return not self._cuda or self._free_bytes() >= self.offloaded_bytes() + margin_bytes

    def wait(self) -> None:
        """Makes the current stream wait for the background restore; returns at once (on the host).

        Called before anything reads the optimizer's state: hooks on optimizer.step and
        optimizer.state_dict, and offload(). Harmless when nothing is in flight, and on the CPU.
        """
        if not self._waited:
            torch.cuda.current_stream(self.device).wait_event(self._background[1])
            self._waited = True

    def background_stats(self) -> dict[str, float]:
        """Seconds and bytes of the last background restore, once its copies have finished ({} before)."""
        if self._background is None or not self._background[1].query():
            return {}
        started, ended, nbytes = self._background
        return {"offloader/restore_background_s": started.elapsed_time(ended) / 1000,
                "offloader/restore_background_bytes": float(nbytes)}

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
            moved.append((key, tensor, self.device))
            nbytes += host.nbytes
        self._moved[part] = moved
        return nbytes

    def _restore_entries(self, entries: list, journal: list) -> int:
        nbytes = 0
        for _, tensor, device in entries:
            host = tensor.data
            on_device = torch.empty_like(host, device=device)
            on_device.copy_(host, non_blocking=self._cuda)
            journal.append((tensor, host))
            tensor.data = on_device
            nbytes += host.nbytes
        return nbytes

    def _restore_in_background(self, entries: list) -> int:
        """Queues the copies of `entries` on the side stream; the tensors point at their device
        memory at once, and the default stream must `wait()` before reading it.

        The device tensors are allocated on the default stream (so the caching allocator frees
        them in its order), and the side stream first waits for everything queued there, so no
        copy can land in memory the default stream is still using.
        """
        if not entries:
            return 0
        targets = [torch.empty_like(tensor.data, device=device) for _, tensor, device in entries]
        started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side), torch.no_grad():
            started.record()
            for target, (_, tensor, _) in zip(targets, entries):
                target.copy_(tensor.data, non_blocking=True)  # the host buffer stays in self._host
            ended.record()
        nbytes = 0
        for target, (_, tensor, _) in zip(targets, entries):
            tensor.data = target
            nbytes += target.nbytes
        self._background, self._waited = (started, ended, nbytes), False
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


def _weak_hook(method: weakref.WeakMethod) -> Callable[..., None]:
    """An optimizer hook that calls `method` while its object lives, and returns None (no change)."""
    def hook(*_) -> None:
        bound = method()
        if bound is not None:
            bound()
    return hook
