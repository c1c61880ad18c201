"""LoRA on the GPU: a short bf16 run with fp32 adapters (trainer.memory.precision=mixed), the merged
weights pushed by cuda_ipc, and the KL reference with the adapters disabled. Run it on the lent
H200 (benchmarks/README.md); about 90 s, most of it the engine's start."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from colo_rl.run import train

from ..conftest import compose_config, engine_processes, small_run_overrides
from .test_gpu import BF16_LOGPROB_TOL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU and a vLLM built for it: run on the lent H200, "
                              "see benchmarks/README.md"),
]


def test_a_bf16_lora_run_pushes_merged_weights_the_engine_agrees_with(tmp_path):
    before = engine_processes()
    train(compose_config(*small_run_overrides(
        tmp_path, "logger=none", "model.dtype=bfloat16", "generator.weight_sync=cuda_ipc",
        "trainer.lora.rank=8", "trainer.lr=1e-2", "trainer.algo.kl_coef=0.05",
        "sampling.logprobs_every=1")))  # the engine's log-probs on every step, for the gap below
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/step"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["train/trainable_params"] == 34816
        assert r["sync/readback_checked"] > 0  # checksums of the merged tensors the engine mapped
        assert r["sync/cast_gib"] > 0  # the merged copies of the 14 adapted weights
        # the engine sampled with the weights the trainer scores with: merged, not the bare base
        assert r["train/engine_logprob_gap"] < BF16_LOGPROB_TOL
    assert records[-1]["train/kl"] > 0  # the reference (adapters disabled) differs once they trained
    state = load_file(tmp_path / "checkpoint" / "model.safetensors")
    assert state and all(".lora_" in name and t.dtype == torch.float32 for name, t in state.items())
    assert engine_processes() == before
