"""The output head and the log-probs of the sampled tokens as one autograd function (issue #24).

`head_logprobs(states, weight, targets, temperature, chunk, dtype)` is
`log_softmax(states @ weight.T / temperature)[targets]` over `chunk` rows at a time, written out
by hand so that what the generic path does per chunk happens once per call:

- the weight is cast to the compute dtype once (autocast casts it for every chunk, and again in
  every chunk's recomputation);
- the weight's gradient is summed over the chunks in fp32 by the matmul itself on CUDA
  (`addmm(..., out_dtype=float32)`, Megatron's gradient-accumulation fusion), where autograd would
  make each chunk's bf16 gradient, cast it and add it;
- forward keeps only the states (in the compute dtype), the cast weight and each row's log-sum-exp;
  backward recomputes each chunk's logits (or, with keep_logits, reads the ones forward kept) and
  writes their gradient in one pass, (onehot(target) - softmax) * grad / temperature, in the
  logits' dtype.

The values are those of the generic path (trainer.perf.logprob_chunk with activation checkpointing): the
same matmuls on the same rows, the same fp32 log-sum-exp. `ops` chooses how a chunk's logits become
log-probs and gradients: eager torch ops (any device), or the same functions through torch.compile
(Inductor fuses each into a kernel or two reading the bf16 logits).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    return logits / temperature if temperature > 0 and temperature != 1 else logits  # x / 1 is x


def logprob_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(n,) log-probs of `targets` and (n,) log-sum-exp, fp32, from (n, vocab) logits."""
    z = _scaled(logits, temperature)
    lse = z.logsumexp(dim=-1)
    return z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse, lse


def _grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
          temperature: float) -> torch.Tensor:
    """d(sum grad * logprob)/d logits = (onehot(target) - softmax) * grad / temperature, in the
    logits' dtype. One expression: Inductor makes it one pass over the logits."""
    scale = grad / temperature if temperature > 0 and temperature != 1 else grad
    p = torch.exp(_scaled(logits, temperature) - lse.unsqueeze(-1))
    onehot = torch.arange(logits.size(-1), device=logits.device) == targets.unsqueeze(-1)
    return ((onehot.float() - p) * scale.unsqueeze(-1)).to(logits.dtype)


def _grad_eager(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
                temperature: float) -> torch.Tensor:
    """_grad op by op in place on one fp32 copy of the logits (no onehot, no second copy)."""
    scale = grad / temperature if temperature > 0 and temperature != 1 else grad
    z = logits.float()  # a copy when the logits are bf16; on fp32 logits the recomputed chunk itself
    if temperature > 0 and temperature != 1:
        z.div_(temperature)
    z.sub_(lse.unsqueeze(-1)).exp_().mul_(scale.neg().unsqueeze(-1))
    z.scatter_add_(-1, targets.unsqueeze(-1), scale.unsqueeze(-1))
    return z.to(logits.dtype)


@dataclass(frozen=True)
class ChunkOps:
    """How one chunk's logits become (log-probs, log-sum-exp), and their gradient."""

    stats: Callable
    grad: Callable


EAGER = ChunkOps(logprob_stats, _grad_eager)


@functools.cache
def compiled_ops() -> ChunkOps:
    """The chunk functions through torch.compile, made on first use; the chunk's row count is the
    one dynamic size (the last chunk is shorter)."""
    return ChunkOps(torch.compile(logprob_stats), torch.compile(_grad))


def accumulate_matmul(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """total + a @ b in `dtype` (the weight's): on CUDA a bf16 product is summed in fp32 inside the
    matmul (no bf16 gradient, no cast, no separate add); elsewhere the product, then the add."""
    fused = a.is_cuda and a.dtype != dtype
    if total is None:
        return torch.mm(a, b, out_dtype=dtype) if fused else (a @ b).to(dtype)
    if fused:
        return torch.addmm(total, a, b, out_dtype=dtype, out=total)
    return total.add_(a @ b)


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, states, weight, targets, temperature, chunk, dtype, ops, keep_logits):
        with torch.autocast(device_type=states.device.type, enabled=False):
            x, w = states.to(dtype), weight.to(dtype)  # the weight's one cast
            logprobs = torch.empty(len(x), dtype=torch.float32, device=x.device)
            lse = torch.empty_like(logprobs)
            kept = torch.empty(len(x), len(w), dtype=dtype, device=x.device) if keep_logits else None
            for start in range(0, len(x), chunk):
                end = start + chunk
                logits = torch.mm(x[start:end], w.t(), out=kept[start:end]) if keep_logits else x[start:end] @ w.t()
                logprobs[start:end], lse[start:end] = ops.stats(logits, targets[start:end], temperature)
        ctx.save_for_backward(x, w, targets, lse, kept)
        ctx.args = (temperature, chunk, ops, states.dtype, weight.dtype)
        return logprobs

    @staticmethod
    def backward(ctx, grad):
        x, w, targets, lse, kept = ctx.saved_tensors
        temperature, chunk, ops, states_dtype, weight_dtype = ctx.args
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad = grad.float()
        grad_x = torch.empty_like(x) if want_x else None
        grad_w = None
        for start in range(0, len(x), chunk):
            end = start + chunk
            logits = kept[start:end] if kept is not None else x[start:end] @ w.t()
            g = ops.grad(logits, targets[start:end], lse[start:end], grad[start:end], temperature)
            if want_x:
                torch.mm(g, w, out=grad_x[start:end])
            if want_w:
                grad_w = accumulate_matmul(grad_w, g.t(), x[start:end], weight_dtype)
        if want_w and grad_w is None:  # no rows
            grad_w = torch.zeros(w.shape, dtype=weight_dtype, device=w.device)
        return (grad_x.to(states_dtype) if want_x else None), grad_w, None, None, None, None, None, None


def head_logprobs(states: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                  chunk: int, dtype: torch.dtype, ops: ChunkOps = EAGER, keep_logits: bool = False) -> torch.Tensor:
    """(n,) fp32 log-probs of `targets` under logits `states @ weight.T / temperature` (n, vocab),
    computed `chunk` rows at a time in `dtype`; gradients flow to `states` and `weight`.
    keep_logits: forward keeps all n rows of logits (n x vocab in `dtype`) for backward instead of
    recomputing each chunk's there (one head matmul less)."""
    return _HeadLogprobs.apply(states, weight, targets, temperature, chunk, dtype, ops, keep_logits)


def fusable(head: torch.nn.Module) -> bool:
    """Whether `head` is a plain bias-free nn.Linear whose weight is an ordinary tensor (not a LoRA
    wrapper, a sharded DTensor, or a module with its own forward), so head_logprobs computes
    exactly what calling it would."""
    return (type(head) is torch.nn.Linear and head.bias is None and "forward" not in head.__dict__
            and type(head.weight) in (torch.nn.Parameter, torch.Tensor))
