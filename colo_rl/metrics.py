"""Where step metrics go: metrics.jsonl always, a W&B run when logger.backend=wandb, a progress
bar while running, and a summary table at the end."""

from __future__ import annotations

import json
import math
import netrc
import os
import sys
import time
from pathlib import Path
from statistics import mean

import torch

from colo_rl.config import LoggerConfig
from colo_rl.rundir import drop_records_from
from colo_rl.timing import host_metrics
from colo_rl.trainer.flops import peak_tflops, perf_metrics

STEP_KEY = "train/step"
# Phases of a step in the order they happen; the summary table and dashboards use this order.
PHASES = ("offload", "stage", "server_start", "wake_weights", "weight_load", "wake_kv", "generate",
          "eval", "sleep", "restore", "score", "train")
# The phases that hand the GPU between trainer and engine: timing/switch_s is their sum.
SWITCH_PHASES = ("offload", "stage", "wake_weights", "weight_load", "wake_kv", "sleep", "restore")


def wandb_mode(requested: str) -> str:
    """`auto`: online when a W&B API key is configured here, offline otherwise."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    return "offline"


class MetricsLogger:
    """Writes each step's metrics to metrics.jsonl and, optionally, one W&B run per job."""

    def __init__(self, cfg: LoggerConfig, *, output_dir: Path, config: dict,
                 group: str | None = None, name: str | None = None, total_steps: int = 0,
                 initial_step: int = 0, enabled: bool = True):
        self.cfg = cfg
        self.enabled = enabled  # False: keep the records in memory only (data-parallel ranks > 0)
        self.output_dir = Path(output_dir)
        self.config, self.group, self.name = config, cfg.group or group, cfg.name or name
        self.total_steps, self.initial_step = total_steps, initial_step
        self.path = self.output_dir / "metrics.jsonl"
        self.samples_path = self.output_dir / "samples.jsonl"
        self.records: list[dict] = []
        self.run = None
        self.final_summary: dict | None = None  # offline W&B runs cannot be read back from disk
        self.final_config: dict | None = None
        self._file = None
        self._samples = None
        self._bar = None
        self._next_extra: dict[str, float] = {}

    def add_to_next(self, metrics: dict[str, float]) -> None:
        """Metrics that belong to no step (set-up's) go into the next step's record."""
        self._next_extra.update(metrics)

    def __enter__(self) -> "MetricsLogger":
        if not self.enabled:
            return self
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # A run resumed into its own directory logs again the steps after its checkpoint
        drop_records_from(self.path, self.initial_step, STEP_KEY)
        self._file = open(self.path, "a")
        self._samples = open(self.samples_path, "a")
        if self.cfg.backend == "wandb":
            self._start_wandb()
        # the bar redraws itself with carriage returns: only where its stream is a terminal; a log
        # file gets one plain line per step instead (_plain_line)
        if self.cfg.progress and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total_steps, initial=self.initial_step, desc="colo_rl",
                             unit="step", dynamic_ncols=True)
        return self

    def _start_wandb(self) -> None:
        import wandb

        self.run = wandb.init(project=self.cfg.project, entity=self.cfg.entity, group=self.group,
                              name=self.name, tags=list(self.cfg.tags), config=self.config,
                              dir=str(self.output_dir), mode=wandb_mode(self.cfg.mode),
                              reinit="finish_previous")
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        self.run.define_metric("timing/*", step_metric=STEP_KEY, summary="mean")
        self.run.define_metric("memory/*", step_metric=STEP_KEY, summary="min")
        self.run.define_metric("reward/*", step_metric=STEP_KEY, summary="max")
        self.run.define_metric("eval/*", step_metric=STEP_KEY, summary="last")

    def phase(self, name: str) -> None:
        """Show the phase the step is in on the progress bar."""
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(name), refresh=True)

    def _postfix(self, phase: str) -> str:
        reward = self.records[-1].get("reward/mean") if self.records else None
        return f"reward={reward:.3f} phase={phase}" if reward is not None else f"phase={phase}"

    def log(self, step: int, metrics: dict[str, float], count_step: bool = True) -> None:
        """One record; `count_step=False` for a record that is not a training step (the final
        evaluation): the progress bar does not advance."""
        record = {STEP_KEY: step, **self._next_extra, **metrics}
        self._next_extra = {}
        self.records.append(record)
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self.run is not None:
            self.run.log(record)
        if self._bar is not None and count_step:
            self._bar.update(1)
            self._bar.set_postfix_str(self._postfix("done"), refresh=True)
        elif self.cfg.progress and count_step:
            print(self._plain_line(step, record), file=sys.stderr, flush=True)

    def _plain_line(self, step: int, record: dict) -> str:
        """A step's line where no bar is drawn: its number, reward and seconds."""
        reward = record.get("reward/mean")
        return (f"colo_rl: step {step + 1}/{self.total_steps}" + (f" reward={reward:.3f}" if reward is not None else "")
                + (f" {record['timing/step_s']:.2f} s" if "timing/step_s" in record else ""))

    def log_samples(self, rows: list[dict]) -> None:
        """Completions to read: appended to samples.jsonl, and a W&B table of the step's."""
        if not self.enabled or not rows:
            return
        for row in rows:
            self._samples.write(json.dumps(row) + "\n")
        self._samples.flush()
        if self.run is not None:
            import wandb

            names = list(rows[0]["rewards"])
            columns = ["step", "prompt", "completion", "reward", *names, "advantage"]
            table = wandb.Table(columns=columns, data=[
                [r["step"], str(r["prompt"]), r["completion"], r["reward"],
                 *(r["rewards"][n] for n in names), r["advantage"]] for r in rows])
            self.run.log({STEP_KEY: rows[0]["step"], "samples/completions": table})

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._samples is not None:
            self._samples.close()
        if self.run is not None:
            self.final_summary = _plain(self.run.summary)
            self.final_config = dict(self.run.config)
            self.run.finish(exit_code=0 if exc_type is None else 1)


def step_metrics(rollout, train_metrics: dict[str, float], trainer, switch, peak: float | None,
                 reward_metrics: dict[str, float]) -> dict[str, float]:
    """A step's record: the rollout's and the switch's metrics, the phases' seconds, the update's
    train/*, perf/* (over `peak` TFLOP/s, trainer.perf.peak_tflops), the host's resources, the step's
    time and the switch's share of it, and its rewards (each function's in `reward_metrics`).
    `rollout` is the step's StepRollout (colo_rl/rollout.py), `trainer` its GRPOTrainer."""
    timer = rollout.timer
    metrics = {**rollout.rollouts.metrics, **timer.metrics, **train_metrics, **switch.offloader.background_stats(),
               "train/trainable_params": float(trainer.trainable_params)}
    metrics.update(perf_metrics(trainer.last_step_flops, timer.metrics["timing/train_s"],
                                peak_tflops(peak, trainer.device)))
    if torch.cuda.is_available():
        metrics["memory/trainer_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    metrics.update(host_metrics(switch.engine.pid))
    step_s = time.perf_counter() - rollout.started
    switch_s = sum(metrics.get(f"timing/{phase}_s", 0.0) for phase in SWITCH_PHASES)
    metrics.update({
        "timing/step_s": step_s,
        "timing/switch_s": switch_s,
        "timing/switch_overhead_frac": switch_s / step_s,
        "reward/mean": mean(rollout.rewards),
        "reward/max": max(rollout.rewards),
        "reward/min": min(rollout.rewards),
        **reward_metrics,
    })
    return metrics


def _plain(value):
    """W&B summaries nest SummarySubDict objects (the define_metric {"max": ...} entries):
    turn them into plain dicts so callers can compare and serialise them."""
    if hasattr(value, "keys") and hasattr(value, "__getitem__") and not isinstance(value, str):
        return {key: _plain(value[key]) for key in value.keys()}
    return value


def engine_starts(records: list[dict]) -> list[float]:
    """Seconds of every engine start: the first in set-up, later ones after failures."""
    return [r["timing/server_start_s"] for r in records if "timing/server_start_s" in r]


def summary_rows(records: list[dict]) -> list[tuple[str, float, float]]:
    """(phase, mean seconds, share of the mean step) for every per-step phase that took time."""
    if not records:
        return []
    step_s = mean(r.get("timing/step_s", 0.0) for r in records) or math.nan
    rows = []
    for phase in PHASES:
        if phase == "server_start":  # once per engine, mostly outside any step: see engine_starts
            continue
        key = f"timing/{phase}_s"
        if any(key in r for r in records):  # a phase some steps skip (server_start) counts 0 there
            seconds = mean(r.get(key, 0.0) for r in records)
            rows.append((phase, seconds, seconds / step_s))
    return rows


def print_summary(records: list[dict], output_dir: Path) -> None:
    """A rich table of where the time went, peak memory and the reward at the start and end."""
    from rich.console import Console
    from rich.table import Table

    evals = [r for r in records if "eval/reward/mean" in r]
    records = [r for r in records if "reward/mean" in r]  # training steps, not the final evaluation
    if not records:
        return
    title = f"colo_rl: {len(records)} steps ({output_dir})"  # above the table, not wrapped to its width
    table = Table()
    table.add_column("phase")
    table.add_column("mean s", justify="right")
    table.add_column("share of step", justify="right")
    for phase, seconds, share in summary_rows(records):
        table.add_row(phase, f"{seconds:.3f}", f"{share:.1%}")
    table.add_row("step", f"{mean(r['timing/step_s'] for r in records):.3f}", "100%")
    # a terminal's own width; 100 columns in a log file (rich would guess 80, or COLUMNS)
    console = Console(width=None if sys.stdout.isatty() else 100)
    console.print(title, highlight=False, soft_wrap=True)
    console.print(table)
    setup = [r for r in records if "setup/total_s" in r]
    if setup:
        console.print(f"set-up: {setup[0]['setup/total_s']:.1f} s from the run's start to its first step")
    starts = engine_starts(records)
    if starts:
        console.print(f"engine start: {' + '.join(f'{s:.1f}' for s in starts)} s "
                      "(the first during set-up, outside the step times; later ones are restarts)")
    window = max(1, min(5, len(records) // 2))
    first = mean(r["reward/mean"] for r in records[:window])
    last = mean(r["reward/mean"] for r in records[-window:])
    console.print(f"reward/mean: first {window} steps {first:.3f} -> last {window} steps {last:.3f}")
    if evals:
        first_eval, last_eval = evals[0], evals[-1]
        shown = [k for k in first_eval if k.startswith("eval/") and k != "eval/prompts"]
        console.print(f"held-out evaluation ({first_eval['eval/prompts']:.0f} prompts): " + ", ".join(
            f"{k} {first_eval[k]:.3f} (step {first_eval[STEP_KEY]}) -> {last_eval.get(k, math.nan):.3f} "
            f"(step {last_eval[STEP_KEY]})" for k in shown))
    mfu = [r for r in records if "perf/mfu" in r]
    if mfu:
        console.print(f"training: {mean(r['perf/train_tflops'] for r in mfu):.1f} TFLOP/s of model FLOPs, "
                      f"MFU {mean(r['perf/mfu'] for r in mfu):.1%} (mean over {len(mfu)} steps)")
    peaks = [r["memory/trainer_peak_gib"] for r in records if "memory/trainer_peak_gib" in r]
    if peaks:
        console.print(f"trainer peak GPU memory: {max(peaks):.2f} GiB")
    memory_rows = predicted_vs_measured(records)
    if memory_rows:
        memory = Table(title="GPU memory (memory/<key>_gib): planned at start-up, measured")
        for column in ("key", "predicted GiB", "measured GiB", "ratio"):
            memory.add_column(column, justify="left" if column == "key" else "right")
        for key, predicted, measured in memory_rows:
            memory.add_row(key.removeprefix("memory/").removesuffix("_gib"), f"{predicted:.2f}", f"{measured:.2f}",
                           f"{measured / predicted:.2f}" if predicted else "-")
        console.print(memory)


def predicted_vs_measured(records: list[dict]) -> list[tuple[str, float, float]]:
    """(measured key, predicted GiB, measured GiB) for every memory/<k>_predicted_gib the run
    logged whose memory/<k>_gib it also measured: the largest trainer peak, the least free memory."""
    rows = []
    predicted = {k: v for r in records for k, v in r.items()
                 if k.startswith("memory/") and k.endswith("_predicted_gib")}
    for key, value in predicted.items():
        measured_key = key.removesuffix("_predicted_gib") + "_gib"
        measured = [r[measured_key] for r in records if measured_key in r]
        if measured:
            rows.append((measured_key, value, max(measured) if "peak" in key else min(measured)))
    return rows
