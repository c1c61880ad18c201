"""The config reference, docs/config.md, generated from the schema: `python -m colo_rl.docs > docs/config.md`.

Each key's description is its field's `help` in colo_rl/config.py (`described`), written nowhere
else; its default is the one `python -m colo_rl.run` composes from conf/. tests/test_docs.py fails
when a key has no description or the page differs from what this writes.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Iterator

from colo_rl.config import RunConfig, package_dir, register_configs
from colo_rl.config_moves import OLD_KEYS

HEADER = """# Config reference

Every key of colo_rl's config: its full dotted path (set it as `path=VALUE` on the command line),
type, default (what `python -m colo_rl.run` composes from `conf/`) and what it does. Generated from
the schema in `colo_rl/config.py` by `python -m colo_rl.docs > docs/config.md`; edit the
descriptions there, not here. [configuration.md](configuration.md) tells what each group is for.
"""

MOVED = """## Old -> new key names

The trainer's keys were grouped by concern: the algorithm (`trainer.algo.*`), the optimizer and its
schedule (`trainer.optim.*`), where the trainer's state lives (`trainer.memory.*`), how the step
computes (`trainer.perf.*`) and checkpoints (`trainer.checkpoint.*`). The keys typed every day
(`trainer.steps`, `trainer.prompts_per_step`, `trainer.lr`, `trainer.micro_batch_size`,
`trainer.lora.rank`) stayed. An old name, on the command line or in a YAML file, is refused with
one line naming the new one; a checkpoint written before the move still resumes. The table is
`colo_rl.config_moves.OLD_KEYS`.

| old key | new key |
|---|---|
"""


@dataclasses.dataclass(frozen=True)
class Key:
    """One leaf key of the config as the reference shows it."""

    path: str
    type: str
    default: Any
    help: str


def sections(schema: type = RunConfig, prefix: str = "") -> Iterator[tuple[str, type, list[Key]]]:
    """(section path, its dataclass, its leaf keys) of `schema` and every group inside it, depth
    first; the root's own keys last, under the section "run"."""
    leaves, groups = [], []
    for f in dataclasses.fields(schema):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            groups.append((f.name, type(default)))
        else:
            leaves.append(Key(prefix + f.name, f.metadata.get("type") or _type_name(f.type), default,
                              f.metadata.get("help", "")))
    if prefix:
        yield prefix.rstrip("."), schema, leaves
    for name, group in groups:
        yield from sections(group, f"{prefix}{name}.")
    if not prefix:
        yield "run", schema, leaves


def undescribed(schema: type = RunConfig) -> list[str]:
    """The leaf keys of `schema` without a description."""
    return [key.path for _, _, keys in sections(schema) for key in keys if not key.help.strip()]


def composed_defaults() -> dict:
    """The config `python -m colo_rl.run` composes with no overrides, as plain containers."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_configs()
    with initialize_config_dir(str(package_dir("conf")), version_base="1.3"):
        return OmegaConf.to_container(compose("run"), resolve=False)


def config_reference(defaults: dict | None = None) -> str:
    """docs/config.md's text: one table per section, one row per leaf key, then the old -> new table."""
    defaults = composed_defaults() if defaults is None else defaults
    parts = [HEADER]
    for path, schema, keys in sections():
        if not keys:
            continue
        title = "Run-wide keys" if path == "run" else f"`{path}`"
        doc = " ".join((schema.__doc__ or "").split())
        rows = [f"| `{k.path}` | {k.type} | `{_value(_lookup(defaults, k.path))}` | {_cell(k.help)} |"
                for k in keys]
        parts.append(f"## {title}\n\n{_cell(doc)}\n\n| key | type | default | description |\n"
                     "|---|---|---|---|\n" + "\n".join(rows) + "\n")
    parts.append(MOVED + "".join(f"| `{old}` | `{new}` |\n" for old, new in OLD_KEYS.items()))
    return "\n".join(parts)


def _lookup(tree: dict, path: str) -> Any:
    for part in path.split("."):
        tree = tree[part]
    return tree


def _type_name(annotation: str) -> str:
    """The schema's annotation in the reference's words: Optional[int] -> int or null."""
    if annotation.startswith("Optional[") and annotation.endswith("]"):
        return f"{annotation[len('Optional['):-1]} or null"
    return annotation


def _value(value: Any) -> str:
    """A default as it is written in YAML or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _cell(text: str) -> str:
    """Text inside a Markdown table cell: a | would end the cell."""
    return text.replace("|", "\\|")


if __name__ == "__main__":
    sys.stdout.write(config_reference())
