"""Resumable trainer checkpoints: trainer state, every RNG, and the runner's own state.

The file is written next to its final name and renamed over it, so a crash or a full disk
mid-write leaves the previous checkpoint intact. It is read back with `weights_only=True`
(no arbitrary unpickling), which is why `extra` must hold plain Python values and tensors.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

from colo_rl.trainer.grpo import GRPOTrainer

FILENAME = "trainer.pt"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the path and what to do."""


def save_checkpoint(directory: str | Path, trainer: GRPOTrainer, extra: dict,
                    state: dict | None = None) -> Path:
    """Writes directory/trainer.pt atomically with the trainer state, RNG states and `extra`.
    `state`: the trainer state when the caller gathered it already (FSDP: every rank must)."""
    _check_loadable(extra)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / FILENAME
    payload = {"trainer": state if state is not None else trainer.state_dict(),
               "rng": _rng_states(), "extra": extra}
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{FILENAME}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    _fsync_directory(directory)  # makes the rename itself survive a power loss
    return path


def load_checkpoint(directory: str | Path, trainer: GRPOTrainer) -> dict:
    """Loads the trainer state and RNG states written by save_checkpoint; returns its `extra`."""
    path = Path(directory) / FILENAME
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: point trainer.resume at a directory that "
                              f"save_checkpoint wrote (it holds {FILENAME})")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        state, rng, extra = payload["trainer"], payload["rng"], payload["extra"]
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(exc).__name__}: {exc}); it "
                              "may be truncated or from another program: resume from an earlier one") from exc
    trainer.load_state_dict(state)
    _set_rng_states(rng)
    return extra


def _check_loadable(extra: dict) -> None:
    """Fails at save time, not at resume time, when `extra` could not be loaded back."""
    buffer = io.BytesIO()
    try:
        torch.save(extra, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except (pickle.PicklingError, pickle.UnpicklingError, AttributeError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"extra={extra!r} cannot go into a checkpoint ({exc}): use only dicts, "
                              "lists, tuples, str, int, float, bool, None and tensors") from exc


def _rng_states() -> dict:
    np_state = np.random.get_state(legacy=False)
    np_state["state"]["key"] = np_state["state"]["key"].tolist()  # plain ints load with weights_only
    states = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np_state}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np_state = states["numpy"]
    np_state["state"]["key"] = np.asarray(np_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(np_state)
    if "cuda" in states and torch.cuda.is_available():
        # A run resumed on fewer GPUs restores the devices it has.
        torch.cuda.set_rng_state_all(states["cuda"][:torch.cuda.device_count()])


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
