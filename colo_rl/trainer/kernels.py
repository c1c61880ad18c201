"""Faster training forward and backward, computing the same thing (issue #24's MFU).

trainer.perf.kernels=liger (and `auto`, the default, wherever it can run) swaps the Hugging Face
model's RMSNorm, SwiGLU MLP and rotary embedding for Liger's fused Triton kernels (liger-kernel,
as TRL's `use_liger_kernel`): each of those is a chain of elementwise kernels in eager PyTorch,
most of them reading and writing the whole activation in fp32. Liger's own instance patch leaves
the attention's q/k norms (OLMo-2) as they were; they are patched here too. Its patch also rebinds
names in the modeling module, which would reach every model of that type built later in the
process; here only the patched model (and the KL reference, patched alike) runs them. The output
head is left alone: colo_rl's chunked head (trainer.perf.logprob_chunk) already avoids the full logits.
Fewer passes over the activations make the train step faster and its activations smaller.
trainer.perf.kernels=liger with trainer.perf.compile=true is refused (TrainerConfig): Dynamo does not trace
Liger's Triton kernels, and such a model's log-probs differ from the eager model's.

trainer.perf.compile=true compiles each decoder layer with torch.compile (regional compilation: one
layer's code is compiled once and reused by all of them, so the first step pays seconds, not
minutes) and fuses whatever elementwise work is left between the matmuls.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import sys
import types
from pathlib import Path
from typing import Callable

import torch

from colo_rl.config import ConfigError


class _UnusedBackends(logging.Filter):
    """Liger looks for each op's implementation in every vendor's backend module (Triton, CuTe DSL,
    Ascend, cuTile) and logs a warning for each one that cannot be imported on this machine: noise
    at the start of every run, since the Triton one runs. An op with no importable backend still
    fails when it runs; the failures stay in liger_kernel.backends.registry.get_discovery_failures()."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and "could not be imported" in record.msg
                    and record.msg.startswith("Backend impl"))


def quiet_liger_discovery() -> None:
    """Installs _UnusedBackends on Liger's registry logger (once), before Liger is imported."""
    registry = logging.getLogger("liger_kernel.backends.registry")
    if not any(isinstance(f, _UnusedBackends) for f in registry.filters):
        registry.addFilter(_UnusedBackends())


def liger_model_types() -> set[str]:
    """The model types (config.json's model_type) liger-kernel patches; empty without it."""
    if importlib.util.find_spec("liger_kernel") is None:
        return set()
    quiet_liger_discovery()
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return set(MODEL_TYPE_TO_APPLY_LIGER_FN)


def resolve_kernels(kernels: str, device: str, model_type: str, compile: bool = False) -> str:
    """trainer.perf.kernels with `auto` resolved: liger where it runs (a CUDA trainer, liger-kernel
    installed, a model type it knows) and trainer.perf.compile is off (compiled layers fuse the same
    elementwise work, and Dynamo cannot trace Liger's RoPE kernel: no gain together), else
    none. An explicit `liger` that cannot run is refused with a ConfigError naming the key."""
    if kernels == "none":
        return "none"
    installed = importlib.util.find_spec("liger_kernel") is not None
    cuda = str(device).startswith("cuda")
    if kernels == "auto":
        return "liger" if installed and cuda and not compile and model_type in liger_model_types() else "none"
    if not installed:
        raise ConfigError("trainer.perf.kernels=liger needs the package liger-kernel, which is not installed "
                          "here: pip install 'colo_rl[kernels]', or set trainer.perf.kernels=none")
    if not cuda:
        raise ConfigError(f"trainer.perf.kernels=liger runs Triton GPU kernels, but the trainer is on {device}: "
                          "set trainer.perf.kernels=none (or train on a CUDA GPU)")
    known = liger_model_types()
    if model_type not in known:
        raise ConfigError(f"trainer.perf.kernels=liger: liger-kernel has no kernels for model type {model_type!r} "
                          f"(it knows {', '.join(sorted(known))}): set trainer.perf.kernels=none")
    return "liger"


def check_kernels(kernels: str, device: str, model_dir: Path, trust_remote_code: bool = False,
                  compile: bool = False) -> str:
    """trainer.perf.kernels for this machine and the model in `model_dir` (its config only), before
    any engine starts: the resolved value, or a ConfigError naming the key."""
    if kernels == "none":
        return "none"
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code).model_type
    return resolve_kernels(kernels, device, model_type, compile)


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model under a peft wrapper (LoRA), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def apply_liger(model: torch.nn.Module) -> None:
    """Patches `model` (in place) with Liger's kernels, and nothing else in the process. LoRA
    layers stay peft's: the SwiGLU patch calls the projections as modules.

    Liger's patch for a model type also rebinds names in the modeling module (its RMSNorm and MLP
    classes, apply_rotary_pos_emb), so every model of that type built afterwards in the process,
    a `trainer.perf.kernels=none` one or a CPU one included, would run Liger's kernels. Those names are
    put back here; the module-level functions Liger swapped in (RoPE) reach this model's modules
    that call them through a subclass whose forward sees Liger's function (same class name)."""
    quiet_liger_discovery()
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance, _patch_rms_norm_module

    hf = _hf_model(model)
    modeling = sys.modules[type(hf).__module__]
    before = dict(vars(modeling))
    try:
        _apply_liger_kernel_to_instance(model=hf, rope=True, rms_norm=True, swiglu=True,
                                        cross_entropy=False, fused_linear_cross_entropy=False)
    finally:
        swapped = {name: value for name, value in vars(modeling).items() if before.get(name) is not value}
        for name in swapped:
            if name in before:
                setattr(modeling, name, before[name])
            else:
                delattr(modeling, name)
    functions = tuple(sorted((name, fn) for name, fn in swapped.items()
                             if inspect.isfunction(fn) and inspect.isfunction(before.get(name))))
    for module in hf.modules():
        forward = type(module).__dict__.get("forward")
        if (functions and inspect.isfunction(forward) and forward.__globals__ is vars(modeling)
                and any(name in forward.__code__.co_names for name, _ in functions)):
            module.__class__ = _calling(type(module), functions)
    base = getattr(hf, hf.base_model_prefix, hf)
    final = getattr(base, "norm", None)
    if final is None or not hasattr(final, "casting_mode"):
        return
    for module in base.modules():  # the model's RMSNorm class left unpatched: q_norm, k_norm, ...
        if type(module) is type(final) and not hasattr(module, "casting_mode"):
            _patch_rms_norm_module(module, offset=final.offset, casting_mode=final.casting_mode, in_place=False)


@functools.cache
def _calling(cls: type, functions: tuple[tuple[str, Callable], ...]) -> type:
    """A subclass of `cls`, named as it is, whose forward is cls.forward with the module-level
    `functions` (name, function) in place of its module's: a per-instance patch of what forward
    calls, which deep copies keep."""
    forward = cls.forward
    globals_ = {**forward.__globals__, **dict(functions)}
    patched = types.FunctionType(forward.__code__, globals_, forward.__name__, forward.__defaults__,
                                 forward.__closure__)
    patched.__kwdefaults__ = forward.__kwdefaults__
    functools.update_wrapper(patched, forward)
    del patched.__wrapped__  # inspect.signature and Dynamo read the function itself
    return type(cls.__name__, (cls,), {"forward": patched, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks (Hugging Face's `_no_split_modules`), under peft too."""
    names = set(getattr(_hf_model(model), "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def compile_layers(model: torch.nn.Module) -> int:
    """torch.compile each decoder layer in place (`Module.compile`); returns how many. The layers
    share one code object, so Dynamo compiles it once per input shape class: micro-batches of
    different lengths mark the sequence dimension dynamic after the first recompile."""
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(f"trainer.perf.compile=true: {type(_hf_model(model)).__name__} names no decoder layer "
                          "class (_no_split_modules) to compile: set trainer.perf.compile=false")
    for layer in layers:
        layer.compile()
    return len(layers)
