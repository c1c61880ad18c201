"""The start-up memory plan (colo_rl.planner): its arithmetic on known shapes, the choice of
trainer.memory.offload=auto as the free memory shrinks, and the refusal of a config that cannot fit."""

from __future__ import annotations

import pytest
import torch

from colo_rl.config import ConfigError, validate
from colo_rl.planner import GIB, Shape, free_awake, plan_memory, sequence_length, sizes

from .conftest import compose_config

H200 = 143771 * 2**20  # torch.cuda.mem_get_info's total on the lent H200
# benchmarks/peer_workload.py's workload: 128-token prompts + 256 new tokens, micro-batch 16
PEER = ["model=olmo2_1b_shape", "trainer.perf.logprob_chunk=0", "trainer.prompts_per_step=32", "sampling.n=8", "sampling.max_tokens=256",
        "trainer.micro_batch_size=16", "generator.max_model_len=512", "task.max_prompt_tokens=128",
        "generator.gpu_memory_utilization=0.5"]


def built_numel(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # tied parameters are yielded once


@pytest.mark.parametrize("make", [
    lambda: __import__("transformers").Olmo2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                                   tie_word_embeddings=False),
    lambda: __import__("transformers").Olmo2Config(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                                   num_attention_heads=16, num_key_value_heads=16,
                                                   vocab_size=100352, tie_word_embeddings=False),
    lambda: __import__("transformers").Olmo2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=300,
                                                   tie_word_embeddings=False),
    lambda: __import__("transformers").Qwen2Config(hidden_size=192, intermediate_size=400, num_hidden_layers=2,
                                                   num_attention_heads=6, num_key_value_heads=2, vocab_size=500,
                                                   tie_word_embeddings=True),
    lambda: __import__("transformers").LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=1, vocab_size=200,
                                                   attention_bias=True, mlp_bias=True),
], ids=["olmo2_tiny", "olmo2_1b_shape", "olmo2_gqa", "qwen2_tied", "llama_biases"])
def test_parameter_count_from_the_config_equals_the_built_models(make):
    config = make()
    assert Shape.from_hf_config(config).parameters() == built_numel(config)


def test_the_1b_shape_has_1_48_billion_parameters_and_lora_counts_peft_adapters(tmp_path):
    from transformers import Olmo2Config

    from colo_rl.config import LoraConfig
    from colo_rl.lora import apply_lora
    from colo_rl.models import load_policy

    settings = validate(compose_config(*PEER))
    e = settings.model.embedded
    shape = Shape.from_hf_config(Olmo2Config(
        hidden_size=e.hidden_size, intermediate_size=e.intermediate_size, num_hidden_layers=e.num_hidden_layers,
        num_attention_heads=e.num_attention_heads, num_key_value_heads=e.num_key_value_heads,
        vocab_size=e.vocab_size, tie_word_embeddings=False))
    assert round(shape.parameters() / 1e9, 2) == 1.48
    # LoRA: the adapters' count matches peft's on the tiny model, all layers and two of them
    from colo_rl.models import prepare_model_dir

    tiny = validate(compose_config())
    model_dir = prepare_model_dir(tiny.model, tmp_path)
    tiny_shape = Shape.from_model_dir(model_dir)
    for targets in ([], ["q_proj", "mlp.down_proj"]):
        model = apply_lora(load_policy(tiny.model, model_dir, "cpu"), LoraConfig(rank=4, target_modules=targets),
                           adapter_dtype=torch.float32)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert tiny_shape.lora_parameters(4, targets) == trainable


def test_bytes_per_component_for_fp32_masters_8bit_adam_and_lora():
    shape = Shape.from_hf_config(__import__("transformers").Olmo2Config(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=100352, tie_word_embeddings=False))
    n = shape.parameters()
    mixed = sizes(validate(compose_config(*PEER)), shape, 384, cuda=True)
    assert (mixed.weights, mixed.grads, mixed.optimizer) == (4 * n, 4 * n, 8 * n)  # 16 bytes / parameter
    assert mixed.push_copy == mixed.autocast == mixed.engine_weights == 2 * n  # bf16 copies of the masters
    eight = sizes(validate(compose_config(*PEER, "trainer.optim.name=adamw_8bit")), shape, 384, cuda=True)
    assert (eight.weights, eight.grads, eight.optimizer) == (4 * n, 4 * n, 2 * n)
    pure = sizes(validate(compose_config(*PEER, "trainer.memory.precision=pure")), shape, 384, cuda=True)
    assert (pure.weights, pure.grads, pure.optimizer, pure.push_copy, pure.autocast) == (2 * n, 2 * n, 4 * n, 0, 0)
    lora = sizes(validate(compose_config(*PEER, "trainer.lora.rank=16")), shape, 384, cuda=True)
    a = shape.lora_parameters(16, [])
    assert a == 16 * 16 * (4 * (2048 + 2048) + 3 * (2048 + 8192))
    assert (lora.weights, lora.grads, lora.optimizer) == (2 * n + 4 * a, 4 * a, 8 * a)  # bf16 base, fp32 adapters
    kl = sizes(validate(compose_config(*PEER, "trainer.algo.kl_coef=0.1")), shape, 384, cuda=True)
    assert kl.reference == 4 * n and mixed.reference == 0
    # logits: 16 x 384 tokens x 100352 vocab in fp32 are 2.3 GiB a copy; checkpointing keeps them
    assert mixed.activations > sizes(validate(compose_config(*PEER, "trainer.memory.gradient_checkpointing=true")),
                                     shape, 384, cuda=True).activations > 1.25 * 16 * 384 * 100352 * 4
    # the default chunked head (trainer.perf.logprob_chunk=1024): one chunk's logits instead of all of them
    chunked = sizes(validate(compose_config(*PEER, "trainer.perf.logprob_chunk=1024")), shape, 384, cuda=True)
    saved = 1.25 * 16 * 384 * 100352 * 4 - (2 * 1024 * 100352 * 4 + 16 * 256 * 2048 * 2)
    assert mixed.activations - chunked.activations == pytest.approx(saved)


@pytest.mark.parametrize("checkpointing, measured", [(False, 45.8), (True, 29.2)])
def test_trainer_peak_matches_the_h200_measurements(checkpointing, measured):
    """benchmarks/RESULTS.md (2026-12-04, runs Q and R): torch's trainer peak on the peer workload."""
    settings = validate(compose_config(*PEER, f"trainer.memory.gradient_checkpointing={checkpointing}"))
    shape = Shape.from_hf_config(__import__("transformers").Olmo2Config(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=100352, tie_word_embeddings=False))
    assert sequence_length(settings) == 384
    plan = plan_memory(settings, shape, 384, (H200 - 2 * GIB, H200))
    assert plan.predicted["trainer_peak"] == pytest.approx(measured, rel=0.03)


@pytest.mark.parametrize("micro_batch, measured", [(16, 35.99), (32, 45.48)])
def test_liger_kernels_trainer_peak_matches_the_h100_measurements(micro_batch, measured):
    """benchmarks/RESULTS.md (H100, 2026-12-06c): the peer workload's trainer peak with
    trainer.perf.kernels=liger (resolved by the run before the plan) at micro-batches of 16 and 32;
    `auto` not yet resolved plans as the eager model (the larger)."""
    settings, shape = one_b(f"trainer.micro_batch_size={micro_batch}", "trainer.perf.kernels=liger", "trainer.perf.logprob_chunk=1024")
    liger = sizes(settings, shape, 384, cuda=True).trainer_peak() / GIB
    assert liger == pytest.approx(measured, rel=0.03)
    eager = sizes(one_b(f"trainer.micro_batch_size={micro_batch}", "trainer.perf.kernels=auto", "trainer.perf.logprob_chunk=1024")[0], shape, 384,
                  cuda=True).trainer_peak() / GIB
    assert eager > liger + 5
    assert sizes(settings, shape, 384, cuda=False).trainer_peak() > sizes(settings, shape, 384, cuda=True).trainer_peak()


@pytest.mark.parametrize("micro_batch, measured", [(16, 35.19), (32, 43.50)])
def test_bf16_activations_trainer_peak_matches_the_h100_measurements(micro_batch, measured):
    """benchmarks/RESULTS.md (H100, 2026-12-06e): trainer.memory.fp32_activations=false with Liger's
    kernels, the peer workload's trainer peak (autocast's: 35.99 and 45.48 GiB); where the weights
    are not copied (LoRA, DDP, compiled layers) the activations stay autocast's."""
    overrides = (f"trainer.micro_batch_size={micro_batch}", "trainer.perf.kernels=liger", "trainer.perf.logprob_chunk=1024")
    settings, shape = one_b(*overrides, "trainer.memory.fp32_activations=false")
    bf16 = sizes(settings, shape, 384, cuda=True).trainer_peak() / GIB
    assert bf16 == pytest.approx(measured, rel=0.03)
    fp32 = sizes(one_b(*overrides)[0], shape, 384, cuda=True)
    assert fp32.trainer_peak() / GIB > bf16 + 0.5
    ddp = sizes(one_b(*overrides, "trainer.memory.fp32_activations=false", "trainer.parallel=ddp")[0], shape, 384, cuda=True)
    assert ddp.activations == fp32.activations


def test_keeping_the_heads_logits_adds_them_to_the_plan():
    """trainer.memory.logprob_recompute=false: every response position's logits (micro-batch x max_tokens x
    vocab, bf16 under mixed precision) stay from forward to backward; the plan counts them."""
    overrides = ("trainer.micro_batch_size=32", "trainer.perf.kernels=liger", "trainer.perf.logprob_chunk=4096")
    settings, shape = one_b(*overrides)
    kept, _ = one_b(*overrides, "trainer.memory.logprob_recompute=false")
    extra = sizes(kept, shape, 384, cuda=True).activations - sizes(settings, shape, 384, cuda=True).activations
    assert extra == 32 * 256 * 100352 * 2


H100 = 81079 * 2**20  # torch.cuda.mem_get_info's total on the lent H100 (79.2 GiB)


def test_the_awake_phase_matches_the_h100_measurements():
    """benchmarks/RESULTS.md (H100, 2026-12-05): run U (1B shape, fp32 masters + AdamW, 78.7 GiB
    free, offload=auto -> none, utilization 0.5) measured 17.32 GiB free with the engine awake; run W
    (LoRA r16 on an emulated 24 GiB card, 23.97 GiB free, offload all, utilization 0.248) 0.98 GiB."""
    settings, shape = one_b("trainer.perf.logprob_chunk=1024")
    plan = plan_memory(settings, shape, 384, (int(78.68 * GIB), H100))
    assert (plan.offload, plan.gpu_memory_utilization) == ("none", 0.5)
    # never more than was there, within 5 %
    assert 17.32 * 0.95 <= plan.predicted["free_after_wake_kv"] <= 17.32
    lora, _ = one_b("trainer.lora.rank=16", "trainer.memory.gradient_checkpointing=true", "trainer.micro_batch_size=8")
    resident = sizes(lora, shape, 384, cuda=True).awake_resident("all")
    predicted = free_awake(23.97 * GIB, H100, resident, 0.248) / GIB
    assert 0.98 - 0.6 <= predicted <= 0.98
    # that run left less than the margin free: the plan now gives the engine less on that card
    auto, _ = one_b("trainer.lora.rank=16", "trainer.memory.gradient_checkpointing=true", "trainer.micro_batch_size=8",
                    "generator.gpu_memory_utilization=auto")
    planned = plan_memory(auto, shape, 384, (int(23.97 * GIB), H100))
    assert planned.offload == "all" and planned.gpu_memory_utilization < 0.248
    assert planned.predicted["free_after_wake_kv"] >= planned.margin_gib - 0.01


def one_b(*overrides):
    settings = validate(compose_config(*PEER, *overrides))
    shape = Shape.from_hf_config(__import__("transformers").Olmo2Config(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=100352, tie_word_embeddings=False))
    return settings, shape


def test_offload_auto_keeps_on_the_gpu_what_fits_beside_the_awake_engine():
    settings, shape = one_b()
    assert settings.trainer.memory.offload == "auto"
    chosen = {}
    for free_gib in (138, 100, 90, 80):
        plan = plan_memory(settings, shape, 384, (int(free_gib * GIB), H200))
        chosen[free_gib] = plan.offload
        assert plan.gpu_memory_utilization == 0.5  # fixed: the engine keeps its 70 GiB
    # the whole H200: trainer state (16.5 GiB) beside the engine; less free memory: first the
    # optimizer state (11 GiB) leaves, then the weights too
    assert chosen == {138: "none", 100: "none", 90: "optimizer", 80: "all"}
    table = plan_memory(settings, shape, 384, (138 * GIB, H200)).table()
    assert "trainer.memory.offload -> none" in table and "activations (16 x 384 tokens)" in table
    assert "optimizer state (adamw)" in table and "engine asleep" in table


def test_by_default_the_engine_gets_the_kv_cache_of_one_step_not_half_the_card():
    # the peer run on the H200 (RESULTS.md, 2026-12-06) woke and slept a 67 GiB KV cache every step
    # (0.16 s of its 0.40 s switch) for 256 sequences of at most 512 tokens: 16 GiB
    settings = validate(compose_config(*[o for o in PEER if "gpu_memory_utilization" not in o]))
    assert settings.generator.gpu_memory_utilization == "auto"
    _, shape = one_b()
    plan = plan_memory(settings, shape, 384, (138 * GIB, H200))
    kv = next(c for c in plan.components if c.name == "engine KV cache").bytes
    need = 256 * 512 * 128 * 2**10  # (the budget is rounded down to vLLM's 0.001 steps)
    assert 0.99 * need <= kv < 1.1 * need
    assert plan.gpu_memory_utilization < 0.2 and plan.offload == "none"
    assert plan_memory(settings, shape, 384, None).gpu_memory_utilization == 0.5  # a CPU run: as before


def test_torch_cache_is_kept_where_the_engine_wakes_beside_it():
    # the H200's peer run emptied torch's cache twice a step (0.046 s of its 0.40 s switch) and
    # allocated it again in the next train step; with the engine's budget at auto both fit
    settings = validate(compose_config(*[o for o in PEER if "gpu_memory_utilization" not in o],
                                       "trainer.memory.keep_cache=true"))
    _, shape = one_b()
    rich = plan_memory(settings, shape, 384, (138 * GIB, H200))
    # by default (trainer.memory.keep_cache=false) the cache is emptied: the device peak stays lower
    lean = plan_memory(validate(compose_config(*[o for o in PEER if "gpu_memory_utilization" not in o])),
                       shape, 384, (138 * GIB, H200))
    assert not [c for c in lean.components if c.name.startswith("trainer allocator cache")]
    assert lean.engine_wake_bytes == 0  # the Offloader always empties it
    assert lean.predicted["free_after_wake_kv"] > rich.predicted["free_after_wake_kv"] + 30
    kept = [c for c in rich.components if c.name.startswith("trainer allocator cache")]
    assert kept and rich.offload == "none"
    cached = sizes(settings, shape, 384, cuda=True).trainer_peak() * 1.09
    awake = rich.gpu_memory_utilization * H200 + 2.9 * GIB
    assert rich.predicted["free_after_wake_kv"] == pytest.approx((138 * GIB - 1 * GIB - cached - awake) / GIB, abs=0.01)
    assert rich.engine_wake_bytes == pytest.approx(awake + 1 * GIB)
    # the engine at half the card on 80 GiB: no room for the cache, it is emptied as before
    tight, _ = one_b("trainer.memory.keep_cache=true")
    plan = plan_memory(tight, shape, 384, (80 * GIB, H200))
    assert plan.offload == "all" and not [c for c in plan.components if c.name.startswith("trainer allocator cache")]
    assert plan.engine_wake_bytes > 0  # the Offloader still checks, with the free memory it measures


def test_auto_kv_budget_shrinks_with_the_free_memory_and_offload_grows():
    settings, shape = one_b("generator.gpu_memory_utilization=auto")
    rich = plan_memory(settings, shape, 384, (138 * GIB, H200))
    # every sequence of a step (256) at 512 tokens: 16 GiB of KV cache (128 KiB a token) + 2.76 GiB
    # of bf16 weights + 1.19 GiB asleep + 1 GiB for vLLM's activations, of 140.4 GiB
    assert rich.offload == "none" and rich.gpu_memory_utilization == pytest.approx(0.149, abs=0.002)
    # the trainer's 45.8 GiB training peak needs more than the awake phase does: none all the way down
    assert plan_memory(settings, shape, 384, (52 * GIB, H200)).offload == "none"
    # long sequences: 256 x 2048 tokens of KV cache (64 GiB) make the awake phase the larger one
    long, _ = one_b("generator.gpu_memory_utilization=auto", "generator.max_model_len=2048")
    plans = {free: plan_memory(long, shape, 384, (free * GIB, H200)) for free in (138, 90, 75, 60)}
    assert {free: p.offload for free, p in plans.items()} == {138: "none", 90: "optimizer", 75: "all", 60: "all"}
    want = plans[138].gpu_memory_utilization
    assert plans[90].gpu_memory_utilization == want
    # at 75 GiB the room beside the margin and what the awake engine holds beyond its budget (and,
    # nearly as tight, vLLM's start beside the 5.5 GiB of fp32 masters) caps the budget a little
    assert want - 0.02 < plans[75].gpu_memory_utilization < want
    assert plans[60].gpu_memory_utilization < plans[75].gpu_memory_utilization  # the rest of the card
    kv = next(c for c in plans[60].components if c.name == "engine KV cache").bytes
    assert 2048 * 128 * 2**10 < kv < next(c for c in plans[138].components if c.name == "engine KV cache").bytes
    for p in plans.values():
        assert p.predicted["free_after_wake_kv"] >= p.margin_gib - 0.01


def test_a_config_that_cannot_fit_is_refused_naming_the_key_and_what_fits():
    settings, shape = one_b()
    # 80 GiB free and the engine asked for 70: fits only with offload; forcing none is refused
    forced, _ = one_b("trainer.memory.offload=none")
    with pytest.raises(ConfigError, match=r"generator.gpu_memory_utilization=0.5 gives the engine 70.2 GiB.*"
                                          r"use generator.gpu_memory_utilization=0\.\d+ or auto, or trainer.memory.offload=auto"):
        plan_memory(forced, shape, 384, (80 * GIB, H200))
    # vLLM takes its 70.2 GiB at its start, beside the trainer's 5.5 GiB of weights: 72 GiB is too little
    with pytest.raises(ConfigError, match=r"generator.gpu_memory_utilization=0.5 asks vLLM for 70.2 GiB when it "
                                          r"starts, .* use generator.gpu_memory_utilization=0.45\d or auto"):
        plan_memory(settings, shape, 384, (72 * GIB, H200))
    # a 24 GiB card: training alone needs ~46 GiB
    with pytest.raises(ConfigError) as refused:
        plan_memory(settings, shape, 384, (24 * GIB, H200))
    message = str(refused.value)
    assert "the trainer needs ~45.8 GiB while training" in message
    assert "use trainer.optim.name=adamw_8bit" in message  # no micro-batch or checkpointing is enough
    # a micro-batch that is too large for a card that holds the state: the largest that fits
    with pytest.raises(ConfigError, match=r"trainer.micro_batch_size=16 needs ~20.9 GiB of activations; (\d+) fits") as mb:
        plan_memory(settings, shape, 384, (40 * GIB, H200))
    fits = int(mb.value.args[0].rsplit("; ", 1)[1].split()[0])
    ok, _ = one_b(f"trainer.micro_batch_size={fits}", "generator.gpu_memory_utilization=auto")
    assert plan_memory(ok, shape, 384, (40 * GIB, H200)).offload in ("none", "optimizer")
    too_many, _ = one_b(f"trainer.micro_batch_size={fits + 1}", "generator.gpu_memory_utilization=auto")
    with pytest.raises(ConfigError):
        plan_memory(too_many, shape, 384, (40 * GIB, H200))


def test_auto_micro_batch_is_the_largest_that_fits_beside_the_sleeping_engine():
    """trainer.micro_batch_size=auto (the default): the plan takes the largest of 32, 16, 8, 4, 2, 1
    whose trainer peak fits the training room (the same room whose overflow it refuses), with 15 %
    of the activations' estimate to spare."""
    from colo_rl.config import AUTO_MICRO_BATCHES

    real = ("trainer.perf.kernels=liger", "trainer.perf.logprob_chunk=1024", "generator.gpu_memory_utilization=auto",
            "trainer.memory.logprob_recompute=true")  # on a GPU; the logits kept or not: the next test
    settings, shape = one_b("trainer.micro_batch_size=auto", *real)
    assert validate(compose_config()).trainer.micro_batch_size == "auto"  # the default
    # the H100 of the 1B peer runs (78.68 GiB free): 32, measured there at 44.7 GiB of trainer peak
    # (RESULTS.md, 2026-12-06f, activations.sh's fp32 arm; planned 46.6)
    plan = plan_memory(settings, shape, 384, (int(78.68 * GIB), H100))
    assert plan.micro_batch_size == 32 and "trainer.micro_batch_size -> 32" in plan.table()
    assert "activations (32 x 384 tokens)" in plan.table()
    assert plan.predicted["trainer_peak"] == pytest.approx(sizes(settings, shape, 384, cuda=True, micro_batch=32)
                                                          .trainer_peak() / GIB)
    # less free memory: smaller, and each choice is the largest that an explicit setting would be
    # planned with (the next larger one is refused)
    chosen = {}
    for free_gib in (45, 36, 34, 32, 30):
        b = plan_memory(settings, shape, 384, (free_gib * GIB, H200)).micro_batch_size
        chosen[free_gib] = b
        plan_memory(one_b(f"trainer.micro_batch_size={b}", *real)[0], shape, 384, (free_gib * GIB, H200))
        larger = AUTO_MICRO_BATCHES[AUTO_MICRO_BATCHES.index(b) - 1]
        with pytest.raises(ConfigError, match=f"trainer.micro_batch_size={larger} needs"):
            plan_memory(one_b(f"trainer.micro_batch_size={larger}", *real)[0], shape, 384, (free_gib * GIB, H200))
    assert chosen == {45: 16, 36: 8, 34: 4, 32: 2, 30: 1}
    # auto keeps 15 % of its choice's activations free on top of the estimate: 52.3 GiB free takes
    # micro-batch 32 given by hand, but auto, at the estimate's edge there, takes 16
    edge = (int(52.3 * GIB), H200)
    assert plan_memory(one_b("trainer.micro_batch_size=32", *real)[0], shape, 384, edge).micro_batch_size == 32
    assert plan_memory(settings, shape, 384, edge).micro_batch_size == 16
    # never more than a step's sequences
    few, _ = one_b("trainer.micro_batch_size=auto", "trainer.prompts_per_step=3", "sampling.n=4", *real)
    assert plan_memory(few, shape, 384, (int(78.68 * GIB), H100)).micro_batch_size == 12
    # not even one sequence fits: refused, saying so and what would help
    with pytest.raises(ConfigError, match=r"at micro-batch 1, the least trainer.micro_batch_size=auto tries.*"
                                          r"use trainer.memory.gradient_checkpointing=true$"):
        plan_memory(settings, shape, 384, (29 * GIB, H200))
    # nothing planned: 16, as before auto (the CPU; DDP/FSDP, whose ranks must agree)
    assert plan_memory(settings, shape, 384, None).micro_batch_size == 16
    ddp, _ = one_b("trainer.micro_batch_size=auto", "trainer.parallel=ddp", *real)
    assert plan_memory(ddp, shape, 384, (int(78.68 * GIB), H100)).micro_batch_size == 16
    # an explicit size is kept
    assert plan_memory(one_b(*real)[0], shape, 384, (int(78.68 * GIB), H100)).micro_batch_size == 16


def test_auto_keeps_the_heads_logits_where_they_fit_after_the_micro_batch():
    """trainer.memory.logprob_recompute=auto (the default): after the micro-batch is chosen, the plan keeps
    the head's logits for backward (false) where the trainer's peak with them, with 15 % of the
    activations to spare, still fits the training room; else recomputes them (true). Given by
    hand: as given. Nothing planned (CPU, DDP): true."""
    from colo_rl.planner import _training_room

    real = ("trainer.perf.kernels=liger", "trainer.perf.logprob_chunk=1024", "generator.gpu_memory_utilization=auto",
            "trainer.micro_batch_size=auto")
    settings, shape = one_b(*real)
    assert validate(compose_config()).trainer.memory.logprob_recompute == "auto"  # the default
    plan = plan_memory(settings, shape, 384, (int(78.68 * GIB), H100))  # the H100 of the peer runs
    assert plan.micro_batch_size == 32 and plan.logprob_recompute is False
    assert "trainer.memory.logprob_recompute -> false" in plan.table() and "head's logits kept" in plan.table()
    kept = sizes(settings, shape, 384, cuda=True, micro_batch=32, recompute=False)
    recomputed = sizes(settings, shape, 384, cuda=True, micro_batch=32, recompute=True)
    assert kept.activations - recomputed.activations == 32 * 256 * 100352 * 2
    assert plan.predicted["trainer_peak"] == pytest.approx(kept.trainer_peak() / GIB)
    # the micro-batch comes first: on a card where 32 fits only with the logits recomputed, 32 and true
    plans = {f: plan_memory(settings, shape, 384, (int(f * GIB), H100)) for f in (x / 4 for x in range(180, 300))}
    edge = [f for f, p in plans.items() if p.micro_batch_size == 32 and p.logprob_recompute]
    assert edge
    for f in edge:
        room = _training_room(int(f * GIB), True)
        assert kept.trainer_peak() + 0.15 * kept.activations > room
        assert plans[f].predicted["trainer_peak"] == pytest.approx(recomputed.trainer_peak() / GIB)
    assert all(not p.logprob_recompute for f, p in plans.items() if f > max(edge) + 1)
    # given by hand: as given; nothing planned: recomputed
    given = one_b(*real, "trainer.memory.logprob_recompute=false")[0]
    assert plan_memory(given, shape, 384, (int(edge[0] * GIB), H100)).logprob_recompute is False
    assert plan_memory(settings, shape, 384, None).logprob_recompute is True
    ddp = one_b(*real, "trainer.parallel=ddp")[0]
    assert plan_memory(ddp, shape, 384, (int(78.68 * GIB), H100)).logprob_recompute is True
    with pytest.raises(ConfigError, match="trainer.memory.logprob_recompute"):
        validate(compose_config("trainer.memory.logprob_recompute=sometimes"))


def test_on_the_cpu_auto_offloads_everything_as_before_and_the_table_prints(tmp_path, capsys):
    from colo_rl.models import prepare_model_dir
    from colo_rl.planner import plan_run

    settings = validate(compose_config("generator.gpu_memory_utilization=auto"))
    plan = plan_run(settings, prepare_model_dir(settings.model, tmp_path), "cpu")
    assert plan.offload == settings.trainer.memory.offload == "all"
    assert settings.generator.gpu_memory_utilization == 0.5
    assert plan.micro_batch_size == settings.trainer.micro_batch_size == 16  # auto, resolved in the settings
    assert plan.metrics() == {}  # nothing measured on the CPU, nothing predicted
    out = capsys.readouterr().out
    assert "memory plan (CPU run" in out and "trainer.memory.offload -> all" in out


def test_config_accepts_auto_and_refuses_other_words():
    assert validate(compose_config("generator.gpu_memory_utilization=auto")).generator.gpu_memory_utilization == "auto"
    with pytest.raises(ConfigError, match=r"generator.gpu_memory_utilization='most' must be in \(0, 1\] or auto"):
        validate(compose_config("generator.gpu_memory_utilization=most"))
    assert validate(compose_config("trainer.parallel=fsdp")).trainer.memory.offload == "none"
    assert validate(compose_config("trainer.micro_batch_size=8")).trainer.micro_batch_size == 8
    for word in ("half", "0", "1.5", "true"):
        with pytest.raises(ConfigError, match=rf"trainer.micro_batch_size=.* must be >= 1 or auto"):
            validate(compose_config(f"trainer.micro_batch_size={word}"))


def test_the_summary_shows_predicted_beside_measured(tmp_path, capsys):
    from colo_rl.metrics import predicted_vs_measured, print_summary

    records = [{"train/step": i, "reward/mean": 0.5, "timing/step_s": 1.0, "timing/generate_s": 0.5,
                "memory/trainer_peak_gib": peak, "memory/free_after_wake_kv_gib": free}
               for i, (peak, free) in enumerate([(44.0, 52.0), (46.0, 49.0)])]
    records[0].update({"memory/trainer_peak_predicted_gib": 45.76, "memory/free_after_wake_kv_predicted_gib": 50.7})
    assert predicted_vs_measured(records) == [("memory/trainer_peak_gib", 45.76, 46.0),
                                              ("memory/free_after_wake_kv_gib", 50.7, 49.0)]
    print_summary(records, tmp_path)
    out = capsys.readouterr().out
    assert "trainer_peak " in out and "free_after_wake_kv " in out and "45.76" in out and "46.00" in out and "1.01" in out
    # a CPU run logs neither: no memory table
    print_summary([{k: v for k, v in r.items() if not k.startswith("memory/")} for r in records], tmp_path)
    assert "predicted" not in capsys.readouterr().out


def test_an_engine_on_the_cpu_leaves_the_gpu_to_the_trainer():
    settings, shape = one_b("generator.gpu_memory_utilization=auto")
    plan = plan_memory(settings, shape, 384, (60 * GIB, H200), engine_on_device=False)
    assert plan.offload == "none" and "engine KV cache" not in plan.table()
    with pytest.raises(ConfigError, match="trainer.optim.name=adamw_8bit"):
        plan_memory(settings, shape, 384, (24 * GIB, H200), engine_on_device=False)


def test_a_model_the_planner_cannot_read_runs_unplanned_as_before(tmp_path, caplog):
    import json

    from colo_rl.models import prepare_model_dir
    from colo_rl.planner import plan_run

    settings = validate(compose_config("generator.gpu_memory_utilization=auto"))
    model_dir = prepare_model_dir(settings.model, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "mixtral", "num_local_experts": 8}))
    plan = plan_run(settings, model_dir, "cuda:0", memory=(24 * GIB, H200))
    assert (plan.offload, settings.trainer.memory.offload, settings.generator.gpu_memory_utilization) == ("all", "all", 0.5)
    assert settings.trainer.micro_batch_size == plan.micro_batch_size == 16
    assert "no memory plan" in caplog.text and plan.metrics() == {}
