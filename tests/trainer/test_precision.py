"""The trainer's precision apart from the engine's: fp32 master weights under a bf16 engine, what
pure bf16 loses at RL learning rates, the optimizer choices, and what a push hands the engine."""

from __future__ import annotations

import math

import pytest
import torch

from colo_rl.config import ConfigError, GeneratorConfig, ModelConfig, OptimConfig, SamplingConfig, TrainerConfig, validate
from colo_rl.generator import VLLMGenerator
from colo_rl.models import load_policy, write_embedded_model
from colo_rl.run import train
from colo_rl.switch import Switch
from colo_rl.trainer import GRPOTrainer, load_checkpoint
from tests.configs import trainer_config

from ..conftest import compose_config, small_run_overrides

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
GROUP = 4
COMPLETIONS = [[14 + (i * 7 + j) % 40 for j in range(1 + i % 5)] for i in range(len(PROMPTS) * GROUP)]
REWARDS = [float((i * 5) % 3) / 2 for i in range(len(COMPLETIONS))]
BF16 = ModelConfig(dtype="bfloat16")


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory):
    return write_embedded_model(BF16, tmp_path_factory.mktemp("bf16") / "model")


def changed_fraction(before: dict, model: torch.nn.Module) -> float:
    changed = total = 0
    for name, p in model.named_parameters():
        changed += int((p.detach().float() != before[name].float()).sum())
        total += p.numel()
    return changed / total


def steps_of(trainer: GRPOTrainer, steps: int) -> float:
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for _ in range(steps):
        trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    return changed_fraction(before, trainer.model)


def test_fp32_masters_move_at_lr_1e_6_where_pure_bf16_rounds_most_updates_away(bf16_model_dir):
    """The reason trainer.memory.precision exists: 8 AdamW steps at lr 1e-6 from the same start."""
    fractions = {}
    for precision, dtype in (("mixed", "float32"), ("pure", "bfloat16")):
        torch.manual_seed(0)
        model = load_policy(BF16, bf16_model_dir, "cpu", dtype=dtype)
        trainer = GRPOTrainer(model, trainer_config(lr=1e-6, precision=precision), pad_token_id=0,
                              temperature=1.0, max_tokens=8, device="cpu", autocast_dtype=torch.bfloat16)
        assert next(trainer.model.parameters()).dtype == getattr(torch, dtype)
        assert all(v.dtype == getattr(torch, dtype) for s in trainer.optimizer.state.values()
                   for k, v in s.items() if k != "step")
        fractions[precision] = steps_of(trainer, 8)
    assert fractions["mixed"] >= 0.9, fractions
    # Measured here: ~0.999 against ~0.2; bf16's spacing near a weight of 0.02 is 1.2e-4, near
    # 1.0 (every norm weight at init) 0.0078, against AdamW steps of ~1e-6.
    assert fractions["pure"] < 0.5 * fractions["mixed"], fractions


def test_auto_precision_is_mixed_for_16_bit_engines_and_pure_for_fp32():
    from colo_rl.config import trainer_dtype, trainer_precision

    bf16 = validate(compose_config("model.dtype=bfloat16"))
    assert (trainer_precision(bf16), trainer_dtype(bf16)) == ("mixed", "float32")
    fp16 = validate(compose_config("model.dtype=float16"))
    assert (trainer_precision(fp16), trainer_dtype(fp16)) == ("mixed", "float32")
    fp32 = validate(compose_config())
    assert (trainer_precision(fp32), trainer_dtype(fp32)) == ("pure", "float32")
    pure = validate(compose_config("model.dtype=bfloat16", "trainer.memory.precision=pure"))
    assert trainer_dtype(pure) == "bfloat16"


@pytest.mark.parametrize("overrides, match", [
    (["trainer.memory.precision=fp8"], r"trainer.memory.precision='fp8' must be one of auto, mixed, pure"),
    (["trainer.optim.name=sgd"], r"trainer.optim.name='sgd' must be one of adamw, adamw_8bit, adamw_bf16_sr"),
    (["trainer.optim.name=adamw_bf16_sr"], r"trainer.optim.name=adamw_bf16_sr .* model.dtype=float32 .*"
                                          r"set model.dtype=bfloat16 trainer.memory.precision=pure"),
    (["trainer.optim.name=adamw_bf16_sr", "model.dtype=bfloat16"], r"trainer.memory.precision=auto"),
])
def test_precision_and_optimizer_that_cannot_work_are_refused_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(compose_config(*overrides))


@pytest.mark.parametrize("optimizer, precision, state_dtypes", [
    ("adamw_8bit", "mixed", {torch.uint8, torch.float32}),
    ("adamw_bf16_sr", "pure", {torch.bfloat16}),
])
def test_each_optimizer_choice_trains_and_keeps_its_state_small(bf16_model_dir, optimizer, precision,
                                                                state_dtypes):
    dtype = "float32" if precision == "mixed" else "bfloat16"
    model = load_policy(BF16, bf16_model_dir, "cpu", dtype=dtype)
    # 8-bit state is block-wise for tensors of 4096 elements or more: give it one to quantise
    cfg = trainer_config(lr=1e-3, optim=OptimConfig(name=optimizer), precision=precision)
    trainer = GRPOTrainer(model, cfg, pad_token_id=0, temperature=1.0, max_tokens=8, device="cpu")
    fraction = steps_of(trainer, 2)
    assert fraction > 0.5, fraction
    dtypes = {v.dtype for s in trainer.optimizer.state.values() for k, v in s.items()
              if torch.is_tensor(v) and v.dim() > 0 and k not in ("qmap1", "qmap2", "absmax1", "absmax2")}
    assert dtypes <= state_dtypes and dtypes & (state_dtypes - {torch.float32} or state_dtypes), dtypes
    state_bytes = sum(v.nbytes for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    adamw_fp32_bytes = sum(p.numel() for p in trainer.model.parameters()) * 8
    assert state_bytes < 0.55 * adamw_fp32_bytes, state_bytes / adamw_fp32_bytes


def test_gradient_checkpointing_gives_the_same_loss_and_gradient_norm(bf16_model_dir):
    metrics = []
    for checkpointing in (False, True):
        model = load_policy(ModelConfig(), bf16_model_dir, "cpu", dtype="float32")
        trainer = GRPOTrainer(model, trainer_config(gradient_checkpointing=checkpointing, lr=1e-3),
                              pad_token_id=0, temperature=1.0, max_tokens=8, device="cpu")
        assert model.is_gradient_checkpointing == checkpointing
        metrics.append(trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP))
    for key in ("train/loss", "train/grad_norm"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-5), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_mixed_precision_autocasts_to_bf16_and_keeps_fp32_masters(bf16_model_dir):
    model = load_policy(BF16, bf16_model_dir, "cuda", dtype="float32")
    trainer = GRPOTrainer(model, TrainerConfig(micro_batch_size=4, lr=1e-6), pad_token_id=0,
                          temperature=1.0, max_tokens=8, device="cuda", autocast_dtype=torch.bfloat16)
    assert trainer.autocast_dtype == torch.bfloat16
    fraction = steps_of(trainer, 8)
    assert next(model.parameters()).dtype == torch.float32 and fraction >= 0.9


@pytest.fixture(scope="module")
def bf16_engine(tmp_path_factory, bf16_model_dir):
    generator = VLLMGenerator(GeneratorConfig(), model_dir=bf16_model_dir, dtype="bfloat16",
                              log_dir=tmp_path_factory.mktemp("bf16_engine"))
    yield generator
    generator.close()


def test_a_bf16_engine_gets_the_fp32_masters_cast_and_decodes_as_the_cast_model(bf16_engine, bf16_model_dir):
    master = load_policy(BF16, bf16_model_dir, "cpu", dtype="float32")
    with torch.no_grad():  # masters off the bf16 grid, so that the cast is visible
        for p in master.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=8, logprobs=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    rollouts = Switch(bf16_engine, master).generate(prompts, greedy)
    # what a push sends (and the engine verifies by checksum before loading): the cast masters
    pushed = dict(bf16_engine._engine_tensors(master))
    for name, p in master.named_parameters():
        assert pushed[name].dtype == torch.bfloat16 and torch.equal(pushed[name], p.detach().bfloat16())
    cast = load_policy(BF16, bf16_model_dir, "cpu", dtype="bfloat16")
    cast.load_state_dict({k: v.to(torch.bfloat16) for k, v in master.state_dict().items()})
    for prompt, tokens, logprobs in zip(prompts, rollouts.completion_ids, rollouts.logprobs):
        with torch.no_grad():
            logits = cast(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        # the engine's greedy token is the cast model's argmax wherever that is not a near tie
        top2 = logits.topk(2, dim=-1)
        decided = (top2.values[:, 0] - top2.values[:, 1]) > 0.05
        assert torch.equal(logits.argmax(-1)[decided], torch.tensor(tokens)[decided])
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=0.05, rtol=0)


def test_a_bf16_run_trains_fp32_masters_at_lr_1e_6(tmp_path, bf16_engine, bf16_model_dir):
    result = train(compose_config(*small_run_overrides(
        tmp_path, "model.dtype=bfloat16", "trainer.lr=1e-6", "trainer.steps=8", "logger=none")), bf16_engine)
    assert len(result.records) == 8 and all(math.isfinite(r["train/loss"]) for r in result.records)
    start = load_policy(BF16, bf16_model_dir, "cpu", dtype="float32")
    trained = load_policy(BF16, bf16_model_dir, "cpu", dtype="float32")
    trainer = GRPOTrainer(trained, TrainerConfig(), pad_token_id=0, temperature=1.0, max_tokens=8, device="cpu")
    load_checkpoint(tmp_path / "checkpoint", trainer)
    assert next(trained.parameters()).dtype == torch.float32
    before = {n: p.detach().clone() for n, p in start.named_parameters()}
    assert changed_fraction(before, trained) >= 0.9


MICRO_BATCHES = [torch.randint(3, 60, (3, 9), generator=torch.Generator().manual_seed(0)) for _ in range(3)]


def backward_each(model: torch.nn.Module, checkpointing: bool, each=lambda: None) -> None:
    """Forward and backward of each of MICRO_BATCHES under CPU bf16 autocast; each() after each."""
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    for ids in MICRO_BATCHES:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        logits.float().log_softmax(-1)[..., 5:9].mean().backward()
        each()


def summed_in_fp32(model: torch.nn.Module, checkpointing: bool) -> dict[str, torch.Tensor]:
    """The gradients of MICRO_BATCHES, each micro-batch's (in its parameter's dtype) summed in fp32
    as AccumulateGrad sums autocast's fp32 ones."""
    total: dict[str, torch.Tensor] = {}

    def add() -> None:
        for name, p in model.named_parameters():
            grad = p.grad.to(torch.float32)
            total[name] = grad if name not in total else total[name].add_(grad)
        model.zero_grad(set_to_none=True)

    backward_each(model, checkpointing, add)
    return total


@pytest.mark.parametrize("fuse", [False, True], ids=["hook", "fused-accumulation"])
@pytest.mark.parametrize("scope", ["matmul", "all"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["stored", "recomputed"])
def test_compute_copies_give_the_gradients_of_the_model_they_emulate_bit_for_bit(tmp_path, checkpointing, scope,
                                                                                 fuse):
    """Mixed precision casts weights to bf16 once per update (compute_copies), not in every
    micro-batch's forward, and adds each bf16 weight gradient into the fp32 .grad in one pass.
    scope "matmul" (trainer.memory.fp32_activations=true): the gradients are autocast's own on the fp32
    model, bit for bit. "all" (false): those of the model with every weight but the output head in
    bf16 (verl's and Megatron's mixed precision), summed over micro-batches in fp32. With
    activations recomputed in backward too; the masters are the model's parameters afterwards. CPU
    autocast here; tests/gpu/test_kernels_gpu.py compares whole trainer updates on CUDA.
    fused-accumulation (trainer.perf.fuse_grad_accumulation): the linear layers' weight gradients go
    into the masters from their own backward (the copies get none); on a CPU by the same bf16
    product and fp32 add, so bit for bit too (on CUDA the sum happens inside the matmul)."""
    from colo_rl.trainer.precision import compute_copies

    model_dir = write_embedded_model(ModelConfig(), tmp_path / "model")
    emulated = load_policy(ModelConfig(), model_dir, "cpu")
    if scope == "all":
        for name, p in emulated.named_parameters():
            if not name.startswith("lm_head."):
                p.data = p.data.to(torch.bfloat16)
    expected = summed_in_fp32(emulated, checkpointing)

    model = load_policy(ModelConfig(), model_dir, "cpu")
    masters = dict(model.named_parameters())
    with compute_copies(model, torch.bfloat16, scope, fuse_accumulation=fuse):
        computed_in = {n: p.dtype for n, p in model.named_parameters()}
        copies_with_grad = {n for n, p in model.named_parameters() if p.requires_grad}
        backward_each(model, checkpointing)
    assert all(p is masters[n] for n, p in model.named_parameters())
    assert all("forward" not in m.__dict__ for m in model.modules())  # nn.Linear's own forward again
    linears = {n for n in masters if ".layers." in n and n.endswith("proj.weight")}
    assert not (linears & copies_with_grad) if fuse else linears <= copies_with_grad
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in masters.values())
    assert {n for n, d in computed_in.items() if d == torch.bfloat16} == (
        {n for n in masters if ".layers." in n and n.endswith("proj.weight")} if scope == "matmul"
        else {n for n in masters if not n.startswith("lm_head.")})
    assert expected.keys() == masters.keys()
    for name, grad in expected.items():
        assert torch.equal(masters[name].grad, grad), name


def test_weight_copies_are_made_only_where_nothing_else_holds_the_parameters():
    from colo_rl.trainer.precision import weight_copies

    assert weight_copies(True, False, compile=False, lora=False, fp32_activations=True) == "matmul"
    assert weight_copies(True, False, compile=False, lora=False, fp32_activations=False) == "all"
    assert weight_copies(False, False, compile=False, lora=False, fp32_activations=False) is None  # no autocast
    assert weight_copies(True, False, compile=True, lora=False, fp32_activations=True) is None  # compiled graphs
    assert weight_copies(True, False, compile=False, lora=True, fp32_activations=True) is None  # peft's adapters
    assert weight_copies(True, True, compile=False, lora=False, fp32_activations=True) is None  # DDP/FSDP hooks
