"""Advantage estimators and policy losses: the named parts an RL algorithm is made of.

trainer.advantage_estimator and trainer.policy_loss name one each, as a built-in short name or as
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

from colo_rl.rewards import load_function

ADVANTAGE_ESTIMATORS = {name: f"colo_rl.trainer.algorithms:{name}" for name in ("grpo", "rloo", "reinforce_pp")}
POLICY_LOSSES = {name: f"colo_rl.trainer.algorithms:{name}" for name in ("ppo_clip", "gspo")}


def load_estimator(path: str) -> Callable:
    """trainer.advantage_estimator as a function; ConfigError naming the key otherwise."""
    return load_function(path, "trainer.advantage_estimator", ADVANTAGE_ESTIMATORS)


def load_policy_loss(path: str) -> Callable:
    """trainer.policy_loss as a function; ConfigError naming the key otherwise."""
    return load_function(path, "trainer.policy_loss", POLICY_LOSSES)


def grpo(rewards: torch.Tensor, group_size: int, *, lengths: torch.Tensor, cfg) -> torch.Tensor:
    """GRPO's group-relative advantage: r - group mean, over the group's std with
    trainer.advantage_norm=std (verl's compute_grpo_outcome_advantage, TRL's GRPOTrainer)."""
    from colo_rl.trainer.grpo import group_advantages  # grpo.py imports this module

    return group_advantages(rewards, group_size, cfg.advantage_norm, std=cfg.advantage_std)


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


def ppo_clip(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, *, clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) with the
    token ratio r = exp(logprobs - old_logprobs) (verl's compute_policy_loss_vanilla without its
    dual clip; clip_high > clip_low is DAPO's clip-higher)."""
    # exp of a padded position's gap can be inf, and inf * 0 is NaN: zero the gap first.
    ratio = torch.exp(torch.where(mask, logprobs - old_logprobs, 0.0))
    adv = advantages.unsqueeze(1)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    # the clipped term is the larger one exactly where a bound stops the gradient: below
    # 1 - clip_low with a negative advantage, above 1 + clip_high with a positive one
    return torch.maximum(unclipped, clipped), clipped > unclipped


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
