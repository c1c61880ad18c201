"""Settings resolved once: every `auto` of the validated config decided, each with its reason.

`resolve_settings` is the one place an `auto` (or a null that means "choose for me") becomes a
value. It reads the machine (devices, the package set, /dev/shm) and the memory plan, and returns
a frozen copy of the settings with the decisions in it; the settings it was given, and the user's
composed config, stay as they were. Nothing downstream resolves `auto` again: the run, the W&B
config and the run directory's resolved.yaml all read this object.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from colo_rl.config import RunConfig, freeze, resolve_device, trainer_precision
from colo_rl.metrics import wandb_mode
from colo_rl.planner import Plan, plan_run
from colo_rl.trainer.kernels import check_kernels

RESOLVED_FILE = "resolved.yaml"
# decided by the memory plan, whose table prints them with their reasons
PLAN_KEYS = ("trainer.memory.offload", "generator.gpu_memory_utilization", "trainer.micro_batch_size",
             "trainer.memory.logprob_recompute")


@dataclass(frozen=True)
class Decision:
    """One key the config left to colo_rl: what it became and why."""

    key: str
    value: Any
    reason: str

    def line(self) -> str:
        value = str(self.value).lower() if isinstance(self.value, bool) else self.value
        return f"{self.key} -> {value}: {self.reason}"


@dataclass(frozen=True)
class Resolved:
    """What the run actually uses: the settings with no `auto` left (frozen: assigning to them
    raises), the decisions that made them so, and the memory plan."""

    settings: RunConfig
    decisions: tuple[Decision, ...]
    plan: Plan

    def config(self) -> dict:
        """The resolved settings as plain data, with each decision's reason under `decisions`:
        the W&B config and resolved.yaml."""
        return {**dataclasses.asdict(self.settings),
                "decisions": {d.key: {"value": d.value, "reason": d.reason} for d in self.decisions}}

    def table(self) -> str:
        """The decisions the plan's table does not print, one a line with its reason."""
        return "\n".join(d.line() for d in self.decisions if d.key not in PLAN_KEYS)

    def write(self, output_dir: Path) -> Path:
        """resolved.yaml in the run directory, beside Hydra's composed config: what ran, readable
        without W&B."""
        path = Path(output_dir) / RESOLVED_FILE
        path.write_text(OmegaConf.to_yaml(OmegaConf.create(self.config())))
        return path


def resolve_settings(settings: RunConfig, *, model_dir: Path, device: str, task=None,
                     memory: tuple[int, int] | None = None) -> Resolved:
    """Every `auto` of `settings` decided for the trainer on `device` ("cpu", "cuda:0") and the
    model in `model_dir`; `memory`: the device's (free, total) bytes for the plan (default:
    measured). Raises ConfigError where a setting cannot run here (the plan's refusals, Liger's)."""
    resolved = copy.deepcopy(settings)
    t, g, s = resolved.trainer, resolved.generator, resolved.sampling
    decisions = [_device("trainer.device", settings.trainer.device),
                 _device("generator.device", settings.generator.device),
                 _precision(settings)]
    t.device, g.device, t.memory.precision = (d.value for d in decisions)
    kernels = check_kernels(t.perf.kernels, device, model_dir, resolved.model.trust_remote_code, t.perf.compile)
    decisions.append(Decision("trainer.perf.kernels", kernels, _kernels_reason(settings.trainer.perf.kernels, kernels)))
    t.perf.kernels = kernels
    decisions.append(_logprob_kernel(t.perf.logprob_kernel, device))
    t.perf.logprob_kernel = decisions[-1].value
    # the plan resolves its four keys in the copy it is given
    plan = plan_run(resolved, model_dir, device, task, memory=memory, show=False)
    decisions += [Decision(key, _value(resolved, key), plan.reasons.get(key, "as given")) for key in PLAN_KEYS]
    decisions += [_weight_sync(g.weight_sync, g.device), _staging_dir(g.staging_dir),
                  _logprobs_every(s.logprobs_every, t.algo.tis_cap), _logger_mode(resolved.logger.mode)]
    g.weight_sync, g.staging_dir, s.logprobs_every, resolved.logger.mode = (d.value for d in decisions[-4:])
    asked = {d.key for d in decisions if _was_auto(settings, d.key)}
    return Resolved(freeze(resolved), tuple(d for d in decisions if d.key in asked), plan)


def _value(settings: RunConfig, key: str) -> Any:
    node = settings
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _was_auto(settings: RunConfig, key: str) -> bool:
    return _value(settings, key) in ("auto", None)


def _device(key: str, requested: str) -> Decision:
    value = resolve_device(requested)
    return Decision(key, value, "torch sees a CUDA GPU" if value == "cuda" else "torch sees no CUDA GPU")


def _precision(settings: RunConfig) -> Decision:
    value = trainer_precision(settings)
    return Decision("trainer.memory.precision", value,
                    f"model.dtype={settings.model.dtype}: " + ("fp32 masters beside 16-bit compute" if value == "mixed"
                                                              else "the parameters' own dtype throughout"))


def _kernels_reason(requested: str, value: str) -> str:
    if requested != "auto":
        return "as given"
    return ("a CUDA trainer, liger-kernel installed, a model type it knows, trainer.perf.compile off" if value == "liger"
            else "Liger's kernels need a CUDA trainer, liger-kernel, a model type it knows and trainer.perf.compile off")


def _logprob_kernel(requested: str, device: str) -> Decision:
    if requested != "auto":
        return Decision("trainer.perf.logprob_kernel", requested, "as given")
    cuda = device.startswith("cuda")
    return Decision("trainer.perf.logprob_kernel", "compiled" if cuda else "eager",
                    "a CUDA trainer: the head's chunks compiled" if cuda else "off CUDA: eager")


def _weight_sync(requested: str, engine_device: str) -> Decision:
    if requested != "auto":
        return Decision("generator.weight_sync", requested, "as given")
    cuda = engine_device == "cuda"
    return Decision("generator.weight_sync", "cuda_ipc" if cuda else "file",
                    "the engine on the trainer's GPU: shared CUDA tensors" if cuda else
                    "an engine off CUDA reads a staged file")


def _staging_dir(requested: str) -> Decision:
    if requested != "auto":
        return Decision("generator.staging_dir", requested, "as given")
    shm = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    return Decision("generator.staging_dir", "/dev/shm" if shm else tempfile.gettempdir(),
                    "a writable /dev/shm (memory, not disk)" if shm else "no writable /dev/shm: the temp directory")


def _logprobs_every(requested: int | None, tis_cap: float | None) -> Decision:
    if requested is not None:
        return Decision("sampling.logprobs_every", requested, "as given")
    every = 1 if tis_cap is not None else 10
    return Decision("sampling.logprobs_every", every,
                    "trainer.algo.tis_cap needs the engine's log-probs on every step" if every == 1 else
                    "train/engine_logprob_gap every 10 steps; the others sample at full speed")


def _logger_mode(requested: str) -> Decision:
    value = wandb_mode(requested)
    if requested != "auto":
        return Decision("logger.mode", value, "as given")
    return Decision("logger.mode", value, "a W&B API key is configured here" if value == "online" else
                    "no W&B API key configured here")
