"""colo_rl.report through its CLI, in a real subprocess, on the metrics.jsonl of a real run (and
on the recorded H200 run for the memory figure, which only CUDA runs can fill)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from matplotlib.image import imread

from colo_rl.metrics import PHASES, STEP_KEY
from colo_rl.report import (MEMORY_KEYS, REWARD_KEYS, STEP_TIMING_KEYS, TRAIN_KEYS, job_dirs,
                            line_series, memory_series, phase_series, read_metrics)

from colo_rl.sweep import objective

from .conftest import ROOT

# A real `python -m colo_rl.run` on the lent H200 (benchmarks/RESULTS.md): memory/* keys included.
H200_RUN = ROOT / "benchmarks" / "results" / "run_1b_file_h200_2026-12-02.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def report(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "colo_rl.report", *map(str, args)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def run_copy(source: Path, directory: Path) -> Path:
    """A run directory holding a copy of `source` (a metrics.jsonl) and nothing else."""
    directory.mkdir(parents=True)
    shutil.copy(source, directory / "metrics.jsonl")
    return directory


def raw_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    image = imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100, (path, image.shape)
    assert image.std() > 0, f"{path} is blank"


def test_the_cli_writes_every_figure_of_a_real_run_into_run_dir_report(short_run_dir, tmp_path):
    run = run_copy(short_run_dir / "metrics.jsonl", tmp_path / "run")
    result = report(run)
    assert result.returncode == 0, result.stderr
    out = run / "report"
    names = ["phases.png", "reward.png", "train.png"]
    if torch.cuda.is_available():
        names.insert(1, "memory.png")
    else:  # free GPU memory is measured on CUDA only: a CPU run has no memory/* keys
        assert "CUDA only" in result.stderr
    assert result.stdout.splitlines() == [str(out / name) for name in names]
    for name in names:
        assert_png(out / name)


def test_the_plotted_series_are_the_logged_values(short_run_dir):
    logged = raw_records(short_run_dir / "metrics.jsonl")
    records = read_metrics(short_run_dir)
    assert records == logged and [r[STEP_KEY] for r in records] == [0, 1, 2]
    phases = phase_series(records)
    # every in-step phase the CPU run timed, in the order a step runs them
    assert list(phases) == [k for k in STEP_TIMING_KEYS if any(k in r for r in logged)]
    assert [PHASES.index(k.removeprefix("timing/").removesuffix("_s")) for k in phases] == \
        sorted(PHASES.index(k.removeprefix("timing/").removesuffix("_s")) for k in phases)
    assert "timing/generate_s" in phases and "timing/train_s" in phases
    for key, values in phases.items():
        assert values == [r[key] for r in logged], key
    for keys in (REWARD_KEYS, TRAIN_KEYS):
        series = line_series(records, keys)
        assert set(series) == {k for k in keys if any(k in r for r in logged)}
        for key, (steps, values) in series.items():
            # a key logged on some steps only (train/engine_logprob_gap: sampling.logprobs_every)
            # is plotted at exactly those steps
            assert steps == [r[STEP_KEY] for r in logged if key in r], key
            assert values == [r[key] for r in logged if key in r], key
    assert line_series(records, TRAIN_KEYS)["train/loss"][0] == [0, 1, 2]


def test_changing_one_logged_reward_changes_the_reward_figure_only(short_run_dir, tmp_path):
    original = run_copy(short_run_dir / "metrics.jsonl", tmp_path / "original")
    changed = run_copy(short_run_dir / "metrics.jsonl", tmp_path / "changed")
    records = raw_records(changed / "metrics.jsonl")
    records[1]["reward/mean"] = records[1]["reward/max"] = records[1]["reward/mean"] + 0.5
    (changed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for run in (original, changed):
        assert report(run).returncode == 0
    figure = lambda run, name: (run / "report" / name).read_bytes()  # noqa: E731
    assert figure(original, "reward.png") != figure(changed, "reward.png")
    # the same data draws the same bytes, so the difference above is the changed reward
    assert figure(original, "phases.png") == figure(changed, "phases.png")
    assert figure(original, "train.png") == figure(changed, "train.png")


def test_the_memory_figure_plots_free_memory_in_event_order_from_a_real_gpu_run(tmp_path):
    run = run_copy(H200_RUN, tmp_path / "h200")
    result = report(run, "--out", tmp_path / "figures")
    assert result.returncode == 0, result.stderr
    assert str(tmp_path / "figures" / "memory.png") in result.stdout.splitlines()
    assert_png(tmp_path / "figures" / "memory.png")
    logged = raw_records(H200_RUN)
    series = memory_series(read_metrics(run))
    assert list(series) == [r[STEP_KEY] for r in logged]
    for record in logged:
        values = series[record[STEP_KEY]]
        assert list(values) == [k for k in MEMORY_KEYS if k in record]  # event order
        assert values == {k: record[k] for k in values}
    assert "memory/free_after_server_start_gib" in series[0]
    assert "memory/free_after_server_start_gib" not in series[1]


def test_a_multirun_directory_gets_figures_comparing_its_jobs(short_run_dir, tmp_path):
    sweep = tmp_path / "sweep"
    run_copy(short_run_dir / "metrics.jsonl", sweep / "0_trainer.lr=0.0001")
    run_copy(H200_RUN, sweep / "1_trainer.lr=0.0003")
    (sweep / ".submitit").mkdir()  # a launcher's folder beside the jobs is not a job
    assert [j.name for j in job_dirs(sweep)] == ["0_trainer.lr=0.0001", "1_trainer.lr=0.0003"]
    result = report(sweep)
    assert result.returncode == 0, result.stderr
    written = [Path(line) for line in result.stdout.splitlines()]
    assert written == [sweep / "report" / name for name in
                       ("reward_by_job.png", "phases_by_job.png", "sweep.png", "sweep.md")]
    for path in written[:3]:
        assert_png(path)
    # the table: one row per job with what it varied, its objective and final metrics; the best job
    short, h200 = read_metrics(sweep / "0_trainer.lr=0.0001"), read_metrics(sweep / "1_trainer.lr=0.0003")
    table = written[3].read_text()
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith(("| 0 |", "| 1 |"))]
    assert [row[1] for row in rows] == ["trainer.lr=0.0001", "trainer.lr=0.0003"]
    assert [float(row[2]) for row in rows] == pytest.approx([objective(short), objective(h200)], rel=1e-3)
    assert float(rows[1][4]) == pytest.approx(h200[-1]["reward/mean"], rel=1e-3)
    best_number = 0 if objective(short) >= objective(h200) else 1
    assert f"best job: {best_number} `{job_dirs(sweep)[best_number].name}`" in table
    assert "Optuna" not in table  # a grid sweep has no optimization_results.yaml


def test_a_sweep_report_lists_a_job_that_failed_before_its_first_step(short_run_dir, tmp_path):
    sweep = tmp_path / "sweep"
    run_copy(short_run_dir / "metrics.jsonl", sweep / "0_trainer.lr=0.001")
    failed = sweep / "1_trainer.lr=-1.0"
    (failed / ".hydra").mkdir(parents=True)  # what Hydra leaves of a job refused by the config
    (failed / ".hydra" / "overrides.yaml").write_text("- trainer.lr=-1.0\n")
    (sweep / "optimization_results.yaml").write_text(
        "name: optuna\nbest_params:\n  trainer.lr: 0.001\nbest_value: 0.5\n")
    assert report(sweep).returncode == 0
    table = (sweep / "report" / "sweep.md").read_text()
    assert "| 1 | trainer.lr=-1 | failed |" in table
    assert "best job: 0 `0_trainer.lr=0.001`" in table
    assert "Optuna best_params: {'trainer.lr': 0.001}, best_value: 0.5" in table
    assert_png(sweep / "report" / "sweep.png")


def test_a_missing_metrics_file_exits_2_naming_it(tmp_path):
    result = report(tmp_path / "no_run")
    assert result.returncode == 2
    assert str(tmp_path / "no_run" / "metrics.jsonl") in result.stderr
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("content,message", [
    ("", "metrics.jsonl is empty"),
    ('{"train/step": 0, "reward/mean": 0.1}\n{"train/st', "metrics.jsonl:2 is not JSON"),
    ('{"reward/mean": 0.1}\n', "metrics.jsonl:1 has no train/step"),
])
def test_an_unreadable_metrics_file_exits_2_naming_it(tmp_path, content, message):
    (tmp_path / "metrics.jsonl").write_text(content)
    result = report(tmp_path)
    assert result.returncode == 2
    assert f"{tmp_path}/{message}" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "report").exists()
