"""Weight hand-over formats shared by the trainer and the engine: verified files and checksums.

Both sides import this module, so it needs only torch and safetensors (never vllm).

A staged file is a safetensors file whose metadata holds a manifest (tensor name -> SHA-256 of
its bytes). The fingerprint (SHA-256 of the manifest) travels over the control channel, not in
the file, so a file that was changed or swapped after staging, manifest included, is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import torch

MANIFEST_KEY = "colo_rl_manifest"
_HASH_THREADS = min(8, os.cpu_count() or 1)  # hashlib releases the GIL on large buffers


class StagingError(RuntimeError):
    """A staged weight file could not be written, or was refused when read."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def sha256_of(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def hash_all(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    items = list(tensors)
    with ThreadPoolExecutor(_HASH_THREADS) as pool:
        digests = pool.map(lambda kv: sha256_of(kv[1]), items)
        return {name: digest for (name, _), digest in zip(items, digests)}


def fingerprint(manifest_json: str) -> str:
    return hashlib.sha256(manifest_json.encode()).hexdigest()


def tensor_checksum(t: torch.Tensor) -> int:
    """A cheap exact checksum computed where the tensor lives (GPU): the integer sum of its words.

    It catches a handle mapped to the wrong memory or a load into the wrong slice; it is not a
    cryptographic hash (the file path has SHA-256 for that).
    """
    flat = t.detach().contiguous().reshape(-1)
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return int(flat.view(words).sum(dtype=torch.int64).item())


def write_staged_file(tensors: list[tuple[str, torch.Tensor]], staging_dir: str | os.PathLike) -> tuple[Path, str]:
    """Write CPU tensors to a fresh file in `staging_dir`; returns (path, fingerprint).

    The file is created exclusively (never overwrites anything) and fsync'd before its path is
    returned; on any failure the partial file is removed.
    """
    from safetensors.torch import save

    directory = Path(staging_dir)
    if not directory.is_dir() or not os.access(directory, os.W_OK):
        raise StagingError(f"generator.staging_dir={directory} is not a writable directory: "
                           "create it or point generator.staging_dir elsewhere")
    contiguous = {name: t.detach().contiguous() for name, t in tensors}
    manifest = json.dumps(hash_all(contiguous.items()), sort_keys=True)
    payload = save(contiguous, metadata={MANIFEST_KEY: manifest})
    path = directory / f"colo_rl-weights-{os.getpid()}-{uuid.uuid4().hex}.safetensors"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as exc:  # a signal mid-write too: no partial file is left behind
        path.unlink(missing_ok=True)
        if not isinstance(exc, OSError):
            raise
        raise StagingError(f"could not write {len(payload) / 2**20:.0f} MiB of weights to "
                           f"generator.staging_dir={directory}: {exc}. Free space there or point "
                           "generator.staging_dir at a larger directory") from exc
    return path, fingerprint(manifest)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}


def read_staged_file(path: str | os.PathLike, expected_fingerprint: str) -> list[tuple[str, torch.Tensor]]:
    """The file's tensors, after checking the manifest's fingerprint and re-hashing every tensor
    against the manifest: a file that fails any check is refused before anything is loaded.

    The file is read once into private memory, and the tensors returned are views of that
    memory: the bytes hashed are the bytes loaded, whatever happens to the file afterwards (a
    memory-mapped or lazily read file would let a change after the check reach the engine).
    """
    with open(path, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        if f.readinto(data) != len(data):
            raise StagingError(f"{path} changed size while it was read; refused")
    header, base = _header(data, path)
    manifest_json = (header.pop("__metadata__", None) or {}).get(MANIFEST_KEY)
    if manifest_json is None:
        raise StagingError(f"{path} has no colo_rl manifest: it was not written by colo_rl")
    if fingerprint(manifest_json) != expected_fingerprint:
        raise StagingError(f"{path}: manifest fingerprint differs from the one the trainer "
                           "sent; the file was changed after staging and is refused")
    manifest = json.loads(manifest_json)
    if set(manifest) != set(header):
        raise StagingError(f"{path}: tensors {sorted(set(manifest) ^ set(header))} are in "
                           "only one of the file and its manifest; refused")
    tensors = [(name, _view(data, base, name, header[name], path)) for name in manifest]
    for name, digest in hash_all(tensors).items():
        if digest != manifest[name]:
            raise StagingError(f"{path}: tensor {name} does not match its SHA-256 in the "
                               "manifest; the file is corrupt or was tampered with, refused")
    return tensors


def _header(data: bytearray, path) -> tuple[dict, int]:
    """The safetensors header (JSON after an 8-byte little-endian length) and where data starts."""
    size = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    try:
        if not 0 < size <= len(data) - 8:
            raise ValueError(f"header length {size} in a file of {len(data)} bytes")
        header = json.loads(bytes(data[8:8 + size]))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except ValueError as exc:
        raise StagingError(f"{path} is not a safetensors file ({exc}); refused") from None
    return header, 8 + size


def _view(data: bytearray, base: int, name: str, spec: dict, path) -> torch.Tensor:
    try:
        dtype = _DTYPES[spec["dtype"]]
        shape = [int(d) for d in spec["shape"]]
        begin, end = (base + int(o) for o in spec["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise StagingError(f"{path}: tensor {name} has an unreadable entry {spec!r} ({exc!r}); refused") from None
    numel = 1
    for d in shape:
        numel *= d
    if not base <= begin <= end <= len(data) or end - begin != numel * dtype.itemsize:
        raise StagingError(f"{path}: tensor {name}'s bytes [{begin}, {end}) do not fit its shape "
                           f"{shape} or the file; refused")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, count=numel, offset=begin).view(shape)
