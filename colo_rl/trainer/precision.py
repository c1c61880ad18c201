"""Mixed precision's weight copies: compute-dtype copies of the fp32 masters made once per update,
their gradients added into the masters' .grad (trainer.perf.fuse_grad_accumulation, fp32_activations)."""

from __future__ import annotations

import functools
from collections import Counter
from contextlib import contextmanager
from typing import Optional

import torch

from colo_rl.trainer.head import accumulate_matmul
from colo_rl.trainer.kernels import decoder_layers


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
    micro-batch, on top of the accumulation (a noticeable share of a train step on a GPU). Here the cast happens once per update and
    the gradient is upcast inside the add. Under "matmul" the values are autocast's: the copy is
    autocast's cast of the same weight (autocast leaves a weight already in its dtype alone), and
    upcasting bf16 to fp32 is exact, so each addition is the one AccumulateGrad made. Only weights
    used once per forward: one used twice (tied, or the output head under the chunked head, once
    per chunk) would have its two gradients summed in bf16 before the hook.

    fuse_accumulation (trainer.perf.fuse_grad_accumulation): a plain nn.Linear's weight gradient is not
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


def weight_copies(autocast: bool, parallel: bool, compile: bool, lora: bool, fp32_activations: bool) -> Optional[str]:
    """What the trainer's compute_copies (above) copies once per update, for the
    trainer and the memory plan alike: None (autocast casts in every forward) without autocast, and
    where other code holds the parameters (DDP/FSDP hooks, compiled graphs, peft's adapters); else
    "matmul", or "all" under trainer.memory.fp32_activations=false."""
    if not autocast or parallel or compile or lora:
        return None
    return "matmul" if fp32_activations else "all"
