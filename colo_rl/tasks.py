"""A run's task: its prompts (training and held-out), how they become token ids, and its rewards.

`Task.setup` does everything that can fail on the user's input (a dataset that is not there, a
missing column, a reward that does not import or answers wrongly on the first batch, prompts too
long for the engine) before any engine starts. The built-in toy tasks (`target_char`, `copy`) are
datasets generated from their seed and scored by built-in reward functions through the same path
as a user's data and rewards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from colo_rl.config import ConfigError, RunConfig
from colo_rl.data import PromptSampler, check_columns, check_prompts, load_split, toy_datasets
from colo_rl.rewards import Rewards, load_rewards

log = logging.getLogger(__name__)
IDS = "_colo_rl_prompt_ids"  # the encoded prompt, added to every row at set-up


def encode_prompts(prompts: list, tokenizer, settings: RunConfig) -> list[list[int]]:
    """Token ids of plain-text prompts (wrapped by model.prompt_template, then by the chat
    template as a user message when model.use_chat_template) or of chat-format message lists."""
    m = settings.model
    if prompts and not isinstance(prompts[0], str):
        return [_chat_ids(tokenizer, messages) for messages in prompts]
    # not str.format: templates hold other braces (Qwen2.5-Math's "\\boxed{}")
    texts = [m.prompt_template.replace("{prompt}", p) for p in prompts]
    if m.use_chat_template:
        return [_chat_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    return tokenizer(texts).input_ids if texts else []


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    # transformers 5 returns a BatchEncoding for tokenize=True: render the text, then tokenize it
    # without adding special tokens a second time (the template writes its own)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


@dataclass
class Batch:
    """Rows of a task: what the rewards see (prompts and columns, one entry per row) and the
    encoded prompts the engine sees."""

    prompts: list
    columns: dict[str, list]
    prompt_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.prompts)

    def slice(self, part: slice) -> "Batch":
        return Batch(self.prompts[part], {k: v[part] for k, v in self.columns.items()},
                     self.prompt_ids[part])

    def repeated(self, n: int) -> tuple[list, dict[str, list]]:
        """Prompts and columns with each row repeated once per completion of its group (TRL's
        layout: reward functions get one entry per completion)."""
        return ([p for p in self.prompts for _ in range(n)],
                {k: [v for v in values for _ in range(n)] for k, values in self.columns.items()})


class Task:
    """Draws training batches in shuffled epochs, holds the held-out batch, scores completions."""

    def __init__(self, train, held_out, prompt_key: str, columns: list[str], rewards: Rewards,
                 seed: int, skipped: dict[str, float]):
        self.train, self.prompt_key, self.columns = train, prompt_key, columns
        self.rewards = rewards
        self.sampler = PromptSampler(len(train), seed)
        self.held_out = self._batch(held_out, list(range(len(held_out)))) if held_out else None
        self.setup_metrics = skipped  # data/*: logged with the first step

    @classmethod
    def setup(cls, settings: RunConfig, tokenizer) -> "Task":
        t, e = settings.task, settings.eval
        eval_size = e.size if e.every else 0
        if t.kind == "dataset":
            train, held_out, where = _dataset_splits(settings, eval_size)
        else:
            train, held_out = toy_datasets(t.kind, t.toy, t.seed, eval_size)
            where = f"the built-in task {t.kind}"
        d = t.dataset
        chat = t.kind == "dataset" and bool(d.messages_column)
        prompt_key = d.messages_column if chat else ("prompt" if t.kind != "dataset" else d.prompt_column)
        prompt_config_key = "task.dataset.messages_column" if chat else "task.dataset.prompt_column"
        check_columns(train, [prompt_key], [prompt_config_key], where)
        check_prompts(train, prompt_key, chat, prompt_config_key, where)
        if t.kind == "dataset" and d.reward_columns is not None:
            check_columns(train, d.reward_columns, ["task.dataset.reward_columns"] * len(d.reward_columns), where)
            columns = list(d.reward_columns)
        else:
            columns = [c for c in train.column_names if c != prompt_key]
        if held_out is not None:
            check_columns(held_out, [prompt_key, *columns],
                          [prompt_config_key] + ["task.dataset.reward_columns"] * len(columns),
                          f"the held-out split {d.eval_split}")
            check_prompts(held_out, prompt_key, chat, prompt_config_key, f"the held-out split {d.eval_split}")
        if (chat or settings.model.use_chat_template) and not getattr(tokenizer, "chat_template", None):
            key = "task.dataset.messages_column" if chat else "model.use_chat_template"
            raise ConfigError(f"{key} needs a chat template, but the tokenizer of model.path="
                              f"{settings.model.path or 'embedded'} has none: use plain prompts with "
                              "model.use_chat_template=false, or a model whose tokenizer has one")
        limit = t.max_prompt_tokens or settings.generator.max_model_len - settings.sampling.max_tokens
        skipped = {}
        train, skipped["data/prompts_skipped"] = _encode_and_filter(train, prompt_key, tokenizer, settings, limit)
        if len(train) == 0:
            raise ConfigError(f"every prompt of {where} is longer than {limit} tokens "
                              "(task.max_prompt_tokens, default generator.max_model_len - "
                              "sampling.max_tokens): raise generator.max_model_len")
        if held_out is not None:
            held_out, skipped["data/eval_prompts_skipped"] = _encode_and_filter(
                held_out, prompt_key, tokenizer, settings, limit)
        task = cls(train, held_out, prompt_key, columns, _rewards(settings), t.seed, skipped)
        first = task._batch(train, list(range(min(len(train), settings.trainer.prompts_per_step))))
        task.rewards.check_first_batch(*first.repeated(1))
        return task

    def next_batch(self, count: int) -> Batch:
        return self._batch(self.train, self.sampler.next(count))

    def _batch(self, dataset, indices: list[int]) -> Batch:
        rows = dataset[indices]
        return Batch(rows[self.prompt_key], {c: rows[c] for c in self.columns}, rows[IDS])

    def score(self, batch: Batch, texts: list[str], n: int, where: str,
              completion_ids: list[list[int]] | None = None):
        """(GRPO reward per completion, {function name: value or None per completion})."""
        prompts, columns = batch.repeated(n)
        if prompts and not isinstance(prompts[0], str):
            completions = [[{"role": "assistant", "content": text}] for text in texts]
        else:
            completions = list(texts)
        values = self.rewards.per_function(prompts, completions, columns, where, completion_ids)
        return self.rewards.combine(values), values


def _rewards(settings: RunConfig) -> Rewards:
    """task.rewards, with DAPO's overlong punishment (weight task.overlong_penalty) added when
    task.overlong_buffer > 0."""
    t, max_tokens = settings.task, settings.sampling.max_tokens
    paths, weights = list(t.rewards), list(t.reward_weights)
    buffer = max(1, round(t.overlong_buffer * max_tokens))
    if t.overlong_buffer > 0:
        paths.append("overlong")
        weights = (weights or [1.0] * len(t.rewards)) + [t.overlong_penalty]
    elif "overlong" in paths:
        raise ConfigError("task.rewards names overlong but task.overlong_buffer=0: set task.overlong_buffer "
                          "(the share of sampling.max_tokens it punishes, e.g. 0.25) instead of listing it")
    return Rewards(load_rewards(paths, weights), {"max_tokens": max_tokens, "overlong_buffer": buffer},
                   timeout_s=t.reward_timeout_s)


def _dataset_splits(settings: RunConfig, eval_size: int):
    """(train, held-out, description) of task.dataset: the held-out rows are task.dataset.eval_split's
    first eval.size, or, without one, eval.size rows set aside from the training split."""
    d = settings.task.dataset
    train = load_split(d, d.split, "task.dataset.split")
    where = f"task.dataset.path={d.path} (split {d.split})"
    if not eval_size:
        return train, None, where
    if d.eval_split:
        held_out = load_split(d, d.eval_split, "task.dataset.eval_split")
        return train, held_out.select(range(min(eval_size, len(held_out)))), where
    if len(train) <= eval_size:
        raise ConfigError(f"{where} has {len(train)} rows: holding out eval.size={eval_size} for "
                          "evaluation leaves none to train on; lower eval.size, name a "
                          "task.dataset.eval_split, or set eval.every=0")
    order = np.random.default_rng([settings.task.seed, 2**31]).permutation(len(train))
    log.info("evaluating on %d rows held out of %s (no task.dataset.eval_split)", eval_size, where)
    # in memory: a save_to_disk directory must not get cache files written into it
    return (train.select(sorted(order[eval_size:]), keep_in_memory=True),
            train.select(order[:eval_size], keep_in_memory=True), where)


def _encode_and_filter(dataset, prompt_key: str, tokenizer, settings: RunConfig, limit: int):
    """The dataset with each row's token ids, without rows longer than `limit` tokens; and how
    many were skipped."""
    encoded = dataset.map(lambda rows: {IDS: encode_prompts(rows[prompt_key], tokenizer, settings)},
                          batched=True, keep_in_memory=True)
    empty = next((row for row, ids in enumerate(encoded[IDS]) if not ids), None)
    if empty is not None:  # vLLM refuses a prompt of no tokens, after the engine started
        raise ConfigError(f"row {empty} of the prompts is empty once rendered (model.prompt_template="
                          f"{settings.model.prompt_template!r}): remove empty prompts from the data")
    kept = encoded.filter(lambda rows: [len(ids) <= limit for ids in rows[IDS]], batched=True,
                          keep_in_memory=True)
    skipped = len(encoded) - len(kept)
    if skipped:
        log.warning("skipped %d of %d prompts longer than %d tokens (task.max_prompt_tokens)",
                    skipped, len(encoded), limit)
    return kept, float(skipped)
