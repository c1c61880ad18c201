"""Figures of a run for readers without W&B: `python -m colo_rl.report RUN_DIR [--out DIR]`.

Reads RUN_DIR/metrics.jsonl and writes to RUN_DIR/report/ (or --out):
- phases.png: seconds of each phase per step, stacked in the order a step runs them, and the
  same as a share of the step (the engine start is named in the title, not stacked);
- memory.png: free GPU memory after each event of a step (CUDA runs only: skipped on CPU);
- reward.png: reward/mean with the reward/min..reward/max band;
- train.png: train/loss, train/grad_norm, train/kl and train/engine_logprob_gap.
A multirun directory (no metrics.jsonl of its own, jobs in subdirectories) gets, comparing its
jobs instead:
- reward_by_job.png and phases_by_job.png: reward/mean per step and the mean phase seconds;
- sweep.png: the table of each job's overrides (those that vary between jobs), objective (what
  the job returned to the sweeper, colo_rl/sweep.py), final metrics and seconds, the best job
  marked; the held-out eval/reward/mean of each job per step; the objective of each job in job
  order with the best so far (for an Optuna sweep: its trials in the order they ran, failed
  trials marked);
- sweep.md: the same table as Markdown, and the best job (Optuna's best_params too).

The metric keys below are the ones the runner logs; the W&B workspace in
experiments/dashboards/ plots the same keys.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

from colo_rl.metrics import PHASES, STEP_KEY, engine_starts, summary_rows
from colo_rl.sweep import EVAL_KEY, FINAL_KEYS, Job, best, optuna_results, varying

TIMING_KEYS = tuple(f"timing/{phase}_s" for phase in PHASES)
# The phases inside a step's wall clock (timing/step_s). The engine's first start happens during
# set-up and is reported with step 0's metrics: stacking it on step 0 would dwarf every step
# (as in metrics.summary_rows, it is shown on its own).
STEP_PHASES = tuple(phase for phase in PHASES if phase != "server_start")
STEP_TIMING_KEYS = tuple(f"timing/{phase}_s" for phase in STEP_PHASES)
# Events after which the switch snapshots free GPU memory, in the order a step passes them
# (colo_rl.switch.Switch). Logged on CUDA only; `offload` only with weight_sync=file, and
# `server_start` only by the step that started an engine.
MEMORY_EVENTS = ("trainer_step", "server_start", "offload", "wake_weights", "wake_kv", "sleep",
                 "restore")
MEMORY_KEYS = tuple(f"memory/free_after_{event}_gib" for event in MEMORY_EVENTS)
REWARD_KEYS = ("reward/mean", "reward/min", "reward/max")
TRAIN_KEYS = ("train/loss", "train/grad_norm", "train/kl", "train/engine_logprob_gap")
# Logged only by the step that starts an engine (the first, or one after a restart).
ENGINE_START_KEYS = ("timing/server_start_s", "memory/free_after_server_start_gib")
MEMORY_LINES_MAX = 8  # more steps than this: memory.png shows the first and the last only


class MetricsFileError(Exception):
    """metrics.jsonl is missing, empty or not JSON lines; the message names the file."""


def read_metrics(run_dir: Path) -> list[dict]:
    """The step records of one run, in the order they were logged."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise MetricsFileError(f"{path} does not exist: pass the directory of a run (it holds "
                               "metrics.jsonl) or of a multirun (its job directories do)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise MetricsFileError(f"{path}:{number} is not JSON ({exc.msg})") from exc
    if not records:
        raise MetricsFileError(f"{path} is empty: the run has not finished a step yet")
    missing = [n for n, r in enumerate(records, start=1) if STEP_KEY not in r]
    if missing:
        raise MetricsFileError(f"{path}:{missing[0]} has no {STEP_KEY}: not a colo_rl metrics file")
    return records


def is_multirun(run_dir: Path) -> bool:
    """A sweep directory: no metrics.jsonl of its own, job directories that have one."""
    run_dir = Path(run_dir)
    return run_dir.is_dir() and not (run_dir / "metrics.jsonl").exists() and bool(job_dirs(run_dir))


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The job directories of a multirun that logged metrics, in job-number order."""
    jobs = [p for p in Path(sweep_dir).iterdir() if (p / "metrics.jsonl").is_file()]
    return sorted(jobs, key=_job_number)


def failed_job_dirs(sweep_dir: Path) -> list[Path]:
    """The job directories of a multirun whose job stopped before logging a step (no metrics.jsonl:
    a job refused before it held its directory left it empty, its overrides in its name), in
    job-number order."""
    jobs = [p for p in Path(sweep_dir).iterdir()
            if p.is_dir() and not (p / "metrics.jsonl").exists()
            and ((p / ".hydra" / "overrides.yaml").is_file() or re.match(r"\d+(_|$)", p.name))]
    return sorted(jobs, key=_job_number)


def _job_number(path: Path) -> tuple[int, str]:
    match = re.match(r"(\d+)", path.name)
    return (int(match.group(1)) if match else sys.maxsize, path.name)


# -- the series each figure plots ------------------------------------------------------------

def steps(records: list[dict]) -> list[int]:
    return [r[STEP_KEY] for r in records]


def phase_series(records: list[dict]) -> dict[str, list[float]]:
    """Seconds per step of every in-step phase some step logged, in PHASES order; 0 where a
    step skipped the phase (stage with weight_sync=cuda_ipc)."""
    return {key: [r.get(key, 0.0) for r in records]
            for key in STEP_TIMING_KEYS if any(key in r for r in records)}


def memory_series(records: list[dict]) -> dict[int, dict[str, float]]:
    """step -> {memory key: free GiB} in event order, for every step up to MEMORY_LINES_MAX
    steps, else the first and the last; steps without memory keys (CPU runs) are left out."""
    shown = records if len(records) <= MEMORY_LINES_MAX else [records[0], records[-1]]
    series = {r[STEP_KEY]: {key: r[key] for key in MEMORY_KEYS if key in r} for r in shown}
    return {step: values for step, values in series.items() if values}


def line_series(records: list[dict], keys: tuple[str, ...]) -> dict[str, tuple[list[int], list[float]]]:
    """key -> (steps, values) over the steps that logged it, for every key some step logged."""
    series = {}
    for key in keys:
        logged = [r for r in records if key in r]
        if logged:
            series[key] = (steps(logged), [r[key] for r in logged])
    return series


# -- figures ---------------------------------------------------------------------------------

def _figure(rows: int = 1, cols: int = 1, size: tuple[float, float] = (9.0, 4.5)):
    """A figure drawn by Agg, independent of pyplot's global state and of any display."""
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("colo_rl.report needs matplotlib: "
                                  "pip install -e '.[dashboards]'") from exc
    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False)


def _phase_colors() -> dict[str, tuple]:
    from matplotlib import colormaps

    palette = colormaps["tab20"].colors
    ordered = palette[::2] + palette[1::2]  # 10 distinct hues before the lighter ones
    return {phase: ordered[i % len(ordered)] for i, phase in enumerate(PHASES)}


def plot_phases(records: list[dict], path: Path) -> Path:
    series, x = phase_series(records), steps(records)
    step_s = [r.get("timing/step_s", 0.0) for r in records]
    colors = _phase_colors()
    fig, axes = _figure(1, 2, size=(13.0, 4.5))
    seconds_ax, share_ax = axes[0]
    bottom = [0.0] * len(x)
    share_bottom = [0.0] * len(x)
    for key, values in series.items():
        phase = key.removeprefix("timing/").removesuffix("_s")
        shares = [v / s if s else 0.0 for v, s in zip(values, step_s)]
        seconds_ax.bar(x, values, bottom=bottom, label=phase, color=colors[phase])
        share_ax.bar(x, shares, bottom=share_bottom, label=phase, color=colors[phase])
        bottom = [b + v for b, v in zip(bottom, values)]
        share_bottom = [b + v for b, v in zip(share_bottom, shares)]
    # the step's wall clock: what the bars do not reach is time outside any timed phase
    seconds_ax.plot(x, step_s, color="black", marker="_", markersize=18, linestyle="none",
                    label="timing/step_s")
    starts = engine_starts(records)
    started = f"; engine start {' + '.join(f'{s:.1f}' for s in starts)} s not stacked" if starts else ""
    seconds_ax.set(title=f"phase seconds per step{started}", xlabel=STEP_KEY, ylabel="s")
    share_ax.set(title="share of the step", xlabel=STEP_KEY, ylabel="timing/<phase>_s / timing/step_s",
                 ylim=(0, 1.05))
    share_ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    seconds_ax.legend(loc="upper right", fontsize="x-small", ncols=2)
    return _save(fig, path)


def plot_memory(records: list[dict], path: Path) -> Path | None:
    series = memory_series(records)
    if not series:
        return None
    fig, axes = _figure()
    ax = axes[0][0]
    events = [k for k in MEMORY_KEYS if any(k in values for values in series.values())]
    position = {key: i for i, key in enumerate(events)}
    for step, values in series.items():
        ax.plot([position[k] for k in values], list(values.values()), marker="o", label=f"step {step}")
    ax.set_xticks(range(len(events)),
                  [k.removeprefix("memory/free_after_").removesuffix("_gib") for k in events])
    ax.set(title="free GPU memory after each event of a step (memory/free_after_<event>_gib)",
           xlabel="event", ylabel="GiB free")
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_reward(records: list[dict], path: Path) -> Path:
    series = line_series(records, REWARD_KEYS)
    fig, axes = _figure()
    ax = axes[0][0]
    x, mean = series["reward/mean"]
    if "reward/min" in series and "reward/max" in series:
        ax.fill_between(series["reward/min"][0], series["reward/min"][1], series["reward/max"][1],
                        alpha=0.25, label="reward/min .. reward/max")
    ax.plot(x, mean, marker="o", label="reward/mean")
    ax.set(title="reward per step", xlabel=STEP_KEY, ylabel="reward")
    ax.legend()
    return _save(fig, path)


def plot_train(records: list[dict], path: Path) -> Path | None:
    series = line_series(records, TRAIN_KEYS)
    if not series:
        return None
    fig, axes = _figure(2, 2, size=(11.0, 7.0))
    for ax, key in zip([ax for row in axes for ax in row], TRAIN_KEYS):
        if key in series:
            ax.plot(*series[key], marker="o")
            ax.set(title=key, xlabel=STEP_KEY)
        else:
            ax.set_axis_off()
    return _save(fig, path)


def plot_reward_by_job(jobs: dict[str, list[dict]], path: Path) -> Path:
    fig, axes = _figure()
    ax = axes[0][0]
    for name, records in jobs.items():
        ax.plot(*line_series(records, ("reward/mean",))["reward/mean"], marker="o", label=name)
    ax.set(title="reward/mean per job", xlabel=STEP_KEY, ylabel="reward/mean")
    ax.legend(fontsize="small")
    return _save(fig, path)


def plot_phases_by_job(jobs: dict[str, list[dict]], path: Path) -> Path:
    colors = _phase_colors()
    fig, axes = _figure(size=(11.0, 1.5 + 0.6 * len(jobs)))
    ax = axes[0][0]
    names = list(jobs)
    left = [0.0] * len(names)
    for phase in PHASES:
        seconds = [dict((p, s) for p, s, _ in summary_rows(jobs[n])).get(phase, 0.0) for n in names]
        if any(seconds):
            ax.barh(names, seconds, left=left, label=phase, color=colors[phase])
            left = [a + b for a, b in zip(left, seconds)]
    ax.invert_yaxis()  # job 0 on top
    ax.set(title="mean seconds per phase of a step, per job", xlabel="s")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    return _save(fig, path)


# -- the sweep: table, best job, eval curves, trials in order ---------------------------------

TABLE_COLUMNS = ("job", "overrides", "objective", *FINAL_KEYS, "time_s")
BEST_COLOR = "#fff2a8"
FAILED_COLOR = "#f4c7c3"


def _short(override: str) -> str:
    """`trainer.lr=0.0012520653814999472` -> `trainer.lr=0.001252`: four significant digits."""
    key, sep, value = override.partition("=")
    try:
        number = float(value)
    except ValueError:
        return override
    return f"{key}{sep}{number:.4g}" if sep and not value.isdigit() else override


def sweep_rows(jobs: list[Job]) -> list[list[str]]:
    """One row of TABLE_COLUMNS per job: its varying overrides, objective, final metrics, seconds."""
    varied, _ = varying(jobs)
    return [[str(job.number if job.number is not None else job.name),
             ", ".join(_short(o) for o in overrides) or "-", *_row_values(job)]
            for job, overrides in zip(jobs, varied)]


def _row_values(job: Job) -> list[str]:
    if job.failed:
        return ["failed", *("-" for _ in FINAL_KEYS), "-"]
    return [f"{job.objective:.4g}", *(f"{job.final[k]:.4g}" if k in job.final else "-" for k in FINAL_KEYS),
            f"{job.seconds:.1f}"]


def write_sweep_table(jobs: list[Job], optuna: dict | None, title: str, path: Path) -> Path:
    """sweep.md: the sweep's fixed overrides, the table of its jobs and the best job."""
    _, fixed = varying(jobs)
    lines = [f"# {title}", "",
             f"Every job: `{' '.join(fixed)}`" if fixed else "Every job: the defaults", "",
             "| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in sweep_rows(jobs)]
    top = best(jobs)
    lines += ["", f"best job: {top.number} `{top.name}` (objective {top.objective:.6g})" if top else "best job: none (no job "
              "logged a reward)"]
    if optuna is not None:
        lines.append(f"Optuna best_params: {optuna.get('best_params')}, best_value: {optuna.get('best_value')}")
    path.write_text("\n".join(lines) + "\n")
    return path


def plot_sweep(jobs: list[Job], records: dict[str, list[dict]], optuna: dict | None, path: Path) -> Path:
    from matplotlib.figure import Figure

    # laid out by hand: constrained layout cannot size an axes that holds only a table
    fig = Figure(figsize=(13.0, 4.6 + 0.22 * len(jobs)))
    axes = fig.subplot_mosaic([["table", "table"], ["eval", "trials"]],
                              height_ratios=[0.3 + 0.2 * len(jobs), 3.0],
                              gridspec_kw={"left": 0.06, "right": 0.98, "bottom": 0.11, "top": 0.93,
                                           "hspace": 0.3, "wspace": 0.2})
    top = best(jobs)
    _draw_table(axes["table"], jobs, top)
    _draw_eval(axes["eval"], records)
    _draw_trials(axes["trials"], jobs, top, optuna is not None)
    return _save(fig, path)


def _draw_table(ax, jobs: list[Job], top: Job | None) -> None:
    ax.set_axis_off()
    table = ax.table(cellText=sweep_rows(jobs), colLabels=TABLE_COLUMNS, loc="upper center",
                     cellLoc="left", colLoc="left")
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    table.auto_set_column_width(list(range(len(TABLE_COLUMNS))))
    for row, job in enumerate(jobs, start=1):
        color = BEST_COLOR if job is top else FAILED_COLOR if job.failed else None
        if color:
            for col in range(len(TABLE_COLUMNS)):
                table[row, col].set_facecolor(color)
    _, fixed = varying(jobs)
    best_text = f"best job {top.number}: objective {top.objective:.4g}" if top else "no job logged a reward"
    every = " ".join(_short(o) for o in fixed) or "the defaults"
    ax.set_title(textwrap.fill(f"{best_text} (highlighted); every job: {every}", width=160),
                 fontsize="small", loc="left")


def _draw_eval(ax, records: dict[str, list[dict]]) -> None:
    for name, job_records in records.items():
        series = line_series(job_records, (EVAL_KEY,))
        if EVAL_KEY in series:
            ax.plot(*series[EVAL_KEY], marker="o", label=name)
    ax.set(title=f"{EVAL_KEY} (held-out) per job", xlabel=STEP_KEY, ylabel=EVAL_KEY)
    if ax.lines:
        ax.legend(title="job", fontsize="x-small")
    else:
        ax.text(0.5, 0.5, "no held-out evaluation (eval.every=0)", ha="center", transform=ax.transAxes)


def _draw_trials(ax, jobs: list[Job], top: Job | None, is_optuna: bool) -> None:
    done = [job for job in jobs if not job.failed and job.number is not None]
    ax.plot([j.number for j in done], [j.objective for j in done], marker="o", linestyle="none",
            label="objective")
    running, so_far = [], float("-inf")
    for job in done:
        so_far = max(so_far, job.objective)
        running.append(so_far)
    ax.step([j.number for j in done], running, where="post", label="best so far")
    failed = [job.number for job in jobs if job.failed and job.number is not None]
    if failed:
        ax.plot(failed, [min(running, default=0.0)] * len(failed), marker="x", color="red",
                linestyle="none", label="failed")
    if top is not None and top.number is not None:
        ax.plot([top.number], [top.objective], marker="*", markersize=16, color="gold",
                markeredgecolor="black", linestyle="none", label=f"best: {top.number}")
    ax.set(title="Optuna trials in the order they ran" if is_optuna else "objective per job",
           xlabel="trial" if is_optuna else "job", ylabel="objective (maximized)")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize="small")


def _save(fig, path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        if ax.get_xlabel() == STEP_KEY:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps, not 0.5
    fig.savefig(path, dpi=100)
    return path


# -- entry point ---------------------------------------------------------------------------

def render(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write the figures of a run (or the comparison of a multirun's jobs); returns their paths."""
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "report"
    if is_multirun(run_dir):
        return render_sweep(run_dir, out_dir)
    records = read_metrics(run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [plot_phases(records, out_dir / "phases.png"),
               plot_memory(records, out_dir / "memory.png"),
               plot_reward(records, out_dir / "reward.png"),
               plot_train(records, out_dir / "train.png")]
    return [path for path in written if path is not None]


def render_sweep(sweep_dir: Path, out_dir: Path) -> list[Path]:
    """The figures and table comparing a multirun's jobs (module docstring)."""
    records = {job.name: read_metrics(job) for job in job_dirs(sweep_dir)}
    jobs = [Job.read(d, records.get(d.name, []))
            for d in sorted([*job_dirs(sweep_dir), *failed_job_dirs(sweep_dir)], key=_job_number)]
    optuna = optuna_results(sweep_dir)
    # a job by its number and what it varied: its directory's name repeats every override
    labelled = {f"{job.number}: " + ", ".join(_short(o) for o in overrides): records[job.name]
                for job, overrides in zip(jobs, varying(jobs)[0]) if not job.failed}
    out_dir.mkdir(parents=True, exist_ok=True)
    return [plot_reward_by_job(labelled, out_dir / "reward_by_job.png"),
            plot_phases_by_job(labelled, out_dir / "phases_by_job.png"),
            plot_sweep(jobs, labelled, optuna, out_dir / "sweep.png"),
            write_sweep_table(jobs, optuna, str(sweep_dir), out_dir / "sweep.md")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colo_rl.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run's output directory (or a multirun's sweep directory)")
    parser.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        written = render(args.run_dir, args.out)
    except MetricsFileError as exc:
        print(f"colo_rl.report: {exc}", file=sys.stderr)
        return 2
    if not is_multirun(args.run_dir) and not any(p.name == "memory.png" for p in written):
        print("colo_rl.report: no memory.png: the run logged no memory/* keys "
              "(free GPU memory is measured on CUDA only)", file=sys.stderr)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
