"""The expected values of tests/trainer/test_algorithms.py, computed with verl's and TRL's own code.

verl 0.9.1 (PyPI wheel verl-0.9.1-py3-none-any.whl), verl/trainer/ppo/core_algos.py:
compute_grpo_outcome_advantage, compute_rloo_outcome_advantage,
compute_reinforce_plus_plus_outcome_advantage, compute_policy_loss_vanilla,
compute_policy_loss_gspo (their agg_loss). verl's package needs Ray and a GPU stack to import
whole, so its files are read from the unpacked wheel with the few modules core_algos imports
(no colo_rl dependency; nothing of verl is copied here):

    pip download verl==0.9.1 --no-deps -d /tmp/verl && unzip -q /tmp/verl/verl-*.whl -d /tmp/verl/site
    pip install --target /tmp/verl/deps --no-deps tensordict pyvers codetiming orjson ray msgpack
    PYTHONPATH=/tmp/verl/deps python tests/trainer/algorithms_reference.py /tmp/verl/site

TRL 1.16.0 (`pip install 'colo_rl[bench]'`), trl/trainer/grpo_trainer.py GRPOTrainer._compute_loss:
its loss arithmetic after the policy's forward, run on the same log-probs (the object it is
called on holds only what that arithmetic reads; `_get_per_token_logps_and_entropies` returns
the case's log-probs in place of a model's forward).

It prints the values that test_algorithms.py pins (float64 inputs, printed with repr).
"""

from __future__ import annotations

import sys
import types

import numpy as np
import torch

# the small case, shared with the test (which imports these names)
GROUP = 4
REWARDS = [1.0, 0.0, 0.5, 0.0, 0.2, 0.7, 1.0, 1.0]
LENGTHS = [3, 1, 4, 2, 5, 2, 3, 1]
MAX_TOKENS = 6
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # DAPO's clip-higher; GSPO's own bounds are pinned too
GSPO_CLIP_LOW, GSPO_CLIP_HIGH = 3e-4, 4e-4


def policy_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs, old_logprobs, advantages, mask) of the loss cases: float64, (8, 6), ratios
    within [0.5, 2] (verl's dual clip at 3 never binds, colo_rl has none)."""
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(MAX_TOKENS).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)).double()
    old = -torch.rand(len(LENGTHS), MAX_TOKENS, generator=g, dtype=torch.float64) * 3
    logprobs = old + (torch.rand(len(LENGTHS), MAX_TOKENS, generator=g, dtype=torch.float64) - 0.5) * 0.8
    advantages = torch.tensor([1.2, -0.7, 0.3, -1.1, 0.9, -0.4, 0.05, -0.25], dtype=torch.float64)
    return logprobs, old, advantages, mask


def probe() -> torch.Tensor:
    """Weights that turn the (8, 6) gradient of the loss over the log-probs into one number."""
    return torch.arange(1, 8 * MAX_TOKENS + 1, dtype=torch.float64).reshape(8, MAX_TOKENS) / 10


def _verl(site: str):
    verl = types.ModuleType("verl")  # skip verl/__init__.py (Ray, the data protocol)
    verl.__path__ = [f"{site}/verl"]
    sys.modules["verl"] = verl
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig

    return core_algos, AlgoConfig, ActorConfig


def estimators(core_algos, AlgoConfig) -> dict[str, list[float]]:
    mask = (torch.arange(MAX_TOKENS).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)).double()
    index = np.repeat(np.arange(len(REWARDS) // GROUP), GROUP)
    last = torch.tensor(LENGTHS) - 1

    def token_rewards():  # the outcome reward on each response's last token
        t = torch.zeros(len(REWARDS), MAX_TOKENS, dtype=torch.float64)
        t[torch.arange(len(REWARDS)), last] = torch.tensor(REWARDS, dtype=torch.float64)
        return t

    def first_token(adv):  # verl's advantages are per token, constant over a sequence here
        return adv[:, 0].tolist()

    out = {}
    for norm, name in ((True, "grpo_std"), (False, "grpo_mean")):
        adv, _ = core_algos.compute_grpo_outcome_advantage(token_rewards(), mask, index,
                                                           norm_adv_by_std_in_grpo=norm)
        out[name] = first_token(adv)
    adv, _ = core_algos.compute_rloo_outcome_advantage(token_rewards(), mask, index)
    out["rloo"] = first_token(adv)
    adv, _ = core_algos.compute_reinforce_plus_plus_outcome_advantage(token_rewards(), mask,
                                                                      config=AlgoConfig(gamma=1.0))
    out["reinforce_pp"] = first_token(adv)
    return out


def losses(core_algos, ActorConfig) -> dict[str, tuple[float, float, float]]:
    """{case: (loss, probe . d loss / d logprobs, clip fraction)}."""
    modes = {"token": "token-mean", "sequence": "seq-mean-token-mean", "constant": "seq-mean-token-sum-norm"}
    cases = {f"ppo_clip_{agg}": (core_algos.compute_policy_loss_vanilla, mode, CLIP_LOW, CLIP_HIGH)
             for agg, mode in modes.items()}
    cases["gspo_sequence"] = (core_algos.compute_policy_loss_gspo, modes["sequence"], GSPO_CLIP_LOW, GSPO_CLIP_HIGH)
    cases["gspo_sequence_wide"] = (core_algos.compute_policy_loss_gspo, modes["sequence"], CLIP_LOW, CLIP_HIGH)
    out = {}
    for name, (fn, mode, low, high) in cases.items():
        config = ActorConfig(strategy="fsdp", rollout_n=GROUP, clip_ratio=low, clip_ratio_low=low,
                             clip_ratio_high=high, ppo_micro_batch_size_per_gpu=1,
                             global_batch_info={"loss_scale_factor": MAX_TOKENS} if mode.endswith("norm") else {})
        logprobs, old, advantages, mask = policy_case()
        logprobs.requires_grad_(True)
        loss, metrics = fn(old, logprobs, advantages.unsqueeze(1) * mask, mask, loss_agg_mode=mode, config=config)
        loss.backward()
        out[name] = (loss.item(), (logprobs.grad * probe()).sum().item(), metrics["actor/pg_clipfrac"])
    return out


def trl_losses() -> dict[str, tuple[float, float, float]]:
    """{case: (loss, probe . d loss / d logprobs, clip_ratio/region_mean)} of TRL's GRPO loss."""
    from collections import defaultdict
    from types import SimpleNamespace

    from trl.trainer.grpo_trainer import GRPOTrainer

    cases = {"ppo_clip_token": ("dapo", "token", CLIP_LOW, CLIP_HIGH),
             "ppo_clip_sequence": ("grpo", "token", CLIP_LOW, CLIP_HIGH),
             "ppo_clip_constant": ("dr_grpo", "token", CLIP_LOW, CLIP_HIGH),
             "gspo_sequence": ("grpo", "sequence", GSPO_CLIP_LOW, GSPO_CLIP_HIGH),
             "gspo_sequence_wide": ("grpo", "sequence", CLIP_LOW, CLIP_HIGH)}
    out = {}
    for name, (loss_type, level, low, high) in cases.items():
        logprobs, old, advantages, mask = policy_case()
        logprobs.requires_grad_(True)
        accelerator = SimpleNamespace(reduce=lambda t, reduction: t, gather=lambda t: t, num_processes=1,
                                      gather_for_metrics=lambda t: t, sync_gradients=True)
        trainer = SimpleNamespace(
            _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, torch.zeros_like(logprobs), None),
            top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=0.0,
            loss_type=loss_type, epsilon_low=low, epsilon_high=high, use_vllm=False,
            args=SimpleNamespace(delta=None, steps_per_generation=1), model=SimpleNamespace(training=True),
            current_gradient_accumulation_steps=1, max_completion_length=MAX_TOKENS, _entropy_bonus_enabled=False,
            aux_loss_enabled=False, accelerator=accelerator, _metrics=defaultdict(lambda: defaultdict(list)))
        inputs = {"prompt_ids": torch.ones(8, 1, dtype=torch.long), "prompt_mask": torch.ones(8, 1),
                  "completion_ids": torch.ones(8, MAX_TOKENS, dtype=torch.long), "completion_mask": mask,
                  "advantages": advantages, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
        loss = GRPOTrainer._compute_loss(trainer, None, inputs)
        loss.backward()
        out[name] = (loss.item(), (logprobs.grad * probe()).sum().item(),
                     trainer._metrics["train"]["clip_ratio/region_mean"][0])
    return out


if __name__ == "__main__":
    core_algos, AlgoConfig, ActorConfig = _verl(sys.argv[1])
    print("ESTIMATORS =", repr(estimators(core_algos, AlgoConfig)))
    print("LOSSES =", repr(losses(core_algos, ActorConfig)))
    print("TRL_LOSSES =", repr(trl_losses()))
