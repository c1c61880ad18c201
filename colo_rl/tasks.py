"""Prompt sources and reward functions.

`target_char` and `copy` are built in: a tiny random policy visibly improves on them within a
few minutes of CPU. `math_jsonl` reads {question, answer} records from a local file and judges
answers with math-verify.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from colo_rl.config import ConfigError, TaskConfig


@dataclass
class Prompt:
    text: str
    answer: str


class Task:
    """Samples prompts and scores completions; rewards are in [0, 1]."""

    def __init__(self, cfg: TaskConfig):
        self.cfg = cfg

    def sample(self, count: int, rng: random.Random) -> list[Prompt]:
        raise NotImplementedError

    def score(self, prompt: Prompt, completion: str) -> float:
        raise NotImplementedError


class TargetCharTask(Task):
    """Emit `target` as often as possible: reward = share of completion characters equal to it."""

    def sample(self, count, rng):
        alphabet = self.cfg.alphabet
        return [Prompt("".join(rng.choice(alphabet) for _ in range(self.cfg.prompt_len)) + ":",
                       self.cfg.target) for _ in range(count)]

    def score(self, prompt, completion):
        return completion.count(prompt.answer) / len(completion) if completion else 0.0


class CopyTask(Task):
    """Repeat the prompt's string: reward = share of positions that match it."""

    def sample(self, count, rng):
        prompts = []
        for _ in range(count):
            word = "".join(rng.choice(self.cfg.alphabet) for _ in range(self.cfg.prompt_len))
            prompts.append(Prompt(f"{word}=", word))
        return prompts

    def score(self, prompt, completion):
        target = prompt.answer
        return sum(a == b for a, b in zip(completion, target)) / len(target)


class MathJsonlTask(Task):
    """Math word problems from a local JSONL file, answers judged by math-verify."""

    def __init__(self, cfg: TaskConfig):
        super().__init__(cfg)
        self.records = self._read(cfg)

    @staticmethod
    def _read(cfg: TaskConfig) -> list[Prompt]:
        records = []
        with open(cfg.path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    records.append(Prompt(str(row[cfg.question_key]), str(row[cfg.answer_key])))
                except (json.JSONDecodeError, KeyError) as exc:
                    raise ConfigError(f"task.path={cfg.path} line {line_no}: expected a JSON object "
                                      f"with task.question_key={cfg.question_key!r} and "
                                      f"task.answer_key={cfg.answer_key!r} ({exc!r})") from exc
        if not records:
            raise ConfigError(f"task.path={cfg.path} holds no records")
        return records

    def sample(self, count, rng):
        return [rng.choice(self.records) for _ in range(count)]

    def score(self, prompt, completion):
        from math_verify import parse, verify

        # GSM8K answers end with "#### 42"; keep only the final answer for the gold side.
        gold = parse(prompt.answer.split("####")[-1].strip())
        return float(verify(gold, parse(completion)))


TASKS = {"target_char": TargetCharTask, "copy": CopyTask, "math_jsonl": MathJsonlTask}


def make_task(cfg: TaskConfig) -> Task:
    return TASKS[cfg.kind](cfg)
