"""trainer.kernels=liger and trainer.compile on CUDA under trainer.precision=mixed (fp32 masters,
bf16 autocast): the same log-probs, loss and gradients as the eager Hugging Face model to bf16
rounding; every RMSNorm (the attention's q/k norms included) runs Liger's; AdamW is fused; the
weights cast once per update give the same step bit for bit. Skips without CUDA; run on the lent GPU (benchmarks/README.md)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import Olmo2Config, Olmo2ForCausalLM

from colo_rl.config import TrainerConfig
from colo_rl.trainer import GRPOTrainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU; run on the lent H200: see benchmarks/README.md"),
]

VOCAB, B, PROMPT, COMPLETION, LAYERS = 4096, 8, 48, 80, 3


def step(cast_once: bool = True, **cfg):
    torch.manual_seed(0)
    config = Olmo2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
    model = Olmo2ForCausalLM(config).cuda()
    trainer = GRPOTrainer(model, TrainerConfig(micro_batch_size=4, **{"kernels": "none", **cfg}), pad_token_id=0, temperature=0.8,
                          max_tokens=COMPLETION, device="cuda", autocast_dtype=torch.bfloat16)
    fused = trainer.optimizer.defaults.get("fused")
    assert trainer.cast_once is not cfg.get("compile", False)
    trainer.cast_once = trainer.cast_once and cast_once
    grads = {}
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    trainer.optimizer.step = lambda: grads.update(
        {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, VOCAB, (B, PROMPT), generator=g).tolist()
    completions = [torch.randint(1, VOCAB, (COMPLETION - 5 * i,), generator=g).tolist() for i in range(B)]
    micro = trainer._micro_batches(prompts, completions, torch.linspace(-0.5, 1, B), None)
    stats, before = trainer._update(micro, None, [None] * len(micro), float(B * COMPLETION))
    logprobs = torch.cat([b[mb.mask.bool()] for b, mb in zip(before, micro)])
    return model, fused, stats, logprobs, grads


@pytest.mark.parametrize("cfg", [{"kernels": "liger"}, {"compile": True}], ids=["liger", "compile"])
def test_faster_kernels_give_the_eager_models_step_to_bf16_rounding(cfg):
    _, fused, eager_stats, eager_lp, eager_grads = step()
    model, _, stats, logprobs, grads = step(**cfg)
    assert fused is True
    if cfg.get("kernels") == "liger":
        norms = [m for m in model.modules() if type(m).__name__ == "Olmo2RMSNorm"]
        assert len(norms) == 4 * LAYERS + 1 and all(hasattr(m, "casting_mode") for m in norms)
    torch.testing.assert_close(logprobs, eager_lp, rtol=1e-2, atol=3e-2)
    assert stats["loss"] == pytest.approx(eager_stats["loss"], rel=2e-2, abs=1e-3)
    assert stats["grad_norm"] == pytest.approx(eager_stats["grad_norm"], rel=3e-2)
    for name in eager_grads:
        a, b = eager_grads[name], grads[name]
        assert torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0) > 0.99, name


def test_weights_cast_once_per_update_give_the_same_step_bit_for_bit():
    """compute_copies (the decoder layers' weights in bf16 once per update, each gradient added into
    the fp32 .grad in one pass) against autocast's cast in every micro-batch: the same log-probs,
    loss and gradients, bit for bit (the math attention kernel: its backward is deterministic)."""
    with sdpa_kernel(SDPBackend.MATH):
        _, _, per_micro_stats, per_micro_lp, per_micro_grads = step(cast_once=False)
        _, _, stats, logprobs, grads = step()
    assert torch.equal(logprobs, per_micro_lp)
    assert stats["loss"] == per_micro_stats["loss"] and stats["grad_norm"] == per_micro_stats["grad_norm"]
    assert grads.keys() == per_micro_grads.keys()
    for name, grad in per_micro_grads.items():
        assert grad.dtype == torch.float32 and torch.equal(grads[name], grad), name
