"""The GRPO trainer: one update over a step's completions (micro-batches, the reference, the
optimizer step, non-finite and out-of-memory handling) and its state. The maths is in loss.py, the
log-prob head in logprobs.py, the weight copies in precision.py, DDP/FSDP in distributed.py, the
optimizer and schedule in optim.py, the packing of sequences in batch.py.

The trainer sees only token ids and rewards; the engine that sampled them lives in another
process. Log-probs are taken at the engine's sampling temperature so that the ratio
exp(logp - old) and the engine-vs-trainer log-prob gap compare like with like; the engine runs
with logprobs_mode=processed_logprobs for the same reason (vLLM's default is before the
temperature; validate refuses TIS at a temperature other than 1 if a user sets that back).
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import torch

from colo_rl.config import TrainerConfig, logprob_recompute, micro_batch_size
from colo_rl.lora import is_lora, trainable_parameters
from colo_rl.parallel import Parallel
from colo_rl.trainer.batch import _check_batch, _MicroBatch, _pack
from colo_rl.trainer.distributed import _gradient_sync, _wrap
from colo_rl.trainer.flops import ModelShape, step_flops
from colo_rl.trainer.head import EAGER, compiled_ops
from colo_rl.trainer.kernels import apply_liger, compile_layers, resolve_kernels
from colo_rl.trainer.logprobs import _chunked_head, _target_logprobs_eager, target_logprob_function
from colo_rl.trainer.algorithms import load_estimator, load_policy_loss
from colo_rl.trainer.loss import _logprob_gap, _tis_ratio, _tis_stats, grpo_loss, loss_normalizer
from colo_rl.trainer.optim import make_optimizer, scheduled_lr
from colo_rl.trainer.precision import compute_copies, weight_copies

class TrainingDiverged(RuntimeError):
    """trainer.optim.max_nonfinite_steps steps in a row had a non-finite loss or gradient norm; none of
    them changed the trainer, which holds the last finite update's state."""


class TrainerOutOfMemory(RuntimeError):
    """The device ran out of memory in a train step. `state_intact`: it happened before any of the
    step's optimizer steps began, so the parameters and optimizer state are the previous step's
    (the partial gradients are dropped) and a checkpoint of them is a whole step's."""

    def __init__(self, message: str, state_intact: bool):
        super().__init__(message)
        self.state_intact = state_intact


def _masked_truncated(cfg: TrainerConfig, truncated: Optional[list[bool]], count: int) -> Optional[torch.Tensor]:
    """(N,) bool of the completions trainer.algo.mask_truncated leaves out of the loss; None when it is off."""
    if not cfg.algo.mask_truncated:
        return None
    if truncated is None or len(truncated) != count:
        raise ValueError(f"trainer.algo.mask_truncated=true needs one truncated flag per completion ({count}); "
                         f"got {None if truncated is None else len(truncated)}")
    return torch.tensor(truncated, dtype=torch.bool)


def _trained_sequences(cfg: TrainerConfig, advantages: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Indices of the sequences that go through forward and backward: all of them, or with
    trainer.algo.skip_zero_advantage those whose advantage is not 0 and that have loss tokens (the
    others add exactly 0 to the loss and the gradient). At least one, so that the optimizer steps
    on a whole zero gradient as it would without skipping (AdamW skips a parameter without one)."""
    if not cfg.algo.skip_zero_advantage:
        return torch.arange(advantages.numel())
    trained = ((advantages != 0) & (lengths > 0)).nonzero().reshape(-1)
    return trained if trained.numel() else torch.arange(1)


class GRPOTrainer:
    """Owns the policy's optimiser (and the frozen reference when KL is on) and runs GRPO steps."""

    # Steps whose update was skipped for a non-finite loss or gradient norm: the current run of
    # them (the runner stops at trainer.optim.max_nonfinite_steps) and all since this trainer was made.
    nonfinite_in_a_row = 0
    nonfinite_total = 0

    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, *, pad_token_id: int,
                 temperature: float, max_tokens: int, device: str, parallel: Parallel | None = None,
                 autocast_dtype: torch.dtype | None = None):
        """`model` is already on `device`, in the dtype its parameters and optimizer state keep (fp32
        masters under trainer.memory.precision=mixed). `autocast_dtype`: what forward and backward compute
        in on a GPU (the engine's dtype under mixed precision); None, and on a CPU, computes in the
        parameters' dtype."""
        self.model = model  # the module whose weights the engine gets
        if cfg.memory.gradient_checkpointing:
            # use_reentrant=False: recomputation that also works when the inputs need no grad
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()  # Hugging Face checkpoints activations only in training mode
        self.parallel = parallel or Parallel.single()
        self.shape = ModelShape.of(model)  # before FSDP shards it; for perf/* (colo_rl/trainer/flops.py)
        self.last_step_flops = 0.0  # model FLOPs of the last train_step
        # Under LoRA the reference is the same model with its adapters disabled: no second copy.
        # Copied before compilation (it only runs forward, without grad); given Liger's kernels below.
        self.reference = _frozen_copy(model) if cfg.algo.kl_coef > 0 and not is_lora(model) else None
        # trainer.perf.kernels=auto: Liger's on a GPU where they can run (colo_rl/trainer/kernels.py)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        self.kernels = resolve_kernels(cfg.perf.kernels, device, model_type, cfg.perf.compile)
        if self.kernels == "liger":
            apply_liger(model)
            if self.reference is not None:  # the policy's forward computation, kernels included
                apply_liger(self.reference)
        if cfg.perf.compile:
            compile_layers(model)
        self.forward_model = _wrap(model, self.parallel, device)  # what runs forward/backward
        self.cfg = cfg
        self.estimator = load_estimator(cfg.algo.advantage_estimator)  # trainer.algo.advantage_estimator
        self.policy_loss = load_policy_loss(cfg.algo.policy_loss)  # trainer.algo.policy_loss
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        # each chunk of the output head's logits to log-probs (trainer.perf.logprob_kernel)
        self.target_logprobs = target_logprob_function(cfg.perf.logprob_kernel, self.device)
        # trainer.perf.fused_head: the head and the log-softmax as one function (colo_rl/trainer/head.py)
        # whenever the head is a plain linear layer; None: each chunk through the head module
        self.head_ops = ((compiled_ops() if self.target_logprobs is not _target_logprobs_eager else EAGER)
                         if cfg.perf.fused_head else None)
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
        # trainer.memory.fp32_activations=false every weight but the output head's.
        self.copies = weight_copies(self.autocast_dtype is not None, self.parallel.enabled, cfg.perf.compile,
                                    is_lora(model), cfg.memory.fp32_activations)
        self.step_count = 0
        self._optimizer_touched = False  # set once a train step's first optimizer step begins

    def train_step(self, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                   rewards: list[float], group_size: int,
                   engine_logprobs: Optional[list[list[float]]] = None,
                   truncated: Optional[list[bool]] = None) -> dict[str, float]:
        """One GRPO step on a batch of groups; returns its train/* metrics.

        prompt_ids has one entry per prompt; completion_ids num_prompts * group_size entries,
        prompt i's group at [i*G:(i+1)*G]. Runs cfg.algo.updates_per_batch optimizer steps, each
        accumulating micro-batches of cfg.micro_batch_size sequences into the full-batch gradient.
        `truncated`: which completions reached sampling.max_tokens (trainer.algo.mask_truncated leaves
        them out of the loss).
        """
        _check_batch(prompt_ids, completion_ids, rewards, group_size, engine_logprobs)
        if self.cfg.algo.tis_cap is not None and engine_logprobs is None:
            raise ValueError(f"trainer.algo.tis_cap={self.cfg.algo.tis_cap} needs the engine's sampled log-probs: "
                             "pass engine_logprobs (sampling.logprobs=true) or set trainer.algo.tis_cap=null")
        lr = self._set_lr()
        self._optimizer_touched = False
        try:
            return self._train_step(prompt_ids, completion_ids, rewards, group_size, engine_logprobs, lr, truncated)
        except torch.OutOfMemoryError as exc:
            intact = not self._optimizer_touched
            if intact:  # only gradients and activations were touched: drop them
                self.optimizer.zero_grad(set_to_none=True)
            size = micro_batch_size(self.cfg)
            advice = (f"set trainer.micro_batch_size={max(1, size // 2)} or trainer.memory.gradient_checkpointing=true"
                      if size > 1 else "set trainer.memory.gradient_checkpointing=true or a smaller sampling.max_tokens")
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
        for _ in range(self.cfg.algo.updates_per_batch):
            stats, logprobs_before = self._update(micro, old, ref, normalizer)
            if old is None:  # the first update's forward saw the policy before any step
                old = logprobs_before
            updates.append(stats)
            if stats["skipped"]:  # the next update would start from the same state
                break
        self.last_step_flops = step_flops(self.shape, [len(prompts[i]) for i in trained],
                                          [len(completion_ids[i]) for i in trained], updates=len(updates),
                                          reference_forward=self.cfg.algo.kl_coef > 0)
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
        if self.cfg.algo.skip_zero_advantage:
            metrics["train/sequences_skipped"] = float(len(prompts) - len(trained))
        if engine_logprobs is not None:
            metrics["train/engine_logprob_gap"] = _logprob_gap(micro, old)
        if self.cfg.algo.tis_cap is not None:
            metrics.update(_tis_stats(micro, old, self.cfg.algo.tis_cap))
        return metrics

    def _set_lr(self) -> float:
        """Puts this step's scheduled lr on every param group. It follows from step_count alone, so a
        resumed run continues the schedule exactly without any scheduler state to checkpoint."""
        lr = scheduled_lr(self.cfg.lr, self.step_count, schedule=self.cfg.optim.lr_schedule,
                          warmup_steps=self.cfg.optim.warmup_steps, total_steps=self.cfg.steps)
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
            return loss_normalizer(lengths, self.cfg.algo.loss_agg, self.max_tokens)
        p = self.parallel
        if self.cfg.algo.loss_agg == "token":
            total = max(p.all_sum(float(lengths.sum())), 1.0)
        elif self.cfg.algo.loss_agg == "sequence":
            total = max(p.all_sum(float((lengths > 0).sum())), 1.0)
        else:
            total = p.all_sum(float(lengths.numel())) * self.max_tokens
        return total / p.world_size

    def _micro_batches(self, prompts, completions, advantages, engine, keep=None) -> list[_MicroBatch]:
        """Micro-batches of cfg.micro_batch_size sequences. With cfg.perf.sort_by_length the sequences go
        in order of length first, so each micro-batch pads to a length near its own: the loss and
        gradient are sums over sequences with the global batch's normalizer, so the grouping
        changes them only by floating-point summation order. `keep` (bool per sequence): False
        masks the whole sequence out of the loss."""
        size = micro_batch_size(self.cfg)
        if self.cfg.perf.sort_by_length and size < len(completions):
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
        with compute_copies(self.model, self.autocast_dtype, self.copies, self.cfg.perf.fuse_grad_accumulation):
            self._accumulate(micro, old, ref, normalizer, sums, logprobs_before)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.max_grad_norm)
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
                tis = (_tis_ratio(mb, old_i).clamp(max=self.cfg.algo.tis_cap)
                       if self.cfg.algo.tis_cap is not None else None)
                loss, stats = grpo_loss(logprobs, old_i, mb.advantages, mb.mask,
                                        clip_eps=self.cfg.algo.clip_eps, clip_eps_high=self.cfg.algo.clip_eps_high,
                                        loss_agg=self.cfg.algo.loss_agg, max_tokens=self.max_tokens,
                                        ref_logprobs=ref[i], kl_coef=self.cfg.algo.kl_coef,
                                        tis_weights=tis, normalizer=normalizer, sync=False,
                                        policy_loss=self.policy_loss)
                loss.backward()
            sums += torch.stack([loss.detach(), stats["clip_frac"] * stats["tokens"],
                                 stats["kl"] * stats["tokens"], stats["tokens"]]).to(torch.float64)

    def _token_logprobs(self, model: torch.nn.Module, mb: _MicroBatch) -> torch.Tensor:
        """(b, T) log-probs of the response tokens, at the sampling temperature.

        trainer.perf.logprob_chunk > 0: the output head runs only on the response positions, that many
        at a time, each chunk's logits recomputed in backward (see _chunked_head); padded positions
        get 0. 0: the whole (b, L, vocab) logits, then log_softmax over the gathered positions."""
        # use_cache=False: Hugging Face models build a KV cache by default, in training too, copying
        # every layer's keys and values into it (torch.cat in DynamicCache.update), for nothing here
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            if self.cfg.perf.logprob_chunk:
                keep = not logprob_recompute(self.cfg) and torch.is_grad_enabled()  # no backward, nothing kept
                with _chunked_head(model, mb, self.temperature, self.cfg.perf.logprob_chunk, self.target_logprobs,
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
        if self.cfg.algo.kl_coef == 0:
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
                             f"model but trainer.algo.kl_coef={self.cfg.algo.kl_coef}: resume with the kl_coef "
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


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


