"""What a careless or unlucky user writes (issue 39): nothing they had is lost, nothing they wrote
is ignored, and every wrong input is refused before any engine starts as one `colo_rl: error:`
line. Refusals run in this process through `colo_rl.run.train` (the runner's own code path) with
a `generator.python` that leaves a file behind if anything starts an engine worker; the cases
that need a whole command (Hydra's files, the exit code, the process's end) run it.

The classes, what happens and what is kept, are in tests/README.md's matrix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from colo_rl.cli import input_error_message
from colo_rl.rundir import RunDirLock
from colo_rl.run import train

from .conftest import ROOT, compose_config, engine_processes, small_run_overrides


@pytest.fixture()
def no_engine(tmp_path) -> tuple[Path, str]:
    """(marker, override): a generator.python that leaves `marker` behind if a worker starts."""
    marker = tmp_path / "engine_started"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\ncase \"$*\" in *colo_rl.generator.worker*) touch {marker};; esac\n"
                      f"exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return marker, f"generator.python={python}"


def refused(no_engine, output_dir: Path, *overrides: str) -> str:
    """The one-line input error `train` stops with, having started no engine worker."""
    marker, python = no_engine
    before = engine_processes()
    with pytest.raises(Exception) as info:
        train(compose_config(*small_run_overrides(output_dir, "logger=none", python, *overrides)))
    message = input_error_message(info.value)
    assert message is not None, info.value  # an input error, not a bug with a traceback
    assert "\n" not in message, message
    assert not marker.exists() and engine_processes() == before
    assert not (output_dir / "engine.log").exists()
    return message


def tree(directory: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `directory`: its modification time and bytes."""
    return {str(p.relative_to(directory)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(directory.rglob("*")) if p.is_file()}


def finished_run(run_dir: Path, engine) -> Path:
    """A directory as a finished 2-step run leaves it (checkpoint, metrics, .hydra/)."""
    train(compose_config(*small_run_overrides(run_dir, "logger=none", "trainer.steps=2")), engine)
    return run_dir / "checkpoint"


# -- data loss ---------------------------------------------------------------------------------

def test_an_export_target_that_holds_anything_is_refused_before_the_engine(tmp_path, no_engine, engine):
    """On b259d2e each of these trained, then deleted the target's contents (exit 0)."""
    run_dir = tmp_path / "run"
    finished_run(run_dir, engine)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    kept = {d: tree(d) for d in (tmp_path / "mine", run_dir)}
    cases = {
        str(tmp_path / "mine"): "exists and is not empty",
        str(run_dir): "is or holds the run directory",
        str(run_dir / "checkpoint"): "is or holds its checkpoint",
        str(tmp_path): "is or holds the run directory",
    }
    for target, expected in cases.items():
        message = refused(no_engine, run_dir, "trainer.export_final=true", f"trainer.export_dir={target}",
                          f"trainer.resume={run_dir / 'checkpoint'}", "trainer.steps=3")
        assert message.startswith(f"trainer.export_dir={target}: ") and expected in message, message
    (run_dir / "export").mkdir()
    (run_dir / "export" / "notes.txt").write_text("mine")
    message = refused(no_engine, run_dir, "trainer.export_final=true", "trainer.steps=3",
                      f"trainer.resume={run_dir / 'checkpoint'}")
    assert "trainer.export_final (into" in message and "exists and is not empty" in message
    for directory, files in kept.items():  # the run's own .hydra/ and lock are rewritten each time
        assert {k: v for k, v in tree(directory).items() if k in files and not k.startswith(".")} \
            == {k: v for k, v in files.items() if not k.startswith(".")}


def test_a_new_run_into_a_finished_runs_directory_is_refused_unless_resumed_or_told(tmp_path, no_engine,
                                                                                    engine):
    """On b259d2e the second run replaced the checkpoint and dropped the metrics (exit 0)."""
    checkpoint = finished_run(tmp_path, engine)
    before = tree(tmp_path)
    message = refused(no_engine, tmp_path)
    assert message.startswith(f"output_dir={tmp_path} holds the checkpoint of an earlier run"), message
    assert f"trainer.resume={checkpoint}" in message and "overwrite_output_dir=true" in message
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith(".")} == \
        {k: v for k, v in before.items() if not k.startswith(".")}
    # told: it goes on to the next check (a refused export target here: still nothing replaced)
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "x").write_text("x")
    assert "exists and is not empty" in refused(no_engine, tmp_path, "overwrite_output_dir=true",
                                                "trainer.export_final=true")


def test_a_run_refused_because_its_directory_is_in_use_writes_nothing_there(tmp_path):
    """On b259d2e Hydra rewrote the live run's .hydra/ files before colo_rl's lock refused it."""
    run_dir = tmp_path / "live"
    with RunDirLock(run_dir):
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "config.yaml").write_text("the live run's config\n")
        before = tree(run_dir)
        env = dict(os.environ, PYTHONPATH=str(ROOT), COLO_RL_PRESPAWN="0")
        env.pop("HYDRA_FULL_ERROR", None)
        proc = subprocess.run([sys.executable, "-m", "colo_rl.run", f"hydra.run.dir={run_dir}",
                               "logger=none", "trainer.lr=3e-4"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert f"colo_rl: error: output_dir={run_dir} is in use by another colo_rl run" in proc.stderr
        assert tree(run_dir) == before
