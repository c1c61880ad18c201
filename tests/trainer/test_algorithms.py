"""The named estimators and policy losses against verl's own code, their loader, and the trainer's
options that leave sequences out (trainer.algo.skip_zero_advantage, trainer.algo.mask_truncated).

The expected values were computed by tests/trainer/algorithms_reference.py with verl 0.9.1's
verl/trainer/ppo/core_algos.py and TRL 1.16.0's trl/trainer/grpo_trainer.py (the functions named
on each value) on the same inputs.
"""

import sys

import pytest
import torch

from colo_rl.config import ConfigError, ModelConfig, TrainerConfig
from colo_rl.models import load_policy, write_embedded_model
from colo_rl.trainer import GRPOTrainer, grpo_loss
from colo_rl.trainer.algorithms import gspo, load_estimator, load_policy_loss, ppo_clip, rloo
from tests.configs import trainer_config

from .algorithms_reference import (CLIP_HIGH, CLIP_LOW, GROUP, GSPO_CLIP_HIGH, GSPO_CLIP_LOW, LENGTHS, MAX_TOKENS,
                                   REWARDS, policy_case, probe)

# verl 0.9.1, verl/trainer/ppo/core_algos.py; each sequence's advantage (verl's is per token, the
# same on every token of a sequence here)
ESTIMATORS = {
    # compute_grpo_outcome_advantage(norm_adv_by_std_in_grpo=True), epsilon 1e-6
    ("grpo", "std"): [1.3055796924007037, -0.7833478154404222, 0.26111593848014075, -0.7833478154404222,
                      -1.3907552907175293, -0.06622644241512052, 0.7284908665663251, 0.7284908665663251],
    # compute_grpo_outcome_advantage(norm_adv_by_std_in_grpo=False) (Dr. GRPO)
    ("grpo", "mean"): [0.625, -0.375, 0.125, -0.375, -0.5249999999999999, -0.025000000000000022, 0.275, 0.275],
    # compute_rloo_outcome_advantage
    ("rloo", "mean"): [0.8333333333333333, -0.5, 0.16666666666666663, -0.5, -0.7, -0.03333333333333344,
                       0.3666666666666666, 0.3666666666666666],
    # compute_reinforce_plus_plus_outcome_advantage, AlgoConfig(gamma=1.0)
    ("reinforce_pp", "mean"): [1.1820275618718703, -1.4036577282607026, -0.11081508319441619, -1.4036577282607026,
                               -0.886520670234188, 0.40632197483209825, 1.1820275618718703, 1.1820275618718703],
}

# verl 0.9.1, verl/trainer/ppo/core_algos.py: (loss, probe . d loss / d logprobs, pg_clipfrac)
LOSSES = {
    # compute_policy_loss_vanilla, clip_ratio_low 0.2, clip_ratio_high 0.28, loss_agg_mode
    # token-mean / seq-mean-token-mean / seq-mean-token-sum-norm (loss_scale_factor = max tokens)
    ("ppo_clip", "token", CLIP_LOW, CLIP_HIGH): (-0.2616591396065507, -0.2372812386553499, 0.19047619038548752),
    ("ppo_clip", "sequence", CLIP_LOW, CLIP_HIGH): (0.008279315241278395, 0.24338587495825353, 0.19047619038548752),
    ("ppo_clip", "constant", CLIP_LOW, CLIP_HIGH): (-0.11447587357786593, -0.10381054191171551, 0.19047619038548752),
    # compute_policy_loss_gspo, seq-mean-token-mean, GSPO's bounds 3e-4 / 4e-4, then wide ones
    ("gspo", "sequence", GSPO_CLIP_LOW, GSPO_CLIP_HIGH): (0.05366739993598893, 0.05930818998162457, 0.4285714283673469),
    ("gspo", "sequence", CLIP_LOW, CLIP_HIGH): (0.0034436479831129185, 0.299244282603973, 0.14285714278911565),
}


# TRL 1.16.0, trl/trainer/grpo_trainer.py GRPOTrainer._compute_loss on the same log-probs:
# (loss, probe . d loss / d logprobs, clip_ratio/region_mean or None where TRL counts sequences)
TRL_LOSSES = {
    # loss_type dapo (token mean) / grpo (sequence mean of token means) / dr_grpo (sum / (B x
    # max_completion_length)), importance_sampling_level="token", epsilon_low 0.2, epsilon_high 0.28
    ("ppo_clip", "token", CLIP_LOW, CLIP_HIGH): (-0.2616591396065507, -0.2372812386553499, 0.19047619047619047),
    ("ppo_clip", "sequence", CLIP_LOW, CLIP_HIGH): (0.00827931669042678, 0.24338587814388998, 0.19047619047619047),
    ("ppo_clip", "constant", CLIP_LOW, CLIP_HIGH): (-0.11447587357786593, -0.10381054191171551, 0.19047619047619047),
    # GSPO: importance_sampling_level="sequence", loss_type grpo (its clip ratio is per sequence)
    ("gspo", "sequence", GSPO_CLIP_LOW, GSPO_CLIP_HIGH): (0.053667401549576194, 0.059308191578712185, None),
    ("gspo", "sequence", CLIP_LOW, CLIP_HIGH): (0.0034436494070045898, 0.2992442860755242, None),
}


@pytest.mark.parametrize("name, norm", list(ESTIMATORS))
def test_each_estimator_matches_verl(name, norm):
    estimator = load_estimator(name)
    advantages = estimator(torch.tensor(REWARDS, dtype=torch.float64), GROUP, lengths=torch.tensor(LENGTHS),
                           cfg=trainer_config(advantage_norm=norm))
    torch.testing.assert_close(advantages, torch.tensor(ESTIMATORS[name, norm], dtype=torch.float64),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("peer, case", [("verl", case) for case in LOSSES] + [("trl", case) for case in TRL_LOSSES])
def test_each_policy_loss_matches_verl_and_trl(peer, case):
    name, agg, low, high = case
    logprobs, old, advantages, mask = policy_case()
    logprobs.requires_grad_(True)
    loss, stats = grpo_loss(logprobs, old, advantages, mask, clip_eps=low, clip_eps_high=high, loss_agg=agg,
                            max_tokens=MAX_TOKENS, policy_loss=load_policy_loss(name))
    loss.backward()
    expected_loss, expected_probe, expected_clip = (LOSSES if peer == "verl" else TRL_LOSSES)[case]
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert (logprobs.grad * probe()).sum().item() == pytest.approx(expected_probe, abs=1e-6)
    if expected_clip is not None:
        assert stats["clip_frac"] == pytest.approx(expected_clip, abs=1e-6)


def test_gspo_on_one_token_sequences_is_ppo_clip():
    """The sequence ratio of a one-token sequence is its token's ratio."""
    logprobs, old, advantages, _ = policy_case()
    mask = torch.zeros_like(logprobs, dtype=torch.bool)
    mask[:, 0] = True
    for a, b in zip(gspo(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28),
                    ppo_clip(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28)):
        torch.testing.assert_close(a[:, 0], b[:, 0])


def test_a_group_of_equal_rewards_gets_zero_rloo_advantage():
    rewards = torch.tensor([0.1] * 7 + [0.0, 1.0] * 3 + [0.9], dtype=torch.float32)
    advantages = rloo(rewards, 7, lengths=torch.ones(14), cfg=TrainerConfig())
    assert torch.equal(advantages[:7], torch.zeros(7)) and advantages[7:].abs().min() > 0.1


def test_parts_load_by_short_name_or_import_path_and_bad_ones_name_the_key(tmp_path, monkeypatch):
    assert load_estimator("colo_rl.trainer.algorithms:rloo") is load_estimator("rloo") is rloo
    assert load_policy_loss("gspo") is gspo
    (tmp_path / "my_algos.py").write_text("def half(rewards, group_size, *, lengths, cfg):\n    return rewards / 2\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_algos", raising=False)
    assert load_estimator("my_algos:half")(torch.ones(2), 2, lengths=None, cfg=None).tolist() == [0.5, 0.5]
    with pytest.raises(ConfigError, match=r"^trainer.algo.advantage_estimator: 'rlooo' is not an import path.*rloo"):
        load_estimator("rlooo")
    with pytest.raises(ConfigError, match=r"^trainer.algo.policy_loss: 'my_algos:nope'.*no callable 'nope'"):
        load_policy_loss("my_algos:nope")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_embedded_model(ModelConfig(), tmp_path_factory.mktemp("policy"))


def _trainer(model_dir, **overrides) -> GRPOTrainer:
    torch.manual_seed(0)
    model = load_policy(ModelConfig(), model_dir, "cpu")
    return GRPOTrainer(model, trainer_config(micro_batch_size=2, **overrides), pad_token_id=0, temperature=1.0,
                       max_tokens=4, device="cpu")


PROMPTS = [[5, 6, 7], [8, 9], [3, 4]]
COMPLETIONS = [[10, 11], [12], [13, 14, 15, 16], [17, 2], [18, 19, 20, 21], [22], [23, 24], [25, 26, 27, 28], [29]]
RANGED = [1.0, 0.0, 0.4, 0.3, 0.3, 0.3, 0.0, 1.0, 1.0]  # the middle group has no spread


def _gradients(trainer, prompts=PROMPTS, completions=COMPLETIONS, rewards=RANGED, **step) -> tuple[dict, dict]:
    """One train step's metrics and the gradients its optimizer step got (recorded, not applied:
    AdamW's first step turns a gradient's sign into a whole lr, so parameters would compare the
    summation order, not the gradient)."""
    grads = {}
    trainer.optimizer.step = lambda: grads.update(
        {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    metrics = trainer.train_step(prompts, completions, rewards, 3, **step)
    return metrics, grads


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "gspo"])
def test_skipping_zero_advantage_sequences_gives_the_same_loss_and_update(model_dir, policy_loss):
    plain, plain_grads = _gradients(_trainer(model_dir, policy_loss=policy_loss))
    skipping, skipping_grads = _gradients(_trainer(model_dir, policy_loss=policy_loss, skip_zero_advantage=True))
    assert skipping["train/sequences_skipped"] == 3.0 and "train/sequences_skipped" not in plain
    for key in ("train/loss", "train/grad_norm", "train/advantage_abs_mean"):
        assert skipping[key] == pytest.approx(plain[key], abs=1e-6), key
    assert plain_grads.keys() == skipping_grads.keys()
    for name, value in plain_grads.items():
        torch.testing.assert_close(skipping_grads[name], value, rtol=1e-5, atol=1e-7)  # float32 summation order


def test_truncated_completions_are_masked_out_of_the_loss_on_request(model_dir):
    """Masking the last group's completions as truncated trains as the first two groups alone
    (GRPO's advantages are per group; the token normalizer counts the kept tokens only)."""
    truncated = [False] * 6 + [True] * 3
    masked, masked_grads = _gradients(_trainer(model_dir, mask_truncated=True), truncated=truncated)
    alone, alone_grads = _gradients(_trainer(model_dir), PROMPTS[:2], COMPLETIONS[:6], RANGED[:6])
    assert masked["train/truncated_masked"] == 3.0 and "train/truncated_masked" not in alone
    assert masked["train/loss"] == pytest.approx(alone["train/loss"], abs=1e-6)
    for name, value in alone_grads.items():
        torch.testing.assert_close(masked_grads[name], value, rtol=1e-5, atol=1e-7)  # float32 summation order
    # off (the default), the flags change nothing
    off, off_grads = _gradients(_trainer(model_dir), truncated=truncated)
    plain, plain_grads = _gradients(_trainer(model_dir))
    assert off == plain and all(torch.equal(off_grads[n], plain_grads[n]) for n in plain_grads)


def test_the_trainer_trains_with_the_policy_loss_it_is_given(model_dir, tmp_path, monkeypatch):
    """trainer.algo.policy_loss reaches the loss of a train step (the merge of the named parts once loaded
    it and trained with ppo_clip all the same): a user's loss that doubles ppo_clip's per-token term
    doubles the loss and every gradient."""
    (tmp_path / "doubled_loss.py").write_text(
        "from colo_rl.trainer.loss import ppo_clip\n"
        "def doubled(*args, **kwargs):\n"
        "    per_token, clipped = ppo_clip(*args, **kwargs)\n"
        "    return 2 * per_token, clipped\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    unclipped = dict(max_grad_norm=1e9)  # the gradient clip would scale both to one norm
    plain, plain_grads = _gradients(_trainer(model_dir, **unclipped))
    doubled, doubled_grads = _gradients(_trainer(model_dir, policy_loss="doubled_loss:doubled", **unclipped))
    assert doubled["train/loss"] == pytest.approx(2 * plain["train/loss"], rel=1e-6)
    for name, value in plain_grads.items():
        torch.testing.assert_close(doubled_grads[name], 2 * value, rtol=1e-5, atol=1e-7)
