"""Self-describing, resumable checkpoints that need no pickle to read.

A checkpoint is a directory:

    manifest.json           format, step, versions of colo_rl/torch/transformers, and every file
                            below with its size and SHA-256 (verified before anything is loaded)
    config.yaml             the run's resolved config: resume compares the new one against it
    model.safetensors       the policy, under its state_dict (Hugging Face) names
    optimizer.safetensors   every tensor of the optimizer's state, flattened ("state/0/exp_avg")
    reference.safetensors   the frozen KL reference, when trainer.algo.kl_coef > 0
    state.pt                the small rest: step count, the optimizer's param groups, RNG states
                            and the runner's `extra`, read with torch.load(weights_only=True)
    hf/                     the model's config.json, tokenizer and generation config, so that
                            `python -m colo_rl.export` needs nothing but this directory

It is written into a temporary directory beside its final name and swapped in at once
(renameat2 RENAME_EXCHANGE), so a crash or a full disk mid-write leaves the previous checkpoint
whole. Files the manifest lists are the checkpoint; a later kind (a LoRA adapter alone) lists
others.

`snapshot()` takes a host copy of everything a checkpoint holds (tensors, RNG states, `extra`) so
that `BackgroundWriter` can write it on a thread while training goes on and changes the originals.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from colo_rl.config import CheckpointError
from colo_rl.lora import is_lora

FORMAT = "colo_rl-checkpoint"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
CONFIG = "config.yaml"
STATE = "state.pt"
HF_DIR = "hf"
# what a model directory holds besides its weights; weights come from model.safetensors
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf)$|.*\.index\.json$")
_MAX_HF_FILE = 64 * 2**20
# Resume refuses a config that differs from the checkpoint's in these: the tensors' shapes and
# meaning (model), and what the optimizer's state was built with (load_state_dict would
# silently put the checkpoint's lr and betas back). A value maps to what is compared.
COMPARED_KEYS = {
    "model.source": None, "model.path": None, "model.tokenizer": None, "model.embedded": None,
    "model.dtype": None, "trainer.memory.precision": None, "trainer.optim.name": None, "trainer.lr": None,
    "trainer.optim.betas": list, "trainer.optim.weight_decay": None,
    "trainer.algo.kl_coef": lambda v: "a reference model" if v > 0 else "no reference model",
    "trainer.lora": None,  # which tensors the checkpoint holds and what alpha / rank scales them by
}


class TrainerState(Protocol):
    """What a checkpoint reads and writes of a trainer (GRPOTrainer is one): its state as a dict
    of tensors and back, the policy module, the frozen reference (or None) and its config."""

    model: torch.nn.Module
    reference: torch.nn.Module | None
    cfg: Any

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


# -- writing ------------------------------------------------------------------------------------


def save_checkpoint(directory: str | Path, trainer: TrainerState, extra: dict, state: dict | None = None,
                    *, config: dict | None = None, model_dir: str | Path | None = None,
                    rng: dict | None = None) -> Path:
    """Write the checkpoint directory `directory` atomically; returns it.

    `state`: the trainer state when the caller gathered it already (FSDP: every rank must), or a
    `snapshot()`'s. `rng`: the RNG states to record (a snapshot's); None: the current ones.
    `config`: the run's resolved config (plain containers), compared on resume.
    `model_dir`: the model's Hugging Face directory; its config and tokenizer files are kept.
    """
    _check_loadable(extra)
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    state = state if state is not None else trainer.state_dict()
    _check_finite_weights(state["model"], directory)
    _remove_partials(directory)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.partial-"))
    try:
        aliases = {}
        aliases["model"] = _save_tensors(tmp / "model.safetensors", state["model"])
        optimizer_tensors: dict[str, torch.Tensor] = {}
        skeleton = _split(state["optimizer"], "", optimizer_tensors)
        aliases["optimizer"] = _save_tensors(tmp / "optimizer.safetensors", optimizer_tensors)
        if "reference" in state:
            aliases["reference"] = _save_tensors(tmp / "reference.safetensors", state["reference"])
        _torch_save(tmp / STATE, {"step_count": state["step_count"], "optimizer": skeleton,
                                  "rng": rng if rng is not None else _rng_states(), "extra": extra})
        if config is not None:
            from omegaconf import OmegaConf

            (tmp / CONFIG).write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
        if model_dir is not None:
            _copy_hf_files(Path(model_dir), tmp / HF_DIR)
        _write_manifest(tmp, extra, aliases, "lora" if is_lora(trainer.model) else "full")
        _fsync_tree(tmp)
        replace_directory(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """safetensors refuses tensors that share memory: a tied weight is written once and its
    other names are returned as aliases (name -> stored name)."""
    stored: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    aliases = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype) if tensor.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        stored[name] = tensor.cpu().contiguous()
    try:
        save_file(stored, str(path))
    except SafetensorError as exc:
        # the Rust writer reports a full disk as text; make it the OSError it is
        code = re.search(r"os error (\d+)", str(exc))
        if code:
            number = int(code.group(1))
            raise OSError(number, os.strerror(number), str(path)) from None
        raise
    return aliases


def _torch_save(path: Path, payload: dict) -> None:
    with open(path, "wb") as f:
        torch.save(payload, f)


def _split(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """`obj` with every tensor replaced by {"__tensor__": name}, the tensors put into `tensors`."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {k: _split(v, f"{prefix}/{k}" if prefix else str(k), tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_split(v, f"{prefix}/{i}" if prefix else str(i), tensors) for i, v in enumerate(obj)]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def _join(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_join(v, tensors) for v in obj]
        return tuple(items) if isinstance(obj, tuple) else items
    return obj


def _copy_hf_files(model_dir: Path, target: Path) -> None:
    target.mkdir()
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and not _WEIGHT_FILE.match(path.name) and path.stat().st_size <= _MAX_HF_FILE:
            shutil.copyfile(path, target / path.name)  # follows the HF cache's blob symlinks


def _write_manifest(tmp: Path, extra: dict, aliases: dict, kind: str) -> None:
    """`kind`: "full" (model.safetensors holds every weight) or "lora" (the adapters only,
    under peft's names; the base is the model's own)."""
    import transformers

    files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(tmp.rglob("*")) if p.is_file()}
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": kind,
        "step": extra.get("step") if isinstance(extra, dict) else None,
        "versions": {"colo_rl": _package_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "aliases": {k: v for k, v in aliases.items() if v},
        "files": files,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("colo_rl")
    except PackageNotFoundError:
        return "unknown"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_tree(root: Path) -> None:
    for path in [*sorted(root.rglob("*")), root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_partials(directory: Path) -> None:
    """Leftovers of a writer that died before its swap (one writer per run directory)."""
    for stale in directory.parent.glob(f".{directory.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def replace_directory(tmp: Path, directory: Path) -> None:
    """Put the complete directory `tmp` at `directory` in one step; what was there before
    (a previous checkpoint or export) is deleted after."""
    if not directory.exists():
        os.rename(tmp, directory)
    else:
        libc = ctypes.CDLL(None, use_errno=True)
        exchanged = getattr(libc, "renameat2", None) is not None and libc.renameat2(
            _AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(directory), _RENAME_EXCHANGE) == 0
        if exchanged:
            shutil.rmtree(tmp)  # now the previous checkpoint
        else:
            # a filesystem without RENAME_EXCHANGE: two renames; between them the previous
            # checkpoint is whole at its .old name
            old = directory.with_name(f".{directory.name}.partial-old")
            os.rename(directory, old)
            os.rename(tmp, directory)
            shutil.rmtree(old)
    fd = os.open(directory.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power loss
    finally:
        os.close(fd)


def _check_loadable(extra: dict) -> None:
    """Fails at save time, not at resume time, when `extra` could not be loaded back."""
    buffer = io.BytesIO()
    try:
        torch.save(extra, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except (pickle.PicklingError, pickle.UnpicklingError, AttributeError, TypeError, RuntimeError):
        raise CheckpointError(f"extra={extra!r} cannot go into a checkpoint: use only dicts, lists, "
                              "tuples, str, int, float, bool, None and tensors") from None


# -- reading ------------------------------------------------------------------------------------


def _check_finite_weights(model: dict[str, torch.Tensor], directory: Path) -> None:
    """A checkpoint is the state to go on from: weights holding inf or NaN are not one."""
    bad = [name for name, t in model.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise CheckpointError(f"the trainer's weights are not finite ({len(bad)} tensors, e.g. {bad[0]}): "
                              f"no checkpoint written, {directory} keeps the last one written (if any). "
                              "Lower trainer.lr or trainer.algo.kl_coef, or look for inf/NaN rewards "
                              "(task.rewards, task.reward_weights)")


def read_manifest(directory: str | Path) -> dict:
    """The manifest of a checkpoint directory (its step, versions and files)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a checkpoint directory (no {MANIFEST} in it). Point "
                              "trainer.checkpoint.resume at the checkpoint/ directory a run wrote")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable ({exc}). Resume from another checkpoint") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(f, dict) and isinstance(f.get("bytes"), int)
                                              and isinstance(f.get("sha256"), str) for f in files.values()):
        raise CheckpointError(f"{path}: not a colo_rl manifest (an object whose \"files\" map each "
                              "file to its bytes and sha256). Resume from a checkpoint a run wrote")
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r} version "
                              f"{manifest.get('format_version')!r}, this colo_rl reads {FORMAT!r} "
                              f"version {FORMAT_VERSION}. Use the colo_rl that wrote it")
    return manifest


def verify_checkpoint(directory: str | Path) -> dict:
    """Check every file against the manifest's size and SHA-256; returns the manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for name, expected in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in {MANIFEST}). Resume from another "
                                  "checkpoint")
        if path.stat().st_size != expected["bytes"] or _sha256(path) != expected["sha256"]:
            raise CheckpointError(f"{path}: its bytes differ from the SHA-256 in {MANIFEST} (changed "
                                  "or damaged after it was written). Resume from another checkpoint")
    return manifest


def read_config(directory: str | Path) -> dict | None:
    """The resolved config the checkpoint was trained with (None when none was stored), in the
    current layout: a checkpoint written before the trainer keys were grouped has its keys moved
    through colo_rl.config_moves.OLD_KEYS."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    from colo_rl.config_moves import translate

    return translate(OmegaConf.to_container(OmegaConf.load(path), resolve=True))


def check_compatible(directory: str | Path, config: dict) -> None:
    """Refuse a run config that differs from the checkpoint's where resuming would go wrong,
    naming every such key. Cheap: reads the manifest and config.yaml, not the tensors."""
    read_manifest(directory)
    saved = read_config(directory)
    if saved is None:
        return
    differences = []
    for key, normalize in COMPARED_KEYS.items():
        for full_key, new, old in _leaves(key, _select(config, key), _select(saved, key)):
            if new is _ABSENT or old is _ABSENT:
                continue
            if key.startswith("model.embedded") and _select(config, "model.source") != "embedded":
                continue
            if normalize is not None:
                new, old = normalize(new), normalize(old)
            if new != old:
                differences.append(f"{full_key}={_fmt(new)} (the checkpoint: {_fmt(old)})")
    if differences:
        raise CheckpointError(
            f"trainer.checkpoint.resume={directory}: this run's config differs from the checkpoint's in "
            f"{'; '.join(differences)}. Resume with the checkpoint's values (its config.yaml), or "
            "start a new run without trainer.checkpoint.resume")


_ABSENT = object()


def _select(config: Any, key: str) -> Any:
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _leaves(key: str, new: Any, old: Any):
    if isinstance(new, dict) and isinstance(old, dict):
        for sub in sorted(set(new) | set(old)):
            yield from _leaves(f"{key}.{sub}", new.get(sub, _ABSENT), old.get(sub, _ABSENT))
    else:
        yield key, new, old


def _fmt(value: Any) -> str:
    return "null" if value is None else str(value)


def load_checkpoint(directory: str | Path, trainer: TrainerState, *, config: dict | None = None,
                    verified: bool = False) -> dict:
    """Verify, compare (with `config`: the run's resolved config) and load a checkpoint written
    by save_checkpoint into `trainer`, with every RNG state; returns its `extra`. `verified`: the
    caller has just checked its files against the manifest (verify_checkpoint), so they are not
    hashed twice (fp32 masters with AdamW state are 16 bytes a parameter)."""
    directory = Path(directory)
    if config is not None:
        check_compatible(directory, config)
    manifest = read_manifest(directory) if verified else verify_checkpoint(directory)
    aliases = manifest.get("aliases", {})
    files = manifest["files"]
    has_reference = "reference.safetensors" in files
    if has_reference != (trainer.reference is not None):
        raise CheckpointError(
            f"trainer.checkpoint.resume={directory}: the checkpoint {'has' if has_reference else 'has no'} "
            f"reference model but trainer.algo.kl_coef={trainer.cfg.algo.kl_coef}. Resume with the kl_coef "
            "the checkpoint was trained with")
    small = _load_small(directory / STATE)
    model = _load_tensors(directory, "model", aliases)
    # what the trainer itself saves: under LoRA the adapters only
    _check_shapes(directory, model, trainer.state_dict()["model"])
    state = {"model": model, "step_count": small["step_count"],
             "optimizer": _join(small["optimizer"], _load_tensors(directory, "optimizer", aliases))}
    if has_reference:
        state["reference"] = _load_tensors(directory, "reference", aliases)
    trainer.load_state_dict(state)
    _set_rng_states(small["rng"])
    return small["extra"]


def _load_small(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, KeyError, TypeError) as exc:
        # never relay torch's advice to retry with weights_only=False: that unpickles code
        raise CheckpointError(f"{path}: not a colo_rl state file ({type(exc).__name__}); it holds "
                              "something other than plain values and tensors. Resume from "
                              "another checkpoint") from None


def _load_tensors(directory: Path, name: str, aliases: dict) -> dict[str, torch.Tensor]:
    path = directory / f"{name}.safetensors"
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc}). Resume from "
                              "another checkpoint") from None
    for alias, stored in aliases.get(name, {}).items():
        tensors[alias] = tensors[stored]
    return tensors


def _check_shapes(directory: Path, saved: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> None:
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    wrong = [f"{k} {list(saved[k].shape)} (this model: {list(current[k].shape)})"
             for k in current if k in saved and saved[k].shape != current[k].shape]
    if missing or unexpected or wrong:
        parts = ([f"shapes differ: {', '.join(wrong[:5])}"] if wrong else []) + \
                ([f"missing {missing[:5]}"] if missing else []) + \
                ([f"not in this model {unexpected[:5]}"] if unexpected else [])
        raise CheckpointError(f"trainer.checkpoint.resume={directory}: model.safetensors does not fit this model "
                              f"({'; '.join(parts)}). Resume with the model.* settings the checkpoint "
                              "was trained with (its config.yaml)")


# -- background writes ---------------------------------------------------------------------------


@dataclass
class Snapshot:
    """What one checkpoint holds, copied to host memory at one moment of the run."""

    state: dict  # trainer.state_dict()'s structure, every tensor a host copy
    rng: dict
    extra: dict
    step: int
    seconds: float  # the copy's time: what the run waited for


class HostBuffers:
    """Pinned host tensors that successive snapshots copy GPU tensors into, in the same order each
    time. Pinning is slow and a copy into pageable memory runs at a small fraction of the pinned
    rate (a 1B policy's state would stall a step for seconds), so they are allocated at the first
    snapshot and reused: later copies run at the pinned rate. A snapshot may
    reuse them only once the write of the previous one has ended (BackgroundWriter.snapshot waits)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def take(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """The `index`-th buffer, (re)allocated where it does not match `like`'s shape and dtype."""
        if index < len(self._buffers):
            buffer = self._buffers[index]
            if buffer.shape == like.shape and buffer.dtype == like.dtype:
                return buffer
        buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=torch.cuda.is_available())
        if index < len(self._buffers):
            self._buffers[index] = buffer
        else:
            self._buffers.append(buffer)
        return buffer


def snapshot(trainer: TrainerState, extra: dict, state: dict | None = None,
             buffers: HostBuffers | None = None) -> Snapshot:
    """A host copy of the trainer's state, the RNG states and `extra`, isolated from the updates
    that follow. Tensors that share memory (tied weights) stay shared in the copy, so the file
    written from it is the one a direct save writes. With `buffers`, tensors are copied into its
    tensors (pinned on CUDA: asynchronously, then one synchronize) instead of fresh ones."""
    start = time.perf_counter()
    state = state if state is not None else trainer.state_dict()
    copies: dict[tuple, torch.Tensor] = {}

    def copy(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            key = (obj.device, obj.data_ptr(), obj.dtype, tuple(obj.shape), tuple(obj.stride()))
            if key not in copies:
                if buffers is not None:
                    copies[key] = buffers.take(len(copies), obj).copy_(obj.detach(), non_blocking=True)
                else:
                    copies[key] = obj.detach().to("cpu", copy=True)
            return copies[key]
        if isinstance(obj, dict):
            return {k: copy(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(copy(v) for v in obj)
        return obj

    host = copy(state)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    rng = _rng_states()
    extra = pickle.loads(pickle.dumps(extra))  # the sampler's state and step, as they are now
    return Snapshot(host, rng, extra, int(extra.get("step", -1)), time.perf_counter() - start)


class BackgroundWriter:
    """Writes one checkpoint at a time on a thread. `submit` first waits for the write in flight,
    so a run holds at most one host copy besides the one being taken; `wait` returns when nothing
    is in flight and raises what a failed write raised (once)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.written: tuple[int, float] | None = None  # (step, seconds) of the last write that ended
        self.buffers = HostBuffers()  # the snapshots' pinned host copies (GPU state), reused

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def snapshot(self, trainer: TrainerState, extra: dict, state: dict | None = None) -> Snapshot:
        """snapshot() into this writer's host buffers, once the write in flight (which reads them)
        has ended."""
        self.wait()
        return snapshot(trainer, extra, state, buffers=self.buffers)

    def submit(self, write, step: int) -> None:
        """Run `write()` (which writes the checkpoint of `step`) on the writer's thread."""
        self.wait()

        def run() -> None:
            start = time.perf_counter()
            try:
                write()
            except BaseException as exc:  # handed to whoever waits next
                self._error = exc
            else:
                self.written = (step, time.perf_counter() - start)

        self._thread = threading.Thread(target=run, name="colo_rl-checkpoint", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


# -- RNG states ---------------------------------------------------------------------------------


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
