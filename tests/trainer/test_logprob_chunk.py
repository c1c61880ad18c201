"""trainer.perf.logprob_chunk: the output head over chunks of response positions (never the full
(b, L, vocab) logits) gives the full path's log-probs, loss and gradients."""

from __future__ import annotations

import torch
import pytest

from colo_rl.config import LoraConfig, ModelConfig, TrainerConfig
from colo_rl.lora import apply_lora
from colo_rl.models import load_policy, write_embedded_model
from colo_rl.trainer import GRPOTrainer
from colo_rl.trainer.logprobs import _output_head
from tests.configs import trainer_config

from ..conftest import update_recording_grads

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
GROUP = 3
# different lengths and an empty completion: padding and masking are exercised
COMPLETIONS = [[14 + (i * 7 + j) % 40 for j in range(i % 5)] for i in range(len(PROMPTS) * GROUP)]
REWARDS = [float((i * 5) % 3) / 2 for i in range(len(COMPLETIONS))]
# fp32 on a CPU: the chunked head computes the same matmuls on fewer rows and the same fp32
# log-sum-exp; the observed differences are a few fp32 ulp of the matmul sums (<= ~4e-6 relative
# with LoRA on the head, where peft adds B @ A x on differently shaped rows)
RTOL, ATOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_embedded_model(ModelConfig(), tmp_path_factory.mktemp("policy"))


def policy(model_dir, lora=None):
    torch.manual_seed(0)
    model = load_policy(ModelConfig(), model_dir, "cpu")
    if lora is not None:
        model = apply_lora(model, LoraConfig(rank=4, target_modules=lora), torch.float32)
        g = torch.Generator().manual_seed(1)  # B starts at 0: give the adapters weight
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def trainer(model, chunk, temperature=0.7, **cfg):
    return GRPOTrainer(model, trainer_config(logprob_chunk=chunk, **cfg), pad_token_id=0,
                       temperature=temperature, max_tokens=8, device="cpu")


def logprobs_loss_grads(t: GRPOTrainer):
    """Per micro-batch log-probs (real tokens), then one update's loss and gradients (SGD lr 0 keeps
    the parameters, so the gradients are those of the same state)."""
    micro = t._micro_batches([p for p in PROMPTS for _ in range(GROUP)], COMPLETIONS,
                             torch.tensor(REWARDS) - 0.4, None)
    with torch.no_grad():
        logprobs = [t._token_logprobs(t.forward_model, mb)[mb.mask.bool()] for mb in micro]
    stats, before, grads = update_recording_grads(t, micro, normalizer=7.0)
    return logprobs, stats, grads, before


@pytest.mark.parametrize("lora", [None, ["q_proj", "v_proj"], ["q_proj", "lm_head"]],
                         ids=["full", "lora", "lora-on-head"])
@pytest.mark.parametrize("chunk", [1, 5, 1024])
def test_chunked_logprobs_loss_and_gradients_equal_the_full_logits_path(model_dir, lora, chunk):
    full = logprobs_loss_grads(trainer(policy(model_dir, lora), 0, micro_batch_size=4))
    chunked = logprobs_loss_grads(trainer(policy(model_dir, lora), chunk, micro_batch_size=4))
    for a, b in zip(full[0], chunked[0]):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    assert full[1]["loss"] != 0
    assert abs(chunked[1]["loss"] - full[1]["loss"]) <= RTOL * abs(full[1]["loss"]) + ATOL
    assert chunked[1]["grad_norm"] == pytest.approx(full[1]["grad_norm"], rel=RTOL)
    assert full[2].keys() == chunked[2].keys() and full[2]
    if lora is None:
        assert "lm_head.weight" in full[2] or "model.embed_tokens.weight" in full[2]
    for name in full[2]:
        torch.testing.assert_close(chunked[2][name], full[2][name], rtol=1e-5, atol=1e-7)
    # padded positions: 0 from the chunked path (the loss masks them either way)
    mb_mask = [t for t in chunked[3]]
    assert all(torch.isfinite(t).all() for t in mb_mask)


def test_a_full_step_with_kl_and_several_updates_gives_the_same_parameters(model_dir):
    """The reference (a no-grad forward through the frozen copy) and the PPO-clipped updates go
    through the chunked head too."""
    results = []
    for chunk in (0, 3):
        t = trainer(policy(model_dir), chunk, micro_batch_size=4, kl_coef=0.1, updates_per_batch=2)
        # SGD: Adam's first step divides by |g|, which turns ulp-level differences of near-zero
        # gradients into different updates
        t.optimizer = torch.optim.SGD(t.model.parameters(), lr=0.5)
        metrics = t.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
        results.append((metrics, {n: p.detach().clone() for n, p in t.model.named_parameters()}))
    (m0, p0), (m1, p1) = results
    assert m0["train/kl"] > 0
    for key in ("train/loss", "train/grad_norm", "train/kl", "train/clip_frac"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-7), key
    for name in p0:
        torch.testing.assert_close(p1[name], p0[name], rtol=1e-5, atol=1e-6)


def test_all_empty_completions_still_step_and_the_head_is_restored(model_dir):
    model = policy(model_dir)
    t = trainer(model, 4)
    metrics = t.train_step(PROMPTS, [[]] * len(COMPLETIONS), REWARDS, GROUP)
    assert metrics["train/loss"] == 0.0 and metrics["train/response_tokens"] == 0.0
    head = _output_head(model)
    assert "forward" not in head.__dict__  # the class's forward again: plain calls give logits
    out = model(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert out.shape == (1, 3, model.config.vocab_size)


def test_a_negative_chunk_is_refused_naming_the_key():
    from colo_rl.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.perf.logprob_chunk=-1"):
        trainer_config(logprob_chunk=-1)


def test_sorting_by_length_pads_less_and_gives_the_same_step(model_dir):
    """trainer.perf.sort_by_length: micro-batches of similar lengths compute fewer padded positions;
    the metrics and the SGD step equal those of batch order to float summation order."""
    prompts = [[5, 6, 7, 8, 9, 10], [8], [10, 11]]
    completions = [[14 + j for j in range((i * 5) % 7)] for i in range(len(prompts) * GROUP)]
    engine = [[-0.5 - 0.1 * j for j in range(len(c))] for c in completions]
    results, padded = [], []
    for sort in (False, True):
        t = trainer(policy(model_dir), 0, micro_batch_size=2, sort_by_length=sort, tis_cap=2.0, kl_coef=0.05)
        t.optimizer = torch.optim.SGD(t.model.parameters(), lr=0.5)
        micro = t._micro_batches([p for p in prompts for _ in range(GROUP)], completions,
                                 torch.zeros(len(completions)), engine)
        padded.append(sum(mb.input_ids.numel() - mb.attention_mask.sum().item() for mb in micro))
        assert sum(mb.mask.sum().item() for mb in micro) == sum(map(len, completions))
        metrics = t.train_step(prompts, completions, REWARDS, GROUP, engine_logprobs=engine)
        results.append((metrics, {n: p.detach().clone() for n, p in t.model.named_parameters()}))
    assert padded[1] < padded[0]
    (m0, p0), (m1, p1) = results
    assert m0.keys() == m1.keys() and m0["train/loss"] != 0
    for key in m0:
        assert m1[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-7), key
    for name in p0:
        torch.testing.assert_close(p1[name], p0[name], rtol=1e-5, atol=1e-6)


def test_compiled_log_softmax_of_the_chunks_gives_the_full_paths_loss_and_gradients(model_dir):
    """trainer.perf.logprob_kernel=compiled (the default on CUDA): each chunk's logits go through one
    torch.compile'd function, under the chunk's activation checkpointing; chunks of 5 leave a
    shorter last one (the dynamic size). Same log-probs, loss and gradients as the full logits."""
    from colo_rl.trainer.logprobs import _target_logprobs_compiled, _target_logprobs_eager

    compiled = trainer(policy(model_dir), 5, micro_batch_size=4, logprob_kernel="compiled")
    assert compiled.target_logprobs is _target_logprobs_compiled()
    assert trainer(policy(model_dir), 5).target_logprobs is _target_logprobs_eager  # auto on a CPU
    full = logprobs_loss_grads(trainer(policy(model_dir), 0, micro_batch_size=4))
    chunked = logprobs_loss_grads(compiled)
    for a, b in zip(full[0], chunked[0]):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    assert abs(chunked[1]["loss"] - full[1]["loss"]) <= RTOL * abs(full[1]["loss"]) + ATOL
    assert full[2].keys() == chunked[2].keys() and full[2]
    for name in full[2]:
        torch.testing.assert_close(chunked[2][name], full[2][name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "keep-logits"])
@pytest.mark.parametrize("lora", [None, ["q_proj", "v_proj"]], ids=["full", "lora"])
def test_the_fused_head_gives_the_generic_chunks_loss_and_gradients(model_dir, lora, recompute):
    """trainer.perf.fused_head (the default): the head and the log-softmax as one autograd function
    give what each chunk through the head module under checkpointing gives, at a temperature,
    with the head trained (full) and frozen (LoRA elsewhere), its logits recomputed in backward
    (the default) or kept (trainer.memory.logprob_recompute=false)."""
    from colo_rl.trainer.head import fusable

    fused_trainer = trainer(policy(model_dir, lora), 5, micro_batch_size=4, logprob_recompute=recompute)
    assert fused_trainer.head_ops is not None and fusable(_output_head(fused_trainer.model))
    generic_trainer = trainer(policy(model_dir, lora), 5, micro_batch_size=4, fused_head=False)
    assert generic_trainer.head_ops is None
    fused, generic = logprobs_loss_grads(fused_trainer), logprobs_loss_grads(generic_trainer)
    for a, b in zip(generic[0], fused[0]):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    assert generic[1]["loss"] != 0
    assert abs(fused[1]["loss"] - generic[1]["loss"]) <= RTOL * abs(generic[1]["loss"]) + ATOL
    assert fused[2].keys() == generic[2].keys() and fused[2]
    assert ("lm_head.weight" in fused[2] or "model.embed_tokens.weight" in fused[2]) == (lora is None)
    for name in generic[2]:
        torch.testing.assert_close(fused[2][name], generic[2][name], rtol=1e-5, atol=1e-7)


def test_a_lora_adapted_head_is_not_fused(model_dir):
    from colo_rl.trainer.head import fusable

    model = policy(model_dir, ["q_proj", "lm_head"])
    assert not fusable(_output_head(model))
    assert fusable(_output_head(policy(model_dir)))


def _reference_head(x, w, targets, temperature, dtype):
    logits = (x.to(dtype) @ w.to(dtype).t()).float() / temperature
    return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("keep_logits", [False, True], ids=["recompute", "keep"])
@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("kernel", ["eager", "compiled"])
def test_head_logprobs_values_and_gradients_against_autograd(chunk, kernel, keep_logits):
    """colo_rl.trainer.head.head_logprobs against autograd through matmul and log_softmax, fp32
    (chunks of 1, of 3 with a shorter last one, and one chunk for all rows; the logits recomputed
    in backward or kept from forward): the log-probs, the states' and the weight's gradients."""
    from colo_rl.trainer.head import EAGER, compiled_ops, head_logprobs

    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 8, generator=g, requires_grad=True)
    w = torch.randn(40, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (11,), generator=g)
    upstream = torch.randn(11, generator=g)
    ops = compiled_ops() if kernel == "compiled" else EAGER
    ours = head_logprobs(x, w, targets, 0.7, chunk, torch.float32, ops, keep_logits)
    (ours * upstream).sum().backward()
    ours_grads = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    reference = _reference_head(x, w, targets, 0.7, torch.float32)
    (reference * upstream).sum().backward()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_grads[0], x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_grads[1], w.grad, rtol=1e-5, atol=1e-6)


def test_head_logprobs_in_bf16_keep_fp32_gradients_for_fp32_weights():
    """Mixed precision: fp32 states and weight, bf16 compute (as under autocast). The log-probs are
    autograd's through the same bf16 casts; the weight's gradient comes back fp32, summed over the
    chunks in fp32 (autograd's bf16 product differs from it by bf16 rounding only)."""
    from colo_rl.trainer.head import head_logprobs

    g = torch.Generator().manual_seed(1)
    x = torch.randn(13, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (13,), generator=g)
    ours = head_logprobs(x, w, targets, 1.0, 4, torch.bfloat16)
    ours.sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    ours_grads = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    reference = _reference_head(x, w, targets, 1.0, torch.bfloat16)
    reference.sum().backward()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)  # bf16 logits of other row blocks: ulps
    for a, b in zip(ours_grads, (x.grad, w.grad)):
        assert (a - b).norm() <= 1e-2 * b.norm(), ((a - b).norm(), b.norm())


@pytest.mark.parametrize("chunk", [0, 5])
def test_the_training_forward_builds_no_kv_cache(model_dir, chunk):
    """Hugging Face models return a KV cache by default, built by concatenating every layer's keys
    and values; the trainer's forwards (log-probs with gradients, the no-grad reference) ask for
    none."""
    model = policy(model_dir)
    caches = []
    model.register_forward_hook(lambda module, args, output: caches.append(output.past_key_values))
    t = trainer(model, chunk, micro_batch_size=4)
    t.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    assert caches and all(cache is None for cache in caches)
    assert model(input_ids=torch.tensor([[5, 6, 7]])).past_key_values is not None  # the default, for contrast
