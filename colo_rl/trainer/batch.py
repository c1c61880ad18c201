"""Packing a step's sequences for the trainer: right-padded prompt+completion tensors, and
where their response tokens sit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


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
