"""Reward functions, built in and the user's own, with TRL's GRPOTrainer signature:

    def my_reward(prompts, completions, **columns) -> list[float | None]

One call per batch. `prompts[i]` and `completions[i]` belong together (a prompt is repeated once
per completion of its group); `columns` holds the dataset row's other fields as lists of the same
length (`answer=[...]`). Plain-text tasks pass strings; a messages column (chat format) passes
each prompt as its list of messages and each completion as `[{"role": "assistant", "content":
text}]`, as TRL does. Return one number per completion, or None where the function does not
apply to that sample (left out of the weighted sum, like TRL).

`task.rewards` names functions by `module:function` import path, the directory the run starts
from being on `sys.path`; a bare name is one of the built-ins below (`BUILTIN`), which go through
the same loader.

A function may also name, as parameters, what the run knows of each completion beyond its text
(`CONTEXT`): `completion_ids` (its token ids, as TRL passes them), `max_tokens`
(sampling.max_tokens) and `overlong_buffer` (task.overlong_buffer in tokens). Only functions that
name them get them.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import logging
import math
import numbers
import os
import re
import reprlib
import signal
import sys
import threading
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from statistics import mean
from typing import Callable

from colo_rl.config import ConfigError

log = logging.getLogger("colo_rl")

def _text(completion) -> str:
    """A completion's text, whether plain or in chat format."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"]


def target_char(prompts, completions, target, **columns) -> list[float]:
    """Share of the completion's characters equal to the row's `target` (0 when empty)."""
    texts = [_text(c) for c in completions]
    return [t.count(ch) / len(t) if t else 0.0 for t, ch in zip(texts, target)]


def copy_match(prompts, completions, answer, **columns) -> list[float]:
    """Share of the positions of the row's `answer` that the completion reproduces."""
    return [sum(a == b for a, b in zip(_text(c), ans)) / len(ans)
            for c, ans in zip(completions, answer)]


def math_accuracy(prompts, completions, answer, **columns) -> list[float | None]:
    """1.0 when math-verify judges the completion's answer equal to the row's `answer`; GSM8K
    answers ("... #### 72") are compared by their final part. None where the gold answer does
    not parse (the sample cannot be judged)."""
    from math_verify import parse, verify

    scores = []
    for completion, gold_text in zip(completions, answer):
        gold = parse(str(gold_text).split("####")[-1].strip())
        scores.append(float(verify(gold, parse(_text(completion)))) if gold else None)
    return scores


_BOXED = re.compile(r"\\boxed\{[^{}]*(\{[^{}]*\}[^{}]*)*\}")


def format(prompts, completions, **columns) -> list[float]:  # noqa: A001 (the issue's name)
    """1.0 when the completion states a final answer in \\boxed{...} (the format math-verify
    and the Qwen2.5-Math prompts ask for), else 0.0."""
    return [1.0 if _BOXED.search(_text(c)) else 0.0 for c in completions]


def overlong(prompts, completions, completion_ids, max_tokens, overlong_buffer, **columns) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to max_tokens - overlong_buffer tokens, then falling
    linearly to -1 at max_tokens (verl's DAPORewardManager, penalty factor 1: task.overlong_penalty
    is this function's weight). task.overlong_buffer > 0 adds it to the task's rewards."""
    expected = max_tokens - overlong_buffer
    return [min(-(len(ids) - expected) / overlong_buffer, 0.0) for ids in completion_ids]


# short names usable in task.rewards, resolved by the same loader as users' import paths
BUILTIN = {name: f"colo_rl.rewards:{name}"
           for name in ("target_char", "copy_match", "math_accuracy", "format", "overlong")}
# what a reward function gets when its signature names it (besides prompts, completions, columns)
CONTEXT = ("completion_ids", "max_tokens", "overlong_buffer")


class RewardError(RuntimeError):
    """A reward function failed during the run; the message names it and the step."""


@dataclass
class RewardFunction:
    """A loaded reward function, its import path, its weight and the name it is logged under."""

    path: str
    name: str
    weight: float
    fn: Callable
    context: tuple[str, ...] = ()  # the CONTEXT names its signature asks for


def load_function(path: str, key: str = "task.rewards", builtin: dict[str, str] | None = None) -> Callable:
    """The callable named by `module:function` or by a short name of `builtin` (default: the
    reward functions' BUILTIN); ConfigError naming `key` otherwise."""
    builtin = BUILTIN if builtin is None else builtin
    target = builtin.get(path, path)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: {path!r} is not an import path: write module:function "
                          f"(e.g. my_module:my_function) or one of the built-ins {', '.join(builtin)}")
    # `python -m colo_rl.run` from the user's directory must find the module next to them
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: {path!r}: module {module_name!r} does not import ({exc}); it is "
                          f"looked up on sys.path, which includes the directory the run starts from "
                          f"({cwd})") from exc
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's module failed as it ran
        where = f" ({exc.filename}, line {exc.lineno})" if isinstance(exc, SyntaxError) else ""
        raise ConfigError(f"{key}: {path!r}: importing module {module_name!r} raised "
                          f"{type(exc).__name__}{where}: {exc}. Fix the module (run `python -c "
                          f"'import {module_name}'` to see its traceback)") from exc
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ConfigError(f"{key}: {path!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) "
                          f"has no callable {attr!r}")
    return fn


def load_rewards(paths: list[str], weights: list[float]) -> list[RewardFunction]:
    """task.rewards with task.reward_weights (default: 1 each), imported and checked."""
    if not paths:
        raise ConfigError("task.rewards is empty: name at least one reward function "
                          f"(module:function or one of {', '.join(BUILTIN)})")
    if weights and len(weights) != len(paths):
        raise ConfigError(f"task.reward_weights={list(weights)} has {len(weights)} entries for "
                          f"{len(paths)} task.rewards: give one weight per function, or none")
    loaded = [RewardFunction(p, "", w, load_function(p))
              for p, w in zip(paths, weights or [1.0] * len(paths))]
    for r in loaded:
        r.context = _context_names(r.fn)
    names = [getattr(r.fn, "__name__", r.path.rpartition(":")[2]) for r in loaded]
    for r, name in zip(loaded, names):
        # two functions of one name (a.correct, b.correct) are logged under their full paths
        r.name = name if names.count(name) == 1 else r.path.replace(":", ".")
    return loaded


DEFAULT_TIMEOUT_S = 600.0  # task.reward_timeout_s's default (colo_rl/config.py)


class Rewards:
    """Calls every reward function once per batch and combines them into the GRPO reward."""

    def __init__(self, functions: list[RewardFunction], context: dict | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.functions = functions
        self.context = context or {}  # the run's CONTEXT values (max_tokens, overlong_buffer)
        self.timeout_s = timeout_s

    def per_function(self, prompts: list, completions: list, columns: dict[str, list], where: str,
                     completion_ids: list[list[int]] | None = None,
                     warn_unapplied: bool = True) -> dict[str, list[float | None]]:
        """{logged name: one value or None per completion}. Raises RewardError naming the
        function and `where` (the step) when one raises, returns something else or does not
        return within task.reward_timeout_s. Each function gets its own copies of the inputs, so
        one that changes them cannot change what the next one scores."""
        values = {}
        context = {**self.context, "completion_ids": completion_ids}
        for r in self.functions:
            extra = {name: context[name] for name in r.context}
            out = self._call(r, copy.deepcopy(prompts), copy.deepcopy(completions),
                             {**copy.deepcopy(columns), **copy.deepcopy(extra)}, where)
            values[r.name] = _checked(r, out, len(completions), where)
            if warn_unapplied and completions and all(v is None for v in values[r.name]):
                log.warning("reward function %s returned None for every completion %s: it applied to "
                            "none of them and adds nothing to their reward (logged as reward/%s_applied_frac)",
                            r.path, where, r.name)
        return values

    def _call(self, r: RewardFunction, prompts: list, completions: list, columns: dict, where: str):
        """r.fn, in this thread (math-verify and other user code set signal.alarm, which only the
        main thread may), under a deadline of timeout_s. Whatever it raises, SystemExit included,
        is a RewardError; KeyboardInterrupt stays what it is."""
        try:
            with _deadline(self.timeout_s):
                return r.fn(prompts=prompts, completions=completions, **columns)
        except _DeadlinePassed:
            raise RewardError(f"reward function {r.path} did not return within task.reward_timeout_s="
                              f"{self.timeout_s:g} s {where}: make it faster or raise "
                              "task.reward_timeout_s") from None
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - the user's code: SystemExit is a failure too
            raise RewardError(f"reward function {r.path} raised {type(exc).__name__} {where}: "
                              f"{exc}") from exc

    def combine(self, values: dict[str, list[float | None]]) -> list[float]:
        """The weighted sum per completion; None (not applicable) is left out, as in TRL."""
        count = len(next(iter(values.values())))
        return [sum(r.weight * values[r.name][i] for r in self.functions
                    if values[r.name][i] is not None) for i in range(count)]

    def check_first_batch(self, prompts: list, columns: dict[str, list]) -> None:
        """Call every function on the first batch with empty completions (a model may generate
        nothing): a function that fails or returns a wrong answer stops the run before any
        engine starts, as a ConfigError naming it."""
        empty = ["" if isinstance(p, str) else [{"role": "assistant", "content": ""}] for p in prompts]
        try:
            self.per_function(prompts, empty, columns, "on the first batch (empty completions)",
                              [[] for _ in prompts], warn_unapplied=False)
        except RewardError as exc:
            raise ConfigError(f"task.rewards: {exc}") from exc.__cause__

    @staticmethod
    def metrics(values: dict[str, list[float | None]], prefix: str = "reward/") -> dict[str, float]:
        """Each function's mean over the samples it applied to, as `reward/<name>`."""
        out = {}
        for name, vals in values.items():
            applied = [v for v in vals if v is not None]
            if applied:
                out[f"{prefix}{name}"] = mean(applied)
            elif vals:  # a function that applied to no sample of the batch: say so on the charts
                out[f"{prefix}{name}_applied_frac"] = 0.0
        return out


def _context_names(fn: Callable) -> tuple[str, ...]:
    """The CONTEXT names `fn` takes as parameters of its own (not through **columns)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function without a signature asks for none
        return ()
    return tuple(name for name in CONTEXT if name in parameters
                 and parameters[name].kind is not inspect.Parameter.VAR_KEYWORD)


class _DeadlinePassed(BaseException):
    """Raised in the main thread when a reward call's deadline passes; a BaseException, so that
    the user's own `except Exception` does not swallow it."""


DEADLINE_SIGNAL = signal.SIGUSR2  # sent by a deadline's timer to the main thread
_deadline_open = False


def _expire(signum, frame) -> None:
    if _deadline_open:  # a signal that arrives after its call returned is ignored
        raise _DeadlinePassed()


@contextmanager
def _deadline(seconds: float):
    """Raise _DeadlinePassed in the main thread after `seconds`: a timer thread sends it
    DEADLINE_SIGNAL, which also interrupts a blocking call (sleep, a socket read). The handler
    stays installed, so a late signal is always caught. Outside the main thread (no signal
    handlers there) the call runs without a deadline."""
    global _deadline_open
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(DEADLINE_SIGNAL) is not _expire:
        signal.signal(DEADLINE_SIGNAL, _expire)
    timer = threading.Timer(seconds, signal.pthread_kill, args=(threading.main_thread().ident, DEADLINE_SIGNAL))
    timer.daemon = True
    _deadline_open = True
    timer.start()
    try:
        yield
    finally:
        _deadline_open = False
        timer.cancel()
        timer.join()  # a signal it sent has arrived by now, and is ignored


def _checked(r: RewardFunction, out, count: int, where: str) -> list[float | None]:
    if isinstance(out, (str, bytes, Mapping)) or not hasattr(out, "__len__"):
        raise RewardError(f"reward function {r.path} returned {type(out).__name__} {where}: it must "
                          f"return a list of {count} numbers (or None), one per completion")
    out = list(out)
    if len(out) != count:
        raise RewardError(f"reward function {r.path} returned {len(out)} values for {count} "
                          f"completions {where}: return one number (or None) per completion")
    for i, v in enumerate(out):
        if v is None:
            continue
        if not isinstance(v, numbers.Real) or not _finite(v):
            raise RewardError(f"reward function {r.path} returned {reprlib.repr(v)} for completion {i} {where}: "
                              "each value must be a finite number, or None where it does not apply")
    return [None if v is None else float(v) for v in out]



def _finite(v: numbers.Real) -> bool:
    """Whether `v` is a float that is not inf or NaN (an int too large for a float is not)."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False
