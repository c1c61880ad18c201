"""The log-prob head: the output head applied to a chunk of response positions at a time
(trainer.perf.logprob_chunk), each chunk's logits turned into the target tokens' log-probs (eager or
compiled, trainer.perf.logprob_kernel), or the fused head of colo_rl/trainer/head.py."""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.utils.checkpoint

from colo_rl.trainer.batch import _MicroBatch
from colo_rl.trainer.head import fusable, head_logprobs, logprob_stats


def _output_head(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face output head (lm_head) under DDP, FSDP2 (in place) and peft wrappers."""
    inner = model.module if hasattr(model, "no_sync") and hasattr(model, "module") else model  # DDP
    head = inner.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(inner).__name__} has no output head (get_output_embeddings() is None): "
                         "set trainer.perf.logprob_chunk=0")
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
    """trainer.perf.logprob_kernel resolved for `device`: the function each chunk of the output head's
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

    With `head_ops` (trainer.perf.fused_head) and a plain bias-free linear head, the chunks go through
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
