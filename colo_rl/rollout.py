"""What the loop asks for each step: a rollout. Today's is single-turn: sample the step's prompts,
generate their completions through the switch (the engine wakes, generates and sleeps), score
them; the held-out evaluation rides in the same wake when it is due. Multi-turn episodes and
dynamic sampling plug in as other rollout classes with the same `collect(step)`, without touching
the loop (colo_rl/run.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from statistics import mean

import torch

from colo_rl.config import RunConfig, SamplingConfig
from colo_rl.dynamic_sampling import dynamic_sampler
from colo_rl.generator.client import Rollouts
from colo_rl.metrics import MetricsLogger
from colo_rl.parallel import Parallel
from colo_rl.switch import Switch
from colo_rl.tasks import Batch, Task
from colo_rl.timing import StepTimer
from colo_rl.trainer.algorithms import load_estimator


@dataclass
class StepRollout:
    """One step's rollout: this rank's prompts, their completions and rewards (the weighted total
    and each function's values), the evaluation's metrics when one ran, and the step's timer
    (started when the step began) for the phases that follow."""

    batch: Batch
    rollouts: Rollouts
    rewards: list[float]
    values: dict[str, list]
    eval_metrics: dict[str, float]
    timer: StepTimer
    started: float


class SingleTurnRollout:
    """One completion per sample: prompts drawn by the task's sampler, sampling.n completions of
    each, every completion scored by the task's reward functions. Under data parallelism every
    rank draws the same global batch and works on its shard."""

    def __init__(self, settings: RunConfig, task: Task, switch: Switch, logger: MetricsLogger, par: Parallel):
        self.settings, self.task, self.switch, self.logger, self.par = settings, task, switch, logger, par

    def collect(self, step: int) -> StepRollout:
        settings, task, par = self.settings, self.task, self.par
        s, e = settings.sampling, settings.eval
        timer = StepTimer()
        started = time.perf_counter()
        global_batch = task.next_batch(settings.trainer.prompts_per_step)
        shard = par.shard(global_batch.prompts)
        batch, seed = global_batch.slice(shard), step_seed(s, step, len(global_batch), shard, par.rank)
        evaluating = task.held_out is not None and step % e.every == 0
        eval_batch = eval_shard(task, par) if evaluating else None
        self.logger.phase("generate")
        sampler = dynamic_sampler(settings, task, batch, step)  # None unless trainer.algo.dynamic_sampling.enabled
        rollouts = self.switch.generate(
            batch.prompt_ids, step_sampling(settings, step), seed=seed, step=step,
            eval_batch=(eval_batch.prompt_ids, eval_sampling(settings)) if evaluating else None,
            refill=sampler)
        self.logger.phase("train")
        with timer.phase("score"):
            if sampler is None:
                rewards, values = task.score(batch, rollouts.texts, s.n, f"at step {step}", rollouts.completion_ids)
            else:  # scored in the wake: the groups with a spread, from every round
                batch, rollouts, rewards, values, sampled = sampler.result(rollouts)
                rollouts.metrics.update(sampled)
            eval_metrics = (evaluation_metrics(task, eval_batch, rollouts.evaluation, settings, step, par)
                            if evaluating else {})
        return StepRollout(batch, rollouts, rewards, values, eval_metrics, timer, started)


def step_seed(s: SamplingConfig, step: int, num_prompts: int, shard: slice, rank: int) -> int | list[int] | None:
    """The seed of this rank's generate call at `step`: under sampling.seed_scope=batch one int
    (the engine's sampler is seeded with it before the call; ranks differ), under prompt one per
    prompt of the shard (prompt_seeds); None for unseeded sampling."""
    if s.seed is None:
        return None
    if s.seed_scope == "prompt":
        return prompt_seeds(s.seed, step, num_prompts, s.n)[shard]
    return ((s.seed + step) * 1_000_003 + rank) % 2**31


def prompt_seeds(sampling_seed: int | None, step: int, num_prompts: int, n: int) -> list[int] | None:
    """One sampling seed per prompt of the global batch (vLLM gives completion j seed + j), so
    what a prompt samples depends on the step and its index, not on the batch it shares."""
    if sampling_seed is None:
        return None
    base = (sampling_seed + step) * num_prompts * n
    return [(base + i * n) % 2**31 for i in range(num_prompts)]


def logprobs_due(settings: RunConfig, step: int) -> bool:
    """Whether step `step` asks the engine for sampled-token log-probs: every step with
    trainer.algo.tis_cap (its importance weights need them), else steps 0, K, 2K... of
    sampling.logprobs_every=K (null: 10), which log train/engine_logprob_gap. The loss without
    TIS does not read them, so the other steps train identically, at the engine's full speed."""
    s = settings.sampling
    if not s.logprobs:
        return False
    every = s.logprobs_every or (1 if settings.trainer.algo.tis_cap is not None else 10)
    return step % every == 0


def step_sampling(settings: RunConfig, step: int) -> SamplingConfig:
    """sampling, with log-probs asked for only on the steps `logprobs_due` names."""
    s = settings.sampling
    due = logprobs_due(settings, step)
    return s if due == s.logprobs else replace(s, logprobs=due)


def eval_sampling(settings: RunConfig) -> SamplingConfig:
    """How held-out prompts are sampled: eval.n completions at eval.temperature (greedy by
    default), with the training run's length and stop settings and a fixed seed."""
    s, e = settings.sampling, settings.eval
    return SamplingConfig(name="eval", n=e.n, temperature=e.temperature, max_tokens=s.max_tokens,
                          stop=list(s.stop), seed=s.seed, logprobs=False)


def eval_shard(task: Task, par: Parallel) -> Batch:
    """This rank's share of the held-out prompts (every world_size-th, so any count splits)."""
    return task.held_out.slice(slice(par.rank, None, par.world_size))


def evaluation_metrics(task: Task, batch: Batch, rollouts: Rollouts, settings: RunConfig,
                       step: int, par: Parallel) -> dict[str, float]:
    """eval/*: the held-out prompts' mean reward (and each function's), the share of prompts
    with a completion reaching eval.pass_reward (pass@n), and the completions' mean length."""
    e = settings.eval
    totals, values = task.score(batch, rollouts.texts, e.n, f"at step {step} (evaluation)",
                                rollouts.completion_ids)
    lengths = [len(ids) for ids in rollouts.completion_ids]
    passed = [max(totals[i:i + e.n]) >= e.pass_reward for i in range(0, len(totals), e.n)]
    gathered = par.gather((totals, values, lengths, passed))
    totals = [x for g in gathered for x in g[0]]
    values = {name: [v for g in gathered for v in g[1][name]] for name in values}
    lengths = [x for g in gathered for x in g[2]]
    passed = [x for g in gathered for x in g[3]]
    return {"eval/reward/mean": mean(totals), **task.rewards.metrics(values, "eval/reward/"),
            f"eval/pass_at_{e.n}": float(mean(passed)), "eval/mean_length": float(mean(lengths)),
            "eval/prompts": float(len(passed))}


def final_evaluation(step: int, settings: RunConfig, task: Task, switch: Switch,
                     logger: MetricsLogger, par: Parallel) -> None:
    """The held-out evaluation of the trained policy, in a wake of its own; logged as a record
    of its own at `step` (the number of steps trained)."""
    logger.phase("eval")
    batch = eval_shard(task, par)
    start = time.perf_counter()
    rollouts = switch.generate(batch.prompt_ids, eval_sampling(settings))
    metrics = evaluation_metrics(task, batch, rollouts, settings, step, par)
    metrics["timing/eval_s"] = time.perf_counter() - start
    logger.log(step, metrics, count_step=False)


def sample_rows(step: int, batch: Batch, texts: list[str], rewards: list[float],
                values: dict[str, list], settings: RunConfig, completion_ids: list[list[int]]) -> list[dict]:
    """The first logger.log_completions completions of the step, each with its prompt, every
    reward function's value, the weighted reward and its advantage (trainer.algo.advantage_estimator)."""
    n, count = settings.sampling.n, settings.logger.log_completions
    estimator = load_estimator(settings.trainer.algo.advantage_estimator)
    advantages = estimator(torch.tensor(rewards, dtype=torch.float64), n,
                           lengths=torch.tensor([len(c) for c in completion_ids]), cfg=settings.trainer).tolist()
    prompts, _ = batch.repeated(n)
    return [{"step": step, "prompt": prompts[i], "completion": texts[i], "reward": rewards[i],
             "rewards": {name: vals[i] for name, vals in values.items()},
             "advantage": advantages[i]} for i in range(min(count, len(texts)))]
