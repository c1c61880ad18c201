"""The package as a user installs it: a wheel built from the source tree, installed (not
editable) into a fresh virtual environment, run from a directory outside the repository."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from .conftest import CONF, EXPERIMENTS, ROOT


def _run(*args, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel --no-deps` of a copy of the source tree (the build writes build/ beside it)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("colo_rl", "conf", "experiments"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    # no build isolation: the shared environment's setuptools, no download
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "-w", dist, src, cwd=src)
    assert built.returncode == 0, built.stderr[-3000:]
    (path,) = dist.glob("colo_rl-*.whl")
    return path


def test_the_wheel_holds_every_module_the_configs_and_py_typed(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    package = ROOT / "colo_rl"
    expected = {f"colo_rl/{p.relative_to(package)}" for p in package.rglob("*.py")}
    expected |= {f"colo_rl/conf/{p.relative_to(CONF)}" for p in CONF.rglob("*.yaml")}
    expected |= {f"colo_rl/experiments/{p.relative_to(EXPERIMENTS)}" for p in EXPERIMENTS.rglob("*.yaml")}
    expected.add("colo_rl/py.typed")
    assert not expected - names, sorted(expected - names)


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The python of a fresh venv with the wheel installed (not editable)."""
    tmp_path = tmp_path_factory.mktemp("installed")
    venv = tmp_path / "venv"
    created = _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    python = venv / "bin" / "python"
    installed = _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                     "--no-index", wheel, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr[-3000:]
    # colo_rl's dependencies (torch, hydra, ...) come from the shared environment; a path line in
    # a .pth adds them without running that environment's editable-install hook for colo_rl
    site_packages = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                              cwd=tmp_path).stdout.strip())
    (site_packages / "shared_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    where = _run(python, "-c", "import colo_rl; print(colo_rl.__file__)", cwd=tmp_path)
    assert where.stdout.strip() == str(site_packages / "colo_rl" / "__init__.py"), where
    return python


def test_the_installed_wheel_composes_experiments_from_outside_the_repository(installed, tmp_path):
    python = installed

    # a user's own config directory beside the shipped ones
    mine = tmp_path / "my_conf" / "experiment"
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text("# @package _global_\ntrainer:\n  steps: 7\n")
    composed = _run(python, "-m", "colo_rl.run", "experiment=tiny_smoke", "--cfg", "job", cwd=tmp_path)
    assert composed.returncode == 0, composed.stderr[-3000:]
    assert "- smoke" in composed.stdout and "steps: 3" in composed.stdout
    own = _run(python, "-m", "colo_rl.run", "--config-dir", tmp_path / "my_conf", "experiment=mine",
               "--cfg", "job", cwd=tmp_path)
    assert own.returncode == 0, own.stderr[-3000:]
    assert "steps: 7" in own.stdout


@pytest.mark.slow
def test_the_installed_wheel_runs_an_experiment_from_outside_the_repository(installed, tmp_path):
    """`cd /tmp && python -m colo_rl.run experiment=tiny_smoke`: a whole run (its own engine, whose
    worker imports the installed package too) with nothing of the source tree on the path."""
    ran = _run(installed, "-m", "colo_rl.run", "experiment=tiny_smoke", "output_dir=run",
               "logger.progress=false", cwd=tmp_path, timeout=900)
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/step"] for r in records if "reward/mean" in r] == [0, 1, 2]
    assert (tmp_path / "run" / "checkpoint" / "manifest.json").exists()
