"""The built-in tasks' prompts and rewards, and math answers judged by the real math-verify."""

from __future__ import annotations

import random

import pytest

from colo_rl.config import ConfigError, TaskConfig
from colo_rl.tasks import Prompt, make_task


def math_task(tmp_path, *lines: str):
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return make_task(TaskConfig(name="gsm8k", kind="math_jsonl", path=str(path)))


@pytest.mark.parametrize("completion, reward", [
    ("Natalia sold 48 + 24 = 72 clips. The answer is \\boxed{72}.", 1.0),
    ("She sold 72 clips in total, so the answer is $72$.", 1.0),
    ("The answer is \\boxed{72.0}", 1.0),
    ("The answer is \\boxed{73}", 0.0),
    ("I do not know.", 0.0),
    ("", 0.0),
])
def test_math_answers_are_judged_by_math_verify_against_the_gsm8k_final_answer(tmp_path, completion, reward):
    task = math_task(tmp_path, '{"question": "How many clips?", "answer": "48/2 = 24\\n48 + 24 = 72\\n#### 72"}')
    prompt = task.sample(1, random.Random(0))[0]
    assert prompt.text == "How many clips?"
    assert task.score(prompt, completion) == reward


def test_math_equivalent_forms_are_accepted(tmp_path):
    task = math_task(tmp_path, '{"question": "Half of one?", "answer": "#### 1/2"}')
    prompt = task.sample(1, random.Random(0))[0]
    assert task.score(prompt, "\\boxed{\\frac{1}{2}}") == 1.0
    assert task.score(prompt, "\\boxed{0.5}") == 1.0
    assert task.score(prompt, "\\boxed{\\frac{1}{3}}") == 0.0


def test_a_bad_jsonl_line_names_the_file_the_line_and_the_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"math.jsonl line 2: .*task.question_key='question'"):
        math_task(tmp_path, '{"question": "1+1?", "answer": "#### 2"}', '{"prompt": "2+2?"}')
    with pytest.raises(ConfigError, match="holds no records"):
        math_task(tmp_path, "")


def test_target_char_rewards_the_share_of_the_target_and_samples_reproducibly():
    task = make_task(TaskConfig(target="a", prompt_len=3, alphabet="xyz"))
    prompts = task.sample(5, random.Random(7))
    assert prompts == task.sample(5, random.Random(7))
    assert all(len(p.text) == 4 and p.text.endswith(":") and set(p.text[:3]) <= set("xyz") for p in prompts)
    assert task.score(prompts[0], "aaaa") == 1.0
    assert task.score(prompts[0], "abab") == 0.5
    assert task.score(prompts[0], "") == 0.0


def test_copy_rewards_matching_positions():
    task = make_task(TaskConfig(name="copy", kind="copy", prompt_len=4, alphabet="ab"))
    prompt = Prompt("abba=", "abba")
    assert task.score(prompt, "abba") == 1.0
    assert task.score(prompt, "abbb") == 0.75
    assert task.score(prompt, "b") == 0.0
    assert all(p.text == p.answer + "=" for p in task.sample(3, random.Random(0)))
