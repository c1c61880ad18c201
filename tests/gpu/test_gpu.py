"""The colocation claims on a real GPU (issue #6): a sleeping engine frees the GPU, wake/sleep
cycles do not leak, both weight-sync paths give the engine the trainer's exact weights, the
offload/restore cycle through the generator is bit-exact, and short GRPO runs finish.

Everything here is real: a CUDA vLLM engine in its subprocess, the trainer on the same GPU,
Hydra-composed runs. Run it on the lent H200 (benchmarks/README.md). One engine start takes about
a minute there, so the fp32 and bf16 engines are module-scoped and each serves both weight-sync
modes: the mode is chosen per step (`VLLMGenerator.weight_sync`), not at engine start.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from colo_rl.config import EmbeddedModelConfig, GeneratorConfig, ModelConfig, SamplingConfig, TrainerConfig
from colo_rl.generator import VLLMGenerator
from colo_rl.models import load_policy, write_embedded_model
from colo_rl.run import train
from colo_rl.switch import Switch
from colo_rl.trainer import GRPOTrainer, Offloader
from tests.configs import trainer_config

from ..conftest import compose_config, engine_processes, small_run_overrides
from ..trainer.test_offload import state_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU and vLLM built for it; run on the lent H200: "
                              "see benchmarks/README.md"),
]

GIB = 2**30
SYNC_MODES = ["cuda_ipc", "file"]
# Small enough that an engine starts fast, large enough to exercise packed q/k/v and several
# layers; head_dim 64 (vLLM's kernels want 64 or 128).
SMALL = EmbeddedModelConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=8, vocab_size=64)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [20, 21, 22, 23, 24], [30, 31]]
GREEDY = SamplingConfig(n=1, temperature=0.0, max_tokens=16)
SAMPLED = SamplingConfig(n=4, temperature=1.0, max_tokens=32)
# Engine and trainer sum fp32 products in different orders (the worker makes vLLM's Triton attention
# multiply in full fp32, not TF32: generator.worker.exact_fp32_dots), so a greedy pick may differ
# where the top two logits are closer than this; anywhere else a differing token means different weights.
NEAR_TIE = 1e-3
FP32_LOGPROB_TOL = 1e-2  # max |engine - trainer| with fp32 weights
BF16_LOGPROB_TOL = 0.05  # mean |engine - trainer| with bf16 weights (different kernels round differently)
ASLEEP_MAX_GIB = 1.0  # what the sleeping engine may keep (CUDA context, graph pools)
LEAK_MAX_GIB = 0.25


def free_gib() -> float:
    """Free GPU memory as the driver sees it, after this process hands back its cached blocks."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0] / GIB


def new_trainer(model_dir: Path, dtype: str) -> GRPOTrainer:
    """A GRPO trainer on the GPU after one step, so that AdamW state exists to be offloaded."""
    model = load_policy(ModelConfig(dtype=dtype, embedded=SMALL), model_dir, "cuda")
    # Hugging Face's own layers (no Liger): the reference the engine's log-probs are held to
    trainer = GRPOTrainer(model, trainer_config(kernels="none"), pad_token_id=0, temperature=1.0,
                          max_tokens=SAMPLED.max_tokens, device="cuda")
    # The math attention kernel's backward is deterministic, so two trainers can be compared bit for bit.
    with sdpa_kernel(SDPBackend.MATH):
        trainer.train_step(PROMPTS[:2], [[12, 13, 2], [14], [15, 16, 17], [18, 2]], [1.0, 0.0, 0.0, 1.0], 2)
    return trainer


@dataclass
class Colocated:
    """One engine and one trainer sharing the GPU, as in a run."""

    generator: VLLMGenerator
    trainer: GRPOTrainer
    offloader: Offloader
    model_dir: Path
    free_before_start_gib: float  # trainer state on the GPU, no engine yet

    def using(self, sync_mode: str) -> VLLMGenerator:
        self.generator.weight_sync = sync_mode
        return self.generator

    def cycle(self, sync_mode: str, sampling: SamplingConfig = GREEDY, seed: int = 0):
        """One generate step with the trainer's state offloaded and restored around it."""
        return Switch(self.using(sync_mode), self.trainer.model, self.offloader).generate(PROMPTS, sampling,
                                                                                         seed=seed)


def colocated(tmp_path_factory, dtype: str):
    model_dir = write_embedded_model(ModelConfig(dtype=dtype, embedded=SMALL),
                                     tmp_path_factory.mktemp(f"model_{dtype}"))
    trainer = new_trainer(model_dir, dtype)
    offloader = Offloader(trainer.model, trainer.optimizer, "all")
    free_before = free_gib()
    generator = VLLMGenerator(GeneratorConfig(weight_sync="cuda_ipc", gpu_memory_utilization=0.3),
                              model_dir=model_dir, dtype=dtype,
                              log_dir=tmp_path_factory.mktemp(f"engine_{dtype}"))
    pair = Colocated(generator, trainer, offloader, model_dir, free_before)
    pair.cycle("cuda_ipc")  # starts the engine; it is asleep when this returns
    yield pair
    generator.close()


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    yield from colocated(tmp_path_factory, "float32")


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    yield from colocated(tmp_path_factory, "bfloat16")


def trainer_view(model, prompt: list[int], completion: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 logits predicting each completion token, log-probs of those tokens) under `model`,
    teacher-forced on the engine's tokens."""
    ids = torch.tensor([prompt + completion], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(completion)].float()
    picked = torch.tensor(completion, device="cuda").unsqueeze(-1)
    return logits, logits.log_softmax(-1).gather(-1, picked).squeeze(-1)


def assert_greedy_matches(model, rollouts) -> None:
    """Every engine token is the trainer's argmax (except at a near-tie) and its log-prob agrees."""
    for prompt, tokens, engine_logprobs in zip(PROMPTS, rollouts.completion_ids, rollouts.logprobs):
        assert len(tokens) == GREEDY.max_tokens or tokens[-1] == 2, tokens  # full length or EOS
        logits, logprobs = trainer_view(model, prompt, tokens)
        top = logits.topk(2, dim=-1)
        gap = top.values[:, 0] - top.values[:, 1]
        wrong = [(i, t, int(top.indices[i, 0]), float(gap[i])) for i, t in enumerate(tokens)
                 if t != int(top.indices[i, 0]) and gap[i] > NEAR_TIE]
        assert not wrong, f"prompt {prompt}: (position, engine token, trainer argmax, logit gap) {wrong}"
        diff = (logprobs - torch.tensor(engine_logprobs, device="cuda")).abs().max().item()
        assert diff < FP32_LOGPROB_TOL, f"prompt {prompt}: engine vs trainer log-prob differ by {diff:.2e}"


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * 0.5)
    return other


@pytest.mark.parametrize("sync_mode", SYNC_MODES)
def test_a_sleeping_engine_holds_under_1_gib(fp32, sync_mode):
    m = fp32.cycle(sync_mode).metrics
    total = torch.cuda.mem_get_info()[1] / GIB
    assert m["generator/sleep_skipped"] == 0.0
    awake = fp32.free_before_start_gib - m["memory/free_after_wake_kv_gib"]
    assert awake > 0.2 * total, f"the awake engine took only {awake:.1f} GiB of {total:.0f}: did it wake?"
    held = fp32.free_before_start_gib - free_gib()  # trainer state back on the GPU in both readings
    report = fp32.generator.process.request("memory", timeout=60)  # by owner, for the message
    assert "torch_reserved_gib" in report and "process_used_gib" in report, report
    assert held < ASLEEP_MAX_GIB, (f"the sleeping engine still holds {held:.2f} GiB ({sync_mode}; awake "
                                   f"it took {awake:.1f} GiB); the engine's own report: {report}")


@pytest.mark.parametrize("sync_mode", SYNC_MODES)
def test_wake_sleep_cycles_do_not_leak(fp32, sync_mode):
    free = [fp32.cycle(sync_mode, SAMPLED, seed=i).metrics["memory/free_after_sleep_gib"] for i in range(6)]
    drift = free[1] - free[5]
    assert abs(drift) < LEAK_MAX_GIB, (f"free GPU memory after sleep drifted {drift:+.3f} GiB from cycle 2 "
                                       f"to 6 ({sync_mode}): {[round(f, 3) for f in free]}")


@pytest.mark.parametrize("sync_mode", SYNC_MODES)
def test_fp32_engine_greedy_is_the_trainers_greedy(fp32, sync_mode):
    rollouts = fp32.cycle(sync_mode)
    assert_greedy_matches(fp32.trainer.model, rollouts)


@pytest.mark.parametrize("sync_mode", SYNC_MODES)
def test_new_weights_change_the_output_and_old_weights_bring_it_back(fp32, sync_mode):
    first = fp32.cycle(sync_mode)
    other = perturbed(fp32.trainer.model, seed=1)
    changed = Switch(fp32.using(sync_mode), other).generate(PROMPTS, GREEDY)
    assert changed.completion_ids != first.completion_ids
    assert_greedy_matches(other, changed)
    del other
    again = fp32.cycle(sync_mode)
    assert again.completion_ids == first.completion_ids  # no stale weights, no stale prefix cache
    assert_greedy_matches(fp32.trainer.model, again)


@pytest.mark.parametrize("sync_mode", SYNC_MODES)
def test_bf16_engine_logprobs_match_the_trainers(bf16, sync_mode):
    rollouts = bf16.cycle(sync_mode, SAMPLED)
    diffs = []
    for i, (tokens, engine_logprobs) in enumerate(zip(rollouts.completion_ids, rollouts.logprobs)):
        _, logprobs = trainer_view(bf16.trainer.model, PROMPTS[i // SAMPLED.n], tokens)
        diffs.append((logprobs - torch.tensor(engine_logprobs, device="cuda")).abs())
    diffs = torch.cat(diffs)
    mean_diff, max_diff = diffs.mean().item(), diffs.max().item()
    assert mean_diff < BF16_LOGPROB_TOL, (f"{sync_mode}: mean |engine - trainer| log-prob {mean_diff:.4f} "
                                          f"(max {max_diff:.3f}) over {diffs.numel()} tokens")


@pytest.mark.parametrize("awake", [False, True], ids=["restore_after_sleep", "restore_while_awake"])
@pytest.mark.parametrize("sync_mode", SYNC_MODES)
def test_offload_restore_through_the_generator_is_bit_exact(fp32, sync_mode, awake):
    cycled, kept = new_trainer(fp32.model_dir, "float32"), new_trainer(fp32.model_dir, "float32")
    before = {k: t.detach().clone() for k, t in state_tensors(cycled).items()}
    offloader = Offloader(cycled.model, cycled.optimizer, "all", restore_while_awake=awake)
    rollouts = Switch(fp32.using(sync_mode), cycled.model, offloader).generate(PROMPTS, SAMPLED)
    assert offloader._host and offloader.offloaded == set()  # it did move the state, and brought it back
    # the small engine (30% of the GPU) leaves room: the restore ran before its sleep when asked to
    assert rollouts.metrics["generator/restored_awake"] == float(awake)
    offloader.wait()  # reading the AdamW state directly, not through optimizer.step or state_dict
    for key, tensor in state_tensors(cycled).items():
        assert tensor.device == before[key].device and torch.equal(tensor, before[key]), key

    rewards = [float(i % 2) for i in range(len(rollouts.completion_ids))]
    with sdpa_kernel(SDPBackend.MATH):
        for trainer in (cycled, kept):
            trainer.train_step(PROMPTS, rollouts.completion_ids, rewards, SAMPLED.n)
    a, b = state_tensors(cycled), state_tensors(kept)
    assert a.keys() == b.keys()
    unequal = [key for key in a if not torch.equal(a[key], b[key])]
    assert not unequal, f"after the next step these differ from a trainer that never offloaded: {unequal[:5]}"
    # The AdamW moments came back on the side stream (trainer.memory.overlap_restore, on by default).
    assert offloader.background_stats()["offloader/restore_background_bytes"] > 0


@pytest.mark.parametrize("sync_mode", SYNC_MODES)
def test_short_grpo_run_finishes_on_the_gpu(tmp_path, sync_mode):
    before = engine_processes()
    # trainer.memory.offload=all: this test checks the offload cycle, which the memory plan would skip
    # for the tiny trainer (it fits beside the engine: see the test below)
    train(compose_config(*small_run_overrides(tmp_path, f"generator.weight_sync={sync_mode}", "logger=none",
                                              "trainer.memory.offload=all")))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/step"] for r in records] == [0, 1, 2]
    keys = ["timing/offload_s", "timing/wake_weights_s", "timing/weight_load_s", "timing/wake_kv_s",
            "timing/generate_s", "timing/sleep_s", "timing/restore_s", "timing/train_s",
            "timing/generator_total_s", "timing/step_s", "memory/free_after_sleep_gib"]
    for record in records:
        missing = [k for k in keys if k not in record]
        assert not missing, missing
        assert record["generator/sleep_skipped"] == 0.0  # the engine really slept on the GPU
        assert record["rollout/tokens"] > 0
        assert ("timing/stage_s" in record) == (sync_mode == "file")
        if sync_mode == "cuda_ipc":
            assert record["sync/readback_checked"] > 0
    # AdamW's moments exist from the first optimizer step on, and come back in the background after
    # that; step 0's restore has none (on the H200 its record lacked the key).
    assert [("offloader/restore_background_s" in r) for r in records] == [False, True, True]
    assert (tmp_path / "checkpoint" / "manifest.json").exists()
    assert engine_processes() == before


def test_the_default_plan_keeps_a_small_trainer_on_the_gpu_and_predicts_free_memory(tmp_path):
    """trainer.memory.offload=auto (colo_rl.planner): the tiny trainer fits beside the engine, so nothing is
    offloaded; the plan's predicted free memory with the engine awake is near the measured one."""
    before = engine_processes()
    train(compose_config(*small_run_overrides(tmp_path, "logger=none")))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/step"] for r in records] == [0, 1, 2]
    assert not any("offloader/restore_background_s" in r for r in records)  # nothing left the GPU
    first = records[0]
    assert first["memory/trainer_peak_predicted_gib"] > 0
    total_gib = torch.cuda.mem_get_info()[1] / 2**30
    measured = min(r["memory/free_after_wake_kv_gib"] for r in records)
    assert abs(measured - first["memory/free_after_wake_kv_predicted_gib"]) < 0.05 * total_gib
    assert engine_processes() == before


def test_background_checkpoint_snapshots_copy_into_reused_pinned_buffers():
    from colo_rl.trainer.checkpoint import HostBuffers, snapshot

    state = {"model": {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(1024, device="cuda")},
             "optimizer": {"state": {0: {"exp_avg": torch.randn(1024, 1024, device="cuda")}}}}
    buffers = HostBuffers()
    first = snapshot(None, {"step": 1}, state=state, buffers=buffers)
    assert all(t.is_pinned() for t in [*first.state["model"].values(), first.state["optimizer"]["state"][0]["exp_avg"]])
    pointer = first.state["model"]["w"].data_ptr()
    state["model"]["w"].add_(1.0)
    second = snapshot(None, {"step": 2}, state=state, buffers=buffers)
    assert second.state["model"]["w"].data_ptr() == pointer  # reused, not allocated again
    assert torch.equal(second.state["model"]["w"], state["model"]["w"].cpu())


def test_the_offloader_keeps_torchs_cache_only_where_the_engine_can_wake_beside_it():
    model = torch.nn.Linear(1024, 1024, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters())
    offloader = Offloader(model, optimizer, "none")
    scratch = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # activations, freed into the cache
    del scratch
    cached = torch.cuda.memory_reserved()
    offloader.keep_cache_if_free = 2**20  # the engine needs 1 MiB: the cache stays
    offloader.offload()
    assert torch.cuda.memory_reserved() == cached
    offloader.keep_cache_if_free = 2**50  # more than the card: emptied
    offloader.offload()
    assert torch.cuda.memory_reserved() < cached - 200 * 2**20
