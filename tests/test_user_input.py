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
        message = refused(no_engine, run_dir, "trainer.checkpoint.export=true", f"trainer.checkpoint.export_dir={target}",
                          f"trainer.checkpoint.resume={run_dir / 'checkpoint'}", "trainer.steps=3")
        assert message.startswith(f"trainer.checkpoint.export_dir={target}: ") and expected in message, message
    (run_dir / "export").mkdir()
    (run_dir / "export" / "notes.txt").write_text("mine")
    message = refused(no_engine, run_dir, "trainer.checkpoint.export=true", "trainer.steps=3",
                      f"trainer.checkpoint.resume={run_dir / 'checkpoint'}")
    assert "trainer.checkpoint.export (into" in message and "exists and is not empty" in message
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
    assert f"trainer.checkpoint.resume={checkpoint}" in message and "overwrite_output_dir=true" in message
    assert {k: v for k, v in tree(tmp_path).items() if not k.startswith(".")} == \
        {k: v for k, v in before.items() if not k.startswith(".")}
    # told: it goes on to the next check (a refused export target here: still nothing replaced)
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "x").write_text("x")
    assert "exists and is not empty" in refused(no_engine, tmp_path, "overwrite_output_dir=true",
                                                "trainer.checkpoint.export=true")


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


# -- accepted silently -------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, expected", [
    # b259d2e: stored and ignored (the run trained at the default lr, or without LoRA)
    (["+trainer.lrr=1e-4"], "trainer.lrr: no such key in colo_rl's config, so it would be ignored"),
    (["+trainer.lora.rnak=8"], "trainer.lora.rnak: no such key"),
    (["+seed=3"], "seed: no such key"),
    (["+trainer.checkpoint_every=5"], "trainer.checkpoint_every moved to trainer.checkpoint.every (docs/config.md)"),
    # b259d2e: the engine started, and the run ended in TrainingDiverged blaming the lr
    (["trainer.lr=inf"], "trainer.lr=inf must be a finite number"),
    (["trainer.algo.kl_coef=inf"], "trainer.algo.kl_coef=inf must be a finite number"),
    (["task.reward_weights=[nan]"], "task.reward_weights[0]=nan must be a finite number"),
    # b259d2e: vLLM's own error after the engine started
    (["sampling.temperature=inf"], "sampling.temperature=inf must be a finite number"),
    (['sampling.stop=["x",""]'], "sampling.stop=['x', ''] must hold non-empty strings"),
])
def test_keys_added_with_plus_and_numbers_that_are_not_finite_are_refused(tmp_path, no_engine, overrides,
                                                                           expected):
    assert expected in refused(no_engine, tmp_path / "run", *overrides)


def test_the_unknown_key_message_no_longer_recommends_plus(tmp_path, no_engine):
    message = refused(no_engine, tmp_path / "run", "trainer.lrr=1e-4")
    assert message.startswith("trainer.lrr: no such key") and "+" not in message


def test_free_form_engine_kwargs_still_take_any_key():
    from colo_rl.config import validate

    assert validate(compose_config("+generator.engine_kwargs.block_size=16")).generator.engine_kwargs == \
        {"block_size": 16}


# -- dataset rows and files --------------------------------------------------------------------

ROWS = {
    # b259d2e: rendered into garbage prompts, without an error
    "struct_prompt": ('{"prompt": {"text": "abc"}}', "prompt", "row 0 of", "is dict {'text': 'abc'}, not a string"),
    "string_messages": ('{"m": "hello"}', "m", "row 0 of", "is str 'hello', not a non-empty list of messages"),
    "message_without_role": ('{"m": [{"content": "hi"}]}', "m", "row 0 of",
                             "has message 0 = dict {'content': 'hi'}, not {role: str, content: str}"),
    # b259d2e: a traceback
    "int_prompt": ('{"prompt": "ab"}\n{"prompt": 7}', "prompt", "row 1 of", "is int 7, not a string"),
    "null_prompt": ('{"prompt": "ab"}\n{"prompt": null}', "prompt", "row 1 of", "is NoneType None, not a string"),
    # b259d2e: vLLM refused the empty prompt after the engine started
    "empty_prompt": ('{"prompt": "ab"}\n{"prompt": ""}', "prompt", "row 1 of the prompts is empty", ""),
    "empty_file": ("", "prompt", "cannot be read as a dataset", ""),
    "malformed_json": ('{"prompt": "ab"', "prompt", "cannot be read as a dataset", ""),
}


@pytest.mark.parametrize("name", ROWS)
def test_prompts_are_checked_row_by_row_and_unreadable_data_is_one_line(tmp_path, no_engine, name):
    text, column, where, problem = ROWS[name]
    data = tmp_path / "data.jsonl"
    data.write_text(text + "\n" if text else "")
    key = "task.dataset.messages_column" if column == "m" else "task.dataset.prompt_column"
    message = refused(no_engine, tmp_path / "run", "task=dataset", f"task.dataset.path={data}",
                      "task.rewards=[format]", "eval.every=0",
                      *([f"{key}={column}"] if column == "m" else []))
    assert where in message and problem in message, message
    if "row" in where and "empty" not in where:
        assert message.startswith(f"{key}='{column}': "), message


def test_an_empty_directory_or_split_is_one_line(tmp_path, no_engine):
    (tmp_path / "empty").mkdir()
    message = refused(no_engine, tmp_path / "run", "task=dataset", f"task.dataset.path={tmp_path / 'empty'}",
                      "task.rewards=[format]", "eval.every=0")
    assert message.startswith(f"task.dataset.path={tmp_path / 'empty'}: cannot be read as a dataset"), message
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "ab"}\n')
    message = refused(no_engine, tmp_path / "run", "task=dataset", f"task.dataset.path={data}",
                      "task.rewards=[format]", "eval.every=0", "task.dataset.split='train[:0]'")
    assert message.startswith("task.dataset.split='train[:0]': ") and "corresponds to no data" in message


# -- reward functions --------------------------------------------------------------------------

BAD_MODULES = {
    "syntax_error": ("def f(prompts, completions, **kw):\n    return [1.0 for c in completions\n",
                     "raised SyntaxError ("),
    "raises_at_import": ("raise RuntimeError('no judge configured')\n",
                         "raised RuntimeError: no judge configured"),
    "exits_at_import": ("import sys\nsys.exit(3)\n", "raised SystemExit: 3"),
}


@pytest.mark.parametrize("name", BAD_MODULES)
def test_a_reward_module_that_fails_to_import_is_one_line(tmp_path, no_engine, monkeypatch, name):
    """b259d2e: the SyntaxError or the module's own exception as a traceback."""
    source, expected = BAD_MODULES[name]
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, name, raising=False)
    message = refused(no_engine, tmp_path / "run", f"task.rewards=[{name}:f]")
    assert message.startswith(f"task.rewards: '{name}:f': importing module '{name}' ") and expected in message



def _rewards(*fns, timeout_s: float = 600.0):
    from colo_rl.rewards import RewardFunction, Rewards

    return Rewards([RewardFunction(f"test:{f.__name__}", f.__name__, 1.0, f) for f in fns], timeout_s=timeout_s)


def test_what_a_reward_function_returns_or_does_is_checked(caplog):
    """b259d2e: a dict was read by its keys, SystemExit ended the run with exit 0, an int too
    large for a float was a traceback, a mutation changed what the next function scored, a
    batch of all None trained on zeros without a word, a call that never returned hung the run."""
    import time

    from colo_rl.rewards import RewardError

    def as_dict(prompts, completions, **kw):
        return {i: 1.0 for i in range(len(completions))}

    def exits(prompts, completions, **kw):
        sys.exit(0)

    def huge(prompts, completions, **kw):
        return [10 ** 400] * len(completions)

    def never_returns(prompts, completions, **kw):
        time.sleep(3600)

    cases = {as_dict: "test:as_dict returned dict at step 4: it must return a list of 2 numbers",
             exits: "test:exits raised SystemExit at step 4",
             huge: "test:huge returned 1000000000", never_returns:
             "test:never_returns did not return within task.reward_timeout_s=0.5 s at step 4"}
    for fn, expected in cases.items():
        with pytest.raises(RewardError, match=expected):
            _rewards(fn, timeout_s=0.5).per_function(["p", "q"], ["a", "b"], {"answer": ["x", "y"]}, "at step 4")

    def mutates(prompts, completions, answer, **kw):
        completions[0] = "zzz"
        answer.clear()
        return [0.0] * len(completions)

    def reads(prompts, completions, answer, **kw):
        return [float(c == "a" and a == "x") for c, a in zip(completions, answer)]

    def not_applicable(prompts, completions, **kw):
        return [None] * len(completions)

    completions, columns = ["a", "b"], {"answer": ["x", "y"]}
    with caplog.at_level("WARNING", logger="colo_rl"):
        values = _rewards(mutates, reads, not_applicable).per_function(["p", "q"], completions, columns, "at step 2")
    assert values["reads"] == [1.0, 0.0] and completions == ["a", "b"] and columns == {"answer": ["x", "y"]}
    assert "test:not_applicable returned None for every completion at step 2" in caplog.text
    from colo_rl.rewards import Rewards

    assert Rewards.metrics(values)["reward/not_applicable_applied_frac"] == 0.0



def test_a_reward_that_sets_signal_alarm_runs_under_the_deadline():
    """math-verify's parse and verify time themselves with signal.alarm, which only the main
    thread may set: the deadline must not move the call to another thread."""
    from colo_rl.rewards import math_accuracy

    values = _rewards(math_accuracy, timeout_s=30).per_function(["q"] * 2, ["\\boxed{72}", "\\boxed{7}"],
                                                                {"answer": ["#### 72"] * 2}, "at step 0")
    assert values == {"math_accuracy": [1.0, 0.0]}


LEFT_THREAD = 'threading.Thread(target=time.sleep, args=(3600,), name="judge-pool").start()  # not a daemon\n'
USER_REWARDS = """
import os, sys, threading, time

""" + LEFT_THREAD + """
CALLS = []

def exits_at_step_one(prompts, completions, **columns):
    CALLS.append(1)  # call 1 is the first-batch check, call k + 2 step k
    if len(CALLS) == 3:
        sys.exit(0)
    return [0.0] * len(completions)

def hangs_at_step_one(prompts, completions, **columns):
    CALLS.append(1)
    if len(CALLS) == 3:
        time.sleep(3600)
    return [0.0] * len(completions)
"""


@pytest.mark.slow
def test_a_reward_that_exits_is_a_failure_with_a_checkpoint_and_a_left_thread_does_not_hold_the_process(
        tmp_path):
    """b259d2e: exit code 0 and nothing on stderr after step 0; and the module's thread kept the
    finished process alive. Now: exit 1 naming the function and step, a checkpoint of step 1,
    and the process ends although the thread runs on."""
    from colo_rl.trainer.checkpoint import read_manifest

    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run([sys.executable, "-m", "colo_rl.run", f"output_dir={tmp_path / 'run'}", "logger=none",
                           "logger.progress=false", "trainer.steps=3", "trainer.prompts_per_step=2", "sampling.n=2",
                           "sampling.max_tokens=4", "eval.every=0", "task.rewards=[user_rewards:exits_at_step_one]"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == ("colo_rl: error: reward function "
                                                    "user_rewards:exits_at_step_one raised SystemExit at step 1: 0")
    assert read_manifest(tmp_path / "run" / "checkpoint")["step"] == 1
    assert "exiting without waiting for 1 thread(s) left running (not daemons: judge-pool)" in proc.stdout


def test_a_reward_that_never_returns_stops_the_run_at_its_deadline_with_a_checkpoint(tmp_path, monkeypatch,
                                                                                      engine):
    """b259d2e: the run blocked forever."""
    from colo_rl.rewards import RewardError
    from colo_rl.trainer.checkpoint import read_manifest

    (tmp_path / "user_rewards.py").write_text(USER_REWARDS.replace(LEFT_THREAD, ""))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "user_rewards", raising=False)
    with pytest.raises(RewardError, match=r"reward function user_rewards:hangs_at_step_one did not return within "
                                          r"task.reward_timeout_s=2 s at step 1"):
        train(compose_config(*small_run_overrides(tmp_path / "run", "logger=none", "task.reward_timeout_s=2",
                                                  "task.rewards=[user_rewards:hangs_at_step_one]")), engine)
    assert read_manifest(tmp_path / "run" / "checkpoint")["step"] == 1


# -- input that ended in a traceback -----------------------------------------------------------

def test_a_run_directory_under_a_file_is_one_line_exit_2(tmp_path):
    """b259d2e: NotADirectoryError / FileExistsError tracebacks, from Hydra or from the lock."""
    (tmp_path / "afile").write_text("")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("HYDRA_FULL_ERROR", None)
    for override, expected in ((f"hydra.run.dir={tmp_path / 'afile' / 'run'}", "hydra.run.dir: cannot create "),
                               (f"output_dir={tmp_path / 'afile' / 'run'}", f"output_dir={tmp_path / 'afile' / 'run'}: "
                                                                             "cannot write there")):
        proc = subprocess.run([sys.executable, "-m", "colo_rl.run", override, "logger=none"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("colo_rl: error: ")]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert len(errors) == 1 and errors[0].startswith(f"colo_rl: error: {expected}"), proc.stderr
        assert not list(tmp_path.glob("**/engine.log"))


def test_a_manifest_of_the_wrong_shape_is_refused_naming_it(tmp_path, no_engine):
    """b259d2e: AttributeError ('list' object has no attribute 'get')."""
    (tmp_path / "checkpoint").mkdir()
    for text in ("[]", '{"files": ["model.safetensors"]}'):
        (tmp_path / "checkpoint" / "manifest.json").write_text(text)
        message = refused(no_engine, tmp_path / "run", f"trainer.checkpoint.resume={tmp_path / 'checkpoint'}")
        assert message.startswith(f"{tmp_path / 'checkpoint' / 'manifest.json'}: not a colo_rl manifest"), message


@pytest.mark.parametrize("args, expected", [
    (["--max-shard-size", "huge"], "--max-shard-size huge: not a size"),
    (["--max-shard-size=-1GB"], "--max-shard-size -1GB: not a size"),
])
def test_export_arguments_that_ended_in_a_traceback_are_one_line(tmp_path, capsys, args, expected):
    """b259d2e: transformers' ValueError at save_pretrained; an export into a regular file raised
    NotADirectoryError."""
    from colo_rl.export import main

    (tmp_path / "afile").write_text("mine")
    for out, message in ((str(tmp_path / "out"), expected),
                         (str(tmp_path / "afile"), f"{tmp_path / 'afile'}: is a file")):
        with pytest.raises(SystemExit) as info:
            main([str(tmp_path / "checkpoint"), out, *(args if out.endswith("out") else [])])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.strip() == f"colo_rl: error: {message}" + (
            ". Give a positive size such as 5GB or 500MB (or a number of bytes)" if "size" in message
            else ". Give a directory for the exported model"), err
    assert (tmp_path / "afile").read_text() == "mine"


# -- what vLLM refused only after the engine started -------------------------------------------

def test_engine_settings_vllm_would_refuse_are_refused_before_it_starts(tmp_path, no_engine):
    """b259d2e: vLLM's own errors once the engine had started (exit 1), or, for a staging_dir
    that is a file, colo_rl's message only after the engine had started."""
    (tmp_path / "afile").write_text("")
    cases = {"generator.max_model_len=1024": "generator.max_model_len=1024 exceeds the model's "
                                             "max_position_embeddings=512",
             "generator.cpu_kvcache_gib=100000": "generator.cpu_kvcache_gib=100000 is more than this machine's",
             f"generator.staging_dir={tmp_path / 'afile'}": f"generator.staging_dir={tmp_path / 'afile'} is not "
                                                            "a writable directory"}
    for override, expected in cases.items():
        assert refused(no_engine, tmp_path / "run", override).startswith(expected)


# -- leaks ---------------------------------------------------------------------------------------

def test_staged_weights_of_a_dead_trainer_are_removed_when_the_next_engine_starts(tmp_path):
    """b259d2e: a trainer killed between staging and the load left its file in /dev/shm for good."""
    from colo_rl.generator.process import STAGED_PREFIX, EngineProcess, default_staging_dirs, worker_env

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    staging = Path(default_staging_dirs()[0])
    stale = staging / f"{STAGED_PREFIX}{dead.pid}-{os.urandom(4).hex()}.safetensors"
    live = staging / f"{STAGED_PREFIX}{os.getpid()}-{os.urandom(4).hex()}.safetensors"
    for path in (stale, live):
        path.write_bytes(b"weights")
    process = EngineProcess(sys.executable, tmp_path / "engine.log", worker_env())
    try:
        process.launch()
    finally:
        process.kill_now()
    assert not stale.exists() and live.exists()  # a live run's file is its own
    live.unlink()


def test_a_checkpoint_is_never_written_from_weights_that_are_not_finite(tmp_path):
    """b259d2e: after trainer.lr=inf the "last good state" checkpoint held NaN weights."""
    import torch

    from colo_rl.config import ModelConfig, TrainerConfig
    from colo_rl.models import load_policy, write_embedded_model
    from colo_rl.trainer import GRPOTrainer, save_checkpoint
    from colo_rl.trainer.checkpoint import CheckpointError

    model_dir = write_embedded_model(ModelConfig(), tmp_path / "model")
    trainer = GRPOTrainer(load_policy(ModelConfig(), model_dir, "cpu"), TrainerConfig(), pad_token_id=0,
                          temperature=1.0, max_tokens=8, device="cpu")
    checkpoint = save_checkpoint(tmp_path / "checkpoint", trainer, {"step": 1, "sampler": {}})
    before = tree(checkpoint)
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float("nan"))
    with pytest.raises(CheckpointError, match=r"the trainer's weights are not finite \(1 tensors, .*no checkpoint "
                                              r"written.*Lower trainer.lr or trainer.algo.kl_coef"):
        save_checkpoint(checkpoint, trainer, {"step": 2, "sampler": {}})
    assert tree(checkpoint) == before


@pytest.mark.slow
def test_a_barrage_of_sigterms_still_removes_the_workers_socket_directory(tmp_path, tiny_model_dir):
    """b259d2e: a second SIGTERM raised inside server.close() and skipped the cleanup, leaving
    the authkey's directory (reproduced: SIGTERM every 0.5 ms until the worker exits)."""
    import signal
    import time

    from colo_rl.config import GeneratorConfig
    from colo_rl.generator import VLLMGenerator

    generator = VLLMGenerator(GeneratorConfig(), model_dir=tiny_model_dir, dtype="float32", log_dir=tmp_path)
    generator.begin_start()
    generator.wait_started()
    proc, socket_dir = generator.process.proc, generator.process.socket_dir
    try:
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                break
            time.sleep(0.0005)
        assert proc.wait(30) == 143  # the worker's own exit after its cleanup
        assert not os.path.isdir(socket_dir)
    finally:
        generator.process.kill_now()
