"""Checkpoints of a real trainer: exact resumption, RNG states, atomic writes, self-describing
files that need no pickle, checksums and config comparison on resume, readable errors."""

import json
import random
import resource
import signal

import numpy as np
import pytest
import torch

from safetensors.torch import load_file

from colo_rl.config import EmbeddedModelConfig, ModelConfig, TrainerConfig
from colo_rl.models import load_policy, write_embedded_model
from colo_rl.trainer import CheckpointError, GRPOTrainer, load_checkpoint, save_checkpoint
from colo_rl.trainer.checkpoint import check_compatible, read_config, read_manifest
from tests.configs import old_layout, trainer_config

from ..conftest import compose_config

PROMPTS = [[5, 6, 7], [8, 9]]
FIRST = ([[10, 11, 2], [12], [13, 14, 15, 16], [17, 2]], [1.0, 0.0, 0.0, 1.0])
SECOND = ([[20, 2], [21, 22], [23], [24, 25, 26]], [0.0, 1.0, 1.0, 0.0])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_embedded_model(ModelConfig(), tmp_path_factory.mktemp("policy"))


def make_trainer(model_dir, **overrides) -> GRPOTrainer:
    model = load_policy(ModelConfig(), model_dir, "cpu")
    return GRPOTrainer(model, trainer_config(**overrides), pad_token_id=0, temperature=1.0,
                       max_tokens=8, device="cpu")


def step(trainer, batch):
    completions, rewards = batch
    trainer.train_step(PROMPTS, completions, rewards, 2)


def config_of(*overrides: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose_config(*overrides), resolve=True)


def test_a_resumed_trainer_continues_exactly_like_an_uninterrupted_one(model_dir, tmp_path):
    sampler = random.Random(7)
    extra = {"step": 1, "sampler": sampler.getstate()}
    uninterrupted = make_trainer(model_dir, kl_coef=0.1)
    step(uninterrupted, FIRST)
    assert save_checkpoint(tmp_path / "ckpt", uninterrupted, extra) == tmp_path / "ckpt"
    step(uninterrupted, SECOND)

    resumed = make_trainer(model_dir, kl_coef=0.1)
    assert load_checkpoint(tmp_path / "ckpt", resumed) == extra
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


def test_the_checkpoint_describes_itself_and_its_weights_need_no_pickle(model_dir, tmp_path):
    trainer = make_trainer(model_dir, kl_coef=0.1)
    step(trainer, FIRST)
    config = config_of("trainer.algo.kl_coef=0.1")
    path = save_checkpoint(tmp_path / "ckpt", trainer, {"step": 1}, config=config, model_dir=model_dir)
    manifest = read_manifest(path)
    assert manifest["step"] == 1 and manifest["kind"] == "full"
    assert set(manifest["versions"]) == {"colo_rl", "torch", "transformers"}
    assert manifest["versions"]["torch"] == torch.__version__
    assert {"model.safetensors", "optimizer.safetensors", "reference.safetensors", "state.pt",
            "config.yaml", "hf/config.json", "hf/tokenizer.json"} <= set(manifest["files"])
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values())
    # the weights are plain safetensors under the model's own names
    model = load_file(path / "model.safetensors")
    assert model.keys() == trainer.model.state_dict().keys()
    assert all(torch.equal(model[k], v) for k, v in trainer.model.state_dict().items())
    optimizer = load_file(path / "optimizer.safetensors")
    assert torch.equal(optimizer["state/0/exp_avg"], trainer.optimizer.state_dict()["state"][0]["exp_avg"])
    torch.load(path / "state.pt", weights_only=True)  # the small rest, no pickle of code
    from omegaconf import OmegaConf

    assert OmegaConf.to_container(OmegaConf.load(path / "config.yaml")) == config
    assert json.loads((path / "hf" / "config.json").read_text())["hidden_size"] == 128


def test_tied_weights_are_stored_once_and_come_back_tied(model_dir, tmp_path):
    trainer = make_trainer(model_dir)
    model = trainer.model
    model.lm_head.weight = model.model.embed_tokens.weight
    trainer.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(trainer, FIRST)
    save_checkpoint(tmp_path / "ckpt", trainer, {})
    assert read_manifest(tmp_path / "ckpt")["aliases"]["model"] == {"lm_head.weight": "model.embed_tokens.weight"}
    resumed = make_trainer(model_dir)
    resumed.model.lm_head.weight = resumed.model.model.embed_tokens.weight
    resumed.optimizer = torch.optim.AdamW(resumed.model.parameters(), lr=1e-3)
    load_checkpoint(tmp_path / "ckpt", resumed)
    assert torch.equal(resumed.model.lm_head.weight, model.lm_head.weight)
    assert resumed.model.lm_head.weight is resumed.model.model.embed_tokens.weight


def test_rng_states_come_back(model_dir, tmp_path):
    trainer = make_trainer(model_dir)
    save_checkpoint(tmp_path, trainer, {})
    draws = (torch.rand(3), random.random(), np.random.rand())
    load_checkpoint(tmp_path, trainer)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]


@pytest.mark.parametrize("name", ["optimizer.safetensors", "model.safetensors", "state.pt", "hf/config.json"])
def test_a_flipped_byte_is_refused_naming_the_file(model_dir, tmp_path, name):
    trainer = make_trainer(model_dir)
    step(trainer, FIRST)
    path = save_checkpoint(tmp_path / "ckpt", trainer, {}, model_dir=model_dir)
    target = path / name
    data = bytearray(target.read_bytes())
    data[len(data) * 2 // 3] ^= 0x01
    target.write_bytes(bytes(data))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"{target}: its bytes differ from the SHA-256 in manifest.json"):
        load_checkpoint(path, trainer)
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in before.items())  # untouched


def test_missing_or_foreign_checkpoints_name_the_path(model_dir, tmp_path):
    trainer = make_trainer(model_dir)
    with pytest.raises(CheckpointError, match=f"{tmp_path}: not a checkpoint directory .no manifest.json"):
        load_checkpoint(tmp_path, trainer)
    path = save_checkpoint(tmp_path / "ckpt", trainer, {})
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=f"{path / 'model.safetensors'}: missing"):
        load_checkpoint(path, trainer)


def test_a_state_file_that_needs_pickle_is_refused_without_advising_weights_only_false(model_dir, tmp_path):
    """A state.pt whose checksum was rewritten too (someone else's file): refused by
    weights_only=True, and the message does not relay torch's advice to unpickle it."""
    import hashlib

    trainer = make_trainer(model_dir)
    path = save_checkpoint(tmp_path / "ckpt", trainer, {})
    torch.save({"object": np.random.default_rng(0)}, path / "state.pt")  # needs arbitrary unpickling
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / "state.pt").read_bytes()
    manifest["files"]["state.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"{path / 'state.pt'}: not a colo_rl state file") as info:
        load_checkpoint(path, trainer)
    assert "weights_only" not in str(info.value)


def test_a_failed_save_leaves_the_previous_checkpoint_intact(model_dir, tmp_path):
    """A file-size limit (what a full disk looks like to the writer) stops the write half-way."""
    trainer = make_trainer(model_dir)
    path = save_checkpoint(tmp_path / "ckpt", trainer, {"step": 0})
    good = {p.name: p.read_bytes() for p in path.iterdir()}
    step(trainer, FIRST)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG, not a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(good["optimizer.safetensors"]) // 2, hard))
    try:
        with pytest.raises(OSError, match="File too large"):
            save_checkpoint(tmp_path / "ckpt", trainer, {"step": 1})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == good
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no partial directory left behind
    assert load_checkpoint(path, make_trainer(model_dir)) == {"step": 0}


def test_a_second_save_replaces_the_first_whole(model_dir, tmp_path):
    trainer = make_trainer(model_dir, kl_coef=0.1)
    save_checkpoint(tmp_path / "ckpt", trainer, {"step": 0})
    plain = make_trainer(model_dir)
    save_checkpoint(tmp_path / "ckpt", plain, {"step": 1})
    assert not (tmp_path / "ckpt" / "reference.safetensors").exists()  # nothing of the first left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert load_checkpoint(tmp_path / "ckpt", make_trainer(model_dir)) == {"step": 1}


def test_extra_that_could_not_be_loaded_back_is_refused_at_save_time(model_dir, tmp_path):
    with pytest.raises(CheckpointError, match="cannot go into a checkpoint"):
        save_checkpoint(tmp_path / "ckpt", make_trainer(model_dir), {"reward": np.float64(1.0)})
    assert not (tmp_path / "ckpt").exists()


def test_a_checkpoint_with_a_reference_does_not_load_into_a_trainer_without_kl(model_dir, tmp_path):
    save_checkpoint(tmp_path, make_trainer(model_dir, kl_coef=0.1), {})
    with pytest.raises(CheckpointError, match="has reference model but trainer.algo.kl_coef=0.0"):
        load_checkpoint(tmp_path, make_trainer(model_dir))


def test_resume_with_another_model_shape_or_optimizer_is_refused_naming_the_keys(model_dir, tmp_path):
    trainer = make_trainer(model_dir)
    path = save_checkpoint(tmp_path / "ckpt", trainer, {}, config=config_of())
    check_compatible(path, config_of("trainer.steps=99", "logger=none"))  # free to change
    with pytest.raises(CheckpointError, match=r"model.embedded.hidden_size=256 \(the checkpoint: 128\)"):
        check_compatible(path, config_of("model.embedded.hidden_size=256"))
    with pytest.raises(CheckpointError, match=r"trainer.lr=0.1 \(the checkpoint: 0.001\); "
                                              r"trainer.optim.betas=\[0.8, 0.9\]"):
        check_compatible(path, config_of("trainer.lr=0.1", "trainer.optim.betas=[0.8,0.9]"))
    with pytest.raises(CheckpointError, match="trainer.algo.kl_coef=a reference model"):
        check_compatible(path, config_of("trainer.algo.kl_coef=0.1"))


def test_a_checkpoint_written_before_the_trainer_keys_moved_resumes_and_is_compared_by_its_values(model_dir,
                                                                                                    tmp_path):
    config = config_of("trainer.algo.kl_coef=0.1")
    old = old_layout(config)  # the config.yaml of a checkpoint written in the flat layout
    assert "optimizer" in old["trainer"] and "optim" not in old["trainer"]
    path = save_checkpoint(tmp_path / "ckpt", make_trainer(model_dir, kl_coef=0.1), {}, config=old)
    assert read_config(path) == config
    check_compatible(path, config)
    with pytest.raises(CheckpointError, match=r"trainer.optim.name=adamw_8bit \(the checkpoint: adamw\); "
                                              r"trainer.algo.kl_coef=no reference model"):
        check_compatible(path, config_of("trainer.optim.name=adamw_8bit"))


def test_tensors_that_do_not_fit_the_model_are_named(model_dir, tmp_path):
    """Without a stored config (a checkpoint saved by hand) the tensors' shapes still are."""
    path = save_checkpoint(tmp_path / "ckpt", make_trainer(model_dir), {})
    wide = ModelConfig(embedded=EmbeddedModelConfig(hidden_size=256))
    wide_dir = write_embedded_model(wide, tmp_path / "wide")
    other = GRPOTrainer(load_policy(wide, wide_dir, "cpu"), TrainerConfig(), pad_token_id=0,
                        temperature=1.0, max_tokens=8, device="cpu")
    with pytest.raises(CheckpointError, match=r"shapes differ: model.embed_tokens.weight \[64, 128\] "
                                              r"\(this model: \[64, 256\]\)"):
        load_checkpoint(path, other)


def test_a_background_write_holds_the_state_of_its_snapshot_not_of_later_steps(model_dir, tmp_path):
    """trainer.checkpoint.background: the snapshot is the checkpoint, whatever the run does while it
    is written; the files are those a direct save of that moment writes (tied weights included)."""
    from colo_rl.trainer.checkpoint import BackgroundWriter, snapshot

    trainer = make_trainer(model_dir, kl_coef=0.1)
    trainer.model.lm_head.weight = trainer.model.model.embed_tokens.weight
    trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-3)
    step(trainer, FIRST)
    sampler = random.Random(3)
    extra = {"step": 1, "sampler": sampler.getstate()}
    save_checkpoint(tmp_path / "direct", trainer, extra)
    snap = snapshot(trainer, extra)
    draws = (torch.rand(3), random.random(), np.random.rand())  # the RNGs move on after the snapshot
    extra["step"] = 2  # and so does the runner's record
    sampler.random()
    extra["sampler"] = sampler.getstate()
    step(trainer, SECOND)  # updates every tensor in place before (and while) the thread writes
    writer = BackgroundWriter()
    writer.submit(lambda: save_checkpoint(tmp_path / "background", trainer, snap.extra, state=snap.state,
                                          rng=snap.rng), snap.step)
    writer.wait()
    assert not writer.busy and writer.written[0] == 1 and writer.written[1] > 0
    for name in ("model.safetensors", "optimizer.safetensors", "reference.safetensors"):
        assert (tmp_path / "background" / name).read_bytes() == (tmp_path / "direct" / name).read_bytes(), name
    assert read_manifest(tmp_path / "background")["aliases"] == read_manifest(tmp_path / "direct")["aliases"]
    resumed = make_trainer(model_dir, kl_coef=0.1)
    resumed.model.lm_head.weight = resumed.model.model.embed_tokens.weight
    resumed.optimizer = torch.optim.AdamW(resumed.model.parameters(), lr=1e-3)
    assert load_checkpoint(tmp_path / "background", resumed)["step"] == 1
    again = (torch.rand(3), random.random(), np.random.rand())  # the snapshot's RNG states came back
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]
    direct = make_trainer(model_dir, kl_coef=0.1)
    direct.model.lm_head.weight = direct.model.model.embed_tokens.weight
    direct.optimizer = torch.optim.AdamW(direct.model.parameters(), lr=1e-3)
    load_checkpoint(tmp_path / "direct", direct)
    for (name, a), b in zip(direct.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def test_snapshots_reuse_the_writers_host_buffers_and_write_what_a_direct_save_writes(model_dir, tmp_path):
    """The host copy of a background checkpoint goes into buffers allocated once (pinned on CUDA:
    a copy into fresh pageable memory stalled the 1B run 14.8 s); the next snapshot overwrites
    them, and its files are still a direct save's, tied weights included."""
    from colo_rl.trainer.checkpoint import BackgroundWriter

    trainer = make_trainer(model_dir)
    trainer.model.lm_head.weight = trainer.model.model.embed_tokens.weight
    trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-3)
    step(trainer, FIRST)
    writer = BackgroundWriter()
    first = writer.snapshot(trainer, {"step": 1})
    held = writer.buffers.nbytes
    state_bytes = {t.data_ptr(): t.numel() * t.element_size() for t in trainer.model.state_dict().values()}
    assert held >= sum(state_bytes.values())  # every tensor once (the tied pair shares one buffer)
    pointers = {t.data_ptr() for t in first.state["model"].values()}
    step(trainer, SECOND)
    save_checkpoint(tmp_path / "direct", trainer, {"step": 2})
    second = writer.snapshot(trainer, {"step": 2})
    assert writer.buffers.nbytes == held  # nothing allocated again
    assert {t.data_ptr() for t in second.state["model"].values()} == pointers  # the same buffers
    assert second.state["model"]["lm_head.weight"] is second.state["model"]["model.embed_tokens.weight"]
    writer.submit(lambda: save_checkpoint(tmp_path / "background", trainer, second.extra, state=second.state,
                                          rng=second.rng), second.step)
    writer.wait()
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert (tmp_path / "background" / name).read_bytes() == (tmp_path / "direct" / name).read_bytes(), name


def test_a_failed_background_write_is_raised_by_the_next_wait_and_leaves_the_previous_checkpoint(model_dir, tmp_path):
    from colo_rl.trainer.checkpoint import BackgroundWriter, snapshot

    trainer = make_trainer(model_dir)
    path = save_checkpoint(tmp_path / "ckpt", trainer, {"step": 0})
    good = {p.name: p.read_bytes() for p in path.iterdir()}
    step(trainer, FIRST)
    snap = snapshot(trainer, {"step": 1})
    writer = BackgroundWriter()
    (tmp_path / "blocker").write_text("")  # a file where the checkpoint's parent directory should be
    writer.submit(lambda: save_checkpoint(tmp_path / "blocker" / "ckpt", trainer, snap.extra, state=snap.state,
                                          rng=snap.rng), snap.step)
    with pytest.raises(OSError):
        writer.wait()
    writer.wait()  # raised once; nothing in flight now
    assert writer.written is None
    assert {p.name: p.read_bytes() for p in path.iterdir()} == good
