"""LoRA (trainer.lora, peft): what trains, what the engine gets, the reference, checkpoints,
refusals, and a LoRA run of the embedded model learning the built-in task."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import peft
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from colo_rl.config import ConfigError, LoraConfig, ModelConfig, SamplingConfig, TrainerConfig, validate
from colo_rl.export import export_checkpoint
from colo_rl.lora import apply_lora, hf_parameters, merged_weight
from colo_rl.models import load_policy
from colo_rl.run import train
from colo_rl.switch import Switch
from colo_rl.trainer import CheckpointError, GRPOTrainer, Offloader, load_checkpoint, save_checkpoint
from colo_rl.trainer.checkpoint import check_compatible, read_manifest
from tests.configs import trainer_config

from .conftest import ROOT, compose_config, engine_processes, small_run_overrides
from .generator.test_generator import hf_greedy

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
GROUP = 4
COMPLETIONS = [[14 + (i * 7 + j) % 40 for j in range(1 + i % 5)] for i in range(len(PROMPTS) * GROUP)]
REWARDS = [float((i * 5) % 3) / 2 for i in range(len(COMPLETIONS))]
DECODER_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
# The embedded model is randomly initialised: its output head's rows are so small that no hidden
# state makes one token likely (p('a') <= ~0.15), so the built-in task also adapts the head.
LEARNS = ["trainer.lora.rank=8", "trainer.lr=1e-2", f"trainer.lora.target_modules=[{','.join(DECODER_LINEAR)},lm_head]"]


def lora_policy(model_dir, *, dtype="float32", adapter_dtype=torch.float32, seed=None, **lora):
    torch.manual_seed(0)  # peft draws A's initial values from torch's generator; the runner seeds it
    model = apply_lora(load_policy(ModelConfig(dtype=dtype), model_dir, "cpu"),
                       LoraConfig(rank=lora.pop("rank", 8), **lora), adapter_dtype)
    if seed is not None:  # B starts at 0 (the merge is then the base): give the adapters weight
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.2)
    return model


def trainer_of(model, **cfg) -> GRPOTrainer:
    return GRPOTrainer(model, trainer_config(**cfg), pad_token_id=0, temperature=1.0, max_tokens=8,
                       device="cpu", autocast_dtype=torch.bfloat16)


@pytest.mark.parametrize("override,message", [
    ("trainer.lora.rank=-1", "trainer.lora.rank=-1 must be >= 0"),
    ("trainer.lora.alpha=0", "trainer.lora.alpha=0.0 must be > 0"),
    ("trainer.lora.dropout=1.0", "trainer.lora.dropout=1.0 must be in"),
    ("trainer.lora.dropout=-0.1", "trainer.lora.dropout=-0.1 must be in"),
])
def test_lora_values_out_of_range_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(override))


def test_lora_with_fsdp_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="trainer.lora.rank=8 must be 0 with trainer.parallel=fsdp"):
        validate(compose_config("trainer.lora.rank=8", "trainer.parallel=fsdp", "trainer.memory.offload=none"))


def test_lora_without_peft_installed_is_refused_saying_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # what find_spec reports for a missing package
    with pytest.raises(ConfigError, match=r"trainer.lora.rank=8 needs the package peft.*colo_rl\[lora\]"):
        validate(compose_config("trainer.lora.rank=8"))
    validate(compose_config("trainer.lora.rank=0"))


def test_unknown_target_modules_are_refused_before_any_engine_listing_the_linear_layers(tmp_path):
    cfg = compose_config(*small_run_overrides(tmp_path, "logger=none", "trainer.lora.rank=4",
                                              "trainer.lora.target_modules=[q_proj,qkv_proj,embed_tokens]"))
    before = engine_processes()  # the session's shared engine may be up
    with pytest.raises(ConfigError) as info:
        train(cfg)
    message = str(info.value)
    assert message.startswith("trainer.lora.target_modules=['q_proj', 'qkv_proj', 'embed_tokens']: "
                              "qkv_proj, embed_tokens matches no linear layer")
    assert f"named {', '.join(sorted([*DECODER_LINEAR, 'lm_head']))} " in message
    assert engine_processes() == before and not (tmp_path / "engine.log").exists()


def test_only_the_adapters_train_in_fp32_over_a_frozen_bf16_base(tiny_model_dir):
    """trainer.memory.precision=mixed under LoRA: fp32 adapters and AdamW state; the base stays in bf16
    with no master copy, no gradient and no optimizer state."""
    model = lora_policy(tiny_model_dir, dtype="bfloat16")
    trainer = trainer_of(model, lr=1e-2)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert trainer.trainable_params == model.get_nb_trainable_parameters()[0] == 34816
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}
    assert trainer.reference is None  # no frozen copy even with kl_coef > 0: see the KL test
    # a module-suffix name works as peft matches it; the default targets every decoder linear
    adapted = {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert sorted(adapted) == DECODER_LINEAR


def test_training_moves_the_adapters_and_leaves_the_base_bit_identical(tiny_model_dir):
    model = lora_policy(tiny_model_dir)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = trainer_of(model, lr=1e-2, kl_coef=0.1)
    for _ in range(3):
        trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert sum(not torch.equal(p, adapters[n]) for n, p in model.named_parameters() if p.requires_grad) \
        == len(adapters)


def test_the_kl_reference_is_the_base_model_with_the_adapters_disabled(tiny_model_dir):
    model = lora_policy(tiny_model_dir, seed=1)
    trainer = trainer_of(model, kl_coef=0.1)
    micro = trainer._micro_batches([p for p in PROMPTS for _ in range(GROUP)], COMPLETIONS,
                                   torch.zeros(len(COMPLETIONS)), None)
    plain = trainer_of(load_policy(ModelConfig(), tiny_model_dir, "cpu"))
    for mb in micro:
        reference = trainer._reference_logprobs(mb)
        with torch.no_grad():
            base, policy = plain._token_logprobs(plain.model, mb), trainer._token_logprobs(model, mb)
        assert torch.equal(reference, base)
        assert not torch.allclose(policy, base, atol=1e-3)  # the adapters are on again afterwards
    assert trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)["train/kl"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_weights_equal_peft_merge_under_the_base_model_names_and_leave_the_base_alone(
        tiny_model_dir, dtype):
    model = lora_policy(tiny_model_dir, dtype=dtype, seed=2)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine_dtype = getattr(torch, dtype)
    pushed = {name: merged_weight(p, layer, engine_dtype) if layer is not None else p.detach()
              for name, p, layer in hf_parameters(model)}
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    plain = load_policy(ModelConfig(), tiny_model_dir, "cpu")
    assert list(pushed) == [n for n, _ in plain.named_parameters()]  # names the engine already maps
    assert all(torch.equal(pushed[n], expected[n]) and pushed[n].dtype == engine_dtype for n in expected)
    assert sum(not torch.equal(pushed[n], plain.state_dict()[n].to(engine_dtype)) for n in pushed) == 14
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not p.requires_grad)


def test_offloading_a_lora_policy_moves_each_tensor_once_and_restores_it_bit_exact(tiny_model_dir):
    model = lora_policy(tiny_model_dir)
    trainer = trainer_of(model, lr=1e-2)
    trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    for p in model.parameters():  # train_step frees the gradients; keep some to move
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = sum(v.nbytes for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    params = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    grads = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    offloader = Offloader(model, trainer.optimizer, "all")
    assert offloader.offload()["bytes"] == params + grads + states
    offloader.restore()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_checkpoint_holds_the_adapters_only_and_resumes_them_bit_exact(tiny_model_dir, tmp_path):
    trainer = trainer_of(lora_policy(tiny_model_dir), lr=1e-2)
    trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    save_checkpoint(tmp_path, trainer, {"step": 1})
    state = trainer.state_dict()["model"]
    assert set(state) == {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    resumed = trainer_of(lora_policy(tiny_model_dir), lr=1e-2)
    load_checkpoint(tmp_path, resumed)
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), resumed.model.parameters()))
    a, b = (t.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP) for t in (trainer, resumed))
    assert a == b
    full = trainer_of(load_policy(ModelConfig(), tiny_model_dir, "cpu"))
    with pytest.raises(ValueError, match="not this LoRA policy's adapters"):
        resumed.load_state_dict(full.state_dict())


def test_after_a_push_the_engine_greedy_equals_the_merged_model_token_for_token(engine, tiny_model_dir):
    model = lora_policy(tiny_model_dir, seed=3)
    merged = copy.deepcopy(model).merge_and_unload()
    plain = load_policy(ModelConfig(), tiny_model_dir, "cpu")
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=12)
    rollouts = Switch(engine, model).generate(PROMPTS, greedy)
    for prompt, tokens in zip(PROMPTS, rollouts.completion_ids):
        assert tokens == hf_greedy(merged, prompt, greedy.max_tokens)[:len(tokens)]
    assert rollouts.completion_ids != [hf_greedy(plain, p, greedy.max_tokens) for p in PROMPTS]
    assert engine.engine_info["hf_tensors"] == len(list(plain.named_parameters()))


def test_a_lora_run_learns_the_built_in_task_and_logs_its_trainable_parameters(tmp_path, engine):
    result = train(compose_config(*small_run_overrides(
        tmp_path, "logger=none", "trainer.steps=10", "trainer.prompts_per_step=8", "sampling.n=8",
        "sampling.max_tokens=16", *LEARNS)), engine)
    rewards = [r["reward/mean"] for r in result.records]
    assert sum(rewards[:3]) / 3 < 0.15 and sum(rewards[-3:]) / 3 > 0.6, rewards
    # the adapters of 7 linear layers x 2 decoder layers (r=8 x (in + out)) and of lm_head
    assert {r["train/trainable_params"] for r in result.records} == {34816 + 8 * (128 + 64)}
    state = load_file(tmp_path / "checkpoint" / "model.safetensors")
    assert read_manifest(tmp_path / "checkpoint")["kind"] == "lora"
    assert state and all(".lora_A." in n or ".lora_B." in n for n in state)


def adapters_of(checkpoint_dir, model_dir) -> dict[str, torch.Tensor]:
    trainer = trainer_of(lora_policy(model_dir), lr=1e-2)
    load_checkpoint(checkpoint_dir, trainer)
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_resuming_from_an_adapter_checkpoint_continues_bit_exact(tmp_path, engine, tiny_model_dir):
    keys = ["reward/mean", "train/loss", "train/grad_norm", "rollout/tokens"]
    lora = ["logger=none", "trainer.lora.rank=8", "trainer.lr=1e-2"]
    full = train(compose_config(*small_run_overrides(tmp_path / "full", *lora, "trainer.steps=4")), engine).records
    train(compose_config(*small_run_overrides(tmp_path / "first", *lora, "trainer.steps=2")), engine)
    resumed = train(compose_config(*small_run_overrides(
        tmp_path / "resumed", *lora, "trainer.steps=4", f"trainer.checkpoint.resume={tmp_path / 'first' / 'checkpoint'}")),
        engine).records
    assert [r["train/step"] for r in resumed] == [2, 3]
    for a, b in zip(full[2:], resumed):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    expected = adapters_of(tmp_path / "full" / "checkpoint", tiny_model_dir)
    got = adapters_of(tmp_path / "resumed" / "checkpoint", tiny_model_dir)
    assert expected.keys() == got.keys() and all(torch.equal(expected[n], got[n]) for n in expected)
    assert max(float(t.abs().max()) for n, t in got.items() if ".lora_B." in n) > 0  # B left its zero init


def test_gradient_checkpointing_trains_the_adapters_as_without_it(tiny_model_dir):
    """The 24 GiB benchmark arm's setting: peft's model takes Hugging Face's checkpointing."""
    after = []
    for checkpointing in (False, True):
        trainer = trainer_of(lora_policy(tiny_model_dir), lr=1e-2, gradient_checkpointing=checkpointing)
        metrics = trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
        after.append((metrics["train/loss"], [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]))
    assert trainer.model.is_gradient_checkpointing
    assert after[0][0] == after[1][0]
    torch.testing.assert_close(after[0][1], after[1][1], rtol=0, atol=1e-7)


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory, tiny_model_dir):
    """A LoRA trainer after two steps and its checkpoint, with the run config that describes it."""
    trainer = trainer_of(lora_policy(tiny_model_dir), lr=1e-2)
    for _ in range(2):
        trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    config = OmegaConf.to_container(compose_config("trainer.lora.rank=8", "trainer.lr=1e-2"), resolve=True)
    directory = save_checkpoint(tmp_path_factory.mktemp("lora") / "checkpoint", trainer, {"step": 2},
                                config=config, model_dir=tiny_model_dir)
    return directory, trainer.model, config


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]])).logits


def test_the_checkpoint_says_lora_and_is_a_tenth_of_the_model(lora_checkpoint):
    directory, model, _ = lora_checkpoint
    assert json.loads((directory / "manifest.json").read_text())["kind"] == "lora"
    assert set(load_file(directory / "model.safetensors")) == {n for n, p in model.named_parameters() if p.requires_grad}
    full = sum(p.nbytes for _, p, _ in hf_parameters(model))
    assert (directory / "model.safetensors").stat().st_size < full / 8


def test_resuming_with_other_lora_settings_is_refused_naming_the_key(lora_checkpoint):
    directory, _, config = lora_checkpoint
    other = copy.deepcopy(config)
    other["trainer"]["lora"]["alpha"] = 16.0
    with pytest.raises(CheckpointError, match=r"trainer.lora.alpha=16.0 \(the checkpoint: 32.0\)"):
        check_compatible(directory, other)


def test_the_merged_export_loads_with_transformers_as_the_weights_every_push_sends(lora_checkpoint, tmp_path):
    directory, model, _ = lora_checkpoint
    export_checkpoint(directory, tmp_path / "merged")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    pushed = {name: merged_weight(p, layer, torch.float32) if layer is not None else p.detach()
              for name, p, layer in hf_parameters(model)}
    assert exported.state_dict().keys() == pushed.keys()
    assert all(torch.equal(exported.state_dict()[n], pushed[n]) for n in pushed)
    torch.testing.assert_close(logits_of(exported), logits_of(model), rtol=0, atol=1e-5)


def test_the_adapter_export_loads_with_peft_onto_the_base_as_the_trainer_holds_it(lora_checkpoint, tmp_path):
    directory, model, _ = lora_checkpoint
    proc = subprocess.run([sys.executable, "-m", "colo_rl.export", str(directory), str(tmp_path / "adapter"),
                           "--lora", "adapter"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    base = load_policy(ModelConfig(), directory / "hf", "cpu")
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert torch.equal(logits_of(loaded), logits_of(model))
    with loaded.disable_adapter():  # the adapters are what made the difference
        assert not torch.allclose(logits_of(loaded), logits_of(model), atol=1e-3)


def test_an_adapter_export_of_a_full_fine_tuning_checkpoint_is_refused(tmp_path, tiny_model_dir):
    trainer = trainer_of(load_policy(ModelConfig(), tiny_model_dir, "cpu"))
    config = OmegaConf.to_container(compose_config(), resolve=True)
    directory = save_checkpoint(tmp_path / "checkpoint", trainer, {"step": 0}, config=config, model_dir=tiny_model_dir)
    with pytest.raises(CheckpointError, match="--lora adapter: .* is a full fine-tuning checkpoint"):
        export_checkpoint(directory, tmp_path / "out", lora="adapter")


@pytest.mark.slow
def test_two_ddp_ranks_train_the_adapters_like_one_process(tmp_path, engine):
    from .test_parallel import OVERRIDES, kill_tree, model_state, torchrun

    lora = ["trainer.lora.rank=8", "trainer.lr=1e-2", "trainer.memory.offload=none"]
    proc = torchrun(2, "trainer.parallel=ddp", *lora, *OVERRIDES, f"output_dir={tmp_path / 'two'}")
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, out[-4000:]
    train(compose_config(*small_run_overrides(tmp_path / "one", *OVERRIDES, *lora)), engine)
    expected, got = model_state(tmp_path / "one"), model_state(tmp_path / "two")
    assert expected.keys() == got.keys() and all(".lora_" in name for name in got)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert max(float(t.abs().max()) for n, t in got.items() if ".lora_B." in n) > 1e-4  # they trained
