"""Model FLOPs of a GRPO training step and the model FLOP utilisation (perf/mfu) it gives.

The count follows PaLM (Chowdhery et al. 2022, appendix B), whose attention term is Megatron's
(Narayanan et al. 2021, eq. 3): per token, 6 N for the matmuls of the forward (2 N) and backward
(activation gradients 2 N, weight gradients 2 N) pass, plus 12 L H Q T for attention's score and
value matmuls over a sequence of T tokens (L layers, H heads of size Q), counted as full, not
causal, attention as both papers do. Adapted to what colo_rl trains:
- N is every parameter that multiplies: all but the input embedding table (a lookup), the output
  head counted once even when it is tied to the embeddings.
- Only trainable weights get weight gradients: per token 4 N + 2 N_trainable. Under LoRA the
  frozen base still computes activation gradients (4 N, adapters included in N) but no weight
  gradients; full fine-tuning gives PaLM's 6 N.
- The output head is needed at response positions only (the log-prob of each sampled token), so
  its matmul counts there, not at prompt positions; padding counts nowhere.
- A KL reference forward (trainer.algo.kl_coef > 0) counts as 2 N + 4 L H Q T per token (no backward);
  each of trainer.algo.updates_per_batch updates counts a forward and backward.
- Recomputation (gradient checkpointing, the chunked head's backward) is not counted: these are
  model FLOPs, not hardware FLOPs, so MFU compares across those settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets, in TFLOP/s, matched on
# torch.cuda.get_device_name() in order (the first key contained in the name wins).
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM5: "NVIDIA H100 80GB HBM3"
    ("GH200", 989.0),
    ("H200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
]


@dataclass(frozen=True)
class ModelShape:
    """What the count needs from the policy: parameter counts and the attention shape."""

    params: int  # N: every parameter that multiplies (the head's included)
    trainable: int  # of those, the ones with weight gradients
    head_params: int  # the output head's (its LoRA adapters included)
    head_trainable: int
    layers: int
    attention_width: int  # H * Q: heads x head size

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelShape":
        config = model.config
        head = model.get_output_embeddings()
        embed = model.get_input_embeddings()
        head_ids = {id(p) for p in head.parameters()}
        # the embedding table is a lookup, unless it is the (tied) head's weight
        skip = {id(p) for p in embed.parameters()} - head_ids
        unique = {id(p): p for p in model.parameters() if id(p) not in skip}
        params = sum(p.numel() for p in unique.values())
        trainable = sum(p.numel() for p in unique.values() if p.requires_grad)
        head_params = sum(p.numel() for p in head.parameters())
        head_trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(params, trainable, head_params, head_trainable, config.num_hidden_layers,
                   config.num_attention_heads * head_dim)


def step_flops(shape: ModelShape, prompt_lengths: list[int], completion_lengths: list[int], *,
               updates: int = 1, reference_forward: bool = False) -> float:
    """Model FLOPs of one train_step over sequences of these prompt and completion lengths."""
    body, body_trainable = shape.params - shape.head_params, shape.trainable - shape.head_trainable
    train = forward = 0.0
    for p, c in zip(prompt_lengths, completion_lengths):
        tokens = p + c
        attention = 4.0 * shape.layers * shape.attention_width * tokens * tokens  # forward: QK^T and AV
        train += (4 * body + 2 * body_trainable) * tokens + (4 * shape.head_params + 2 * shape.head_trainable) * c \
            + 3 * attention
        forward += 2 * body * tokens + 2 * shape.head_params * c + attention
    return updates * train + (forward if reference_forward else 0.0)


def peak_tflops(configured: Optional[float], device: torch.device) -> Optional[float]:
    """trainer.perf.peak_tflops when set, else the table's dense bf16 peak of this CUDA device; None
    (MFU not logged) on a CPU or an unknown GPU."""
    if configured is not None:
        return float(configured)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def perf_metrics(flops: float, train_s: float, peak: Optional[float]) -> dict[str, float]:
    """perf/train_tflops (model FLOPs of the step over the train phase's seconds) and perf/mfu
    (that over the peak), when a peak is known; nothing otherwise."""
    if peak is None or train_s <= 0:
        return {}
    tflops = flops / train_s / 1e12
    return {"perf/train_tflops": tflops, "perf/mfu": tflops / peak, "perf/step_tflop": flops / 1e12}
