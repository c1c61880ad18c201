"""trainer.logprob_chunk on CUDA under trainer.precision=mixed (fp32 masters, bf16 autocast): the
chunked head gives the full path's log-probs, loss and gradients to bf16 rounding, and holds much
less memory. Skips without CUDA; run on the lent H200 (benchmarks/README.md)."""

from __future__ import annotations

import pytest
import torch
from transformers import Olmo2Config, Olmo2ForCausalLM

from colo_rl.config import TrainerConfig
from colo_rl.trainer import GRPOTrainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU; run on the lent H200: see benchmarks/README.md"),
]

VOCAB, B, PROMPT, COMPLETION = 32768, 8, 64, 192


def step(chunk):
    torch.manual_seed(0)
    config = Olmo2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = Olmo2ForCausalLM(config).cuda()  # fp32 masters
    trainer = GRPOTrainer(model, TrainerConfig(logprob_chunk=chunk, micro_batch_size=B), pad_token_id=0,
                          temperature=0.8, max_tokens=COMPLETION, device="cuda", autocast_dtype=torch.bfloat16)
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    grads = {}
    trainer.optimizer.step = lambda: grads.update(
        {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, VOCAB, (B, PROMPT), generator=g).tolist()
    completions = [torch.randint(1, VOCAB, (COMPLETION - 7 * i,), generator=g).tolist() for i in range(B)]
    micro = trainer._micro_batches(prompts, completions, torch.linspace(-0.5, 1, B), None)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    stats, before = trainer._update(micro, None, [None], float(B * COMPLETION))
    torch.cuda.synchronize()
    return stats, before[0][micro[0].mask.bool()], grads, torch.cuda.max_memory_allocated() - base


def test_chunked_bf16_autocast_matches_the_full_logits_and_peaks_lower():
    full, chunked = step(0), step(512)
    # bf16 matmuls of differently shaped row blocks round differently: 1e-2 on log-probs of ~-10
    torch.testing.assert_close(chunked[1], full[1], rtol=1e-2, atol=2e-2)
    assert chunked[0]["loss"] == pytest.approx(full[0]["loss"], rel=1e-2, abs=1e-3)
    assert chunked[0]["grad_norm"] == pytest.approx(full[0]["grad_norm"], rel=2e-2)
    for name in full[2]:
        a, b = full[2][name], chunked[2][name]
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999, name
    # full: >= 8 x 256 x 32768 bf16 logits + the gathered fp32 ones; chunked: one 512-row chunk
    assert chunked[3] < 0.5 * full[3], (chunked[3] / 2**20, full[3] / 2**20)
