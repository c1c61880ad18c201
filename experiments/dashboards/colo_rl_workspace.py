"""The W&B workspace for colo_rl runs, as code (wandb-workspaces).

    python -m experiments.dashboards.colo_rl_workspace --entity ENTITY --project colo_rl

Run it from the repository root; it saves a new workspace view and prints its URL. Sections:
timing (the phases of a step, stacked in the order they run), memory (free GPU memory after
each event of a step), reward and loss, held-out evaluation, host resources, and the sweep
comparison (config keys against step time and reward, runs grouped by their W&B group: one
group per Hydra multirun).
The metric keys come from colo_rl.report, which plots the same keys from metrics.jsonl.
"""

from __future__ import annotations

import argparse

import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws

from colo_rl.metrics import STEP_KEY
from colo_rl.report import MEMORY_KEYS, REWARD_KEYS, STEP_TIMING_KEYS, TRAIN_KEYS

WORKSPACE_NAME = "colo_rl: colocated trainer and sleeping engine"
SECTIONS = ("Timing: phases of a step", "Memory: free GPU memory", "Reward and loss",
            "Held-out evaluation", "Host resources", "Sweep comparison")
HOST_KEYS = ("host/trainer_rss_gib", "host/engine_rss_gib", "host/open_fds", "host/child_processes")
# What a sweep changes (experiments/experiment/memory_fraction_sweep.yaml and the README's
# lr sweep): W&B config is the resolved Hydra config, so these are its dotted keys.
SWEEP_CONFIG_KEYS = ("generator.gpu_memory_utilization", "trainer.memory.offload", "trainer.lr",
                     "generator.weight_sync")
# The run summary holds what MetricsLogger._start_wandb asks define_metric for, per section:
# {"mean": ...} for timing/*, {"min": ...} for memory/*, {"max": ...} for reward/*; W&B names
# such a nested summary entry `<key>.<aggregate>`.
SUMMARY_AGGREGATE = {"timing": "mean", "memory": "min", "reward": "max"}
SWEEP_SUMMARY_KEYS = ("timing/step_s", "timing/generate_s", "timing/switch_overhead_frac",
                      "reward/mean")


def summary_key(key: str) -> str:
    """The run-summary name of a logged key: `timing/step_s` -> `timing/step_s.mean`."""
    return f"{key}.{SUMMARY_AGGREGATE[key.split('/', 1)[0]]}"


def _line(title: str, y: list[str] | tuple[str, ...], **kwargs) -> wr.LinePlot:
    return wr.LinePlot(title=title, x=STEP_KEY, y=list(y), **kwargs)


def _section(name: str, panels: list, columns: int = 3) -> ws.Section:
    return ws.Section(name=name, panels=panels, is_open=True,
                      layout_settings=ws.SectionLayoutSettings(columns=columns),
                      panel_settings=ws.SectionPanelSettings(x_axis=STEP_KEY))


def timing_section() -> ws.Section:
    return _section(SECTIONS[0], [
        _line("seconds per phase, stacked in step order", STEP_TIMING_KEYS, plot_type="stacked-area",
              title_y="s"),
        _line("share of the step per phase", STEP_TIMING_KEYS, plot_type="pct-area"),
        _line("restore: what the step waits for, and the AdamW moments copied beside train (CUDA)",
              ["timing/restore_s", "offloader/restore_background_s"], title_y="s"),
        _line("step wall clock and generator cycle",
              ["timing/step_s", "timing/generator_total_s", "timing/wake_s"], title_y="s"),
        _line("time outside generate and train (share of the step)",
              ["timing/switch_overhead_frac"], range_y=(0, 1)),
        _line("engine starts (set-up, then restarts)", ["timing/server_start_s"], title_y="s"),
        _line("generation throughput", ["rollout/tokens_per_s"], title_y="tokens/s"),
        _line("generate: the trainer's request, llm.generate in the engine, GC pauses in it",
              ["timing/generate_s", "generator/engine_generate_s", "generator/gc_pause_s"], title_y="s"),
    ])


def memory_section() -> ws.Section:
    return _section(SECTIONS[1], [
        _line("free GPU memory after each event (GiB)", MEMORY_KEYS, title_y="GiB"),
        _line("engine awake: free GPU memory with the KV cache allocated",
              ["memory/free_after_wake_kv_gib"], title_y="GiB"),
        _line("engine asleep: free GPU memory after its sleep and after the restore "
              "(both with the trainer back when it restored while the engine was awake)",
              ["memory/free_after_sleep_gib", "memory/free_after_restore_gib"], title_y="GiB"),
        _line("trainer peak allocated GPU memory", ["memory/trainer_peak_gib"], title_y="GiB"),
    ])


def reward_section() -> ws.Section:
    return _section(SECTIONS[2], [
        _line("reward (mean, min, max of the batch)", REWARD_KEYS),
        *[_line(key, [key]) for key in TRAIN_KEYS],
        _line("completion length", ["rollout/mean_length"], title_y="tokens"),
    ])


def eval_section() -> ws.Section:
    """eval/* is logged before the first step, every eval.every steps and after the last
    (conf/eval); pass@1 is the default eval.n=1's key."""
    return _section(SECTIONS[3], [
        _line("held-out reward (mean over eval.size prompts)", ["eval/reward/mean"]),
        _line("held-out pass@1 (share of prompts with a completion at eval.pass_reward)",
              ["eval/pass_at_1"], range_y=(0, 1)),
        _line("held-out completion length", ["eval/mean_length"], title_y="tokens"),
        _line("evaluation time (in the wake of that step's rollouts)", ["timing/eval_s"], title_y="s"),
    ])


def host_section() -> ws.Section:
    return _section(SECTIONS[4], [_line(key, [key]) for key in HOST_KEYS], columns=4)


def sweep_section() -> ws.Section:
    columns = [*(wr.ParallelCoordinatesPlotColumn(metric=wr.Config(key)) for key in SWEEP_CONFIG_KEYS),
               *(wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric(summary_key(key)))
                 for key in SWEEP_SUMMARY_KEYS)]
    return _section(SECTIONS[5], [
        wr.ParallelCoordinatesPlot(title="sweep: config -> step time and reward", columns=columns),
        wr.ScatterPlot(title="engine memory fraction vs step time",
                       x=wr.Config("generator.gpu_memory_utilization"),
                       y=wr.SummaryMetric(summary_key("timing/step_s"))),
        wr.ScatterPlot(title="engine memory fraction vs generate time",
                       x=wr.Config("generator.gpu_memory_utilization"),
                       y=wr.SummaryMetric(summary_key("timing/generate_s"))),
        wr.ScatterPlot(title="learning rate vs best reward", x=wr.Config("trainer.lr"),
                       y=wr.SummaryMetric(summary_key("reward/mean")), log_x=True),
        _line("reward/mean per W&B group (mean, min-max band)", ["reward/mean"], groupby="Group",
              groupby_aggfunc="mean", groupby_rangefunc="minmax"),
        _line("step time per W&B group (mean, min-max band)", ["timing/step_s"], groupby="Group",
              groupby_aggfunc="mean", groupby_rangefunc="minmax"),
    ])


def build_workspace(entity: str, project: str, name: str = WORKSPACE_NAME) -> ws.Workspace:
    """The workspace, built offline; `.save()` creates it on W&B."""
    return ws.Workspace(
        entity=entity, project=project, name=name,
        sections=[timing_section(), memory_section(), reward_section(), eval_section(), host_section(),
                  sweep_section()],
        settings=ws.WorkspaceSettings(x_axis=STEP_KEY),
        runset_settings=ws.RunsetSettings(groupby=[ws.Metric("Group")]),
    )


def referenced_keys(workspace: ws.Workspace) -> dict[str, set[str]]:
    """Every key the panels plot: `history` (logged per step), `summary` (run summary names,
    `<key>.<aggregate>`) and `config` (dotted config keys)."""
    keys: dict[str, set[str]] = {"history": set(), "summary": set(), "config": set()}

    def add(metric) -> None:
        if isinstance(metric, wr.Config):
            keys["config"].add(metric.name)
        elif isinstance(metric, wr.SummaryMetric):
            keys["summary"].add(metric.name)
        elif isinstance(metric, str):
            keys["history"].add(metric)
        else:
            raise TypeError(f"panel metric {metric!r}: add its kind to referenced_keys")

    for section in workspace.sections:
        for panel in section.panels:
            if isinstance(panel, wr.LinePlot):
                for metric in [panel.x, *panel.y]:
                    add(metric)
            elif isinstance(panel, wr.ScatterPlot):
                for metric in (panel.x, panel.y, panel.z):
                    if metric is not None:
                        add(metric)
            elif isinstance(panel, wr.ParallelCoordinatesPlot):
                for column in panel.columns:
                    add(column.metric)
            else:
                raise TypeError(f"panel {type(panel).__name__}: add its kind to referenced_keys")
    return keys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.dashboards.colo_rl_workspace",
                                     description="Create the colo_rl workspace view on W&B.")
    parser.add_argument("--entity", required=True, help="W&B user or team")
    parser.add_argument("--project", default="colo_rl", help="W&B project (logger.project)")
    parser.add_argument("--name", default=WORKSPACE_NAME, help="name of the workspace view")
    args = parser.parse_args(argv)
    workspace = build_workspace(args.entity, args.project, args.name).save()
    print(workspace.url)


if __name__ == "__main__":
    main()
