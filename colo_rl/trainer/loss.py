"""GRPO's maths: group-relative advantages, the loss normalizer of each aggregation, the clipped
token-level loss, and the truncated importance sampling (TIS) statistics against the engine."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from colo_rl.trainer.batch import _MicroBatch

LOSS_AGGS = ("token", "sequence", "constant")

def group_advantages(rewards: torch.Tensor, group_size: int, norm: str, eps: float = 1e-6,
                     std: str = "unbiased") -> torch.Tensor:
    """Each completion's reward relative to its prompt's group: the GRPO advantage.

    rewards: (num_prompts * group_size,), each prompt's group consecutive. norm 'mean' gives
    r - group mean (Dr. GRPO); 'std' gives (r - mean) / (std + eps) (GRPO), with the group's
    `std` 'unbiased' (Bessel-corrected, as TRL's GRPOTrainer and verl's
    compute_grpo_outcome_advantage) or 'population'. The statistics are taken in float64 and a
    group whose rewards are all equal gets exactly 0: in float32 the mean of ten rewards of 0.1
    differs from 0.1, and dividing that residue by (std + eps) would turn it into a real signal.
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of "
                         f"group_size={group_size}: pass a 1-D tensor of num_prompts * group_size rewards")
    if norm not in ("mean", "std"):
        raise ValueError(f"advantage norm={norm!r} must be 'mean' or 'std' (trainer.algo.advantage_norm)")
    if std not in ("unbiased", "population"):
        raise ValueError(f"advantage std={std!r} must be 'unbiased' or 'population' (trainer.algo.advantage_std)")
    groups = rewards.to(torch.float64).reshape(-1, group_size)
    constant = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if norm == "std" and group_size > 1:  # a group of one is constant: its advantage is 0 below
        spread = groups.std(dim=1, unbiased=std == "unbiased", keepdim=True)
        advantages = advantages / (spread + eps)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    return torch.where(constant, 0.0, advantages).to(dtype).reshape(-1)

def loss_normalizer(lengths: torch.Tensor, loss_agg: str, max_tokens: int) -> float:
    """The denominator of the aggregated loss for sequences of these response lengths.

    'token': the number of response tokens; 'sequence': the number of non-empty sequences (an
    empty one has no token mean to average); 'constant': sequences x max_tokens (Dr. GRPO). At
    least 1, so a batch of empty completions gives loss 0, not NaN.
    """
    if loss_agg == "token":
        return max(float(lengths.sum()), 1.0)
    if loss_agg == "sequence":
        return max(float((lengths > 0).sum()), 1.0)
    if loss_agg == "constant":
        return float(lengths.numel() * max_tokens)
    raise ValueError(f"loss_agg={loss_agg!r} must be one of {', '.join(LOSS_AGGS)} (trainer.algo.loss_agg)")

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


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, *, clip_eps: float, loss_agg: str, max_tokens: int,
              clip_eps_high: Optional[float] = None, ref_logprobs: Optional[torch.Tensor] = None,
              kl_coef: float = 0.0, tis_weights: Optional[torch.Tensor] = None,
              normalizer: Optional[float] = None, sync: bool = True,
              policy_loss: Optional[Callable] = None) -> tuple[torch.Tensor, dict]:
    """The token-level clipped policy-gradient loss, with an optional k3 KL penalty to a reference.

    logprobs, old_logprobs, ref_logprobs, tis_weights, mask: (B, T) over response tokens, mask 1
    for real tokens; advantages: (B,). The PPO ratio r = exp(logprobs - old_logprobs) is clipped
    to [1 - clip_eps, 1 + clip_eps_high] (DAPO's clip-higher; clip_eps_high None: clip_eps), as
    TRL's epsilon_low/epsilon_high. tis_weights (detached, e.g. truncated importance weights of
    the engine/trainer mismatch) multiply the policy-gradient term per token, before the KL per
    token exp(ref - logp) - (ref - logp) - 1 is added. loss_agg: 'token' (sum over masked tokens
    / their number), 'sequence' (each sequence's token mean, then the mean over non-empty
    sequences) or 'constant' (sum / (B * max_tokens), Dr. GRPO). `normalizer` overrides the
    denominator: the trainer passes the full batch's so that micro-batch losses add up to the
    full-batch loss. Padded positions never reach an exp, so any value there (an overflowing
    log-prob gap included) leaves the loss and its gradient unchanged. `policy_loss` makes the
    per-token term and its clip flags (ppo_clip by default; colo_rl/trainer/algorithms.py: gspo, a user's).
    Returns (loss, stats) with stats clip_frac (tokens where either clip bound is active) and
    kl (means over masked tokens) and tokens: Python floats, or with sync=False 0-d tensors on the
    loss's device, so that a caller summing micro-batches waits for the GPU once, not per call.
    """
    if not logprobs.shape == old_logprobs.shape == mask.shape or advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"grpo_loss needs logprobs, old_logprobs, mask of one (B, T) shape and advantages "
                         f"of (B,); got {tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, "
                         f"{tuple(mask.shape)}, {tuple(advantages.shape)}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs: pass the reference policy's log-probs")
    real = mask.bool()
    mask = mask.to(logprobs.dtype)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    per_token, clip_active = (policy_loss or ppo_clip)(logprobs, old_logprobs, advantages.to(logprobs.dtype),
                                                       real, clip_low=clip_eps, clip_high=high)
    if tis_weights is not None:
        per_token = per_token * torch.where(real, tis_weights.detach(), 0.0)
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        delta = torch.where(real, ref_logprobs - logprobs, 0.0)
        kl = torch.exp(delta) - delta - 1
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
    lengths = mask.sum(dim=1)
    if normalizer is None:
        normalizer = loss_normalizer(lengths, loss_agg, max_tokens)
    sums = (per_token * mask).sum(dim=1)
    if loss_agg == "sequence":
        sums = sums / lengths.clamp(min=1)
    loss = sums.sum() / normalizer
    with torch.no_grad():
        tokens = lengths.sum()
        denominator = tokens.clamp(min=1.0)
        stats = {"clip_frac": (clip_active * mask).sum() / denominator,
                 "kl": (kl * mask).sum() / denominator, "tokens": tokens}
    if sync:
        stats = {key: float(value) for key, value in stats.items()}
    return loss, stats

def _tis_ratio(mb: _MicroBatch, trainer_logprobs: torch.Tensor) -> torch.Tensor:
    """(b, T) exp(trainer - engine log-prob) of each sampled token, 1 at padded positions: the
    importance weight of the trainer's policy before the update over the engine's that sampled."""
    gap = torch.where(mb.mask.bool(), trainer_logprobs - mb.engine_logprobs, 0.0)
    return torch.exp(gap)

def _tis_stats(micro: list[_MicroBatch], trainer_logprobs: list[torch.Tensor], cap: float) -> dict[str, float]:
    """The mean importance ratio before truncation over sampled tokens, and the share truncated."""
    total, capped, tokens = 0.0, 0.0, 0.0
    for mb, logprobs in zip(micro, trainer_logprobs):
        ratio = _tis_ratio(mb, logprobs)
        total += float((ratio * mb.mask).sum())
        capped += float(((ratio > cap) * mb.mask).sum())
        tokens += float(mb.mask.sum())
    tokens = max(tokens, 1.0)
    return {"train/tis_ratio_mean": total / tokens, "train/tis_capped_frac": capped / tokens}

def _logprob_gap(micro: list[_MicroBatch], trainer_logprobs: list[torch.Tensor]) -> float:
    """Mean |engine - trainer| log-prob over sampled tokens: near 0 when the weight sync is right."""
    total, tokens = 0.0, 0.0
    for mb, logprobs in zip(micro, trainer_logprobs):
        total += float(((mb.engine_logprobs - logprobs).abs() * mb.mask).sum())
        tokens += float(mb.mask.sum())
    return total / max(tokens, 1.0)
