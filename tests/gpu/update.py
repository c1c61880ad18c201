"""One GRPO update of a small random OLMo-2 on CUDA under mixed precision (fp32 masters, bf16
autocast), for the GPU tests that compare two ways of computing it: what it returns is what they
compare (log-probs, loss statistics, gradients, the peak memory it allocated)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import Olmo2Config, Olmo2ForCausalLM

from colo_rl.config import TrainerConfig
from colo_rl.trainer import GRPOTrainer

from ..conftest import update_recording_grads


# the pytestmark of the tests that use olmo2_update: GPU-only, skipped with this reason elsewhere
CUDA_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU; run on the lent H200: see benchmarks/README.md"),
]


@dataclass
class Update:
    trainer: GRPOTrainer
    stats: dict
    logprobs: torch.Tensor  # the pre-update log-probs of every real response token
    grads: dict[str, torch.Tensor]  # the fp32 gradient of every parameter that got one
    peak_bytes: int  # allocated during the update, above what was allocated before it


def olmo2_update(cfg: TrainerConfig, *, vocab: int, layers: int, batch: int, prompt: int, completion: int,
                 shorter_by: int, cast_once: bool = True, warmup: bool = True) -> Update:
    """The update of `batch` random sequences (prompt tokens, then completion - shorter_by * i
    response tokens for sequence i) with advantages from -0.5 to 1. The optimizer is SGD at lr 0
    that records the gradients, so two calls start from the same seeded model and data.
    cast_once=False casts the weights in every micro-batch, as autocast does (see compute_copies).
    warmup: the same update once before the measured one (SGD at lr 0 changes nothing), so that
    torch.compile'd functions (the log-softmax of the head's chunks) are compiled before the peak
    is measured: whether a call compiles depends on what the process compiled before (Inductor's
    autotuning and a recompilation for dynamic shapes allocate memory of their own)."""
    torch.manual_seed(0)
    config = Olmo2Config(vocab_size=vocab, hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = Olmo2ForCausalLM(config).cuda()  # fp32 masters
    trainer = GRPOTrainer(model, cfg, pad_token_id=0, temperature=0.8, max_tokens=completion, device="cuda",
                          autocast_dtype=torch.bfloat16)
    if not cast_once:
        trainer.copies = None
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, vocab, (batch, prompt), generator=g).tolist()
    completions = [torch.randint(1, vocab, (completion - shorter_by * i,), generator=g).tolist()
                   for i in range(batch)]
    micro = trainer._micro_batches(prompts, completions, torch.linspace(-0.5, 1, batch), None)
    if warmup:
        update_recording_grads(trainer, micro, float(batch * completion))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    stats, before, grads = update_recording_grads(trainer, micro, float(batch * completion))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    logprobs = torch.cat([b[mb.mask.bool()] for b, mb in zip(before, micro)])
    return Update(trainer, stats, logprobs, grads, peak)
