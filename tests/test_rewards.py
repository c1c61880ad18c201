"""Reward functions: the built-ins (the real math-verify), the loader of `module:function`
import paths, and the checks that stop a wrong reward before any engine starts."""

from __future__ import annotations

import sys

import pytest

from colo_rl.config import ConfigError
from colo_rl.rewards import BUILTIN, RewardError, Rewards, load_function, load_rewards
from colo_rl.rewards import format as format_reward
from colo_rl.rewards import copy_match, math_accuracy, target_char

GSM8K_ANSWER = "48/2 = 24\n48 + 24 = 72\n#### 72"


@pytest.mark.parametrize("completion, reward", [
    ("Natalia sold 48 + 24 = 72 clips. The answer is \\boxed{72}.", 1.0),
    ("She sold 72 clips in total, so the answer is $72$.", 1.0),
    ("The answer is \\boxed{72.0}", 1.0),
    ("The answer is \\boxed{73}", 0.0),
    ("I do not know.", 0.0),
    ("", 0.0),
])
def test_math_answers_are_judged_by_math_verify_against_the_gsm8k_final_answer(completion, reward):
    assert math_accuracy(["How many clips?"], [completion], answer=[GSM8K_ANSWER]) == [reward]


def test_math_equivalent_forms_are_accepted_and_chat_completions_read():
    got = math_accuracy(["q"] * 3, ["\\boxed{\\frac{1}{2}}", [{"role": "assistant", "content": "\\boxed{0.5}"}],
                                    "\\boxed{\\frac{1}{3}}"], answer=["#### 1/2"] * 3)
    assert got == [1.0, 1.0, 0.0]
    assert math_accuracy(["q"], ["\\boxed{1}"], answer=["no number here"]) == [None]


def test_toy_and_format_rewards():
    assert target_char(["x:"] * 3, ["aaaa", "abab", ""], target=["a"] * 3) == [1.0, 0.5, 0.0]
    assert copy_match(["abba="] * 3, ["abba", "abbb", "b"], answer=["abba"] * 3) == [1.0, 0.75, 0.0]
    assert format_reward(["q"] * 3, ["so \\boxed{\\frac{1}{2}}", "\\boxed{", "42"]) == [1.0, 0.0, 0.0]


def test_builtins_and_user_functions_load_by_the_same_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def correct(prompts, completions, answer, **kwargs):\n"
        "    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]\n"
        "NOT_CALLABLE = 3\n")
    monkeypatch.chdir(tmp_path)  # the module sits in the directory the run starts from
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_function("my_rewards:correct")(["q"], ["4"], answer=["4"]) == [1.0]
    assert load_function("format") is format_reward
    assert load_function("colo_rl.rewards:target_char") is target_char
    assert set(BUILTIN) == {"target_char", "copy_match", "math_accuracy", "format", "overlong"}
    loaded = load_rewards(["my_rewards:correct", "format"], [1.0, 0.5])
    assert [(r.name, r.weight) for r in loaded] == [("correct", 1.0), ("format", 0.5)]
    assert [r.weight for r in load_rewards(["format", "target_char"], [])] == [1.0, 1.0]


@pytest.mark.parametrize("path, message", [
    ("no_such_module:f", r"task.rewards: 'no_such_module:f': module 'no_such_module' does not import"),
    ("my_rewards:missing", r"'my_rewards:missing': module 'my_rewards' \(.*my_rewards.py\) has no callable 'missing'"),
    ("my_rewards:NOT_CALLABLE", "has no callable 'NOT_CALLABLE'"),
    ("my_rewards", "is not an import path: write module:function"),
])
def test_a_bad_import_path_is_a_config_error_naming_it(tmp_path, monkeypatch, path, message):
    (tmp_path / "my_rewards.py").write_text("NOT_CALLABLE = 3\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    with pytest.raises(ConfigError, match=message):
        load_rewards([path], [])


def _rewards(*fns, weights=None):
    from colo_rl.rewards import RewardFunction

    return Rewards([RewardFunction(f"test:{f.__name__}", f.__name__, w, f)
                    for f, w in zip(fns, weights or [1.0] * len(fns))])


def test_the_weighted_sum_leaves_out_none_like_trl():
    def half(prompts, completions, **kw):
        return [0.5] * len(completions)

    def only_first(prompts, completions, **kw):
        return [1.0] + [None] * (len(completions) - 1)

    rewards = _rewards(half, only_first, weights=[2.0, 0.5])
    values = rewards.per_function(["p", "p"], ["a", "b"], {}, "at step 0")
    assert rewards.combine(values) == [1.5, 1.0]
    assert Rewards.metrics(values) == {"reward/half": 0.5, "reward/only_first": 1.0}


@pytest.mark.parametrize("returned, message", [
    ("[1.0]", r"test:bad returned 1 values for 2 completions on the first batch"),
    ("['high', 1.0]", r"test:bad returned 'high' for completion 0 on the first batch"),
    ("[float('nan'), 1.0]", r"test:bad returned nan for completion 0"),
    ("1.0", r"test:bad returned float on the first batch"),
    ("1 / 0", r"test:bad raised ZeroDivisionError on the first batch"),
])
def test_a_wrong_answer_on_the_first_batch_is_a_config_error_naming_the_function(returned, message):
    namespace = {}
    exec(f"def bad(prompts, completions, **kw):\n    return {returned}\n", namespace)
    with pytest.raises(ConfigError, match="task.rewards: reward function " + message):
        _rewards(namespace["bad"]).check_first_batch(["p", "q"], {})


def test_a_function_raising_mid_run_names_itself_and_the_step():
    def flaky(prompts, completions, **kw):
        raise KeyError("answer")

    with pytest.raises(RewardError, match=r"reward function test:flaky raised KeyError at step 7: 'answer'"):
        _rewards(flaky).per_function(["p"], ["c"], {}, "at step 7")
