"""Advantage estimators and policy losses: the named parts an RL algorithm is made of.

trainer.algo.advantage_estimator and trainer.algo.policy_loss name one each, as a built-in short name or as
a `module:function` import path (the built-ins go through the same loader, as reward functions
do: colo_rl.rewards.load_function). A user's own part follows the built-ins' signatures:

    def my_estimator(rewards, group_size, *, lengths, cfg) -> advantages
        rewards: (N,) float64, each prompt's group of `group_size` consecutive; lengths: (N,)
        response tokens of each completion; cfg: the TrainerConfig. Returns (N,) advantages.

    def my_loss(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high) -> (per_token, clipped)
        logprobs, old_logprobs: (B, T); advantages: (B,); mask: (B, T) bool, True for real
        tokens. Returns the (B, T) per-token loss (before importance weights, KL and
        aggregation, which the trainer applies) and the (B, T) bool of tokens a clip bound stops.

The peers' versions of each are pinned in tests/trainer/test_algorithms.py
(tests/trainer/algorithms_reference.py computes their values with verl's own code).
"""

from __future__ import annotations

from typing import Callable

import torch

from colo_rl.config import _check
from colo_rl.rewards import load_function
from colo_rl.trainer.loss import group_advantages, ppo_clip  # noqa: F401 (ppo_clip: a built-in by this path)

ADVANTAGE_ESTIMATORS = {name: f"colo_rl.trainer.algorithms:{name}" for name in ("grpo", "rloo", "reinforce_pp")}
POLICY_LOSSES = {name: f"colo_rl.trainer.algorithms:{name}" for name in ("ppo_clip", "gspo")}


def load_estimator(path: str) -> Callable:
    """trainer.algo.advantage_estimator as a function; ConfigError naming the key otherwise."""
    return load_function(path, "trainer.algo.advantage_estimator", ADVANTAGE_ESTIMATORS)


def load_policy_loss(path: str) -> Callable:
    """trainer.algo.policy_loss as a function; ConfigError naming the key otherwise."""
    return load_function(path, "trainer.algo.policy_loss", POLICY_LOSSES)


def grpo(rewards: torch.Tensor, group_size: int, *, lengths: torch.Tensor, cfg) -> torch.Tensor:
    """GRPO's group-relative advantage: r - group mean, over the group's std with
    trainer.algo.advantage_norm=std (verl's compute_grpo_outcome_advantage, TRL's GRPOTrainer)."""
    return group_advantages(rewards, group_size, cfg.algo.advantage_norm, std=cfg.algo.advantage_std)


def rloo(rewards: torch.Tensor, group_size: int, *, lengths: torch.Tensor, cfg) -> torch.Tensor:
    """RLOO: each reward minus the mean of the other rewards of its group (the leave-one-out
    baseline, verl's compute_rloo_outcome_advantage). A group whose rewards are all equal gets
    exactly 0, and so does a group of one (no other completion to compare with)."""
    groups = rewards.to(torch.float64).reshape(-1, group_size)
    if group_size == 1:
        return torch.zeros_like(rewards)
    baseline = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    constant = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    return torch.where(constant, 0.0, groups - baseline).to(rewards.dtype).reshape(-1)


def reinforce_pp(rewards: torch.Tensor, group_size: int, *, lengths: torch.Tensor, cfg) -> torch.Tensor:
    """REINFORCE++: the outcome reward whitened over the whole batch's response tokens (verl's
    compute_reinforce_plus_plus_outcome_advantage with gamma 1: every token's return is its
    sequence's reward, so the mean and the Bessel-corrected variance are token-weighted). No
    group baseline: groups are not needed, and the batch is this process's."""
    r = rewards.to(torch.float64)
    weights = lengths.to(torch.float64)
    tokens = weights.sum()
    if tokens < 2:  # no variance to whiten by
        return torch.zeros_like(rewards)
    mean = (weights * r).sum() / tokens
    var = (weights * (r - mean) ** 2).sum() / tokens * (tokens / (tokens - 1))
    return ((r - mean) * torch.rsqrt(var + 1e-8)).to(rewards.dtype)


def gspo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
         mask: torch.Tensor, *, clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: PPO's clip on the sequence-level ratio exp(mean over the sequence's tokens of
    logprobs - old_logprobs), given to every token of the sequence, whose gradient flows through
    each token's log-prob (verl's compute_policy_loss_gspo, TRL's importance_sampling_level=
    "sequence"). The log-ratio is capped at 10 as verl's is."""
    gap = torch.where(mask, logprobs - old_logprobs, 0.0)
    sequence = gap.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    own = torch.where(mask, logprobs, 0.0)
    log_ratio = (own - own.detach() + sequence.detach().unsqueeze(1)).clamp(max=10.0)
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def check_algorithm(settings) -> None:
    """The named parts import, and the features that need a whole batch in one process have it:
    part of the input's checks (run after config.validate, before any engine starts), here since
    config.py cannot import the trainer."""
    t = settings.trainer
    load_estimator(t.algo.advantage_estimator)
    load_policy_loss(t.algo.policy_loss)
    if t.parallel != "none":
        _check(t.algo.advantage_estimator != "reinforce_pp", "trainer.algo.advantage_estimator", t.algo.advantage_estimator,
               f"whitens over the whole batch, which trainer.parallel={t.parallel} splits across ranks: "
               "use grpo or rloo, or trainer.parallel=none")
        _check(t.parallel != "fsdp" or not t.algo.skip_zero_advantage, "trainer.algo.skip_zero_advantage", True,
               "is not supported with trainer.parallel=fsdp (the ranks' forward counts would differ, and "
               "each sharded forward needs all of them): set it false or use trainer.parallel=ddp")
        _check(not t.algo.dynamic_sampling.enabled, "trainer.algo.dynamic_sampling.enabled", True,
               f"is not supported with trainer.parallel={t.parallel} yet (each rank would keep a different "
               "number of groups): set it false or trainer.parallel=none")
    if t.algo.skip_zero_advantage:
        _check(t.algo.kl_coef == 0, "trainer.algo.skip_zero_advantage", True,
               f"cannot skip sequences with trainer.algo.kl_coef={t.algo.kl_coef}: their KL term has a gradient; "
               "set trainer.algo.skip_zero_advantage=false or trainer.algo.kl_coef=0")
        _check(t.algo.policy_loss in POLICY_LOSSES, "trainer.algo.skip_zero_advantage", True,
               f"needs a built-in trainer.algo.policy_loss ({', '.join(POLICY_LOSSES)}), whose gradient at zero "
               f"advantage is known to be 0; {t.algo.policy_loss!r} may need those sequences: set "
               "trainer.algo.skip_zero_advantage=false")
