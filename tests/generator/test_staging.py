"""The staged-file format: what the trainer writes is loaded only if every check passes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from colo_rl.generator.staging import (MANIFEST_KEY, StagingError, read_staged_file,
                                       tensor_checksum, write_staged_file)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(4, 8, generator=g)),
            ("b.weight", torch.randn(16, generator=g).to(torch.bfloat16))]


def test_round_trip_is_bit_exact_and_leaves_a_private_file(tmp_path):
    path, fp = write_staged_file(_tensors(), tmp_path)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    loaded = dict(read_staged_file(path, fp))
    for name, t in _tensors():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t)


def test_each_write_gets_a_fresh_file(tmp_path):
    p1, _ = write_staged_file(_tensors(), tmp_path)
    p2, _ = write_staged_file(_tensors(), tmp_path)
    assert p1 != p2 and p1.exists() and p2.exists()


def test_wrong_fingerprint_is_refused(tmp_path):
    path, fp = write_staged_file(_tensors(), tmp_path)
    with pytest.raises(StagingError, match="fingerprint differs"):
        read_staged_file(path, "0" * 64)


def test_tampered_tensor_is_refused(tmp_path):
    path, fp = write_staged_file(_tensors(), tmp_path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # flip bits inside the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(StagingError, match="does not match its SHA-256"):
        read_staged_file(path, fp)


def test_rewritten_manifest_is_refused(tmp_path):
    """A file re-staged with a consistent manifest of other tensors still fails the fingerprint."""
    from safetensors.torch import save_file

    path, fp = write_staged_file(_tensors(), tmp_path)
    forged = {"a.weight": torch.zeros(4, 8), "b.weight": torch.zeros(16, dtype=torch.bfloat16)}
    from colo_rl.generator.staging import hash_all

    save_file(forged, str(path), metadata={MANIFEST_KEY: json.dumps(hash_all(forged.items()), sort_keys=True)})
    with pytest.raises(StagingError, match="fingerprint differs"):
        read_staged_file(path, fp)


def test_unwritable_staging_dir_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(StagingError, match=f"generator.staging_dir={missing} is not a writable directory"):
        write_staged_file(_tensors(), missing)


def test_full_disk_leaves_no_partial_file(tmp_path):
    """A real ENOSPC: /dev/full accepts no bytes, so the write fails like a full disk."""
    if not os.path.exists("/dev/full"):
        pytest.skip("this system has no /dev/full to make a write fail with ENOSPC")
    staging = tmp_path / "staging"
    staging.mkdir()
    import colo_rl.generator.staging as staging_module

    real_open = os.open

    def open_dev_full(path, flags, mode=0o777):
        if str(path).startswith(str(staging)):
            real_open(path, flags, mode)  # the file is created exclusively, as usual ...
            return real_open("/dev/full", os.O_WRONLY)  # ... but the bytes go to a full device
        return real_open(path, flags, mode)

    staging_module.os.open = open_dev_full
    try:
        with pytest.raises(StagingError, match="could not write .* to generator.staging_dir"):
            write_staged_file(_tensors(), staging)
    finally:
        staging_module.os.open = real_open
    assert list(staging.iterdir()) == []


def test_checksum_sees_a_single_changed_word():
    t = torch.randn(1000).to(torch.bfloat16)
    changed = t.clone()
    changed[500] = changed[500] + 1
    assert tensor_checksum(t) == tensor_checksum(t.clone())
    assert tensor_checksum(t) != tensor_checksum(changed)


def test_the_bytes_returned_are_the_bytes_verified_whatever_happens_to_the_file(tmp_path):
    """The file is changed in place (same inode) after the check, before the engine copies the
    tensors into its parameters: what it copies must still be what was verified."""
    path, fp = write_staged_file(_tensors(), tmp_path)
    loaded = read_staged_file(path, fp)
    with open(path, "r+b") as f:  # every data byte after the header
        f.seek(8 + int.from_bytes(f.read(8), "little"))
        rest = f.read()
        f.seek(-len(rest), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in rest))
    for (name, t), (_, original) in zip(loaded, _tensors()):
        assert torch.equal(t, original), name


def test_a_truncated_or_foreign_file_is_refused_naming_it(tmp_path):
    path, fp = write_staged_file(_tensors(), tmp_path)
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(StagingError, match=f"{path}: tensor .* do not fit"):
        read_staged_file(path, fp)
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(StagingError, match=f"{path} is not a safetensors file"):
        read_staged_file(path, fp)
