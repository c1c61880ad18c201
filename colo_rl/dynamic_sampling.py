"""DAPO's dynamic sampling (trainer.algo.dynamic_sampling): a step trains only on groups whose rewards
have a spread, filled from further prompts generated in the same wake of the engine.

A group whose completions all got the same reward has zero advantage under every group
estimator: it costs a forward and backward for no gradient. `DynamicSampler` is the Switch's
`refill`: after each generate call of the wake it scores the round, keeps the groups with a
spread, and asks for as many new prompts as groups are missing, until the step has
trainer.prompts_per_step of them or trainer.algo.dynamic_sampling.max_rounds calls were made (verl's
max_num_gen_batches). A step that reaches the bound short of groups is topped up with dropped
groups (they add nothing to the gradient), so every step trains on prompts_per_step groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from colo_rl.config import RunConfig
from colo_rl.generator import Rollouts
from colo_rl.tasks import Batch, Task


@dataclass
class _Group:
    """One prompt's row and its completions, with their rewards."""

    batch: Batch  # one row
    completion_ids: list[list[int]]
    texts: list[str]
    logprobs: list[list[float]] | None
    finish_reasons: list[str]
    rewards: list[float]
    values: dict[str, list]  # per reward function

    @property
    def spread(self) -> bool:
        return max(self.rewards) != min(self.rewards)


@dataclass
class DynamicSampler:
    """One step's dynamic sampling: call it with each round's rollouts (the Switch does, in the
    wake); `result()` is the step's batch afterwards."""

    settings: RunConfig
    task: Task
    step: int
    batch: Batch  # the step's first prompts
    asked: Batch | None = None  # the prompts of the round in flight
    rounds: int = 0
    kept: list[_Group] = field(default_factory=list)
    dropped: list[_Group] = field(default_factory=list)
    tokens: int = 0

    def __call__(self, rollouts: Rollouts, round_index: int):
        """Scores round `round_index`'s rollouts (of the prompts last asked for); returns the
        (prompt ids, seed) of the next round, or None when the step has its groups or the bound
        is reached. Round 0 starts the step afresh (a retried wake begins again)."""
        if round_index == 0:
            self.rounds, self.kept, self.dropped, self.tokens, self.asked = 0, [], [], 0, self.batch
        self.rounds += 1
        self.tokens += sum(len(ids) for ids in rollouts.completion_ids)
        for group in self._groups(self.asked, rollouts):
            (self.kept if group.spread else self.dropped).append(group)
        target = self.settings.trainer.prompts_per_step
        if len(self.kept) >= target or self.rounds >= self.settings.trainer.algo.dynamic_sampling.max_rounds:
            return None
        self.asked = self.task.next_batch(target - len(self.kept))
        return self.asked.prompt_ids, _round_seed(self.settings, self.step, self.rounds, len(self.asked))

    def _groups(self, batch: Batch, rollouts: Rollouts) -> list[_Group]:
        n = self.settings.sampling.n
        rewards, values = self.task.score(batch, rollouts.texts, n, f"at step {self.step}",
                                          rollouts.completion_ids)
        groups = []
        for i in range(len(batch)):
            part = slice(i * n, (i + 1) * n)
            groups.append(_Group(batch.slice(slice(i, i + 1)), rollouts.completion_ids[part], rollouts.texts[part],
                                 rollouts.logprobs[part] if rollouts.logprobs is not None else None,
                                 rollouts.finish_reasons[part], rewards[part],
                                 {name: v[part] for name, v in values.items()}))
        return groups

    def result(self, rollouts: Rollouts) -> tuple[Batch, Rollouts, list[float], dict[str, list], dict[str, float]]:
        """(batch, rollouts, rewards, reward values, rollout/* metrics) of the groups the step
        trains on. `rollouts`: what the Switch returned (the first round, with the wake's metrics)."""
        target = self.settings.trainer.prompts_per_step
        groups = self.kept[:target]
        filled = self.dropped[:target - len(groups)]
        groups = groups + filled
        batch = Batch([p for g in groups for p in g.batch.prompts],
                      {k: [v for g in groups for v in g.batch.columns[k]] for k in self.batch.columns},
                      [ids for g in groups for ids in g.batch.prompt_ids])
        merged = Rollouts(prompt_ids=batch.prompt_ids, completion_ids=[c for g in groups for c in g.completion_ids],
                          texts=[t for g in groups for t in g.texts],
                          logprobs=None if rollouts.logprobs is None else [lp for g in groups for lp in g.logprobs],
                          finish_reasons=[r for g in groups for r in g.finish_reasons],
                          group_size=rollouts.group_size, metrics=rollouts.metrics, evaluation=rollouts.evaluation)
        values = {name: [v for g in groups for v in g.values[name]] for name in groups[0].values}
        generated = (len(self.kept) + len(self.dropped)) * self.settings.sampling.n
        metrics = {"rollout/rounds": float(self.rounds),
                   "rollout/groups_dropped": float(len(self.dropped) - len(filled)),
                   "rollout/groups_filled": float(len(filled)),
                   # every round's completions, not only the trained ones
                   "rollout/tokens": float(self.tokens),
                   "rollout/mean_length": self.tokens / max(1, generated),
                   "rollout/tokens_per_s": self.tokens / max(rollouts.metrics.get("timing/generate_s", 0.0), 1e-9)}
        return batch, merged, [r for g in groups for r in g.rewards], values, metrics


def dynamic_sampler(settings: RunConfig, task: Task, batch: Batch, step: int) -> DynamicSampler | None:
    """The step's DynamicSampler with trainer.algo.dynamic_sampling.enabled, else None."""
    return DynamicSampler(settings, task, step, batch) if settings.trainer.algo.dynamic_sampling.enabled else None


def _round_seed(settings: RunConfig, step: int, round_index: int, count: int) -> int | list[int] | None:
    """The seed of a further round: distinct from every step's first round (colo_rl.run.step_seed)
    and from the step's other rounds; one per prompt under sampling.seed_scope=prompt."""
    s = settings.sampling
    if s.seed is None:
        return None
    base = ((s.seed + step) * 1_000_003 + 7_919 * round_index + 104_729) % 2**31
    return base if s.seed_scope == "batch" else [(base + i * s.n) % 2**31 for i in range(count)]
