"""Keys of the flat trainer layout and where they moved when trainer keys were grouped by concern
(issue 38): trainer.algo.*, trainer.optim.*, trainer.memory.*, trainer.perf.*, trainer.checkpoint.*.

`OLD_KEYS` is the one table: docs/config.md renders it, the command line refuses an old key with
one line naming its new place (colo_rl.cli, colo_rl.config.validate), and `translate` reads a
config written in the old layout (a checkpoint's config.yaml) in the new one.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

# old dotted key -> new dotted key (trainer keys of the flat layout, grouped by concern)
OLD_KEYS: dict[str, str] = {
    "trainer.algorithm": "trainer.algo.name",
    "trainer.advantage_estimator": "trainer.algo.advantage_estimator",
    "trainer.advantage_norm": "trainer.algo.advantage_norm",
    "trainer.advantage_std": "trainer.algo.advantage_std",
    "trainer.policy_loss": "trainer.algo.policy_loss",
    "trainer.loss_agg": "trainer.algo.loss_agg",
    "trainer.clip_eps": "trainer.algo.clip_eps",
    "trainer.clip_eps_high": "trainer.algo.clip_eps_high",
    "trainer.tis_cap": "trainer.algo.tis_cap",
    "trainer.kl_coef": "trainer.algo.kl_coef",
    "trainer.updates_per_batch": "trainer.algo.updates_per_batch",
    "trainer.mask_truncated": "trainer.algo.mask_truncated",
    "trainer.skip_zero_advantage": "trainer.algo.skip_zero_advantage",
    "trainer.dynamic_sampling.enabled": "trainer.algo.dynamic_sampling.enabled",
    "trainer.dynamic_sampling.max_rounds": "trainer.algo.dynamic_sampling.max_rounds",
    "trainer.optimizer": "trainer.optim.name",
    "trainer.weight_decay": "trainer.optim.weight_decay",
    "trainer.betas": "trainer.optim.betas",
    "trainer.max_grad_norm": "trainer.optim.max_grad_norm",
    "trainer.lr_schedule": "trainer.optim.lr_schedule",
    "trainer.warmup_steps": "trainer.optim.warmup_steps",
    "trainer.max_nonfinite_steps": "trainer.optim.max_nonfinite_steps",
    "trainer.precision": "trainer.memory.precision",
    "trainer.fp32_activations": "trainer.memory.fp32_activations",
    "trainer.offload": "trainer.memory.offload",
    "trainer.overlap_restore": "trainer.memory.overlap_restore",
    "trainer.restore_while_awake": "trainer.memory.restore_while_awake",
    "trainer.keep_cache": "trainer.memory.keep_cache",
    "trainer.gradient_checkpointing": "trainer.memory.gradient_checkpointing",
    "trainer.logprob_recompute": "trainer.memory.logprob_recompute",
    "trainer.logprob_chunk": "trainer.perf.logprob_chunk",
    "trainer.logprob_kernel": "trainer.perf.logprob_kernel",
    "trainer.fused_head": "trainer.perf.fused_head",
    "trainer.fuse_grad_accumulation": "trainer.perf.fuse_grad_accumulation",
    "trainer.sort_by_length": "trainer.perf.sort_by_length",
    "trainer.kernels": "trainer.perf.kernels",
    "trainer.compile": "trainer.perf.compile",
    "trainer.peak_tflops": "trainer.perf.peak_tflops",
    "trainer.checkpoint_every": "trainer.checkpoint.every",
    "trainer.checkpoint_final": "trainer.checkpoint.final",
    "trainer.checkpoint_background": "trainer.checkpoint.background",
    "trainer.resume": "trainer.checkpoint.resume",
    "trainer.export_final": "trainer.checkpoint.export",
    "trainer.export_dir": "trainer.checkpoint.export_dir",
}


def moved(key: str) -> Optional[str]:
    """The new place of `key` (a dotted path, maybe with a leading + or ~) when it is a key of the
    old layout or a group of them (trainer.dynamic_sampling), else None."""
    key = key.lstrip("+~")
    if key in OLD_KEYS:
        return OLD_KEYS[key]
    for old, new in OLD_KEYS.items():
        if old.startswith(key + ".") and new.endswith(old[len(key):]):
            return new[: len(new) - len(old) + len(key)]
    return None


def moved_message(key: str) -> Optional[str]:
    """`OLD moved to NEW (docs/config.md)` for a key of the old layout, else None."""
    new = moved(key)
    return None if new is None else f"{key.lstrip('+~')} moved to {new} (docs/config.md)"


def translate(config: dict) -> dict:
    """A copy of `config` (plain containers) with every key of the old layout at its new place; a
    config already in the new layout comes back equal."""
    out = copy.deepcopy(config)
    for old, new in OLD_KEYS.items():
        value = _pop(out, old)
        if value is not _ABSENT:
            _put(out, new, value)
    return out


_ABSENT = object()


def _pop(tree: Any, key: str) -> Any:
    """The value at `key`, taken out; a parent it leaves empty goes too (an old group, e.g.
    trainer.dynamic_sampling, whose keys all moved)."""
    head, _, rest = key.partition(".")
    if not isinstance(tree, dict) or head not in tree:
        return _ABSENT
    if not rest:
        return tree.pop(head)
    value = _pop(tree[head], rest)
    if tree[head] == {}:
        del tree[head]
    return value


def _put(tree: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value
