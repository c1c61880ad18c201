"""The command-line boundary, run as a user runs it: `python -m colo_rl.run ...` in a real
subprocess from outside the repository. Every wrong input ends in one `colo_rl: error:` block
naming the key, exit code 2, no traceback, within seconds, and no engine started."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from glob import glob
from pathlib import Path

import pytest

from colo_rl.cli import input_error_message
from colo_rl.config import validate
from colo_rl.config_moves import OLD_KEYS
from colo_rl.trainer.algorithms import check_algorithm

from .conftest import ROOT, compose_config

# The wrong inputs, one subprocess each: (overrides, what the one error line must contain)
BAD_INPUTS = {
    "missing_task_path": (["task=gsm8k"], "task.dataset.path"),
    "model_not_in_cache": (["model=olmo2", "sampling=greedy"], "model.path=allenai/OLMo-2-0425-1B is "
                                                             "not in the local Hugging Face cache"),
    "path_without_source_hf": (["model.path=/no/such/model"], "model.path=/no/such/model: the "
                                                              "directory does not exist"),
    "missing_absolute_path": (["model.source=hf", "model.path=/no/such/model"],
                              "model.path=/no/such/model: the directory does not exist"),
    "unknown_key": (["trainer.lrr=1"], "trainer.lrr: no such key"),
    "in_a_multirun": (["-m", "trainer.lr=-1,1e-3"], "trainer.lr=-1.0 must be > 0"),
    "liger_off_cuda": (["trainer.perf.kernels=liger", "trainer.device=cpu"],
                       "trainer.perf.kernels=liger runs Triton GPU kernels, but the trainer is on cpu"),
    "estimator_path_that_does_not_import": (["trainer/algo=rloo", "trainer.algo.advantage_estimator=no_such_module:loo"],
                                            "trainer.algo.advantage_estimator: 'no_such_module:loo': module "
                                            "'no_such_module' does not import"),
    "algo_sweep_with_an_unknown_preset": (["-m", "trainer/algo=vtrace,grpo"],
                                          "trainer/algo=vtrace: there is no config trainer/algo/vtrace.yaml"),
}
# Hydra's other composition errors, composed for real in this process (the same exceptions
# the subprocess gets; a subprocess each would cost 5 s of importing torch).
COMPOSE_ERRORS = {
    "wrong_type": (["trainer.lr=fast"], "trainer.lr: Value 'fast' of type 'str' could not be converted"),
    "not_a_bool": (["trainer.checkpoint.background=maybe"],
                   "trainer.checkpoint.background: Value 'maybe' is not a valid bool"),
    "keep_cache_not_a_bool": (["trainer.memory.keep_cache=sometimes"],
                              "trainer.memory.keep_cache: Value 'sometimes' is not a valid bool"),
    "compile_not_a_bool": (["trainer.perf.compile=fast"], "trainer.perf.compile: Value 'fast' is not a valid bool"),
    "fp32_activations_not_a_bool": (["trainer.memory.fp32_activations=half"],
                                    "trainer.memory.fp32_activations: Value 'half' is not a valid bool"),
    "unknown_kernels": (["trainer.perf.kernels=flash"], "trainer.perf.kernels='flash' must be one of auto, none, liger"),
    "unknown_logprob_kernel": (["trainer.perf.logprob_kernel=triton"],
                               "trainer.perf.logprob_kernel='triton' must be one of auto, compiled, eager"),
    "micro_batch_size_word": (["trainer.micro_batch_size=half"],
                              "trainer.micro_batch_size='half' must be >= 1 or auto"),
    "fused_head_not_a_bool": (["trainer.perf.fused_head=maybe"], "trainer.perf.fused_head: Value 'maybe' is not a valid bool"),
    "fuse_grad_accumulation_not_a_bool": (["trainer.perf.fuse_grad_accumulation=maybe"],
                                          "trainer.perf.fuse_grad_accumulation: Value 'maybe' is not a valid bool"),
    "logprob_recompute_word": (["trainer.memory.logprob_recompute=sometimes"],
                               "trainer.memory.logprob_recompute='sometimes' must be true, false or auto"),
    "liger_compiled": (["trainer.perf.kernels=liger", "trainer.perf.compile=true"],
                       "trainer.perf.kernels='liger' cannot be combined with trainer.perf.compile=true"),
    "unparsable_override": (["trainer.lr=="], "trainer.lr==: cannot parse this override"),
    "unknown_group_option": (["model=olmo3"], "model=olmo3: there is no config model/olmo3.yaml in "
                                              "the config search path. Choose one of olmo2, "),
    "unknown_experiment": (["experiment=nope"], "experiment=nope: there is no config experiment/nope.yaml"),
    "missing_value": (["trainer.lr=???"], "trainer.lr: has no value (??? in its YAML) and must be set"),
    "unknown_algo_preset": (["trainer/algo=ppo"], "trainer/algo=ppo: there is no config trainer/algo/ppo.yaml"),
    "unknown_estimator": (["trainer.algo.advantage_estimator=vtrace"],
                          "trainer.algo.advantage_estimator: 'vtrace' is not an import path: write module:function "
                          "(e.g. my_module:my_function) or one of the built-ins grpo, rloo, reinforce_pp"),
    "estimator_without_function": (["trainer.algo.advantage_estimator=colo_rl.trainer.algorithms:vtrace"],
                                   "has no callable 'vtrace'"),
    "unknown_policy_loss": (["trainer.algo.policy_loss=cispo"], "trainer.algo.policy_loss: 'cispo' is not an import path"),
    "unknown_algorithm_label": (["trainer.algo.name=ppo"], "trainer.algo.name='ppo' must be one of grpo, dr_grpo, "),
    "dynamic_sampling_rounds": (["trainer/algo=dapo", "trainer.algo.dynamic_sampling.max_rounds=0"],
                                "trainer.algo.dynamic_sampling.max_rounds=0 must be >= 1"),
    "overlong_buffer_range": (["task.overlong_buffer=2"], "task.overlong_buffer=2.0 must be in [0, 1]"),
    "skip_zero_advantage_under_fsdp": (["trainer.algo.skip_zero_advantage=true", "trainer.parallel=fsdp"],
                                       "trainer.algo.skip_zero_advantage=True is not supported with trainer.parallel=fsdp"),
    "reinforce_pp_under_ddp": (["trainer/algo=reinforce_pp", "trainer.parallel=ddp"],
                               "trainer.algo.advantage_estimator='reinforce_pp' whitens over the whole batch"),
    "skip_zero_advantage_with_kl": (["trainer.algo.skip_zero_advantage=true", "trainer.algo.kl_coef=0.1"],
                                    "trainer.algo.skip_zero_advantage=True cannot skip sequences with trainer.algo.kl_coef=0.1"),
    "moved_key": (["trainer.checkpoint_every=5"],
                  "trainer.checkpoint_every moved to trainer.checkpoint.every (docs/config.md)"),
    "moved_group": (["trainer.dynamic_sampling.enabled=true"],
                    "trainer.dynamic_sampling.enabled moved to trainer.algo.dynamic_sampling.enabled (docs/config.md)"),
}


@pytest.mark.parametrize("name", COMPOSE_ERRORS)
def test_hydra_composition_errors_become_one_line_naming_the_key(name):
    overrides, expected = COMPOSE_ERRORS[name]
    with pytest.raises(Exception) as info:
        check_algorithm(validate(compose_config(*overrides)))  # the checks Run makes before the engine starts
    message = input_error_message(info.value)
    assert message is not None and expected in message, message
    assert "\n" not in message and "full_key" not in message


def python(*args: str, cwd: Path, env: dict | None = None) -> subprocess.Popen:
    full_env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    full_env.update(PYTHONPATH=str(ROOT), WANDB_MODE="offline", **(env or {}))
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.Popen:
    return python("-m", "colo_rl.run", *args, cwd=cwd, env=env)


@pytest.fixture()
def engine_marker(tmp_path) -> tuple[Path, str]:
    """A generator.python that leaves a file behind if anything tries to start an engine."""
    marker = tmp_path / "engine_started"
    python = tmp_path / "python"
    # validate() runs this interpreter once to probe for the worker's modules: only the worker
    # itself counts
    python.write_text(f"#!/bin/sh\ncase \"$*\" in *colo_rl.generator.worker*) touch {marker};; esac\n"
                      f"exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return marker, f"generator.python={python}"


def test_each_bad_input_is_one_error_line_exit_2_without_traceback_or_engine(tmp_path, engine_marker):
    marker, python = engine_marker
    # an empty Hugging Face cache, offline: the hub model is certainly not here
    env = {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    for name, (args, expected) in BAD_INPUTS.items():
        started = time.monotonic()
        proc = cli(*args, python, f"output_dir={tmp_path / name}", f"hydra.sweep.dir={tmp_path / name}",
                   "logger=none", cwd=tmp_path, env=env)
        out, err = proc.communicate(timeout=120)
        seconds = time.monotonic() - started
        assert proc.returncode == 2, (name, out[-2000:], err[-2000:])
        assert "Traceback" not in out + err, (name, err)
        errors = [line for line in err.splitlines() if line.startswith("colo_rl: error: ")]
        assert len(errors) == 1 and expected in errors[0], (name, err)
        assert "Error executing job" not in err, (name, err)
        assert seconds < 30, (name, seconds)  # 4-5 s on 2 cores, nearly all of it importing torch
        # the worker spawned as the command started (importing vLLM) is gone with its files
        assert not glob(os.path.join(tempfile.gettempdir(), f"colo_rl-{proc.pid}-*")), name
        assert not glob(os.path.join(tempfile.gettempdir(), f"colo_rl-engine-{proc.pid}-*")), name
    assert not marker.exists()
    assert not list(tmp_path.glob("*/engine*.log"))


@pytest.mark.parametrize("old, new", OLD_KEYS.items(), ids=list(OLD_KEYS))
def test_every_key_of_the_old_trainer_layout_is_one_line_naming_its_new_place_exit_2(old, new, tmp_path):
    # as an override and as an added key; the line comes before torch is imported: no engine
    for arg in (f"{old}=1", f"+{old}=1"):
        proc = cli(arg, f"output_dir={tmp_path / 'run'}", "logger=none", cwd=tmp_path)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (arg, out[-2000:], err[-2000:])
        assert "Traceback" not in out + err, (arg, err)
        assert err.splitlines() == [f"colo_rl: error: {old} moved to {new} (docs/config.md)"], (arg, err)
    assert not (tmp_path / "run").exists()


def test_an_old_key_in_a_yaml_file_or_under_debug_names_its_new_place_too(tmp_path):
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "old.yaml").write_text(
        "# @package _global_\ntrainer:\n  checkpoint_every: 3\n  dynamic_sampling:\n    enabled: true\n")
    env = {"COLO_RL_PRESPAWN": "0"}
    cases = {"yaml": (["--config-dir", str(tmp_path / "conf"), "experiment=old"],
                      "trainer.checkpoint_every moved to trainer.checkpoint.every (docs/config.md)"),
             "debug": (["trainer.kl_coef=0.1", "debug=true"],
                       "trainer.kl_coef moved to trainer.algo.kl_coef (docs/config.md)")}
    for name, (args, expected) in cases.items():
        proc = cli(*args, f"output_dir={tmp_path / name}", "logger=none", cwd=tmp_path, env=env)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (name, err[-3000:])
        errors = [line for line in err.splitlines() if line.startswith("colo_rl: error: ")]
        assert errors == [f"colo_rl: error: {expected}"], (name, err[-3000:])
        assert ("Traceback" in err) == (name == "debug"), (name, err[-3000:])


def test_debug_or_hydra_full_error_shows_the_traceback_of_an_input_error(tmp_path):
    for args, env in ((["debug=true"], {}), ([], {"HYDRA_FULL_ERROR": "1"})):
        proc = cli("trainer.lr=-1", *args, f"output_dir={tmp_path}", "logger=none", cwd=tmp_path,
                   env=env)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err
        assert "Traceback" in err and "colo_rl: error: trainer.lr=-1.0 must be > 0" in err, err


def test_an_internal_error_keeps_its_traceback(tmp_path):
    proc = python("-c", "import colo_rl.cli as c; c.run_cli(lambda: 1 / 0)", cwd=tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" in err and "ZeroDivisionError" in err, err
    assert "colo_rl: error" not in err


def test_a_missing_package_is_an_input_error_and_colo_rls_own_is_a_bug():
    message = input_error_message(ModuleNotFoundError("No module named 'math_verify'", name="math_verify"))
    assert message.startswith("math_verify: the package is not installed") and "pip install" in message
    assert input_error_message(ModuleNotFoundError("x", name="colo_rl.nothing")) is None


def test_a_model_path_without_source_hf_trains_that_model(tmp_path):
    """The embedded model never reads model.path: naming a directory means training it."""
    settings = validate(compose_config(f"model.path={tmp_path}"))
    assert settings.model.source == "hf" and settings.model.path == str(tmp_path)


def test_resuming_another_shape_or_a_changed_checkpoint_is_refused_before_any_engine(tmp_path, engine_marker):
    from omegaconf import OmegaConf

    from colo_rl.config import ModelConfig, TrainerConfig
    from colo_rl.models import load_policy, write_embedded_model
    from colo_rl.trainer import GRPOTrainer, save_checkpoint

    model_dir = write_embedded_model(ModelConfig(), tmp_path / "model")
    trainer = GRPOTrainer(load_policy(ModelConfig(), model_dir, "cpu"), TrainerConfig(), pad_token_id=0,
                          temperature=1.0, max_tokens=8, device="cpu")
    config = OmegaConf.to_container(compose_config(), resolve=True)
    checkpoint = save_checkpoint(tmp_path / "checkpoint", trainer, {"step": 1, "task_rng": None},
                                 config=config, model_dir=model_dir)
    marker, python = engine_marker
    common = (python, f"trainer.checkpoint.resume={checkpoint}", f"output_dir={tmp_path / 'run'}", "logger=none")
    proc = cli(*common, "model.embedded.hidden_size=256", cwd=tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert f"colo_rl: error: trainer.checkpoint.resume={checkpoint}: this run's config differs from the " \
           "checkpoint's in model.embedded.hidden_size=256 (the checkpoint: 128)" in err, err

    data = bytearray((checkpoint / "optimizer.safetensors").read_bytes())
    data[-1] ^= 0x20
    (checkpoint / "optimizer.safetensors").write_bytes(bytes(data))
    proc = cli(*common, cwd=tmp_path)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert (f"colo_rl: error: {checkpoint / 'optimizer.safetensors'}: its bytes differ from the "
            "SHA-256 in manifest.json") in err, err
    assert not marker.exists()


def test_a_run_failure_is_one_error_line_exit_1_and_a_reward_functions_own_traceback(capsys):
    """Not input errors, not bugs in colo_rl: the runner has logged its checkpoint and how to
    resume, so the command line ends with the failure's message alone (exit 1); a reward
    function that raised shows its own traceback, where the user's bug is."""
    from colo_rl.cli import exit_for
    from colo_rl.rewards import RewardError
    from colo_rl.trainer import TrainingDiverged

    with pytest.raises(SystemExit) as info:
        exit_for(TrainingDiverged("step 5: the loss or gradient norm was not finite"), debug=False)
    err = capsys.readouterr().err
    assert info.value.code == 1 and "Traceback" not in err
    assert err.strip() == "colo_rl: error: step 5: the loss or gradient norm was not finite"
    from colo_rl.trainer import TrainerOutOfMemory

    with pytest.raises(SystemExit) as info:
        exit_for(TrainerOutOfMemory("the GPU ran out of memory in a train step at trainer.micro_batch_size=32",
                                    state_intact=True), debug=False)
    err = capsys.readouterr().err
    assert info.value.code == 1 and "Traceback" not in err
    assert err.strip() == "colo_rl: error: the GPU ran out of memory in a train step at trainer.micro_batch_size=32"

    def users_reward():
        raise ValueError("bad row")

    try:
        users_reward()
    except ValueError as cause:
        failure = RewardError("reward function my_rewards:f raised ValueError at step 2")
        failure.__cause__ = cause
    with pytest.raises(SystemExit) as info:
        exit_for(failure, debug=False)
    err = capsys.readouterr().err
    assert info.value.code == 1 and "in users_reward" in err and "ValueError: bad row" in err
    assert err.strip().endswith("colo_rl: error: reward function my_rewards:f raised ValueError at step 2")
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        exit_for(ZeroDivisionError("division by zero"), debug=False)
