"""Checkpoints of a real trainer: exact resumption, RNG states, atomic writes, readable errors."""

import random
import resource
import signal

import numpy as np
import pytest
import torch

from colo_rl.config import ModelConfig, TrainerConfig
from colo_rl.models import load_policy, write_embedded_model
from colo_rl.trainer import CheckpointError, GRPOTrainer, load_checkpoint, save_checkpoint

PROMPTS = [[5, 6, 7], [8, 9]]
FIRST = ([[10, 11, 2], [12], [13, 14, 15, 16], [17, 2]], [1.0, 0.0, 0.0, 1.0])
SECOND = ([[20, 2], [21, 22], [23], [24, 25, 26]], [0.0, 1.0, 1.0, 0.0])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_embedded_model(ModelConfig(), tmp_path_factory.mktemp("policy"))


def make_trainer(model_dir, **overrides) -> GRPOTrainer:
    model = load_policy(ModelConfig(), model_dir, "cpu")
    return GRPOTrainer(model, TrainerConfig(**overrides), pad_token_id=0, temperature=1.0,
                       max_tokens=8, device="cpu")


def step(trainer, batch):
    completions, rewards = batch
    trainer.train_step(PROMPTS, completions, rewards, 2)


def test_a_resumed_trainer_continues_exactly_like_an_uninterrupted_one(model_dir, tmp_path):
    sampler = random.Random(7)
    extra = {"step": 1, "sampler": sampler.getstate()}
    uninterrupted = make_trainer(model_dir, kl_coef=0.1)
    step(uninterrupted, FIRST)
    assert save_checkpoint(tmp_path, uninterrupted, extra) == tmp_path / "trainer.pt"
    step(uninterrupted, SECOND)

    resumed = make_trainer(model_dir, kl_coef=0.1)
    assert load_checkpoint(tmp_path, resumed) == extra
    assert resumed.step_count == 1
    step(resumed, SECOND)
    assert resumed.step_count == uninterrupted.step_count == 2
    for (name, a), b in zip(uninterrupted.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(uninterrupted.optimizer.state.values(), resumed.optimizer.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    restored = random.Random()
    restored.setstate(extra["sampler"])
    assert restored.random() == sampler.random()


def test_rng_states_come_back(model_dir, tmp_path):
    trainer = make_trainer(model_dir)
    save_checkpoint(tmp_path, trainer, {})
    draws = (torch.rand(3), random.random(), np.random.rand())
    load_checkpoint(tmp_path, trainer)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]


def test_missing_or_unreadable_checkpoints_name_the_path(model_dir, tmp_path):
    trainer = make_trainer(model_dir)
    with pytest.raises(CheckpointError, match=f"no checkpoint at {tmp_path / 'trainer.pt'}"):
        load_checkpoint(tmp_path, trainer)
    path = save_checkpoint(tmp_path, trainer, {})
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"{path} is not a readable checkpoint"):
        load_checkpoint(tmp_path, trainer)


def test_a_failed_save_leaves_the_previous_checkpoint_intact(model_dir, tmp_path):
    """A file-size limit (what a full disk looks like to the writer) stops the write half-way."""
    trainer = make_trainer(model_dir)
    path = save_checkpoint(tmp_path, trainer, {"step": 0})
    good = path.read_bytes()
    step(trainer, FIRST)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG, not a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(good) // 2, hard))
    try:
        with pytest.raises((OSError, RuntimeError)):
            save_checkpoint(tmp_path, trainer, {"step": 1})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir()] == ["trainer.pt"]  # no partial file left behind
    assert load_checkpoint(tmp_path, make_trainer(model_dir)) == {"step": 0}


def test_extra_that_could_not_be_loaded_back_is_refused_at_save_time(model_dir, tmp_path):
    with pytest.raises(CheckpointError, match="cannot go into a checkpoint"):
        save_checkpoint(tmp_path, make_trainer(model_dir), {"reward": np.float64(1.0)})
    assert not (tmp_path / "trainer.pt").exists()


def test_a_checkpoint_with_a_reference_does_not_load_into_a_trainer_without_kl(model_dir, tmp_path):
    save_checkpoint(tmp_path, make_trainer(model_dir, kl_coef=0.1), {})
    with pytest.raises(ValueError, match="has reference model but trainer.kl_coef=0.0"):
        load_checkpoint(tmp_path, make_trainer(model_dir))
