"""GRPO maths against hand-computed values, and the trainer on the real embedded OLMo-2 policy."""

import math

import pytest
import torch

from colo_rl.config import ModelConfig, TrainerConfig
from colo_rl.models import load_policy, write_embedded_model
from colo_rl.trainer import GRPOTrainer, group_advantages, grpo_loss, loss_normalizer
from colo_rl.trainer.optim import scheduled_lr
from tests.configs import trainer_config

PROMPTS = [[5, 6, 7], [8, 9]]
GROUP = 3
# Different lengths, an empty completion and a group of identical rewards' worth of spread, so
# that masking and normalisation mistakes change the result.
COMPLETIONS = [[10, 11, 2], [12], [], [13, 14, 15, 16], [17, 2], [18, 19]]
REWARDS = [1.0, 0.0, 0.5, 0.0, 1.0, 0.3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_embedded_model(ModelConfig(), tmp_path_factory.mktemp("policy"))


def make_trainer(model_dir, temperature=1.0, **overrides) -> GRPOTrainer:
    model = load_policy(ModelConfig(), model_dir, "cpu")
    return GRPOTrainer(model, trainer_config(**overrides), pad_token_id=0, temperature=temperature,
                       max_tokens=8, device="cpu")


def params(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def test_group_advantages_mean_and_population_std_match_hand_computed_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0])
    # Group means 0.5 and 2.75; population stds 0.5 and sqrt(1.6875) = 0.75 * sqrt(3).
    mean = group_advantages(rewards, 4, "mean")
    torch.testing.assert_close(mean, torch.tensor([0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25]))
    std = group_advantages(rewards, 4, "std", eps=0.0, std="population")
    s3 = math.sqrt(3)
    torch.testing.assert_close(std, torch.tensor([1.0, -1.0, -1.0, 1.0, -1 / s3, -1 / s3, -1 / s3, s3]))


@pytest.mark.parametrize("eps, expected", [
    # verl 0.9.1 compute_grpo_outcome_advantage: (r - mean) / (torch.std(group) + 1e-6), torch.std
    # unbiased; unbiased stds sqrt(1/3) and 1.5.
    (1e-6, [0.8660239037870368, -0.8660239037870368, -0.8660239037870368, 0.8660239037870368,
            -0.49999966666688894, -0.49999966666688894, -0.49999966666688894, 1.4999990000006667]),
    # TRL 1.16 GRPOTrainer, scale_rewards="group": (r - mean) / (rewards.view(-1, G).std(dim=1) + 1e-4)
    (1e-4, [0.8658754297607016, -0.8658754297607016, -0.8658754297607016, 0.8658754297607016,
            -0.49996666888874075, -0.49996666888874075, -0.49996666888874075, 1.4999000066662223]),
])
def test_group_advantages_with_the_unbiased_std_match_trl_and_verl(eps, expected):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0], dtype=torch.float64)
    advantages = group_advantages(rewards, 4, "std", eps=eps)  # unbiased is the default
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    # float32 rewards give the same numbers to float32 precision
    torch.testing.assert_close(group_advantages(rewards.float(), 4, "std", eps=eps),
                               torch.tensor(expected, dtype=torch.float32))


@pytest.mark.parametrize("norm", ["mean", "std"])
@pytest.mark.parametrize("std", ["unbiased", "population"])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantages(norm, std):
    """All 0.1 in float32: the float32 mean of 7 or more of them is not 0.1, and (r - mean) /
    (std + eps) turned that residue into advantages of 0.0074 before. Beside them a group with a
    spread, which keeps its ordinary advantages."""
    for value, size in ((0.1, 7), (0.1, 10), (0.7, 16), (1e-3, 9)):
        rewards = torch.cat([torch.full((size,), value), torch.linspace(0, 1, size)]).float()
        advantages = group_advantages(rewards, size, norm, std=std)
        assert torch.equal(advantages[:size], torch.zeros(size)), (value, size, advantages[:size])
        assert advantages[size:].abs().max() > 0.1


def test_group_advantages_of_identical_rewards_are_zero_and_bad_shapes_are_refused():
    assert torch.equal(group_advantages(torch.ones(4), 2, "std"), torch.zeros(4))
    assert torch.equal(group_advantages(torch.ones(4), 1, "std"), torch.zeros(4))  # no NaN at n=1
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(torch.ones(4), 3, "mean")
    with pytest.raises(ValueError, match="trainer.algo.advantage_norm"):
        group_advantages(torch.ones(4), 2, "median")
    with pytest.raises(ValueError, match="trainer.algo.advantage_std"):
        group_advantages(torch.ones(4), 2, "std", std="sample")


def _loss_batch():
    """Ratios chosen so two tokens fall outside [0.8, 1.2] on the side where clipping binds."""
    ratios = torch.tensor([[1.5, 0.9, 1.0], [0.5, 1.1, 1.0]])
    old = torch.full((2, 3), -1.0)
    logprobs = (old + ratios.log()).requires_grad_(True)
    advantages = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logprobs, old, advantages, mask


# Per-token loss max(-A r, -A clip(r)): row 0 (A=1): -1.2 (clipped), -0.9, -1.0; row 1 (A=-2):
# 1.6 (clipped), 2.2, masked. Sum 0.7 over 5 tokens.
@pytest.mark.parametrize("loss_agg, expected", [
    ("token", 0.7 / 5),
    ("sequence", (-3.1 / 3 + 3.8 / 2) / 2),
    ("constant", 0.7 / (2 * 4)),
])
def test_grpo_loss_matches_hand_computed_value(loss_agg, expected):
    logprobs, old, advantages, mask = _loss_batch()
    loss, stats = grpo_loss(logprobs, old, advantages, mask, clip_eps=0.2, loss_agg=loss_agg, max_tokens=4)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    assert stats["kl"] == 0.0 and stats["tokens"] == 5.0


def test_grpo_loss_gradient_is_zero_on_clipped_and_masked_tokens():
    logprobs, old, advantages, mask = _loss_batch()
    loss, _ = grpo_loss(logprobs, old, advantages, mask, clip_eps=0.2, loss_agg="token", max_tokens=4)
    loss.backward()
    # d/dlogp of -A * r is -A * r; divided by the 5 tokens.
    expected = torch.tensor([[0.0, -0.9, -1.0], [0.0, 2.2, 0.0]]) / 5
    torch.testing.assert_close(logprobs.grad, expected)


def test_grpo_loss_adds_the_k3_kl_penalty():
    logprobs, old, advantages, mask = _loss_batch()
    delta = torch.tensor([[0.5, 0.0, -0.5], [1.0, 0.2, 3.0]])  # ref - logp; the 3.0 is masked out
    kl = [math.exp(d) - d - 1 for d in (0.5, 0.0, -0.5, 1.0, 0.2)]
    loss, stats = grpo_loss(logprobs, old, advantages, mask, clip_eps=0.2, loss_agg="token",
                            max_tokens=4, ref_logprobs=logprobs.detach() + delta, kl_coef=0.1)
    assert loss.item() == pytest.approx((0.7 + 0.1 * sum(kl)) / 5, rel=1e-6)
    assert stats["kl"] == pytest.approx(sum(kl) / 5, rel=1e-6)


@pytest.mark.parametrize("clip_eps_high, expected_loss, expected_clip_frac", [
    # TRL 1.16 GRPOTrainer._compute_loss, loss_type="dapo" (token mean), epsilon_low=0.2:
    # coef_2 = clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high), loss -min(coef_1 A, coef_2 A);
    # clip_ratio/region_mean counts (coef_1 < 1 - eps_low and A < 0) or (coef_1 > 1 + eps_high and A > 0).
    (0.28, 0.4116666666666666, 3 / 6),
    (None, 0.4333333333333334, 4 / 6),  # epsilon_high = epsilon_low
])
def test_clip_higher_matches_trl_epsilon_low_and_high(clip_eps_high, expected_loss, expected_clip_frac):
    """Ratio 1.25 with a positive advantage is inside [0.8, 1.28] but outside [0.8, 1.2]."""
    ratios = torch.tensor([[1.5, 1.25, 0.7], [0.5, 1.25, 0.75]])
    old = torch.full((2, 3), -1.0)
    logprobs = (old + ratios.log()).requires_grad_(True)
    loss, stats = grpo_loss(logprobs, old, torch.tensor([1.0, -2.0]), torch.ones(2, 3), clip_eps=0.2,
                            clip_eps_high=clip_eps_high, loss_agg="token", max_tokens=3)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    assert stats["clip_frac"] == pytest.approx(expected_clip_frac)
    loss.backward()
    assert (logprobs.grad[0, 1] != 0) == (clip_eps_high == 0.28)  # the 1.25 token still learns


def test_truncated_importance_weights_multiply_the_policy_term_as_in_trl():
    """TRL 1.16: per_token_loss = -min(coef_1 A, coef_2 A) * clamp(exp(old - vllm logp), max=cap),
    then + beta * kl. With weights min(w, 2) of w = 3, 0.5, 1, 2.5, 1.5 and the ratios of
    _loss_batch: (-1.2*2 - 0.9*0.5 - 1.0*1 + 1.6*2 + 2.2*1.5) / 5 = 0.53, plus the unweighted KL."""
    logprobs, old, advantages, mask = _loss_batch()
    weights = torch.tensor([[3.0, 0.5, 1.0], [2.5, 1.5, 1e4]]).clamp(max=2.0)  # the 1e4 is masked
    loss, stats = grpo_loss(logprobs, old, advantages, mask, clip_eps=0.2, loss_agg="token", max_tokens=4,
                            tis_weights=weights)
    assert loss.item() == pytest.approx(0.53, rel=1e-6)
    delta = torch.tensor([[0.5, 0.0, -0.5], [1.0, 0.2, 3.0]])
    kl = sum(math.exp(d) - d - 1 for d in (0.5, 0.0, -0.5, 1.0, 0.2))
    loss, _ = grpo_loss(logprobs, old, advantages, mask, clip_eps=0.2, loss_agg="token", max_tokens=4,
                        tis_weights=weights, ref_logprobs=logprobs.detach() + delta, kl_coef=0.1)
    assert loss.item() == pytest.approx(0.53 + 0.1 * kl / 5, rel=1e-6)


def test_the_trainer_weights_each_token_by_its_capped_engine_ratio_and_logs_it(model_dir):
    """Engine log-probs lower than the trainer's by log(w) give importance ratios w; on the first
    update the PPO ratio is 1, so the loss is -sum_i A_i sum_t min(w_it, cap) / tokens."""
    trainer = make_trainer(model_dir, tis_cap=2.0, micro_batch_size=4)
    exact = _reference_logprobs(trainer.model, 1.0)
    cycle = [0.5, 1.0, 3.0, 1.5, 2.5]
    w = [[cycle[(i + t) % len(cycle)] for t in range(len(c))] for i, c in enumerate(COMPLETIONS)]
    engine = [[lp - math.log(x) for lp, x in zip(row, ws)] for row, ws in zip(exact, w)]
    advantages = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), GROUP, "mean").tolist()
    tokens = sum(len(c) for c in COMPLETIONS)
    expected = -sum(a * sum(min(x, 2.0) for x in ws) for a, ws in zip(advantages, w)) / tokens
    metrics = trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP, engine_logprobs=engine)
    assert metrics["train/loss"] == pytest.approx(expected, rel=1e-4)
    assert metrics["train/tis_ratio_mean"] == pytest.approx(sum(map(sum, w)) / tokens, rel=1e-4)
    assert metrics["train/tis_capped_frac"] == sum(x > 2.0 for ws in w for x in ws) / tokens
    with pytest.raises(ValueError, match="trainer.algo.tis_cap=2.0 needs the engine's sampled log-probs"):
        trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    untouched = make_trainer(model_dir).train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP, engine_logprobs=engine)
    assert "train/tis_ratio_mean" not in untouched
    assert untouched["train/loss"] == pytest.approx(-sum(a * len(c) for a, c in zip(advantages, COMPLETIONS))
                                                    / tokens, abs=1e-6)


@pytest.mark.parametrize("loss_agg", ["token", "sequence", "constant"])
def test_extreme_values_at_padded_positions_give_the_loss_of_the_unpadded_rows(loss_agg):
    """exp(ref - logp) of ref=+1e4 overflows to inf, and an old log-prob of -1e4 makes the ratio
    inf; inf * mask 0 was NaN. Masked before the exp, the padded batch's loss and gradient are
    those of its rows without padding, each under the full batch's normalizer."""
    logprobs, old, advantages, mask = _loss_batch()
    ref = logprobs.detach() + torch.tensor([[0.5, 0.0, -0.5], [1.0, 0.2, 0.0]])
    padded = mask == 0
    kwargs = dict(clip_eps=0.2, loss_agg=loss_agg, max_tokens=4, kl_coef=0.1)
    loss, stats = grpo_loss(logprobs, old.masked_fill(padded, -1e4), advantages, mask,
                            ref_logprobs=ref.masked_fill(padded, 1e4), **kwargs)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()

    normalizer = loss_normalizer(mask.sum(dim=1), loss_agg, 4)
    rows = torch.zeros(()), []
    for i, n in enumerate((3, 2)):
        row = logprobs.detach()[i:i + 1, :n].clone().requires_grad_(True)
        row_loss, _ = grpo_loss(row, old[i:i + 1, :n], advantages[i:i + 1], mask[i:i + 1, :n],
                                ref_logprobs=ref[i:i + 1, :n], normalizer=normalizer, **kwargs)
        row_loss.backward()
        rows = rows[0] + row_loss.detach(), rows[1] + [row.grad[0]]
    assert loss.item() == pytest.approx(rows[0].item(), rel=1e-6)
    torch.testing.assert_close(logprobs.grad[0], rows[1][0])
    torch.testing.assert_close(logprobs.grad[1, :2], rows[1][1])
    assert logprobs.grad[1, 2] == 0
    assert math.isfinite(stats["kl"]) and stats["tokens"] == 5.0


@pytest.mark.parametrize("loss_agg", ["token", "sequence", "constant"])
def test_micro_batches_accumulate_to_the_full_batch_gradient(model_dir, loss_agg):
    """Plain SGD at lr=1 (no clipping) makes each parameter's change equal to minus its gradient."""
    deltas = []
    for micro_batch_size in (1, len(COMPLETIONS)):
        trainer = make_trainer(model_dir, micro_batch_size=micro_batch_size, loss_agg=loss_agg,
                               max_grad_norm=1e9)
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
        before = params(trainer)
        trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
        deltas.append({n: p.detach() - before[n] for n, p in trainer.model.named_parameters()})
    small, full = deltas
    assert sum(d.abs().sum() for d in full.values()) > 0
    for name in full:
        torch.testing.assert_close(small[name], full[name], rtol=1e-4, atol=1e-6)


def test_identical_steps_from_identical_state_give_bit_identical_parameters(model_dir):
    a, b = make_trainer(model_dir, micro_batch_size=4), make_trainer(model_dir, micro_batch_size=4)
    for trainer in (a, b):
        for _ in range(2):
            trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    pa, pb = params(a), params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert a.step_count == b.step_count == 2


def test_metrics_and_empty_completions(model_dir):
    trainer = make_trainer(model_dir)
    metrics = trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    assert set(metrics) == {"train/loss", "train/grad_norm", "train/clip_frac", "train/kl", "train/lr",
                            "train/nonfinite_skipped", "train/nonfinite_skipped_total",
                            "train/response_tokens", "train/advantage_abs_mean"}
    assert metrics["train/response_tokens"] == 12.0
    assert metrics["train/grad_norm"] > 0 and metrics["train/kl"] == 0.0
    empty = trainer.train_step(PROMPTS, [[]] * 6, REWARDS, GROUP)
    assert empty["train/loss"] == 0.0 and empty["train/response_tokens"] == 0.0
    assert all(math.isfinite(v) for v in empty.values())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_train_step_refuses_mismatched_batches(model_dir):
    trainer = make_trainer(model_dir)
    with pytest.raises(ValueError, match="6 completions for 2 prompts with group_size=2"):
        trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, 2)
    with pytest.raises(ValueError, match=r"engine_logprobs\[0\] has 1 values for 3"):
        trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP, engine_logprobs=[[0.0]] * 6)
    assert trainer.step_count == 0


def _optimizer_state(trainer) -> list[torch.Tensor]:
    return [v.clone() for state in trainer.optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("bad_rewards, what", [
    ([math.nan, 0.0, 1.0, 0.0, 1.0, 0.3], "loss"),  # a NaN reward: NaN advantages, NaN loss
    ([1e30, -1e30, 0.0, 0.0, 1e30, -1e30], "grad_norm"),  # finite loss, gradient norm inf
])
def test_a_non_finite_loss_or_gradient_skips_the_update_and_keeps_the_state(model_dir, bad_rewards, what):
    trainer = make_trainer(model_dir, micro_batch_size=4)
    trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)  # AdamW's state exists from here
    before, moments = params(trainer), _optimizer_state(trainer)
    for in_a_row in (1, 2):
        metrics = trainer.train_step(PROMPTS, COMPLETIONS, bad_rewards, GROUP)
        assert not math.isfinite(metrics[f"train/{what}"])
        assert metrics["train/nonfinite_skipped"] == 1.0
        assert metrics["train/nonfinite_skipped_total"] == in_a_row == trainer.nonfinite_in_a_row
        assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
        assert all(torch.equal(a, b) for a, b in zip(_optimizer_state(trainer), moments))
        assert all(p.grad is None for p in trainer.model.parameters())
    assert trainer.step_count == 3  # the schedule's clock runs on: a skipped step is a step
    metrics = trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    assert metrics["train/nonfinite_skipped"] == 0.0 and trainer.nonfinite_in_a_row == 0
    assert metrics["train/nonfinite_skipped_total"] == 2.0
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


SCHEDULES = {"constant": "get_constant_schedule_with_warmup", "linear": "get_linear_schedule_with_warmup",
             "cosine": "get_cosine_schedule_with_warmup"}


def _transformers_lrs(schedule: str, lr: float, warmup_steps: int, steps: int) -> list[float]:
    """The lr of each optimizer step under transformers' scheduler, stepped after each step as its
    Trainer (and TRL's) does."""
    import transformers

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    make = getattr(transformers, SCHEDULES[schedule])
    scheduler = make(optimizer, warmup_steps, steps) if schedule != "constant" else make(optimizer, warmup_steps)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("warmup", [0, 3])
def test_scheduled_lr_is_transformers_schedule_to_the_bit(schedule, warmup):
    lrs = [scheduled_lr(3e-6, k, schedule=schedule, warmup_steps=warmup, total_steps=10) for k in range(10)]
    assert lrs == _transformers_lrs(schedule, 3e-6, warmup, 10)


def test_the_trainer_steps_at_the_cosine_schedules_lr_and_resume_continues_it(model_dir):
    steps, warmup, lr = 6, 2, 0.01
    config = dict(lr=lr, steps=steps, warmup_steps=warmup, lr_schedule="cosine", micro_batch_size=6)
    trainer = make_trainer(model_dir, **config)
    before = params(trainer)
    lrs = []
    for step in range(steps):
        lrs.append(trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)["train/lr"])
        assert all(g["lr"] == lrs[-1] for g in trainer.optimizer.param_groups)
        if step == 0:  # warmup starts at lr 0: the first step must not move the policy
            assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert lrs == _transformers_lrs("cosine", lr, warmup, steps)
    assert lrs[warmup] == lr and lrs[-1] < lr / 5

    interrupted, resumed = make_trainer(model_dir, **config), make_trainer(model_dir, **config)
    for _ in range(3):
        interrupted.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    resumed.load_state_dict(interrupted.state_dict())
    assert [resumed.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)["train/lr"]
            for _ in range(3, steps)] == lrs[3:]


def _reference_logprobs(model, temperature):
    """Each completion's log-probs from its own unpadded forward pass, at the temperature."""
    result = []
    with torch.no_grad():
        for i, completion in enumerate(COMPLETIONS):
            prompt = PROMPTS[i // GROUP]
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]
            steps = logits[len(prompt) - 1:len(prompt) + len(completion) - 1] / temperature
            lp = steps.log_softmax(-1).gather(-1, torch.tensor(completion, dtype=torch.long)[:, None])
            result.append(lp.squeeze(-1).tolist())
    return result


@pytest.mark.parametrize("perturbation", [0.0, 0.25])
def test_engine_logprob_gap_measures_the_difference_before_the_update(model_dir, perturbation):
    """lr=0.05 moves the policy enough that a gap measured after the update would not be ~0."""
    trainer = make_trainer(model_dir, temperature=0.7, lr=0.05, micro_batch_size=4)
    engine = [[lp + perturbation for lp in row] for row in _reference_logprobs(trainer.model, 0.7)]
    metrics = trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP, engine_logprobs=engine)
    assert metrics["train/engine_logprob_gap"] == pytest.approx(perturbation, abs=1e-5)
    after = trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP, engine_logprobs=engine)
    assert abs(after["train/engine_logprob_gap"] - perturbation) > 1e-3


def test_several_updates_per_batch_clip_and_kl_tracks_the_reference(model_dir):
    trainer = make_trainer(model_dir, lr=0.05, updates_per_batch=4, clip_eps=0.05, kl_coef=0.1)
    reference = {n: p.clone() for n, p in trainer.reference.named_parameters()}
    first = trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    second = trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    assert first["train/clip_frac"] > 0  # updates 2-4 reuse the batch with a moved policy
    assert second["train/kl"] > 0
    assert all(torch.equal(p, reference[n]) for n, p in trainer.reference.named_parameters())
    single = make_trainer(model_dir).train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    assert single["train/clip_frac"] == 0.0  # one update: the ratio is exactly 1


TARGET = 20


def _sample(model, prompts, group, length, generator):
    """On-policy rollouts of equal-length prompts by plain multinomial sampling."""
    seqs = torch.tensor([p for p in prompts for _ in range(group)])
    with torch.no_grad():
        for _ in range(length):
            probs = model(input_ids=seqs).logits[:, -1].softmax(-1)
            seqs = torch.cat([seqs, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return seqs[:, len(prompts[0]):].tolist()


def _target_prob(model, prompts):
    with torch.no_grad():
        return model(input_ids=torch.tensor(prompts)).logits[:, -1].softmax(-1)[:, TARGET].mean().item()


def test_rewarding_one_token_raises_its_probability(model_dir):
    trainer = make_trainer(model_dir, lr=0.01)
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13], [14, 15, 16]]
    generator = torch.Generator().manual_seed(0)
    before = _target_prob(trainer.model, prompts)
    for _ in range(8):
        completions = _sample(trainer.model, prompts, 8, 3, generator)
        rewards = [c.count(TARGET) / 3 for c in completions]
        trainer.train_step(prompts, completions, rewards, 8)
    assert _target_prob(trainer.model, prompts) > 3 * before


def test_running_out_of_gpu_memory_says_what_to_change_and_whether_the_state_is_whole(model_dir):
    """torch.OutOfMemoryError, raised where the device would raise it (a forward of the second
    micro-batch; then the optimizer's step), becomes TrainerOutOfMemory: before any optimizer step
    the parameters and optimizer state are the previous step's and the partial gradients are
    dropped (state_intact: the run checkpoints them); inside the optimizer's step they are not."""
    from colo_rl.trainer import TrainerOutOfMemory

    trainer = make_trainer(model_dir, micro_batch_size=2)
    trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)  # optimizer state exists
    before, moments = params(trainer), {k: v["exp_avg"].clone() for k, v in trainer.optimizer.state.items()}
    calls = []

    def second_forward_fails(module, args):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    hook = trainer.model.register_forward_pre_hook(second_forward_fails)
    with pytest.raises(TrainerOutOfMemory, match=r"at trainer.micro_batch_size=2 \(CUDA out of memory. Tried "
                                                 r"to allocate 2.00 GiB\): set trainer.micro_batch_size=1 or "
                                                 r"trainer.memory.gradient_checkpointing=true") as info:
        trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    hook.remove()
    assert info.value.state_intact and isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert all(torch.equal(p, before[n]) for n, p in params(trainer).items())
    assert all(p.grad is None for p in trainer.model.parameters())  # the first micro-batch's are gone
    assert all(torch.equal(trainer.optimizer.state[k]["exp_avg"], m) for k, m in moments.items())
    assert trainer.step_count == 1
    # the trainer goes on from there, as a resumed run would
    trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    assert trainer.step_count == 2

    def step_fails(optimizer, args, kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    trainer.optimizer.register_step_pre_hook(step_fails)
    with pytest.raises(TrainerOutOfMemory, match="resume from the checkpoint written before this step") as info:
        trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, GROUP)
    assert not info.value.state_intact
