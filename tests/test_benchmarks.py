"""The benchmark runner (benchmarks/run.py): every arm set of benchmarks/armsets.yaml composes, and
runs whole on the CPU in its smoke form (the tiny model, a few short steps): the same scripts, the
same arms and overrides the GPU call runs, each script in its own process, real engines."""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from functools import reduce

import pytest

from .conftest import ROOT, compose_config

sys.path.insert(0, str(ROOT / "benchmarks"))

from run import KINDS, load_armsets, startup_runs, step_kind, words  # noqa: E402
from workload import PEER, SMOKE  # noqa: E402

from colo_rl.config import validate  # noqa: E402

ARMSETS = load_armsets()


def colo_rl_arms(armset: dict) -> list[list[str]]:
    """The Hydra overrides of every colo_rl run an arm set makes (flags of the scripts left out)."""
    arms = []
    for step in armset["steps"]:
        kind, spec = step_kind(step)
        if kind in ("peer", "train_profile"):
            arms += [words(value) for value in spec["arms"].values()]
        elif kind == "side_by_side" and "colo_rl" in spec:
            arms.append(words(spec["colo_rl"]))
        elif kind == "startup":
            arms.append(words(spec.get("overrides")))
    return [[word for word in arm if not word.startswith("--")] for arm in arms]


def test_every_arm_set_says_what_it_measures_and_has_only_known_steps():
    assert len(ARMSETS) >= 15
    for name, armset in ARMSETS.items():
        assert armset["about"] and armset["minutes"] <= 10, name  # one GPU call is 10 minutes at most
        assert {step_kind(step)[0] for step in armset["steps"]} <= set(KINDS), name


@pytest.mark.parametrize("name", sorted(ARMSETS))
def test_every_colo_rl_arm_of_an_arm_set_composes_on_the_workload_and_its_smoke_form(name, tmp_path):
    for overrides in colo_rl_arms(ARMSETS[name]):
        for workload in (PEER, SMOKE):
            cfg = validate(compose_config(*workload.overrides(), *overrides, f"output_dir={tmp_path}"))
            for key, _, value in (o.partition("=") for o in overrides):
                assert same(reduce(getattr, key.split("."), cfg), value), (name, key)


def same(setting, typed: str) -> bool:
    """A validated setting against the value an override typed."""
    if isinstance(setting, (int, float)) and not isinstance(setting, bool):
        return setting == float(typed)
    return str(setting).lower() == typed.lower()


def test_an_unknown_arm_set_is_one_error_line_naming_the_ones_there_are(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/run.py", "nope", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "no arm set 'nope'" in done.stderr and "peer_fastest" in done.stderr


def check_step(step: dict, spec: dict, kind: str) -> None:
    """What a step that ran (or was skipped with its reason) must have left in ARMSET.json."""
    if "skipped" in step and kind == "mm_accumulate":
        assert "no CUDA" in step["skipped"]
        return
    assert step["exit_code"] == 0, step.get("output_tail") or step
    raw = step.get("raw", {})
    if kind == "peer":
        assert [arm["name"] for arm in raw["arms"]] == list(spec["arms"])
        for arm in raw["arms"]:
            steps = next((int(w.split("=")[1]) for w in words(spec["arms"][arm["name"]])
                          if w.startswith("trainer.steps=")), SMOKE.steps)
            assert arm["exit_code"] == 0 and len(arm["steps"]) == steps, arm["output_tail"]
        assert ("leave_gib" in step["skipped"]) == bool(spec.get("leave_gib"))
    elif kind == "side_by_side":
        assert ("colo_rl" in raw) == ("colo_rl" in spec) and ("bare_vllm" in raw) == bool(spec.get("bare"))
        if "colo_rl" in spec:
            (arm,) = raw["colo_rl"]["arms"]
            assert arm["exit_code"] == 0 and len(arm["steps"]) == SMOKE.steps, arm["output_tail"]
        if spec.get("bare"):
            assert raw["bare_vllm"]["exit_code"] == 0 and raw["bare_vllm"]["tokens_per_s"] > 0
        assert "TRL's arms need a GPU" in step["skipped"]["trl"] or "not installed" in step["skipped"]["trl"]
    elif kind == "train_profile":
        assert list(step["arms"]) == list(spec["arms"])
        for name, arm in step["arms"].items():
            assert arm["exit_code"] == 0 and arm["raw"]["median_step_s"] > 0, (name, arm.get("output_tail"))
    elif kind == "startup":
        assert len(raw["runs"]) == startup_runs(spec, smoke=True) == 1
        assert all(run["command_to_first_step_s"] > 0 for run in raw["runs"])
    elif kind == "lora_adapters":
        assert raw["adapter_changes_greedy_tokens"] and raw["lora_tokens_per_s"] > 0
    elif kind == "import_profile":
        assert all(run["exit_code"] == 0 and run["modules"] > 100 for run in raw["runs"])


@pytest.fixture(scope="module")
def smoke_call(tmp_path_factory):
    """Every arm set in one smoke call of the runner, as the GPU call runs one: a step or arm that an
    earlier set already ran is run once (the sets share anchors)."""
    root = tmp_path_factory.mktemp("smoke")
    out, tmp = root / "out", root / "tmp"
    tmp.mkdir()
    # TMPDIR: the runner's work directories must be gone at the end. torch's compile cache stays where
    # the suite's other runs keep it (by default under TMPDIR), or every arm set would compile afresh
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(),
                                                                         f"torchinductor_{getpass.getuser()}")
    done = subprocess.run([sys.executable, "benchmarks/run.py", "--all", "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600,
                          env=dict(os.environ, TMPDIR=str(tmp), TORCHINDUCTOR_CACHE_DIR=inductor))
    return done, out, tmp


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ARMSETS))
def test_every_arm_set_runs_whole_in_its_cpu_smoke_form(name, smoke_call):
    done, out, tmp = smoke_call
    assert f"== {name}: " in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"== {name}: {len(ARMSETS[name]['steps'])} steps, failed: none;" in done.stdout, \
        done.stdout[-4000:] + done.stderr[-2000:]
    results = json.loads((out / f"{name}.json").read_text())
    specs = [step_kind(step) for step in ARMSETS[name]["steps"]]
    assert [step["kind"] for step in results["steps"]] == [kind for kind, _ in specs]
    for step, (kind, spec) in zip(results["steps"], specs):
        check_step(step, spec, kind)
    if any(kind == "tests" for kind, _ in specs):  # on the CPU the GPU tests report themselves skipped
        tests = (out / f"{name}_tests.txt").read_text()
        assert tests.count("\n== ") + tests.startswith("== ") == sum(kind == "tests" for kind, _ in specs)
        assert " passed" in tests or " skipped" in tests
    with tarfile.open(out / f"{name}_logs.tgz") as tar:
        names = tar.getnames()
    assert names and not any(n.endswith(".safetensors") for n in names)
    assert not list(tmp.glob("colo_rl_bench_*"))  # the temporary work directories are gone


@pytest.mark.slow
def test_a_smoke_call_of_several_arm_sets_runs_a_shared_step_once(smoke_call):
    """lora24_tests is made of other sets' steps (armsets.yaml's anchors): in one smoke call each ran
    once, and the later set points at where."""
    done, out, _ = smoke_call
    steps = json.loads((out / "lora24_tests.json").read_text())["steps"]
    assert [step["same_as"].split("/")[0] for step in steps] == ["head", "lora24", "lora24", "cuda_init"], steps
    started = [line for line in done.stdout.splitlines() if line.startswith("== lora_24gib: ")]
    assert len(started) == 2 and "peer_workload.py" in started[0] and "the same as lora24/" in started[1], started
