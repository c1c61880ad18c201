"""Settings resolved once (colo_rl/resolve.py) and the memory plan's decisions, each with its
reason; what a run prints when its output is piped to a file."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from colo_rl.planner import GIB, _micro_batch, _recompute, plan_memory
from colo_rl.run import Run

from .conftest import ROOT, compose_config, small_run_overrides
from .test_planner import H100, one_b


def leaves(obj, path=""):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from leaves(value, f"{path}.{key}" if path else key)
    else:
        yield path, obj


def test_resolved_settings_are_frozen_hold_no_auto_and_are_the_wandb_config(tmp_path, engine):
    cfg = compose_config(*small_run_overrides(tmp_path, "trainer.steps=1"))
    composed = OmegaConf.to_container(cfg)
    run = Run(cfg, engine)
    validated = dataclasses.asdict(run.settings)
    result = run.execute()
    assert OmegaConf.to_container(cfg) == composed  # the user's config is never mutated
    assert dataclasses.asdict(run.validated) == validated and validated["trainer"]["memory"]["offload"] == "auto"
    resolved = run.resolved
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.settings.trainer.memory.offload = "none"
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.settings.generator.gpu_memory_utilization = 0.9
    settings = dataclasses.asdict(resolved.settings)
    assert [k for k, v in leaves(settings) if v == "auto"] == []
    assert settings["sampling"]["logprobs_every"] == 10
    decided = {d.key: d for d in resolved.decisions}
    assert decided["trainer.memory.offload"].value == "all" and decided["trainer.device"].value == "cpu"
    assert all(d.reason for d in resolved.decisions)
    wandb = dict(leaves(result.wandb_config))
    assert {k: v for k, v in leaves(resolved.config()) if wandb.get(k) != v} == {}
    assert OmegaConf.to_container(OmegaConf.load(tmp_path / "resolved.yaml")) == resolved.config()


def test_with_stdout_piped_no_bar_frames_no_warnings_and_the_end_table_fits_100_columns(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "COLUMNS": "40"}
    overrides = [o for o in small_run_overrides(tmp_path / "run") if o != "logger.progress=false"]
    with open(tmp_path / "out.log", "w") as out:
        subprocess.run([sys.executable, "-m", "colo_rl.run", *overrides, "trainer.steps=2"], cwd=ROOT, env=env,
                       stdout=out, stderr=subprocess.STDOUT, check=True, timeout=600)
    text = (tmp_path / "out.log").read_text()
    assert "\r" not in text
    assert "colo_rl: step 2/2 reward=" in text  # one plain line per step instead of the bar
    assert "Warning" not in text and "warnings.warn" not in text
    table = text[text.index("colo_rl: 2 steps"):]
    assert max(len(line) for line in table.splitlines()) <= 100
    assert f"colo_rl: 2 steps ({tmp_path / 'run'})" in table  # its title in one piece
    assert "trainer.memory.precision -> pure: model.dtype=float32" in text  # each decision with its reason


# -- the memory plan's decisions, one function each -----------------------------------------
def test_micro_batch_decision():
    settings, shape = one_b("trainer.micro_batch_size=auto", "trainer.perf.kernels=liger", "trainer.perf.logprob_chunk=1024")
    assert _micro_batch(settings, shape, 384, None, True) == (16, "no GPU memory to plan: the default")
    value, reason = _micro_batch(settings, shape, 384, (int(78.68 * GIB), H100), True)
    assert value == 32 and "fits beside the sleeping engine" in reason
    assert _micro_batch(one_b("trainer.micro_batch_size=8")[0], shape, 384, (H100, H100), True) == (8, "as given")
    ddp = one_b("trainer.micro_batch_size=auto", "trainer.parallel=ddp")[0]
    assert _micro_batch(ddp, shape, 384, (H100, H100), True)[1].startswith("trainer.parallel=ddp")


def test_kept_logits_decision():
    settings, shape = one_b("trainer.memory.logprob_recompute=auto", "trainer.perf.kernels=liger", "trainer.perf.logprob_chunk=1024")
    value, reason = _recompute(settings, shape, 384, (int(78.68 * GIB), H100), True, 32)
    assert value is False and "kept for backward" in reason
    value, reason = _recompute(settings, shape, 384, (24 * GIB, H100), True, 32)
    assert value is True and "recomputed" in reason
    assert _recompute(settings, shape, 384, None, True, 16) == (True, "nothing planned (no GPU, or trainer.parallel)")


def test_offload_and_engine_budget_decisions_print_with_their_reasons():
    settings, shape = one_b("generator.gpu_memory_utilization=auto", "trainer.micro_batch_size=16")
    plan = plan_memory(settings, shape, 384, (int(78.68 * GIB), H100))
    assert plan.reasons["trainer.memory.offload"].startswith("the least offload with the awake engine's")
    assert plan.reasons["generator.gpu_memory_utilization"] in (
        "every sequence's KV cache beside the trainer",
        "what is left beside the trainer (vLLM queues the sequences that do not fit)")
    table = plan.table()
    assert f"trainer.memory.offload -> {plan.offload}: the least offload" in table
    cpu = plan_memory(settings, shape, 384, None)
    assert cpu.reasons["trainer.memory.offload"].startswith("a CPU run")
    assert "GPU" not in cpu.table().split("trainer.memory.offload")[0].split("\n", 1)[1]  # the CPU plan says host


def test_offload_and_budget_decision_picks_the_least_offload_that_fits():
    from colo_rl.planner import ENGINE_ASLEEP_GIB, _offload_and_budget, sizes

    settings, shape = one_b("generator.gpu_memory_utilization=auto", "trainer.micro_batch_size=16")
    s = sizes(settings, shape, 384, cuda=True, micro_batch=16)
    (roomy, _), (budget, why) = _offload_and_budget(settings, s, 78 * GIB, H100, 74 * GIB, 4 * GIB,
                                                    ENGINE_ASLEEP_GIB * GIB)
    (tight, reason), _ = _offload_and_budget(settings, s, 30 * GIB, H100, 28 * GIB, 1 * GIB, ENGINE_ASLEEP_GIB * GIB)
    order = ("none", "optimizer", "all")
    assert order.index(roomy) < order.index(tight) and reason.startswith("the least offload")
    assert budget > 0 and why == "every sequence's KV cache beside the trainer"
    given = one_b("trainer.memory.offload=optimizer", "generator.gpu_memory_utilization=0.3")[0]
    (offload, reason), (budget, why) = _offload_and_budget(given, s, 78 * GIB, H100, 74 * GIB, 4 * GIB,
                                                           ENGINE_ASLEEP_GIB * GIB)
    assert (offload, reason, why) == ("optimizer", "as given", "as given") and budget == 0.3 * H100


def test_the_calibration_is_data_with_provenance():
    from colo_rl import planner

    assert len(planner.CALIBRATION) >= 12
    for name, fitted in planner.CALIBRATION.items():
        assert fitted.counts and fitted.vllm and fitted.device and fitted.run, name
        assert getattr(planner, name) == fitted.value, name  # the module's constants are the table's
