"""The optimizer (trainer.optim.name) and the learning-rate schedule (trainer.optim.lr_schedule)."""

from __future__ import annotations

import math

import torch

from colo_rl.config import TrainerConfig


def scheduled_lr(lr: float, step: int, *, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """The learning rate of step `step` (0-based): transformers' get_constant_schedule_with_warmup,
    get_linear_schedule_with_warmup and get_cosine_schedule_with_warmup (half a cosine), with
    their arithmetic, so that a run's lr sequence is theirs to the bit."""
    if step < warmup_steps:
        return lr * (float(step) / float(max(1, warmup_steps)))
    if schedule == "constant":
        return lr
    if schedule == "linear":
        return lr * max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))
    if schedule == "cosine":
        progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        return lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
    raise ValueError(f"lr schedule={schedule!r} must be constant, linear or cosine (trainer.optim.lr_schedule)")

def make_optimizer(params, cfg: TrainerConfig, fused: bool = False) -> torch.optim.Optimizer:
    """trainer.optim.name over `params`. Its state takes the parameters' dtype (fp32 under mixed
    precision), except adamw_8bit's block-wise 8-bit moments (bitsandbytes keeps tensors under
    4096 elements, norms and biases, in 32 bits). `fused`: torch's fused AdamW kernel (same
    update as the foreach one up to float rounding; CUDA parameters only)."""
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay)
    if cfg.optim.name == "adamw":
        return torch.optim.AdamW(params, **kwargs, **({"fused": True} if fused else {}))
    if cfg.optim.name == "adamw_8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, **kwargs)
    if cfg.optim.name == "adamw_bf16_sr":
        from torchao.optim import _AdamW

        return _AdamW(params, bf16_stochastic_round=True, **kwargs)
    raise ValueError(f"optimizer={cfg.optim.name!r} unknown (trainer.optim.name)")
