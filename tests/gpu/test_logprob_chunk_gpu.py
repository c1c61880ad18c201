"""trainer.perf.logprob_chunk on CUDA under trainer.memory.precision=mixed (fp32 masters, bf16 autocast): the
chunked head gives the full path's log-probs, loss and gradients to bf16 rounding, and holds much
less memory. Skips without CUDA; run on the lent H200 (benchmarks/README.md)."""

from __future__ import annotations

import pytest
import torch

from colo_rl.config import TrainerConfig
from tests.configs import trainer_config

from .update import CUDA_ONLY, Update, olmo2_update

pytestmark = CUDA_ONLY

B = 8


def step(chunk: int) -> Update:
    return olmo2_update(trainer_config(logprob_chunk=chunk, micro_batch_size=B), vocab=32768, layers=2, batch=B,
                        prompt=64, completion=192, shorter_by=7)


def test_chunked_bf16_autocast_matches_the_full_logits_and_peaks_lower():
    full, chunked = step(0), step(512)
    # bf16 matmuls of differently shaped row blocks round differently: 1e-2 on log-probs of ~-10
    torch.testing.assert_close(chunked.logprobs, full.logprobs, rtol=1e-2, atol=2e-2)
    assert chunked.stats["loss"] == pytest.approx(full.stats["loss"], rel=1e-2, abs=1e-3)
    assert chunked.stats["grad_norm"] == pytest.approx(full.stats["grad_norm"], rel=2e-2)
    for name in full.grads:
        a, b = full.grads[name], chunked.grads[name]
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999, name
    # full: >= 8 x 256 x 32768 bf16 logits + the gathered fp32 ones; chunked: one 512-row chunk
    assert chunked.peak_bytes < 0.5 * full.peak_bytes, (chunked.peak_bytes / 2**20, full.peak_bytes / 2**20)


def test_compiled_log_softmax_of_the_chunks_matches_the_eager_ops_and_holds_no_more():
    """trainer.perf.logprob_kernel: on CUDA `auto` is the torch.compile'd function; against the eager
    ops on the same bf16 logits (chunks of 512 and a shorter last one) the fp32 log-probs, loss
    and gradients agree to fp32 rounding of the reductions, and the compiled backward keeps no
    more memory."""
    from colo_rl.trainer.logprobs import _target_logprobs_compiled

    def chunked(kernel: str) -> Update:
        return olmo2_update(trainer_config(logprob_chunk=512, micro_batch_size=B, logprob_kernel=kernel),
                            vocab=32768, layers=2, batch=B, prompt=64, completion=192, shorter_by=7)

    compiled, eager = chunked("auto"), chunked("eager")
    assert compiled.trainer.target_logprobs is _target_logprobs_compiled()
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, rtol=1e-5, atol=1e-4)
    assert compiled.stats["loss"] == pytest.approx(eager.stats["loss"], rel=1e-4, abs=1e-6)
    # the logits' bf16 gradient is rounded from fp32 values that may differ in their last bits: a
    # bf16 ulp here and there, averaged out in each weight's gradient (1.3e-3 of the embeddings'
    # norm on the H100 of 2026-12-07 after other tests had compiled the functions for other shapes:
    # Inductor's reduction order for a dynamic vocabulary is not the static one's)
    for name in eager.grads:
        a, b = eager.grads[name], compiled.grads[name]
        assert (b - a).norm() <= 3e-3 * a.norm() + 1e-8, name
    assert compiled.peak_bytes <= eager.peak_bytes * 1.05, (compiled.peak_bytes / 2**20, eager.peak_bytes / 2**20)


@pytest.mark.parametrize("fp32_activations", [True, False], ids=["autocast", "bf16-activations"])
def test_the_fused_head_matches_the_generic_chunks_and_holds_no_more(fp32_activations):
    """trainer.perf.fused_head (the default) against each chunk through the head module under
    checkpointing, bf16 compute with fp32 masters: the same bf16 logits and fp32 reductions, so the
    log-probs and loss agree to the rounding of differently shaped bf16 matmuls; the head's weight
    gradient is summed in fp32 inside the matmuls (the generic path adds bf16 chunk gradients), so
    gradients agree to bf16 rounding. The fused path keeps no more memory."""
    def chunked(fused: bool) -> Update:
        return olmo2_update(trainer_config(logprob_chunk=512, micro_batch_size=B, fused_head=fused,
                                          fp32_activations=fp32_activations),
                            vocab=32768, layers=2, batch=B, prompt=64, completion=192, shorter_by=7)

    fused, generic = chunked(True), chunked(False)
    assert fused.trainer.head_ops is not None and generic.trainer.head_ops is None
    torch.testing.assert_close(fused.logprobs, generic.logprobs, rtol=1e-3, atol=1e-3)
    assert fused.stats["loss"] == pytest.approx(generic.stats["loss"], rel=1e-3, abs=1e-5)
    assert fused.grads.keys() == generic.grads.keys() and "lm_head.weight" in fused.grads
    for name in generic.grads:
        a, b = generic.grads[name], fused.grads[name]
        assert (b - a).norm() <= 1e-2 * a.norm() + 1e-8, name
    assert fused.peak_bytes <= generic.peak_bytes * 1.05, (fused.peak_bytes / 2**20, generic.peak_bytes / 2**20)
