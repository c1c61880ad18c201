"""GRPO: group-relative advantages, the clipped token-level loss, and the trainer that applies it.

The trainer sees only token ids and rewards; the engine that sampled them lives in another
process. Log-probs are taken at the engine's sampling temperature so that the ratio
exp(logp - old) and the engine-vs-trainer log-prob gap compare like with like; the engine runs
with logprobs_mode=processed_logprobs for the same reason (vLLM's default is before the
temperature; validate refuses TIS at a temperature other than 1 if a user sets that back).
"""

from __future__ import annotations

import copy
import functools
import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.utils.checkpoint

from colo_rl.config import TrainerConfig, logprob_recompute, micro_batch_size, weight_copies
from colo_rl.trainer.algorithms import load_estimator, load_policy_loss, ppo_clip
from colo_rl.trainer.flops import ModelShape, step_flops
from colo_rl.trainer.head import EAGER, accumulate_matmul, compiled_ops, fusable, head_logprobs, logprob_stats
from colo_rl.trainer.kernels import apply_liger, compile_layers, decoder_layers, resolve_kernels
from colo_rl.lora import is_lora, trainable_parameters
from colo_rl.parallel import Parallel

LOSS_AGGS = ("token", "sequence", "constant")


class TrainingDiverged(RuntimeError):
    """trainer.max_nonfinite_steps steps in a row had a non-finite loss or gradient norm; none of
    them changed the trainer, which holds the last finite update's state."""


class TrainerOutOfMemory(RuntimeError):
    """The device ran out of memory in a train step. `state_intact`: it happened before any of the
    step's optimizer steps began, so the parameters and optimizer state are the previous step's
    (the partial gradients are dropped) and a checkpoint of them is a whole step's."""

    def __init__(self, message: str, state_intact: bool):
        super().__init__(message)
        self.state_intact = state_intact


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
        raise ValueError(f"advantage norm={norm!r} must be 'mean' or 'std' (trainer.advantage_norm)")
    if std not in ("unbiased", "population"):
        raise ValueError(f"advantage std={std!r} must be 'unbiased' or 'population' (trainer.advantage_std)")
    groups = rewards.to(torch.float64).reshape(-1, group_size)
    constant = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if norm == "std" and group_size > 1:  # a group of one is constant: its advantage is 0 below
        spread = groups.std(dim=1, unbiased=std == "unbiased", keepdim=True)
        advantages = advantages / (spread + eps)
    dtype = rewards.dtype if rewards.is_floating_point() else torch.get_default_dtype()
    return torch.where(constant, 0.0, advantages).to(dtype).reshape(-1)


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
    raise ValueError(f"lr schedule={schedule!r} must be constant, linear or cosine (trainer.lr_schedule)")


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
    raise ValueError(f"loss_agg={loss_agg!r} must be one of {', '.join(LOSS_AGGS)} (trainer.loss_agg)")


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, *, clip_eps: float, loss_agg: str, max_tokens: int,
              clip_eps_high: Optional[float] = None, ref_logprobs: Optional[torch.Tensor] = None,
              kl_coef: float = 0.0, tis_weights: Optional[torch.Tensor] = None,
              normalizer: Optional[float] = None, sync: bool = True,
              policy_loss=ppo_clip) -> tuple[torch.Tensor, dict]:
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
    per-token term and its clip flags (colo_rl/trainer/algorithms.py: ppo_clip, gspo, a user's).
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
    per_token, clip_active = policy_loss(logprobs, old_logprobs, advantages.to(logprobs.dtype), real,
                                         clip_low=clip_eps, clip_high=high)
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


@dataclass
class _MicroBatch:
    """Right-padded prompt+completion sequences and where their response tokens sit."""

    input_ids: torch.Tensor  # (b, L)
    attention_mask: torch.Tensor  # (b, L)
    positions: torch.Tensor  # (b, T): index in input_ids of each response token
    mask: torch.Tensor  # (b, T): 1.0 for real response tokens
    advantages: torch.Tensor  # (b,)
    engine_logprobs: Optional[torch.Tensor]  # (b, T), or None when the engine sent none
    # (row, column) in (b, T) of each real response token, found on the host when packing so that
    # the chunked head never waits for the GPU to learn how many there are; every position when
    # all completions are empty (one graph through the head all the same)
    rows: torch.Tensor  # (n,)
    cols: torch.Tensor  # (n,)


def _pack(prompts: list[list[int]], completions: list[list[int]], advantages: torch.Tensor,
          engine: Optional[list[list[float]]], pad_token_id: int, device: torch.device) -> _MicroBatch:
    length = max(len(p) + len(c) for p, c in zip(prompts, completions))
    width = max(1, max(len(c) for c in completions))  # one column even when every completion is empty
    b = len(prompts)
    input_ids = torch.full((b, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((b, length), dtype=torch.long)
    positions = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width))
    engine_logprobs = torch.zeros((b, width)) if engine is not None else None
    for i, (p, c) in enumerate(zip(prompts, completions)):
        n = len(p) + len(c)
        input_ids[i, :n] = torch.tensor(p + c, dtype=torch.long)
        attention_mask[i, :n] = 1
        positions[i, :len(c)] = torch.arange(len(p), n)
        mask[i, :len(c)] = 1.0
        if engine is not None:
            engine_logprobs[i, :len(c)] = torch.tensor(engine[i], dtype=torch.float32)
    real = mask.bool() if mask.any() else torch.ones_like(mask, dtype=torch.bool)
    rows, cols = real.nonzero(as_tuple=True)
    return _MicroBatch(input_ids.to(device), attention_mask.to(device), positions.to(device),
                       mask.to(device), advantages.to(device),
                       engine_logprobs.to(device) if engine_logprobs is not None else None,
                       rows.to(device), cols.to(device))


def _masked_truncated(cfg: TrainerConfig, truncated: Optional[list[bool]], count: int) -> Optional[torch.Tensor]:
    """(N,) bool of the completions trainer.mask_truncated leaves out of the loss; None when it is off."""
    if not cfg.mask_truncated:
        return None
    if truncated is None or len(truncated) != count:
        raise ValueError(f"trainer.mask_truncated=true needs one truncated flag per completion ({count}); "
                         f"got {None if truncated is None else len(truncated)}")
    return torch.tensor(truncated, dtype=torch.bool)


def _trained_sequences(cfg: TrainerConfig, advantages: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Indices of the sequences that go through forward and backward: all of them, or with
    trainer.skip_zero_advantage those whose advantage is not 0 and that have loss tokens (the
    others add exactly 0 to the loss and the gradient). At least one, so that the optimizer steps
    on a whole zero gradient as it would without skipping (AdamW skips a parameter without one)."""
    if not cfg.skip_zero_advantage:
        return torch.arange(advantages.numel())
    trained = ((advantages != 0) & (lengths > 0)).nonzero().reshape(-1)
    return trained if trained.numel() else torch.arange(1)


def _check_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], rewards: list[float],
                 group_size: int, engine_logprobs: Optional[list[list[float]]]) -> None:
    if group_size < 1 or len(completion_ids) != len(prompt_ids) * group_size:
        raise ValueError(f"got {len(completion_ids)} completions for {len(prompt_ids)} prompts with "
                         f"group_size={group_size}: pass num_prompts * group_size completions, each "
                         "prompt's group consecutive")
    if len(rewards) != len(completion_ids):
        raise ValueError(f"got {len(rewards)} rewards for {len(completion_ids)} completions: pass one each")
    if not prompt_ids:
        raise ValueError("train_step needs at least one prompt")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (it predicts the first completion token)")
    if engine_logprobs is not None:
        if len(engine_logprobs) != len(completion_ids):
            raise ValueError(f"got {len(engine_logprobs)} engine_logprobs lists for "
                             f"{len(completion_ids)} completions: pass one each")
        for i, (lp, c) in enumerate(zip(engine_logprobs, completion_ids)):
            if len(lp) != len(c):
                raise ValueError(f"engine_logprobs[{i}] has {len(lp)} values for {len(c)} completion "
                                 "tokens: pass one log-prob per sampled token")


class GRPOTrainer:
    """Owns the policy's optimiser (and the frozen reference when KL is on) and runs GRPO steps."""

    # Steps whose update was skipped for a non-finite loss or gradient norm: the current run of
    # them (the runner stops at trainer.max_nonfinite_steps) and all since this trainer was made.
    nonfinite_in_a_row = 0
    nonfinite_total = 0

    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, *, pad_token_id: int,
                 temperature: float, max_tokens: int, device: str, parallel: Parallel | None = None,
                 autocast_dtype: torch.dtype | None = None):
        """`model` is already on `device`, in the dtype its parameters and optimizer state keep (fp32
        masters under trainer.precision=mixed). `autocast_dtype`: what forward and backward compute
        in on a GPU (the engine's dtype under mixed precision); None, and on a CPU, computes in the
        parameters' dtype."""
        self.model = model  # the module whose weights the engine gets
        if cfg.gradient_checkpointing:
            # use_reentrant=False: recomputation that also works when the inputs need no grad
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()  # Hugging Face checkpoints activations only in training mode
        self.parallel = parallel or Parallel.single()
        self.shape = ModelShape.of(model)  # before FSDP shards it; for perf/* (colo_rl/trainer/flops.py)
        self.last_step_flops = 0.0  # model FLOPs of the last train_step
        # Under LoRA the reference is the same model with its adapters disabled: no second copy.
        # Copied before compilation (it only runs forward, without grad); given Liger's kernels below.
        self.reference = _frozen_copy(model) if cfg.kl_coef > 0 and not is_lora(model) else None
        # trainer.kernels=auto: Liger's on a GPU where they can run (colo_rl/trainer/kernels.py)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        self.kernels = resolve_kernels(cfg.kernels, device, model_type, cfg.compile)
        if self.kernels == "liger":
            apply_liger(model)
            if self.reference is not None:  # the policy's forward computation, kernels included
                apply_liger(self.reference)
        if cfg.compile:
            compile_layers(model)
        self.forward_model = _wrap(model, self.parallel, device)  # what runs forward/backward
        self.cfg = cfg
        self.estimator = load_estimator(cfg.advantage_estimator)  # trainer.advantage_estimator
        self.policy_loss = load_policy_loss(cfg.policy_loss)  # trainer.policy_loss
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        # each chunk of the output head's logits to log-probs (trainer.logprob_kernel)
        self.target_logprobs = target_logprob_function(cfg.logprob_kernel, self.device)
        # trainer.fused_head: the head and the log-softmax as one function (colo_rl/trainer/head.py)
        # whenever the head is a plain linear layer; None: each chunk through the head module
        self.head_ops = ((compiled_ops() if self.target_logprobs is not _target_logprobs_eager else EAGER)
                         if cfg.fused_head else None)
        trainable = [p for p in model.parameters() if p.requires_grad]  # under LoRA: the adapters
        self.trainable_params = sum(p.numel() for p in trainable)
        # fused AdamW (one kernel for all tensors) on a GPU, as transformers' adamw_torch_fused;
        # FSDP's DTensor parameters keep the foreach path
        self.optimizer = make_optimizer(trainable, cfg, fused=self.parallel.mode != "fsdp" and all(
            p.is_cuda for p in trainable))
        self.autocast_dtype = autocast_dtype if self.device.type == "cuda" else None
        if all(p.dtype == self.autocast_dtype for p in trainable):
            self.autocast_dtype = None  # computing in the parameters' own dtype needs no autocast
        # Under autocast, weights are cast to the compute dtype once per update, not in every
        # micro-batch's forward (see compute_copies): the decoder layers' matmul weights, or with
        # trainer.fp32_activations=false every weight but the output head's.
        self.copies = weight_copies(self.autocast_dtype is not None, self.parallel.enabled, cfg.compile,
                                    is_lora(model), cfg.fp32_activations)
        self.step_count = 0
        self._optimizer_touched = False  # set once a train step's first optimizer step begins

    def train_step(self, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                   rewards: list[float], group_size: int,
                   engine_logprobs: Optional[list[list[float]]] = None,
                   truncated: Optional[list[bool]] = None) -> dict[str, float]:
        """One GRPO step on a batch of groups; returns its train/* metrics.

        prompt_ids has one entry per prompt; completion_ids num_prompts * group_size entries,
        prompt i's group at [i*G:(i+1)*G]. Runs cfg.updates_per_batch optimizer steps, each
        accumulating micro-batches of cfg.micro_batch_size sequences into the full-batch gradient.
        `truncated`: which completions reached sampling.max_tokens (trainer.mask_truncated leaves
        them out of the loss).
        """
        _check_batch(prompt_ids, completion_ids, rewards, group_size, engine_logprobs)
        if self.cfg.tis_cap is not None and engine_logprobs is None:
            raise ValueError(f"trainer.tis_cap={self.cfg.tis_cap} needs the engine's sampled log-probs: "
                             "pass engine_logprobs (sampling.logprobs=true) or set trainer.tis_cap=null")
        lr = self._set_lr()
        self._optimizer_touched = False
        try:
            return self._train_step(prompt_ids, completion_ids, rewards, group_size, engine_logprobs, lr, truncated)
        except torch.OutOfMemoryError as exc:
            intact = not self._optimizer_touched
            if intact:  # only gradients and activations were touched: drop them
                self.optimizer.zero_grad(set_to_none=True)
            size = micro_batch_size(self.cfg)
            advice = (f"set trainer.micro_batch_size={max(1, size // 2)} or trainer.gradient_checkpointing=true"
                      if size > 1 else "set trainer.gradient_checkpointing=true or a smaller sampling.max_tokens")
            raise TrainerOutOfMemory(
                f"the GPU ran out of memory in a train step at trainer.micro_batch_size={size} "
                f"({str(exc).splitlines()[0] if str(exc) else 'torch.OutOfMemoryError'}): {advice}, and "
                "resume from the checkpoint" + ("" if intact else " written before this step"),
                state_intact=intact) from exc

    def _train_step(self, prompt_ids, completion_ids, rewards, group_size, engine_logprobs, lr,
                     truncated) -> dict[str, float]:
        lengths = torch.tensor([len(c) for c in completion_ids])
        masked = _masked_truncated(self.cfg, truncated, len(completion_ids))
        if masked is not None:  # left out of the loss: no tokens of theirs count
            lengths = torch.where(masked, 0, lengths)
        advantages = self.estimator(torch.tensor(rewards, dtype=torch.float64), group_size,
                                    lengths=lengths, cfg=self.cfg)
        prompts = [p for p in prompt_ids for _ in range(group_size)]
        trained = _trained_sequences(self.cfg, advantages, lengths)
        micro = self._micro_batches([prompts[i] for i in trained], [completion_ids[i] for i in trained],
                                    advantages[trained] if len(trained) < len(prompts) else advantages,
                                    [engine_logprobs[i] for i in trained] if engine_logprobs is not None else None,
                                    keep=None if masked is None else ~masked[trained])
        normalizer = self._global_normalizer(lengths)
        # the reference computes as the policy does (with the same weight copies)
        with compute_copies(self.reference, self.autocast_dtype, self.copies):
            ref = [self._reference_logprobs(mb) for mb in micro]
        old = None
        updates = []
        for _ in range(self.cfg.updates_per_batch):
            stats, logprobs_before = self._update(micro, old, ref, normalizer)
            if old is None:  # the first update's forward saw the policy before any step
                old = logprobs_before
            updates.append(stats)
            if stats["skipped"]:  # the next update would start from the same state
                break
        self.last_step_flops = step_flops(self.shape, [len(prompts[i]) for i in trained],
                                          [len(completion_ids[i]) for i in trained], updates=len(updates),
                                          reference_forward=self.cfg.kl_coef > 0)
        skipped = updates[-1]["skipped"]
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if skipped else 0
        self.nonfinite_total += int(skipped)
        self.step_count += 1
        metrics = {f"train/{key}": sum(u[key] for u in updates) / len(updates)
                   for key in ("loss", "grad_norm", "clip_frac", "kl")}
        metrics["train/nonfinite_skipped"] = float(skipped)
        metrics["train/nonfinite_skipped_total"] = float(self.nonfinite_total)
        metrics["train/lr"] = lr
        metrics["train/response_tokens"] = float(lengths.sum())
        metrics["train/advantage_abs_mean"] = float(advantages.abs().mean())
        if masked is not None:
            metrics["train/truncated_masked"] = float(masked.sum())
        if self.cfg.skip_zero_advantage:
            metrics["train/sequences_skipped"] = float(len(prompts) - len(trained))
        if engine_logprobs is not None:
            metrics["train/engine_logprob_gap"] = _logprob_gap(micro, old)
        if self.cfg.tis_cap is not None:
            metrics.update(_tis_stats(micro, old, self.cfg.tis_cap))
        return metrics

    def _set_lr(self) -> float:
        """Puts this step's scheduled lr on every param group. It follows from step_count alone, so a
        resumed run continues the schedule exactly without any scheduler state to checkpoint."""
        lr = scheduled_lr(self.cfg.lr, self.step_count, schedule=self.cfg.lr_schedule,
                          warmup_steps=self.cfg.warmup_steps, total_steps=self.cfg.steps)
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers keep it as a tensor
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        return lr

    def _global_normalizer(self, lengths: torch.Tensor) -> float:
        """The loss denominator of the global batch, over the world size: each rank's gradient
        of (its sum / this) averaged over ranks (what DDP and FSDP do) is then the gradient of
        the global batch's loss, exactly as one process would compute it."""
        if not self.parallel.enabled:
            return loss_normalizer(lengths, self.cfg.loss_agg, self.max_tokens)
        p = self.parallel
        if self.cfg.loss_agg == "token":
            total = max(p.all_sum(float(lengths.sum())), 1.0)
        elif self.cfg.loss_agg == "sequence":
            total = max(p.all_sum(float((lengths > 0).sum())), 1.0)
        else:
            total = p.all_sum(float(lengths.numel())) * self.max_tokens
        return total / p.world_size

    def _micro_batches(self, prompts, completions, advantages, engine, keep=None) -> list[_MicroBatch]:
        """Micro-batches of cfg.micro_batch_size sequences. With cfg.sort_by_length the sequences go
        in order of length first, so each micro-batch pads to a length near its own: the loss and
        gradient are sums over sequences with the global batch's normalizer, so the grouping
        changes them only by floating-point summation order. `keep` (bool per sequence): False
        masks the whole sequence out of the loss."""
        size = micro_batch_size(self.cfg)
        if self.cfg.sort_by_length and size < len(completions):
            order = sorted(range(len(completions)), key=lambda i: len(prompts[i]) + len(completions[i]))
            prompts, completions = [prompts[i] for i in order], [completions[i] for i in order]
            advantages = advantages[torch.tensor(order)]
            engine = [engine[i] for i in order] if engine is not None else None
            keep = keep[torch.tensor(order)] if keep is not None else None
        micro = [_pack(prompts[i:i + size], completions[i:i + size], advantages[i:i + size],
                       engine[i:i + size] if engine is not None else None, self.pad_token_id, self.device)
                 for i in range(0, len(completions), size)]
        if keep is not None:
            for i, mb in enumerate(micro):
                mb.mask *= keep[i * size:(i + 1) * size].to(mb.mask).unsqueeze(1)
        return micro

    def _update(self, micro: list[_MicroBatch], old: Optional[list[torch.Tensor]],
                ref: list[Optional[torch.Tensor]], normalizer: float) -> tuple[dict, list[torch.Tensor]]:
        """One optimizer step over all micro-batches; returns its stats and the pre-step log-probs.
        A non-finite loss or gradient norm (on any rank) skips the step: the gradients are dropped,
        parameters and optimizer state stay as they were, and stats["skipped"] is True.
        The statistics stay on the device until the gradient norm is known: the host waits for
        the GPU once per update, so it queues each micro-batch's kernels while the last one runs."""
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss, clip, kl, tokens
        logprobs_before = []
        with compute_copies(self.model, self.autocast_dtype, self.copies, self.cfg.fuse_grad_accumulation):
            self._accumulate(micro, old, ref, normalizer, sums, logprobs_before)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        if hasattr(norm, "full_tensor"):  # FSDP: the norm over all shards, as a DTensor
            norm = norm.full_tensor()
        loss_sum, clip_sum, kl_sum, tokens, grad_norm = torch.cat(
            [sums, norm.detach().reshape(1).to(device=sums.device, dtype=torch.float64)]).tolist()
        bad = not (math.isfinite(loss_sum) and math.isfinite(grad_norm))
        if self.parallel.enabled:  # every rank takes the same decision, or their parameters part
            bad = self.parallel.all_sum(float(bad)) > 0
        if not bad:
            self._optimizer_touched = True  # from here an exception leaves the state half-updated
            self.optimizer.step()
        # The gradients are dead after the step; freeing them leaves a params-sized block more
        # for the engine while it is awake.
        self.optimizer.zero_grad(set_to_none=True)
        tokens = max(tokens, 1.0)
        return ({"loss": loss_sum, "grad_norm": grad_norm, "clip_frac": clip_sum / tokens,
                 "kl": kl_sum / tokens, "skipped": bad}, logprobs_before)

    def _accumulate(self, micro: list[_MicroBatch], old: Optional[list[torch.Tensor]],
                    ref: list[Optional[torch.Tensor]], normalizer: float, sums: torch.Tensor,
                    logprobs_before: list[torch.Tensor]) -> None:
        """Forward and backward of every micro-batch: the gradients accumulate in the parameters'
        .grad, the loss statistics in `sums`, each micro-batch's log-probs in `logprobs_before`."""
        for i, mb in enumerate(micro):
            # data parallel: gradients are reduced across ranks once, on the last micro-batch
            with _gradient_sync(self.forward_model, self.parallel, i == len(micro) - 1):
                logprobs = self._token_logprobs(self.forward_model, mb)
                logprobs_before.append(logprobs.detach())
                old_i = logprobs_before[i] if old is None else old[i]
                tis = (_tis_ratio(mb, old_i).clamp(max=self.cfg.tis_cap)
                       if self.cfg.tis_cap is not None else None)
                loss, stats = grpo_loss(logprobs, old_i, mb.advantages, mb.mask,
                                        clip_eps=self.cfg.clip_eps, clip_eps_high=self.cfg.clip_eps_high,
                                        loss_agg=self.cfg.loss_agg, max_tokens=self.max_tokens,
                                        ref_logprobs=ref[i], kl_coef=self.cfg.kl_coef,
                                        tis_weights=tis, normalizer=normalizer, sync=False)
                loss.backward()
            sums += torch.stack([loss.detach(), stats["clip_frac"] * stats["tokens"],
                                 stats["kl"] * stats["tokens"], stats["tokens"]]).to(torch.float64)

    def _token_logprobs(self, model: torch.nn.Module, mb: _MicroBatch) -> torch.Tensor:
        """(b, T) log-probs of the response tokens, at the sampling temperature.

        trainer.logprob_chunk > 0: the output head runs only on the response positions, that many
        at a time, each chunk's logits recomputed in backward (see _chunked_head); padded positions
        get 0. 0: the whole (b, L, vocab) logits, then log_softmax over the gathered positions."""
        # use_cache=False: Hugging Face models build a KV cache by default, in training too, copying
        # every layer's keys and values into it (torch.cat in DynamicCache.update), for nothing here
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            if self.cfg.logprob_chunk:
                keep = not logprob_recompute(self.cfg) and torch.is_grad_enabled()  # no backward, nothing kept
                with _chunked_head(model, mb, self.temperature, self.cfg.logprob_chunk, self.target_logprobs,
                                   self.head_ops, keep_logits=keep):
                    # the patched head returns the (b, T) log-probs in the logits' place
                    return model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        # The logits at position t predict token t + 1.
        index = (mb.positions - 1).clamp(min=0).unsqueeze(-1).expand(-1, -1, logits.size(-1))
        picked = logits.gather(1, index).float()
        if self.temperature > 0 and self.temperature != 1:  # (x / 1 is x: a pass over the logits saved)
            picked = picked / self.temperature
        targets = mb.input_ids.gather(1, mb.positions).unsqueeze(-1)
        return picked.log_softmax(dim=-1).gather(-1, targets).squeeze(-1)

    def _reference_logprobs(self, mb: _MicroBatch) -> Optional[torch.Tensor]:
        if self.cfg.kl_coef == 0:
            return None
        with torch.no_grad():
            if self.reference is not None:
                return self._token_logprobs(self.reference, mb)
            with self.model.disable_adapter():  # LoRA: the base model is the reference
                return self._token_logprobs(self.model, mb)

    def state_dict(self) -> dict:
        """Everything needed to resume: model, optimizer, step count and the reference if any.
        Under FSDP the full (unsharded) state, gathered to the CPU: every rank must call this."""
        if self.parallel.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            model_state, optim_state = get_state_dict(
                self.model, self.optimizer,
                options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return {"model": model_state, "optimizer": optim_state, "step_count": self.step_count}
        state = {"model": self._model_state(), "optimizer": self.optimizer.state_dict(),
                 "step_count": self.step_count}
        if self.reference is not None:
            state["reference"] = self.reference.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if ("reference" in state) != (self.reference is not None):
            raise ValueError(f"the checkpoint {'has' if 'reference' in state else 'has no'} reference "
                             f"model but trainer.kl_coef={self.cfg.kl_coef}: resume with the kl_coef "
                             "the checkpoint was trained with")
        self._load_model_state(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.reference is not None:
            self.reference.load_state_dict(state["reference"])
        self.step_count = int(state["step_count"])

    def _model_state(self) -> dict:
        """The model's state, or under LoRA its adapters only: the frozen base is the model's own."""
        if not is_lora(self.model):
            return self.model.state_dict()
        return {name: p.detach() for name, p in trainable_parameters(self.model)}

    def _load_model_state(self, state: dict) -> None:
        if not is_lora(self.model):
            self.model.load_state_dict(state)
            return
        expected = {name for name, _ in trainable_parameters(self.model)}
        if set(state) != expected:
            raise ValueError(f"the checkpoint's model tensors ({len(state)}, e.g. {sorted(state)[:2]}) are not "
                             f"this LoRA policy's adapters ({len(expected)}, e.g. {sorted(expected)[:2]}): "
                             "resume with the trainer.lora settings and the model it was trained with")
        self.model.load_state_dict(state, strict=False)


def make_optimizer(params, cfg: TrainerConfig, fused: bool = False) -> torch.optim.Optimizer:
    """trainer.optimizer over `params`. Its state takes the parameters' dtype (fp32 under mixed
    precision), except adamw_8bit's block-wise 8-bit moments (bitsandbytes keeps tensors under
    4096 elements, norms and biases, in 32 bits). `fused`: torch's fused AdamW kernel (same
    update as the foreach one up to float rounding; CUDA parameters only)."""
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, **kwargs, **({"fused": True} if fused else {}))
    if cfg.optimizer == "adamw_8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, **kwargs)
    if cfg.optimizer == "adamw_bf16_sr":
        from torchao.optim import _AdamW

        return _AdamW(params, bf16_stochastic_round=True, **kwargs)
    raise ValueError(f"optimizer={cfg.optimizer!r} unknown (trainer.optimizer)")


def _wrap(model: torch.nn.Module, parallel: Parallel, device: str) -> torch.nn.Module:
    """DDP keeps `model` whole and wraps it; FSDP2 shards `model` in place (its parameters become
    DTensors) and returns it."""
    if parallel.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [torch.device(device).index] if torch.device(device).type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if parallel.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in decoder_layers(model):
            fully_shard(layer)
        return fully_shard(model)
    return model


@contextmanager
def _gradient_sync(forward_model: torch.nn.Module, parallel: Parallel, sync: bool):
    if parallel.mode == "ddp" and not sync:
        with forward_model.no_sync():
            yield
    elif parallel.mode == "fsdp":
        forward_model.set_requires_gradient_sync(sync)
        yield
    else:
        yield


def _output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face output head (lm_head) under DDP, FSDP2 (in place) and peft wrappers."""
    inner = model.module if hasattr(model, "no_sync") and hasattr(model, "module") else model  # DDP
    head = inner.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(inner).__name__} has no output head (get_output_embeddings() is None): "
                         "set trainer.logprob_chunk=0")
    return head


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """(n,) log-probs of `targets` from (n, vocab) logits in the head's dtype: the log-sum-exp in
    fp32 (as the full path's `.float().log_softmax`)."""
    return logprob_stats(logits, targets, temperature)[0]


def _target_logprobs_eager(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """_target_logprobs op by op: the temperature in place on the fp32 copy, so no second chunk of
    fp32 logits exists (the matmul's backward needs its inputs only)."""
    logits = logits.float()
    if temperature > 0 and temperature != 1:  # in place; x / 1 is x
        logits = logits.div_(temperature)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(dim=-1)


@functools.cache
def _target_logprobs_compiled():
    """_target_logprobs through torch.compile, made on first use. Inductor fuses the cast, the
    temperature and the log-sum-exp into reductions that read the head's bf16 logits, and the
    backward into one pass writing the bf16 gradient of the logits, where eager runs each op over
    fp32 copies. The chunk's row count is the one dynamic size (the last chunk is shorter)."""
    return torch.compile(_target_logprobs)


def target_logprob_function(kernel: str, device: torch.device):
    """trainer.logprob_kernel resolved for `device`: the function each chunk of the output head's
    logits goes through (auto: compiled on CUDA, eager elsewhere)."""
    if kernel == "compiled" or (kernel == "auto" and device.type == "cuda"):
        return _target_logprobs_compiled()
    return _target_logprobs_eager


def _chunk_logprobs(head_forward, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                    target_logprobs) -> torch.Tensor:
    """(n,) log-probs of `targets` from (n, hidden) states: the head in the autocast dtype, then
    `target_logprobs` (one of the two above)."""
    return target_logprobs(head_forward(hidden), targets, temperature)


@contextmanager
def _chunked_head(model: torch.nn.Module, mb: _MicroBatch, temperature: float, chunk: int,
                  target_logprobs, head_ops=None, keep_logits: bool = False):
    """While active, the model's output head maps the final hidden states (b, L, hidden) to the
    (b, T) log-probs of mb's response tokens, never the (b, L, vocab) logits: it gathers the
    states that predict each real response token, applies the head to `chunk` of them at a time
    and keeps only each one's log-sum-exp and target logit. Each chunk runs under activation
    checkpointing, so backward too holds one chunk's logits at a time. Patching the head (rather
    than calling the decoder and the head separately) keeps the model's own forward, and with it
    the DDP, FSDP2 and peft hooks around it, exactly as the full path runs them.

    With `head_ops` (trainer.fused_head) and a plain bias-free linear head, the chunks go through
    colo_rl.trainer.head.head_logprobs instead: the same values, the weight cast once per call and
    its gradient summed in fp32 by the matmuls."""
    head = _output_head(model)
    own = "forward" in head.__dict__  # an instance-level forward (e.g. accelerate's hooks) to restore
    original = head.forward
    rows, cols = mb.rows, mb.cols  # every position when all completions are empty: one graph all the same
    source = (mb.positions[rows, cols] - 1).clamp(min=0)  # the state at t predicts token t + 1
    targets = mb.input_ids[rows, mb.positions[rows, cols]]

    fused = head_ops is not None and fusable(head)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        states = hidden[rows, source]  # (n, hidden)
        out = torch.zeros(mb.mask.shape, dtype=torch.float32, device=hidden.device)
        if fused:
            kind = hidden.device.type
            dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else head.weight.dtype
            return out.index_put((rows, cols), head_logprobs(states, head.weight, targets, temperature, chunk,
                                                             dtype, head_ops, keep_logits))
        grad = torch.is_grad_enabled() and states.requires_grad
        values = []
        for start in range(0, states.size(0), chunk):
            args = (original, states[start:start + chunk], targets[start:start + chunk], temperature,
                    target_logprobs)
            values.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False)
                          if grad else _chunk_logprobs(*args))
        return out.index_put((rows, cols), torch.cat(values))

    head.forward = forward
    try:
        yield
    finally:
        if own:
            head.forward = original
        else:
            del head.forward  # back to the class's forward


@contextmanager
def compute_copies(model: Optional[torch.nn.Module], dtype: Optional[torch.dtype], scope: Optional[str],
                   fuse_accumulation: bool = False):
    """While active, weights of `model` are `dtype` copies made on entry, whose gradients are added
    into the fp32 masters' .grad by a hook as soon as each backward produces them; on exit the
    masters are the model's parameters again. scope "matmul": each nn.Linear weight of the decoder
    layers; "all": every floating parameter but the output head's, so that the model computes in
    `dtype` throughout (the residual stream, the norms); None: nothing changes.

    Autocast casts every fp32 weight to bf16 in each micro-batch's forward and, in backward, each
    bf16 weight gradient to fp32 before adding it to .grad: two passes over 6 bytes a parameter per
    micro-batch, on top of the accumulation (H100, the 1B peer workload's train step: 0.13 s of
    weight casts, 0.16 s of gradient casts of 2.24 s). Here the cast happens once per update and
    the gradient is upcast inside the add. Under "matmul" the values are autocast's: the copy is
    autocast's cast of the same weight (autocast leaves a weight already in its dtype alone), and
    upcasting bf16 to fp32 is exact, so each addition is the one AccumulateGrad made. Only weights
    used once per forward: one used twice (tied, or the output head under the chunked head, once
    per chunk) would have its two gradients summed in bf16 before the hook.

    fuse_accumulation (trainer.fuse_grad_accumulation): a plain nn.Linear's weight gradient is not
    made in bf16 at all: its backward sums it into the master's fp32 .grad inside the matmul
    (`addmm(..., out_dtype=float32)` on CUDA, Megatron's gradient-accumulation fusion): one pass
    less over each weight per micro-batch, and each micro-batch's gradient is no longer rounded to
    bf16 before the sum (elsewhere: the bf16 product, then the add, as the hook does)."""
    if model is None or dtype is None or scope is None:
        yield
        return
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    modules = ([m for layer in decoder_layers(model) for m in layer.modules() if isinstance(m, torch.nn.Linear)]
               if scope == "matmul" else [m for m in model.modules() if m is not head])
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    if head is not None:
        uses.update(id(p) for p in head.parameters())  # never copied, nor anything tied to it
    swapped = []
    for module in dict.fromkeys(modules):
        for name, master in list(module._parameters.items()):
            if (type(master) is not torch.nn.Parameter or not master.is_floating_point()
                    or master.dtype == dtype or uses[id(master)] != 1):
                continue
            fused = (fuse_accumulation and master.requires_grad and name == "weight"
                     and type(module) is torch.nn.Linear and "forward" not in module.__dict__)
            copy_ = torch.nn.Parameter(master.detach().to(dtype), requires_grad=master.requires_grad and not fused)
            if fused:
                module.forward = functools.partial(_linear_into_master, module, master)
            elif master.requires_grad:
                copy_.register_post_accumulate_grad_hook(_grad_into(master))
            module._parameters[name] = copy_
            swapped.append((module, name, master))
    try:
        yield
    finally:
        for module, name, master in swapped:
            module._parameters[name] = master
            if isinstance(module.__dict__.get("forward"), functools.partial):
                del module.forward  # back to nn.Linear's


class _LinearIntoMaster(torch.autograd.Function):
    """x @ weight.T for a compute copy `weight` (no gradient of its own): backward returns the
    input's gradient and adds the weight's into the master's .grad (colo_rl.trainer.head's fused
    accumulation)."""

    @staticmethod
    def forward(ctx, x, weight, master_box):
        with torch.autocast(device_type=x.device.type, enabled=False):
            xc = x.to(weight.dtype)  # autocast's cast of the input, made here
            ctx.save_for_backward(xc, weight)
            ctx.master, ctx.x_dtype = master_box[0], x.dtype
            return xc @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        xc, weight = ctx.saved_tensors
        master = ctx.master
        grad_x = (grad @ weight).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        master.grad = accumulate_matmul(master.grad, grad.reshape(-1, grad.size(-1)).t(),
                                        xc.reshape(-1, xc.size(-1)), master.dtype)
        return grad_x, None, None


def _linear_into_master(module: torch.nn.Linear, master: torch.nn.Parameter, x: torch.Tensor) -> torch.Tensor:
    return _LinearIntoMaster.apply(x, module.weight, (master,))


def _grad_into(master: torch.nn.Parameter):
    """A post-accumulate-grad hook for a compute copy: its gradient goes into `master`'s .grad."""

    def hook(copy_: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = copy_.grad.to(master.dtype)
        else:
            master.grad.add_(copy_.grad)
        copy_.grad = None

    return hook


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


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
