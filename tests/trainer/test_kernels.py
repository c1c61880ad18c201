"""trainer.perf.compile and trainer.perf.kernels (colo_rl/trainer/kernels.py): the same log-probs, loss and
gradients as the eager model; bad settings refused naming the key. Liger's Triton kernels run only
on CUDA: tests/gpu/test_kernels_gpu.py checks them there."""

from __future__ import annotations

import pytest
import torch

from colo_rl.config import ConfigError, ModelConfig, TrainerConfig
from colo_rl.models import load_policy, write_embedded_model
from colo_rl.trainer import GRPOTrainer
from colo_rl.trainer.loss import grpo_loss
from colo_rl.trainer.kernels import apply_liger, check_kernels, decoder_layers, resolve_kernels
from tests.configs import trainer_config

from ..conftest import update_recording_grads

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
GROUP = 2
COMPLETIONS = [[14 + (i * 7 + j) % 40 for j in range(1 + i % 4)] for i in range(len(PROMPTS) * GROUP)]
REWARDS = [float((i * 5) % 3) / 2 for i in range(len(COMPLETIONS))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_embedded_model(ModelConfig(), tmp_path_factory.mktemp("policy"))


def update(model_dir, **cfg):
    """One update's log-probs, stats and gradients (SGD at lr 0: the parameters stay)."""
    torch.manual_seed(0)
    t = GRPOTrainer(load_policy(ModelConfig(), model_dir, "cpu"), trainer_config(micro_batch_size=3, **cfg),
                    pad_token_id=0, temperature=0.7, max_tokens=8, device="cpu")
    micro = t._micro_batches([p for p in PROMPTS for _ in range(GROUP)], COMPLETIONS,
                             torch.tensor(REWARDS) - 0.4, None)
    stats, before, grads = update_recording_grads(t, micro, normalizer=9.0)
    assert grads.keys() == dict(t.model.named_parameters()).keys()  # every parameter got a gradient
    return t, stats, torch.cat([b[mb.mask.bool()] for b, mb in zip(before, micro)]), grads


def test_compiled_decoder_layers_give_the_eager_log_probs_loss_and_gradients(model_dir):
    from torch._dynamo.utils import counters

    eager = update(model_dir)
    counters.clear()
    compiled = update(model_dir, compile=True)
    layers = decoder_layers(compiled[0].model)
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    assert counters["stats"]["unique_graphs"] >= 1  # Dynamo did compile them, not fall back
    # fp32 on a CPU: inductor fuses and reorders the elementwise sums, a few ulp
    torch.testing.assert_close(compiled[2], eager[2], rtol=1e-5, atol=1e-5)
    assert eager[1]["loss"] != 0
    assert compiled[1]["loss"] == pytest.approx(eager[1]["loss"], rel=1e-5, abs=1e-7)
    assert compiled[1]["grad_norm"] == pytest.approx(eager[1]["grad_norm"], rel=1e-4)
    assert eager[3].keys() == compiled[3].keys()
    for name in eager[3]:
        torch.testing.assert_close(compiled[3][name], eager[3][name], rtol=1e-4, atol=1e-6)


def test_the_loss_statistics_without_a_host_sync_equal_the_synced_ones():
    g = torch.Generator().manual_seed(0)
    logprobs, old = -torch.rand(3, 5, generator=g), -torch.rand(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    kwargs = dict(clip_eps=0.1, loss_agg="token", max_tokens=5, ref_logprobs=old * 0.9, kl_coef=0.05)
    loss, synced = grpo_loss(logprobs, old, torch.tensor([1.0, -0.5, 2.0]), mask, **kwargs)
    loss2, lazy = grpo_loss(logprobs, old, torch.tensor([1.0, -0.5, 2.0]), mask, sync=False, **kwargs)
    assert all(isinstance(v, float) for v in synced.values())
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in lazy.values())
    assert synced["clip_frac"] > 0 and synced["kl"] > 0 and synced["tokens"] == 9.0
    assert {k: float(v) for k, v in lazy.items()} == pytest.approx(synced)
    assert float(loss2) == float(loss)


def test_liger_kernels_are_refused_off_cuda_naming_the_key(model_dir):
    with pytest.raises(ConfigError, match="trainer.perf.kernels=liger runs Triton GPU kernels, but the trainer is on cpu"):
        check_kernels("liger", "cpu", model_dir)
    check_kernels("none", "cpu", model_dir)  # the default asks for nothing


def test_auto_picks_liger_only_where_it_can_run():
    assert resolve_kernels("auto", "cpu", "olmo2") == "none"
    assert resolve_kernels("auto", "cuda:0", "no_such_model_type") == "none"
    assert resolve_kernels("none", "cuda:0", "olmo2") == "none"
    assert resolve_kernels("auto", "cuda:0", "olmo2") == "liger"  # liger-kernel is a test dependency
    assert resolve_kernels("auto", "cuda:0", "olmo2", compile=True) == "none"  # compiled layers fuse it
    assert resolve_kernels("liger", "cuda", "llama") == "liger"
    with pytest.raises(ConfigError, match="trainer.perf.kernels=liger: liger-kernel has no kernels for model type 'nope'"):
        resolve_kernels("liger", "cuda", "nope")


def test_unknown_kernels_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="trainer.perf.kernels"):
        trainer_config(kernels="flash")


def test_liger_patches_the_model_it_is_given_and_no_other(model_dir):
    """Liger's patch for OLMo-2 rebinds the modeling module's RMSNorm and MLP classes and its
    apply_rotary_pos_emb, so every OLMo-2 built after it in the process ran Liger's kernels (a
    `kernels=none` baseline on the GPU too, which is how the 2026-12-06d lease's GPU tests saw it).
    Only patching is checked here: Liger's Triton kernels do not run on a CPU."""
    import copy

    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from transformers.models.olmo2 import modeling_olmo2

    names = ("apply_rotary_pos_emb", "Olmo2RMSNorm", "Olmo2MLP")
    module_before = {name: getattr(modeling_olmo2, name) for name in names}
    patched = load_policy(ModelConfig(), model_dir, "cpu")
    apply_liger(patched)
    assert {name: getattr(modeling_olmo2, name) for name in names} == module_before
    layers = patched.config.num_hidden_layers
    norms = [m for m in patched.modules() if hasattr(m, "casting_mode")]
    assert len(norms) == 4 * layers + 1  # two per layer, q/k norms, the final one
    for model in (patched, copy.deepcopy(patched)):  # the KL reference is a deep copy
        attention = [m for m in model.modules() if isinstance(m, modeling_olmo2.Olmo2Attention)]
        assert len(attention) == layers
        assert all(type(m).__name__ == "Olmo2Attention" and type(m) is not modeling_olmo2.Olmo2Attention
                   and type(m).forward.__globals__["apply_rotary_pos_emb"] is liger_rotary_pos_emb
                   for m in attention)
    plain = load_policy(ModelConfig(), model_dir, "cpu")  # built after the patch
    assert not any(hasattr(m, "casting_mode") for m in plain.modules())
    assert {type(m) for m in plain.modules() if "Attention" in type(m).__name__} == {modeling_olmo2.Olmo2Attention}
    ids = torch.tensor([PROMPTS[0] + COMPLETIONS[0]])
    with torch.no_grad():  # it runs on the CPU, as Hugging Face's model
        torch.testing.assert_close(plain(input_ids=ids).logits,
                                   load_policy(ModelConfig(), model_dir, "cpu")(input_ids=ids).logits)


def test_liger_backend_discovery_logs_no_warning_for_other_vendors_backends(caplog):
    """Liger's discovery of an op's backends on this machine (the CuTe DSL, Ascend and cuTile
    modules cannot be imported here, as on most GPUs): no warning reaches the run's output."""
    import logging

    from liger_kernel.backends import registry

    from colo_rl.trainer.kernels import quiet_liger_discovery

    quiet_liger_discovery()
    with caplog.at_level(logging.WARNING):
        registry._discover("layer_norm")
    assert any("layer_norm" in path for path in registry.get_discovery_failures())  # there was something to say
    assert not [r for r in caplog.records if "could not be imported" in r.getMessage()]
