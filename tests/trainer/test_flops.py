"""perf/mfu: the model-FLOP count of a step on hand-counted shapes, and the keys on a real run."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Olmo2Config, Olmo2ForCausalLM

from colo_rl.config import LoraConfig, TrainerConfig
from colo_rl.lora import apply_lora
from colo_rl.run import train
from colo_rl.trainer import GRPOTrainer
from colo_rl.trainer.flops import ModelShape, peak_tflops, perf_metrics, step_flops
from tests.configs import trainer_config

from ..conftest import compose_config, small_run_overrides

V, H, LAYERS, HEADS, FFN = 64, 16, 2, 2, 32
# per layer q, k, v, o (4 H^2) + gate, up, down (3 H FFN) + OLMo-2's q/k norms and its two
# post-norms (4 H); then the final norm (H); the head V H; the embedding table (a lookup) not counted
LAYER = 4 * H * H + 3 * H * FFN + 4 * H
BODY = LAYERS * LAYER + H
HEAD = V * H


def olmo(tied=False):
    torch.manual_seed(0)
    return Olmo2ForCausalLM(Olmo2Config(vocab_size=V, hidden_size=H, intermediate_size=FFN,
                                        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                        num_key_value_heads=HEADS, tie_word_embeddings=tied))


def test_the_shape_counts_every_multiplying_parameter_once():
    shape = ModelShape.of(olmo())
    assert (shape.params, shape.trainable, shape.head_params, shape.layers, shape.attention_width) == \
        (BODY + HEAD, BODY + HEAD, HEAD, LAYERS, H)
    assert BODY + HEAD == 6288  # by hand: 2 x (1024 + 1536 + 64) + 16 + 1024
    tied = ModelShape.of(olmo(tied=True))
    assert tied.params == BODY + HEAD  # the shared table counts once, as the head


def test_step_flops_follow_palms_6n_plus_12_l_hq_t_squared():
    shape = ModelShape.of(olmo())
    # one sequence of 3 prompt + 2 completion tokens: 6 x body x 5 tokens, 6 x head x 2 response
    # tokens, 12 x layers x H x 5^2 for attention
    assert step_flops(shape, [3], [2]) == 6 * BODY * 5 + 6 * HEAD * 2 + 12 * LAYERS * H * 25 == 179808
    # two updates double it; a KL reference adds a forward: a third of each term
    assert step_flops(shape, [3], [2], updates=2) == 2 * 179808
    assert step_flops(shape, [3], [2], reference_forward=True) == 179808 + 179808 / 3
    assert step_flops(shape, [3, 4], [2, 0]) == 179808 + 6 * BODY * 4 + 12 * LAYERS * H * 16


def test_under_lora_frozen_weights_cost_activation_gradients_but_no_weight_gradients():
    model = apply_lora(olmo(), LoraConfig(rank=2, target_modules=["q_proj"]), torch.float32)
    shape = ModelShape.of(model)
    lora = LAYERS * 2 * (H * 2)  # A (2 x H) and B (H x 2) per q_proj
    assert shape.params == BODY + HEAD + lora and shape.trainable == lora and shape.head_trainable == 0
    n = BODY + lora
    assert step_flops(shape, [3], [2]) == (4 * n + 2 * lora) * 5 + 4 * HEAD * 2 + 12 * LAYERS * H * 25


def test_the_trainer_counts_its_last_step():
    model = olmo()
    trainer = GRPOTrainer(model, TrainerConfig(), pad_token_id=0, temperature=1.0, max_tokens=4, device="cpu")
    trainer.train_step([[5, 6, 7], [8]], [[9, 10], [11], [], [12, 13, 14]], [1.0, 0.0, 0.5, 0.2], 2)
    expected = step_flops(ModelShape.of(model), [3, 3, 1, 1], [2, 1, 0, 3])
    assert trainer.last_step_flops == expected > 0


def test_peak_and_metrics():
    assert peak_tflops(None, torch.device("cpu")) is None
    assert peak_tflops(400.0, torch.device("cpu")) == 400.0
    assert perf_metrics(1e12, 2.0, None) == {}
    assert perf_metrics(4e12, 2.0, 8.0) == {"perf/train_tflops": 2.0, "perf/mfu": 0.25, "perf/step_tflop": 4.0}


def test_a_run_with_peak_tflops_logs_mfu_and_shows_it(tmp_path, engine, capsys):
    train(compose_config(*small_run_overrides(tmp_path, "logger=none", "trainer.steps=2",
                                              "trainer.perf.peak_tflops=0.5")), engine)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["perf/step_tflop"] > 0
        assert r["perf/train_tflops"] == pytest.approx(r["perf/step_tflop"] / r["timing/train_s"])
        assert r["perf/mfu"] == pytest.approx(r["perf/train_tflops"] / 0.5)
    assert "MFU" in capsys.readouterr().out


def test_without_a_peak_on_a_cpu_no_mfu_is_logged(tmp_path, engine):
    train(compose_config(*small_run_overrides(tmp_path, "logger=none", "trainer.steps=1")), engine)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records and not any(k.startswith("perf/") for r in records for k in r)


def test_a_non_positive_peak_is_refused_naming_the_key():
    from colo_rl.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.perf.peak_tflops=0"):
        trainer_config(peak_tflops=0)
