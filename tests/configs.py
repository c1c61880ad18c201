"""TrainerConfig for tests that build a GRPOTrainer directly, from keys named as in their group."""

from __future__ import annotations

import copy
import dataclasses

from colo_rl.config import TrainerConfig

# the groups' dataclasses (each field's default_factory is its class)
_GROUPS = {f.name: f.default_factory for f in dataclasses.fields(TrainerConfig)
           if dataclasses.is_dataclass(f.default_factory)}


def trainer_config(**keys) -> TrainerConfig:
    """A TrainerConfig with `keys` set: a key of trainer.* by its name (lr=...), a key of one of its
    groups (trainer.algo.*, trainer.optim.*, ...) by its name in the group (clip_eps=...), where that
    name is in one group only; a whole group by its name (lora=LoraConfig(...))."""
    top = {f.name for f in dataclasses.fields(TrainerConfig)}
    grouped: dict[str, dict] = {}
    direct = {}
    for key, value in keys.items():
        if key in top:
            direct[key] = value
            continue
        owners = [g for g, group in _GROUPS.items() if key in {f.name for f in dataclasses.fields(group)}]
        if len(owners) != 1:
            raise TypeError(f"trainer_config: {key!r} is a key of {owners or 'no group'}; pass the group")
        grouped.setdefault(owners[0], {})[key] = value
    for group, values in grouped.items():
        direct[group] = _GROUPS[group](**values)
    return TrainerConfig(**direct)


def old_layout(config: dict) -> dict:
    """`config` (plain containers, the current layout) as a config.yaml written before the trainer
    keys were grouped (colo_rl.config_moves.OLD_KEYS) held it."""
    from colo_rl.config_moves import OLD_KEYS

    old = copy.deepcopy(config)
    for group in ("algo", "optim", "memory", "perf", "checkpoint"):
        del old["trainer"][group]
    for old_key, new_key in OLD_KEYS.items():
        value, node = config, old
        for part in new_key.split("."):
            value = value[part]
        *parents, leaf = old_key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return old
