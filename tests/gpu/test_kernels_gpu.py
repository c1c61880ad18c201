"""trainer.perf.kernels=liger and trainer.perf.compile on CUDA under trainer.memory.precision=mixed (fp32 masters,
bf16 autocast): the same log-probs, loss and gradients as the eager Hugging Face model to bf16
rounding, and so does trainer.memory.fp32_activations=false; every RMSNorm (the attention's q/k norms
included) runs Liger's; AdamW is fused; the weights cast once per update give the same step bit
for bit. Skips without CUDA; run on the lent GPU (benchmarks/README.md)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from colo_rl.config import TrainerConfig
from tests.configs import trainer_config

from .update import CUDA_ONLY, Update, olmo2_update

pytestmark = CUDA_ONLY

LAYERS = 3


def step(cast_once: bool = True, **cfg) -> Update:
    return olmo2_update(trainer_config(micro_batch_size=4, **{"kernels": "none", **cfg}), vocab=4096, layers=LAYERS,
                        batch=8, prompt=48, completion=80, shorter_by=5, cast_once=cast_once)


@pytest.mark.parametrize("cfg", [{"kernels": "liger"}, {"compile": True}, {"fp32_activations": False}],
                         ids=["liger", "compile", "bf16_activations"])
def test_faster_kernels_give_the_eager_models_step_to_bf16_rounding(cfg):
    eager, fast = step(), step(**cfg)
    assert fast.trainer.optim.name.defaults.get("fused") is True
    # compiled layers keep autocast's casts; bf16 activations copy every weight but the head's
    assert fast.trainer.copies == (None if cfg.get("compile") else "all" if "fp32_activations" in cfg else "matmul")
    if cfg.get("kernels") == "liger":
        norms = [m for m in fast.trainer.model.modules() if type(m).__name__ == "Olmo2RMSNorm"]
        assert len(norms) == 4 * LAYERS + 1 and all(hasattr(m, "casting_mode") for m in norms)
    torch.testing.assert_close(fast.logprobs, eager.logprobs, rtol=1e-2, atol=3e-2)
    assert fast.stats["loss"] == pytest.approx(eager.stats["loss"], rel=2e-2, abs=1e-3)
    assert fast.stats["grad_norm"] == pytest.approx(eager.stats["grad_norm"], rel=3e-2)
    for name in eager.grads:
        a, b = eager.grads[name], fast.grads[name]
        assert torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0) > 0.99, name


def test_weights_cast_once_per_update_give_the_same_step_bit_for_bit():
    """compute_copies (the decoder layers' weights in bf16 once per update, each gradient added into
    the fp32 .grad in one pass) against autocast's cast in every micro-batch: the same log-probs,
    loss and gradients, bit for bit (the math attention kernel: its backward is deterministic)."""
    with sdpa_kernel(SDPBackend.MATH):  # the hook's bf16 gradient and fp32 add: autocast's own sum
        per_micro, once = step(cast_once=False), step(fuse_grad_accumulation=False)
    assert once.trainer.copies == "matmul" and per_micro.trainer.copies is None
    assert torch.equal(once.logprobs, per_micro.logprobs)
    assert once.stats["loss"] == per_micro.stats["loss"] and once.stats["grad_norm"] == per_micro.stats["grad_norm"]
    assert once.grads.keys() == per_micro.grads.keys()
    for name, grad in per_micro.grads.items():
        assert grad.dtype == torch.float32 and torch.equal(once.grads[name], grad), name


@pytest.mark.parametrize("fp32_activations", [True, False], ids=["autocast", "bf16-activations"])
def test_fused_gradient_accumulation_changes_only_the_rounding_of_the_weight_gradients(fp32_activations):
    """trainer.perf.fuse_grad_accumulation (the default): each linear layer's weight gradient is summed
    into the fp32 master gradient inside its matmul (addmm out_dtype=float32) instead of made in
    bf16 and added.
    Forward is the same computation (the log-probs and loss bit for bit); the linear weights'
    gradients differ by the bf16 rounding of each micro-batch's share the hook path makes (so they
    are not equal: the fused path ran), everything else's by no more than that."""
    with sdpa_kernel(SDPBackend.MATH):
        hook = step(fp32_activations=fp32_activations, fuse_grad_accumulation=False)
        fused = step(fp32_activations=fp32_activations)  # the default
    assert torch.equal(fused.logprobs, hook.logprobs)
    assert fused.stats["loss"] == hook.stats["loss"]
    linears = [n for n in hook.grads if ".layers." in n and n.endswith("proj.weight")]
    assert linears and any(not torch.equal(fused.grads[n], hook.grads[n]) for n in linears)
    for name, grad in hook.grads.items():
        assert fused.grads[name].dtype == torch.float32
        assert (fused.grads[name] - grad).norm() <= 1e-2 * grad.norm() + 1e-8, name
