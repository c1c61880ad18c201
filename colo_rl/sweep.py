"""What a sweep reads from its jobs: each job's objective, overrides, final metrics and time.

The objective is what `colo_rl.run.run(cfg)` returns to Hydra's sweeper (Optuna's
`hydra.sweeper.direction: maximize`): the last held-out `eval/reward/mean` the run logged (the
final evaluation of the trained policy, `eval.every > 0`). A run without held-out evaluation
(`eval.every=0`) returns the mean `reward/mean` of its last `TRAIN_TAIL` steps instead, a noisier
number (it is measured on the prompts it trains on, with sampling noise).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

EVAL_KEY = "eval/reward/mean"
TRAIN_KEY = "reward/mean"
TRAIN_TAIL = 5  # steps averaged when there is no held-out evaluation
DIRECTION = "maximize"  # both objectives are rewards
# The final metrics the sweep table shows per job, when the job logged them.
FINAL_KEYS = (EVAL_KEY, TRAIN_KEY, "timing/step_s", "setup/total_s")


def objective(records: list[dict]) -> float:
    """The number a sweeper optimises for one run's metric records (module docstring); NaN for a
    run that logged no reward at all."""
    evals = [r[EVAL_KEY] for r in records if EVAL_KEY in r]
    if evals:
        return float(evals[-1])
    steps = [r[TRAIN_KEY] for r in records if TRAIN_KEY in r]
    return float(mean(steps[-TRAIN_TAIL:])) if steps else math.nan


@dataclass
class Job:
    """One job of a multirun as its directory left it."""

    name: str  # the directory's name: `NUM_OVERRIDES`
    number: int | None
    overrides: list[str]  # what the sweep set for this job (.hydra/overrides.yaml), else from the name
    objective: float  # NaN for a job that logged no step (it failed before its first)
    final: dict[str, float]  # the last value of each FINAL_KEYS key the job logged
    seconds: float  # as logged: set-up, the steps and the final evaluation (not the engine's close)

    @property
    def failed(self) -> bool:
        return not self.final

    @classmethod
    def read(cls, directory: Path, records: list[dict]) -> "Job":
        """The job in `directory` from its metric records ([] for a job that logged none)."""
        match = re.match(r"(\d+)_?(.*)", directory.name)
        final = {}
        for key in FINAL_KEYS:
            logged = [r[key] for r in records if key in r]
            if logged:
                final[key] = logged[-1]
        # set-up, every step, and the final evaluation (a record of its own, with no step_s)
        seconds = sum(r.get("setup/total_s", 0.0) + r.get("timing/step_s", r.get("timing/eval_s", 0.0))
                      for r in records)
        return cls(name=directory.name, number=int(match.group(1)) if match else None,
                   overrides=_overrides(directory, match.group(2) if match else directory.name),
                   objective=objective(records), final=final, seconds=seconds)


def _overrides(directory: Path, from_name: str) -> list[str]:
    """The job's sweep overrides: Hydra's own record of them, or the directory name's."""
    path = directory / ".hydra" / "overrides.yaml"
    if path.is_file():
        from omegaconf import OmegaConf

        return [str(o) for o in OmegaConf.load(path)]
    return [o for o in from_name.split(",") if o]


def varying(jobs: list[Job]) -> tuple[list[list[str]], list[str]]:
    """Each job's overrides that differ between the jobs (what the sweep varied), and the
    overrides every job shares (the sweep's fixed command line)."""
    shared = set.intersection(*(set(job.overrides) for job in jobs)) if jobs else set()
    fixed = [o for o in jobs[0].overrides if o in shared] if jobs else []
    return [[o for o in job.overrides if o not in shared] for job in jobs], fixed


def best(jobs: list[Job]) -> Job | None:
    """The job with the highest objective (DIRECTION), ignoring jobs whose objective is NaN."""
    scored = [job for job in jobs if not math.isnan(job.objective)]
    return max(scored, key=lambda job: job.objective) if scored else None


def optuna_results(sweep_dir: Path) -> dict | None:
    """optimization_results.yaml, which Hydra's Optuna sweeper writes into the sweep directory
    once every trial has run (best_params, best_value), or None for any other sweep."""
    path = Path(sweep_dir) / "optimization_results.yaml"
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path))
