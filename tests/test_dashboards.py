"""How runs are looked at and launched: the W&B workspace as code (built offline; every key it
plots is one a real run logs) and the SLURM launcher config (composed, never submitted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import wandb
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import get_class
from omegaconf import OmegaConf

from colo_rl.config import LoggerConfig
from colo_rl.metrics import PHASES, STEP_KEY, MetricsLogger
from colo_rl.report import ENGINE_START_KEYS
from experiments.dashboards.colo_rl_workspace import (SECTIONS, SUMMARY_AGGREGATE, build_workspace,
                                                     referenced_keys)

from .conftest import CONF, EXPERIMENTS, ROOT, compose_config, small_run_overrides

# Real `python -m colo_rl.run` runs on the lent H200 (benchmarks/RESULTS.md), both weight syncs:
# the only real runs here that log memory/* (free GPU memory is measured on CUDA only) and
# offloader/* (the background restore runs on CUDA only).
H200_RUNS = sorted((ROOT / "benchmarks" / "results").glob("run_1b_*_h200_*.jsonl"))


def records_of(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def logged_keys(records: list[dict]) -> set[str]:
    return set().union(*records)


@pytest.fixture(scope="module")
def workspace():
    return build_workspace("colo-rl-entity", "colo_rl")


def test_the_workspace_builds_offline_into_the_view_save_would_upload(workspace):
    view = workspace._to_model()  # what Workspace.save() sends, built without any network call
    dumped = view.model_dump(by_alias=True, exclude_none=True)
    assert dumped["entity"] == "colo-rl-entity" and dumped["project"] == "colo_rl"
    sections = dumped["spec"]["section"]["panelBankConfig"]["sections"]
    assert [s["name"] for s in sections] == list(SECTIONS)
    assert all(s["panels"] for s in sections)
    assert dumped["spec"]["section"]["settings"]["xAxis"] == STEP_KEY
    assert dumped["spec"]["section"]["runSets"][0]["grouping"] == [{"section": "run", "name": "group"}]
    titles = {p.title for s in workspace.sections for p in s.panels}
    assert {"seconds per phase, stacked in step order", "free GPU memory after each event (GiB)",
            "reward (mean, min, max of the batch)", "train/loss", "train/grad_norm", "train/kl",
            "train/engine_logprob_gap", "sweep: config -> step time and reward"} <= titles


def test_the_stacked_timing_panel_lists_every_in_step_phase_in_step_order(workspace):
    stacked = [p for p in workspace.sections[0].panels if getattr(p, "plot_type", None) == "stacked-area"]
    assert len(stacked) == 1 and stacked[0].x == STEP_KEY
    phases = [key.removeprefix("timing/").removesuffix("_s") for key in stacked[0].y]
    # server_start happens in set-up, outside the steps: it has a panel of its own
    assert phases == [p for p in PHASES if p != "server_start"]
    view_panel = workspace._to_model().spec.section.panel_bank_config.sections[0].panels[0]
    assert view_panel.config.plot_type == "stacked-area"
    assert view_panel.config.metrics == [f"timing/{p}_s" for p in phases]


@pytest.fixture(scope="module")
def eval_run_dir(tmp_path_factory, engine):
    """A real 3-step run with held-out evaluation (before step 0, at step 2, after the last): the
    only runs that log eval/* and timing/eval_s."""
    from colo_rl.run import train

    output_dir = tmp_path_factory.mktemp("eval_run")
    train(compose_config(*small_run_overrides(output_dir, "logger=none", "eval.every=2", "eval.size=4")),
          engine)
    return output_dir


def test_every_per_step_key_the_panels_plot_is_logged_by_a_real_run(workspace, short_run_dir, eval_run_dir):
    cpu_run = records_of(short_run_dir / "metrics.jsonl")
    eval_run = records_of(eval_run_dir / "metrics.jsonl")
    gpu_runs = [records_of(path) for path in H200_RUNS]
    assert {path.name.split("_h200_")[0] for path in H200_RUNS} == {"run_1b_cuda_ipc", "run_1b_file"}
    history = referenced_keys(workspace)["history"]
    cuda_only = {k for k in history if k.startswith(("memory/", "offloader/"))}
    # the shared engine may have started in an earlier test: then no step of this run started it
    start_only = set(ENGINE_START_KEYS) - logged_keys(cpu_run)
    eval_only = {k for k in history if k.startswith("eval/")} | {"timing/eval_s"}
    assert eval_only <= logged_keys(eval_run), sorted(eval_only - logged_keys(eval_run))
    assert not eval_only & logged_keys(cpu_run)  # eval.every=0 logs none of them
    missing = history - cuda_only - start_only - eval_only - logged_keys(cpu_run)
    assert not missing, f"plotted but never logged by a real run: {sorted(missing)}"
    gpu_logged = set().union(*map(logged_keys, gpu_runs))
    assert not cuda_only - gpu_logged, sorted(cuda_only - gpu_logged)
    assert start_only <= gpu_logged
    for run in gpu_runs:  # logged by the step that starts an engine only
        assert [r[STEP_KEY] for r in run if "timing/server_start_s" in r] == [0]
    if torch.cuda.is_available():
        assert not cuda_only - logged_keys(cpu_run)
    assert {"memory/free_after_wake_kv_gib", "reward/mean", "reward/max", "train/loss",
            "train/grad_norm", "train/kl", "train/engine_logprob_gap", "eval/reward/mean",
            "eval/pass_at_1", "timing/eval_s"} <= history


def test_every_summary_key_names_what_the_logger_makes_wandb_aggregate(workspace, short_run_dir,
                                                                     tmp_path, monkeypatch):
    """The run summary holds only the aggregates MetricsLogger asks define_metric for. The calls
    are recorded on their way to a real offline W&B run (the spy passes each one through)."""
    defined: dict[str, str | None] = {}
    real_define_metric = wandb.Run.define_metric

    def recording(self, name, *args, **kwargs):
        defined[name] = kwargs.get("summary")
        return real_define_metric(self, name, *args, **kwargs)

    monkeypatch.setattr(wandb.Run, "define_metric", recording)
    with MetricsLogger(LoggerConfig(backend="wandb", mode="offline", progress=False),
                       output_dir=tmp_path, config={}) as logger:
        assert logger.run is not None
    assert {f"{section}/*": agg for section, agg in SUMMARY_AGGREGATE.items()}.items() <= defined.items()
    summary = referenced_keys(workspace)["summary"]
    assert summary, "the sweep section compares run summaries"
    for name in summary:
        key, aggregate = name.rsplit(".", 1)
        assert defined[f"{key.split('/')[0]}/*"] == aggregate, name
        assert key in logged_keys(records_of(short_run_dir / "metrics.jsonl")), name


def test_every_config_key_the_panels_use_is_in_the_config_a_run_gives_wandb(workspace):
    config = OmegaConf.to_container(compose_config(), resolve=True)  # MetricsLogger's config=
    used = referenced_keys(workspace)["config"]
    for key in used:
        node = config
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"{key} is not in the W&B config"
            node = node[part]
    swept = OmegaConf.load(EXPERIMENTS / "experiment" / "memory_fraction_sweep.yaml").hydra.sweeper.params
    assert set(swept) <= used, "the sweep comparison must show what memory_fraction_sweep varies"


def test_the_dashboard_cli_is_a_module_of_the_repository(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "experiments.dashboards.colo_rl_workspace", "--help"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--entity" in result.stdout and "--project" in result.stdout
    readme = (ROOT / "experiments" / "dashboards" / "README.md").read_text().splitlines()
    assert readme[0].startswith("# ") and \
        "python -m experiments.dashboards.colo_rl_workspace --entity" in readme[2]


# -- SLURM ------------------------------------------------------------------------------------

SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"


def compose_with_hydra(*overrides: str):
    """The config `python -m colo_rl.run -m OVERRIDES` runs with, hydra node included."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("run", overrides=[f"hydra.searchpath=[file://{EXPERIMENTS}]", *overrides],
                       return_hydra_config=True)


def test_the_slurm_launcher_runs_each_sweep_job_on_one_gpu():
    cfg = compose_with_hydra("hydra/launcher=slurm_gpu", "experiment=memory_fraction_sweep")
    launcher = cfg.hydra.launcher
    assert launcher._target_ == SLURM_LAUNCHER
    assert get_class(launcher._target_).__name__ == "SlurmLauncher"
    assert launcher.gpus_per_node == 1 and launcher.tasks_per_node == 1 and launcher.nodes == 1
    assert launcher.cpus_per_task >= 1 and launcher.mem_gb >= 1 and launcher.timeout_min >= 1
    assert launcher.max_num_timeout == 0  # a requeued job would start over instead of resuming
    assert launcher.submitit_folder.startswith(cfg.hydra.sweep.dir + "/")
    assert cfg.hydra.runtime.choices["hydra/launcher"] == "slurm_gpu"
    assert cfg.model.name == "olmo2_1b_shape"  # the experiment still applies


def test_the_slurm_launcher_takes_cluster_settings_and_refuses_typos():
    cfg = compose_with_hydra("hydra/launcher=slurm_gpu", "hydra.launcher.partition=h200",
                             "hydra.launcher.timeout_min=30")
    assert cfg.hydra.launcher.partition == "h200" and cfg.hydra.launcher.timeout_min == 30
    with pytest.raises(ConfigCompositionException, match="gpus_per_nod"):
        compose_with_hydra("hydra/launcher=slurm_gpu", "hydra.launcher.gpus_per_nod=2")


def test_without_the_override_sweeps_run_locally():
    cfg = compose_with_hydra()
    assert cfg.hydra.launcher._target_ != SLURM_LAUNCHER
