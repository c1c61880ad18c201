"""The Offloader on a real trainer's state. On this CPU machine the "device" tensors are CPU
tensors too: the offloader still moves them into separate host buffers and drops the originals,
so everything but pinning and asynchrony is exercised here (the GPU test covers those)."""

import pytest
import torch

from colo_rl.config import ModelConfig, TrainerConfig
from colo_rl.models import load_policy, write_embedded_model
from colo_rl.trainer import GRPOTrainer, Offloader

PROMPTS = [[5, 6, 7], [8, 9]]
COMPLETIONS = [[10, 11, 2], [12], [13, 14, 15, 16], [17, 2]]
REWARDS = [1.0, 0.0, 0.0, 1.0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_embedded_model(ModelConfig(), tmp_path_factory.mktemp("policy"))


def stepped_trainer(model_dir, device="cpu") -> GRPOTrainer:
    """A trainer after one step, so that the optimizer has state to move."""
    model = load_policy(ModelConfig(), model_dir, device)
    trainer = GRPOTrainer(model, TrainerConfig(), pad_token_id=0, temperature=1.0, max_tokens=8, device=device)
    trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, 2)
    return trainer


def state_tensors(trainer) -> dict[str, torch.Tensor]:
    """Every tensor the offloader may move, by name: parameters, buffers, optimizer state."""
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    tensors = {f"param:{n}": p for n, p in trainer.model.named_parameters()}
    tensors.update({f"buffer:{n}": b for n, b in trainer.model.named_buffers()})
    for p, state in trainer.optimizer.state.items():
        tensors.update({f"state:{names[id(p)]}:{k}": v for k, v in state.items()})
    return tensors


def snapshot(trainer) -> dict[str, tuple[int, torch.Tensor]]:
    return {k: (t.data_ptr(), t.detach().clone()) for k, t in state_tensors(trainer).items()}


def assert_same_values(trainer, before):
    for key, tensor in state_tensors(trainer).items():
        assert torch.equal(tensor, before[key][1]), key


def test_a_step_after_offload_and_restore_is_bit_identical_to_one_without(model_dir):
    moved, kept = stepped_trainer(model_dir), stepped_trainer(model_dir)
    offloader = Offloader(moved.model, moved.optimizer, "all")
    offloader.offload(("optimizer",))
    offloader.offload(("params",))
    offloader.restore()
    for trainer in (moved, kept):
        trainer.train_step(PROMPTS, COMPLETIONS, [0.0, 1.0, 1.0, 0.0], 2)
    a, b = state_tensors(moved), state_tensors(kept)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_identity_and_keys_survive_and_host_buffers_are_reused(model_dir):
    trainer = stepped_trainer(model_dir)
    ids = [id(p) for p in trainer.model.parameters()]
    keys = {id(p): set(s) for p, s in trainer.optimizer.state.items()}
    step_tensors = [s["step"] for s in trainer.optimizer.state.values()]
    before = snapshot(trainer)
    offloader = Offloader(trainer.model, trainer.optimizer, "all")

    hosts = []
    for _ in range(2):
        result = offloader.offload()
        assert offloader.offloaded == {"optimizer", "params"} and result["bytes"] > 0
        on_host = {k: t.data_ptr() for k, t in state_tensors(trainer).items()}
        for key, ptr in on_host.items():
            assert ptr != before[key][0], f"{key} still on its original storage"
            assert ptr == offloader._host[key].data_ptr(), f"{key} is not in its host buffer"
        hosts.append(on_host)
        restored = offloader.restore()
        assert restored["bytes"] == result["bytes"] and restored["background_bytes"] == 0.0  # no side stream on the CPU
        offloader.wait()  # harmless with nothing in flight
        assert offloader.background_stats() == {}
        assert offloader.offloaded == set()
        assert_same_values(trainer, before)

    assert hosts[0] == hosts[1]  # the second cycle allocated no new host buffer
    assert [id(p) for p in trainer.model.parameters()] == ids
    assert [id(p) for p in trainer.optimizer.param_groups[0]["params"]] == ids
    assert {id(p): set(s) for p, s in trainer.optimizer.state.items()} == keys
    assert all(s["step"] is t for s, t in zip(trainer.optimizer.state.values(), step_tensors))
    assert all(int(t) == 1 for t in step_tensors)


def test_policy_optimizer_leaves_the_weights_and_none_moves_nothing(model_dir):
    trainer = stepped_trainer(model_dir)
    before = snapshot(trainer)
    Offloader(trainer.model, trainer.optimizer, "optimizer").offload()
    for key, tensor in state_tensors(trainer).items():
        moved = tensor.data_ptr() != before[key][0]
        assert moved == key.startswith("state:"), key

    trainer = stepped_trainer(model_dir)
    before = snapshot(trainer)
    offloader = Offloader(trainer.model, trainer.optimizer, "none")
    assert offloader.offload()["bytes"] == 0.0 and offloader.offloaded == set()
    assert all(t.data_ptr() == before[k][0] for k, t in state_tensors(trainer).items())
    with pytest.raises(ValueError, match="trainer.memory.offload"):
        Offloader(trainer.model, trainer.optimizer, "weights")


def test_a_failure_half_way_puts_back_what_was_moved(model_dir):
    trainer = stepped_trainer(model_dir)
    offloader = Offloader(trainer.model, trainer.optimizer, "all")
    offloader.offload()
    offloader.restore()
    before = snapshot(trainer)
    # The optimizer part goes first and the last parameter late, so most tensors have moved
    # by the time its wrongly shaped buffer refuses the copy.
    last = f"param:{list(dict(trainer.model.named_parameters()))[-1]}"
    offloader._host[last] = torch.empty(1)
    with pytest.raises(RuntimeError, match=f"host buffer for {last} is"):
        offloader.offload()
    assert offloader.offloaded == set()
    for key, tensor in state_tensors(trainer).items():
        assert tensor.data_ptr() == before[key][0], f"{key} was not put back"
    assert_same_values(trainer, before)


def test_gradients_move_with_the_optimizer_part():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).square().sum().backward()
    grads = {n: (p.grad.data_ptr(), p.grad.clone()) for n, p in model.named_parameters()}
    offloader = Offloader(model, optimizer, "optimizer")
    assert offloader.offload()["bytes"] == sum(g.nbytes for _, g in grads.values())
    assert all(p.grad.data_ptr() != grads[n][0] for n, p in model.named_parameters())
    offloader.restore()
    assert all(torch.equal(p.grad, grads[n][1]) for n, p in model.named_parameters())


def test_restoring_what_was_not_offloaded_is_a_no_op(model_dir):
    trainer = stepped_trainer(model_dir)
    before = snapshot(trainer)
    assert Offloader(trainer.model, trainer.optimizer, "all").restore()["bytes"] == 0.0
    assert all(t.data_ptr() == before[k][0] for k, t in state_tensors(trainer).items())


def test_restore_while_awake_is_asked_for_and_needs_something_offloaded(model_dir):
    trainer = stepped_trainer(model_dir)
    for asked in (False, True):
        offloader = Offloader(trainer.model, trainer.optimizer, "all", restore_while_awake=asked)
        assert not offloader.fits_beside_engine() and offloader.offloaded_bytes() == 0  # nothing offloaded
        moved = offloader.offload()["bytes"]
        assert offloader.offloaded_bytes() == moved > 0
        assert offloader.fits_beside_engine() == asked  # on the CPU there is always room
        offloader.restore()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_restore_while_awake_needs_room_for_everything_offloaded(model_dir):
    trainer = stepped_trainer(model_dir, "cuda")
    offloader = Offloader(trainer.model, trainer.optimizer, "all", restore_while_awake=True)
    offloader.offload()
    free = torch.cuda.mem_get_info()[0]
    assert offloader.fits_beside_engine(margin_bytes=free - offloader.offloaded_bytes() - 2**20)
    assert not offloader.fits_beside_engine(margin_bytes=free - offloader.offloaded_bytes() + 2**20)
    offloader.restore()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_buffers_are_pinned_memory_is_freed_and_cpu_step_stays(model_dir):
    trainer = stepped_trainer(model_dir, "cuda")
    before = snapshot(trainer)
    offloader = Offloader(trainer.model, trainer.optimizer, "all")
    allocated = torch.cuda.memory_allocated()
    result = offloader.offload()
    # torch lets go of every byte moved. (Whether the driver gets them back, `freed_gib`, depends
    # on which 2 MiB segments this tiny model's tensors share with others': on the H200 it read
    # 0.0 after another test's trainer. The 512 MiB model of the next test checks it.)
    assert allocated - torch.cuda.memory_allocated() >= result["bytes"] > 0
    for key, tensor in state_tensors(trainer).items():
        if before[key][1].device.type == "cpu":  # AdamW's `step`, unless fused: left where it is
            assert key.endswith(":step") and tensor.data_ptr() == before[key][0] and key not in offloader._host
        else:
            assert tensor.device.type == "cpu" and tensor.is_pinned(), key
    offloader.restore()
    assert all(t.device.type == "cuda" for t in trainer.model.parameters())
    assert_same_values(trainer, before)
    trainer.train_step(PROMPTS, COMPLETIONS, REWARDS, 2)


def adamw_after_one_step(seed: int, device: str = "cuda"):
    """A model with 128 MiB of weights, AdamW's moments (256 MiB), and gradients for a second step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048, bias=False) for _ in range(8))).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(64, 2048, device=device)).square().mean().backward()
        if not optimizer.state:
            optimizer.step()
    return model, optimizer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_background_restore_overlaps_and_the_next_step_waits_for_it():
    """The moments arrive on a side stream after restore() returns; optimizer.step (through its
    hook) and state_dict see them complete, so the step equals one that never offloaded."""
    model, optimizer = adamw_after_one_step(0)
    kept_model, kept_optimizer = adamw_after_one_step(0)
    offloader = Offloader(model, optimizer, "all")
    first = offloader.offload()
    offloaded = first["bytes"]
    assert first["freed_gib"] * 2**30 > 0.5 * offloaded  # the driver, and so the engine, gets it
    moments = sum(v.nbytes for s in optimizer.state.values() for k, v in s.items() if k != "step")
    # Stale memory for the restore to land in: one block of NaNs, freed into torch's cache.
    torch.full((int(offloaded) // 4 + 2**20,), float("nan"), device="cuda")
    result = offloader.restore()
    assert result["background_bytes"] == moments and result["bytes"] > 0
    last = optimizer.state[list(model.parameters())[-1]]["exp_avg_sq"]
    # Control: read on the default stream without waiting, the last moment has not arrived.
    assert torch.isnan(last).any().item(), "the background copy was already done: nothing overlapped"
    assert not torch.isnan(model[0].weight).any().item()  # parameters are back at once
    optimizer.step()  # the hook waits for the side stream on the GPU
    kept_optimizer.step()
    for a, b in zip(model.parameters(), kept_model.parameters()):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), kept_model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][key], kept_optimizer.state[q][key]), key
    stats = offloader.background_stats()
    assert stats["offloader/restore_background_bytes"] == moments
    assert stats["offloader/restore_background_s"] > 0

    # state_dict waits too; and so does the next offload, before it copies the moments out.
    offloader.offload()
    torch.full((int(offloaded) // 4 + 2**20,), float("nan"), device="cuda")
    offloader.restore()
    saved = optimizer.state_dict()["state"]
    assert not any(torch.isnan(v).any().item() for s in saved.values() for k, v in s.items() if k != "step")
    offloader.restore()  # a no-op: nothing offloaded
    offloader.offload()
    offloader.overlap_restore = False
    assert offloader.restore()["background_bytes"] == 0.0
    assert offloader.background_stats() == {}  # nothing from the earlier restores
    for p, q in zip(model.parameters(), kept_model.parameters()):
        assert torch.equal(optimizer.state[p]["exp_avg"], kept_optimizer.state[q]["exp_avg"])
