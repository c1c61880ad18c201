"""Where prompts come from: Hugging Face `datasets`, offline only, and the built-in toy tasks.

Every task is a `datasets.Dataset` of rows: a local JSON/JSONL/CSV/Parquet file, a directory
written by `save_to_disk` (or holding data files), a hub dataset already in the local Hugging Face
cache, or rows the toy tasks generate from their seed. `PromptSampler` walks it in shuffled
epochs without replacement; its position is plain values that go into checkpoints.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np

from colo_rl.config import ConfigError, DatasetConfig, ToyConfig

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
TOY_ROWS = 10_000  # a toy task's training pool: far more rows than a CPU run draws


class DatasetNotAvailableError(ConfigError):
    """The dataset cannot be found locally; the message says how to make it available."""


def toy_rows(kind: str, cfg: ToyConfig, count: int, seed: str) -> dict[str, list]:
    """`count` rows of a built-in task, drawn from `seed`: target_char {prompt, target},
    copy {prompt, answer}."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(cfg.alphabet) for _ in range(cfg.prompt_len)) for _ in range(count)]
    if kind == "target_char":
        return {"prompt": [w + ":" for w in words], "target": [cfg.target] * count}
    return {"prompt": [w + "=" for w in words], "answer": words}


def _quiet() -> None:
    import datasets

    datasets.disable_progress_bars()  # one progress bar per run: the runner's


def toy_datasets(kind: str, cfg: ToyConfig, seed: int, eval_size: int):
    """(train, held-out) datasets of a toy task: the held-out rows come from another seed."""
    from datasets import Dataset

    _quiet()
    return (Dataset.from_dict(toy_rows(kind, cfg, TOY_ROWS, f"train:{seed}")),
            Dataset.from_dict(toy_rows(kind, cfg, eval_size, f"eval:{seed}")) if eval_size else None)


def load_split(cfg: DatasetConfig, split: str, key: str):
    """One split of task.dataset.path as a `datasets.Dataset`; never downloads. `key` names the
    split's config key in errors."""
    import datasets

    _quiet()
    source = _resolve(cfg.path)
    try:
        if source.is_file():
            loaded = datasets.load_dataset(FILE_BUILDERS[source.suffix.lower()], data_files=str(source),
                                           split=split)
        elif (source / "dataset_info.json").is_file() or (source / "dataset_dict.json").is_file():
            loaded = _from_disk(source, split, key)
        else:
            loaded = datasets.load_dataset(str(source), split=split)
    except ConfigError:
        raise
    except ValueError as exc:
        if "split" in str(exc).lower() or "instruction" in str(exc).lower():  # "train[:0]" names no rows
            raise ConfigError(f"{key}={split!r}: {exc} (task.dataset.path={cfg.path})") from exc
        raise _unreadable(cfg.path, exc) from exc
    except Exception as exc:  # noqa: BLE001 - datasets and pyarrow raise many kinds for bad files
        raise _unreadable(cfg.path, exc) from exc
    if len(loaded) == 0:
        raise ConfigError(f"{key}={split!r} of task.dataset.path={cfg.path} has no rows: give a "
                          "split (or file) that holds prompts")
    return loaded


def _unreadable(path: str, exc: BaseException) -> ConfigError:
    """A file or directory that `datasets` cannot read (empty, malformed, no data files)."""
    first = (str(exc).strip().splitlines() or [""])[0]
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip():
        first += f"; {str(cause).strip().splitlines()[0]}"
    return ConfigError(f"task.dataset.path={path}: cannot be read as a dataset ({type(exc).__name__}: "
                       f"{first}). Give a JSON/JSONL/CSV/Parquet file of rows, or a save_to_disk directory")


def _from_disk(source: Path, split: str, key: str):
    import datasets

    loaded = datasets.load_from_disk(str(source))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(f"{key}={split!r} is not a split of {source}: it has "
                              f"{', '.join(loaded)}")
        return loaded[split]
    if split != "train":
        raise ConfigError(f"{key}={split!r}: {source} holds a single dataset, not splits: "
                          f"use {key}=train")
    return loaded


def _resolve(path: str | None) -> Path:
    """task.dataset.path as a local file or directory: itself, or a hub dataset's snapshot in
    the local Hugging Face cache."""
    if not path:
        raise ConfigError("task.dataset.path is unset: name a local JSON/JSONL/CSV/Parquet file, a "
                          "save_to_disk directory, or a hub dataset id in the local cache")
    local = Path(path).expanduser()
    if local.is_file():
        if local.suffix.lower() not in FILE_BUILDERS:
            raise ConfigError(f"task.dataset.path={path}: {local.suffix or 'no extension'} is not a "
                              f"data file colo_rl reads: use {', '.join(FILE_BUILDERS)}")
        return local
    if local.is_dir():
        return local
    if local.suffix.lower() in FILE_BUILDERS or path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise ConfigError(f"task.dataset.path={path} does not exist (relative paths start from the "
                          f"directory the run starts in, {os.getcwd()})")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(path, repo_type="dataset", local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as exc:
        raise DatasetNotAvailableError(
            f"task.dataset.path={path} is neither a local file or directory nor a dataset in the "
            f"local Hugging Face cache ({constants.HF_HUB_CACHE}); colo_rl never downloads. On a "
            f"machine with hub access run `hf download --repo-type dataset {path}` (then copy the "
            f"cache or set HF_HOME), or point task.dataset.path at a local file") from exc


def check_columns(dataset, columns: list[str], keys: list[str], where: str) -> None:
    """ConfigError naming the key and listing the columns there are when one is missing."""
    for column, key in zip(columns, keys):
        if column not in dataset.column_names:
            raise ConfigError(f"{key}={column!r} is not a column of {where}: its columns are "
                              f"{', '.join(dataset.column_names)}")


def check_prompts(dataset, column: str, chat: bool, key: str, where: str) -> None:
    """Every row's prompt is a string (a list of {role, content} messages under
    task.dataset.messages_column): anything else would be rendered into a garbage prompt, or
    stop the run later in the tokenizer or the engine. The error names the row."""
    for row, value in enumerate(dataset[column]):
        problem = _message_problem(value) if chat else (
            None if isinstance(value, str) else f"is {_describe(value)}, not a string")
        if problem:
            form = "a list of {role, content} messages" if chat else "a string"
            raise ConfigError(f"{key}={column!r}: row {row} of {where} {problem}. Every prompt must be "
                              f"{form}: fix the data, or name another column")


def _message_problem(value) -> str | None:
    if not isinstance(value, list) or not value:
        return f"is {_describe(value)}, not a non-empty list of messages"
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            return f"has message {i} = {_describe(message)}, not {{role: str, content: str}}"
    return None


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


class PromptSampler:
    """Row indices of a dataset in shuffled epochs without replacement, seeded: epoch e is a
    fixed permutation of (seed, e), so a position (epoch, index) is all a checkpoint needs."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def next(self, count: int) -> list[int]:
        rows = []
        while len(rows) < count:
            if self.index == self.size:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(rows), self.size - self.index)
            rows.extend(int(i) for i in self._order[self.index:self.index + take])
            self.index += take
        return rows

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "size": self.size, "seed": self.seed}

    def load_state(self, state: dict) -> None:
        if (state["size"], state["seed"]) != (self.size, self.seed):
            raise ConfigError(f"trainer.checkpoint.resume: the checkpoint's sampler walked {state['size']} prompts "
                              f"with task.seed={state['seed']}, this run has {self.size} with "
                              f"task.seed={self.seed}: resume with the same task settings")
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._permutation(self.epoch)
