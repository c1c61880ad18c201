"""The engine process: its own group, killed cleanly, noticed dead at once, gone with its trainer.

Real subprocesses and real signals; each test here starts its own worker because it kills it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch

from colo_rl.config import GeneratorConfig, SamplingConfig
from colo_rl.generator import EngineProcess, GeneratorError, VLLMGenerator
from colo_rl.generator import process as process_module
from colo_rl.generator.process import group_members
from colo_rl.switch import Switch
from colo_rl.trainer import Offloader

from ..conftest import ROOT


def bare_worker(tmp_path) -> EngineProcess:
    """A worker without an engine: enough for the control channel and signal tests."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = EngineProcess(sys.executable, tmp_path / "engine.log", env)
    process.spawn(connect_timeout=60)
    return process


def test_worker_runs_in_its_own_process_group_with_a_private_socket(tmp_path):
    """...and the start clears the socket directories (authkeys inside) that dead trainers left,
    not those of live ones."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tempfile.mkdtemp(prefix=f"colo_rl-{dead.pid}-")
    alive = tempfile.mkdtemp(prefix=f"colo_rl-{os.getppid()}-")  # pytest's parent is alive
    process = bare_worker(tmp_path)
    try:
        assert not os.path.exists(stale) and os.path.isdir(alive)
        assert os.path.basename(process.socket_dir).startswith(f"colo_rl-{os.getpid()}-")
        assert os.getpgid(process.pid) == process.pid != os.getpgid(0)
        assert oct(os.stat(process.socket_dir).st_mode & 0o777) == "0o700"
        assert oct(os.stat(f"{process.socket_dir}/worker.json").st_mode & 0o777) == "0o600"
        socket_dir, pgid = process.socket_dir, process.pid
    finally:
        os.rmdir(alive)
        assert process.close() == 0
    assert not os.path.exists(socket_dir)
    assert group_members(pgid) == []


def test_a_socket_directory_names_its_trainer_by_pid_and_start_ticks_not_the_wall_clock():
    """worker.json's owner is (pid, start in clock ticks after boot): the same pid with other
    ticks is a reused pid, so the directory is a dead run's; the live owner's is kept. (The check
    once compared psutil's wall-clock create_time, which moves when the clock is stepped.)"""
    from colo_rl.generator.process import remove_stale_socket_dirs, start_ticks

    me = start_ticks(os.getpid())
    assert isinstance(me, int) and me == int(open(f"/proc/{os.getpid()}/stat").read().split()[21])
    dirs = {}
    for name, ticks in (("live", me), ("reused", me + 1)):
        dirs[name] = tempfile.mkdtemp(prefix=f"colo_rl-{os.getpid()}-")
        with open(os.path.join(dirs[name], "worker.json"), "w") as f:
            json.dump({"parent_pid": os.getpid(), "parent_start_ticks": ticks}, f)
    try:
        removed = remove_stale_socket_dirs()
        assert dirs["reused"] in removed and not os.path.exists(dirs["reused"])
        assert os.path.isdir(dirs["live"]) and dirs["live"] not in removed
    finally:
        for path in dirs.values():
            shutil.rmtree(path, ignore_errors=True)


def test_garbage_and_silence_before_the_trainer_connects_do_not_lock_it_out(tmp_path):
    """Clients that get to a fresh worker first (garbage bytes, a connection that says nothing)
    are refused; the trainer, coming third, connects and is served."""
    socket_dir = tempfile.mkdtemp(prefix=f"colo_rl-{os.getpid()}-")
    path, key = os.path.join(socket_dir, "control.sock"), os.urandom(32)
    config = os.path.join(socket_dir, "worker.json")
    with open(config, "w") as f:
        json.dump({"socket": path, "authkey": key.hex(), "parent_pid": os.getpid()}, f)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = EngineProcess(sys.executable, tmp_path / "engine.log", env)
    with open(process.log_path, "ab") as log:
        process.proc = subprocess.Popen([sys.executable, "-m", "colo_rl.generator.worker", config],
                                        stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
    process.socket_dir = socket_dir
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        garbage, silent = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
        garbage.connect(path)
        garbage.sendall(b"\x00\x00\x00\x05hello" * 8)
        silent.connect(path)
        start = time.monotonic()
        process.conn = process._connect(path, key, timeout=30)
        assert time.monotonic() - start < 5
        assert process.request("ping", timeout=10)["pid"] == process.pid
        garbage.close()
        silent.close()
    finally:
        assert process.close() == 0
    assert not os.path.exists(socket_dir)
    assert "refused client 1" in (tmp_path / "engine.log").read_text()


def test_a_handshake_that_never_completes_fails_within_the_start_timeout(tmp_path):
    """A listener that accepts and then says nothing (a wedged worker, or something else on the
    path): the trainer's wait ends at generator.start_timeout_s, not never."""
    path = str(tmp_path / "control.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    process = EngineProcess(sys.executable, tmp_path / "engine.log", dict(os.environ))
    start = time.monotonic()
    with pytest.raises(GeneratorError, match=r"during connect: the worker's control socket did not "
                                             r"complete the handshake within generator.start_timeout_s=2 s"):
        process._connect(path, os.urandom(32), timeout=2)
    assert time.monotonic() - start < 5
    listener.close()


def test_hung_worker_times_out_and_its_group_is_killed(tmp_path):
    process = bare_worker(tmp_path)
    pgid = process.pid
    os.kill(process.pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(GeneratorError, match="no reply within 2 s.*process group was killed"):
        process.request("ping", timeout=2)
    assert time.monotonic() - start < 20
    assert group_members(pgid) == []
    process.close()


def test_dead_worker_is_noticed_while_waiting_not_after_the_timeout(tmp_path):
    process = bare_worker(tmp_path)
    os.kill(process.pid, signal.SIGSTOP)  # it cannot answer, so only its death ends the wait
    threading.Timer(1.0, os.kill, (process.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(GeneratorError, match=r"(?s)exited with code -9 while handling 'ping'.*engine log: "):
        process.request("ping", timeout=600)
    assert time.monotonic() - start < 10
    process.close()


@pytest.mark.slow
def test_sigkill_mid_generate_is_a_clear_error_and_the_next_step_restarts(tiny_model_dir, tiny_policy, tmp_path):
    generator = VLLMGenerator(GeneratorConfig(), model_dir=tiny_model_dir, dtype="float32", log_dir=tmp_path)
    optimizer = torch.optim.AdamW(tiny_policy.parameters(), lr=1e-3)
    offloader = Offloader(tiny_policy, optimizer, "all")
    sampling = SamplingConfig(n=8, temperature=1.0, max_tokens=200)
    prompts = [[5, 6, 7, 8]] * 64
    try:
        Switch(generator, tiny_policy, offloader).generate(prompts[:1], SamplingConfig(n=1, max_tokens=2))
        pgid = generator.process.pid
        threading.Timer(1.5, os.kill, (pgid, signal.SIGKILL)).start()
        with pytest.raises(GeneratorError, match=r"(?s)during generate: .*exited with code -9.*engine log: .*engine.log"):
            Switch(generator, tiny_policy, offloader).generate(prompts, sampling)
        assert group_members(pgid) == []
        assert offloader.offloaded == set()
        assert all(p.device.type == "cpu" for p in tiny_policy.parameters())
        rollouts = Switch(generator, tiny_policy, offloader).generate(prompts[:2],
                                                                      SamplingConfig(n=2, max_tokens=4))
        assert generator.process.pid != pgid and "timing/server_start_s" in rollouts.metrics
        assert len(rollouts.completion_ids) == 4
    finally:
        generator.close()


TRAINER_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from colo_rl.config import GeneratorConfig, ModelConfig, SamplingConfig
    from colo_rl.generator import VLLMGenerator
    from colo_rl.models import load_policy
    from colo_rl.switch import Switch
    if __name__ == "__main__":
        model_dir, log_dir, in_process = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "true"
        policy = load_policy(ModelConfig(), model_dir, "cpu")
        generator = VLLMGenerator(GeneratorConfig(in_process=in_process), model_dir=model_dir, dtype="float32",
                                  log_dir=log_dir)
        Switch(generator, policy).generate([[5, 6, 7]], SamplingConfig(n=1, max_tokens=2))
        # a batch that keeps the engine busy for minutes: 512 x 8 completions of 240 tokens
        generator.process.send("generate", prompts=[[5, 6, 7, 8]] * 512,
                               sampling={"n": 8, "max_tokens": 240, "ignore_eos": True, "temperature": 1.0})
        print(generator.process.pid, generator.process.socket_dir, flush=True)
        time.sleep(600)
""")


@pytest.mark.slow
@pytest.mark.parametrize("in_process", ["true", "false"])  # false: vLLM's engine core in a child (GPU default)
def test_killing_the_trainer_mid_generate_takes_the_engine_and_its_key_down_within_seconds(
        tiny_model_dir, tmp_path, in_process):
    """The worker is busy with a batch of minutes when its trainer is SIGKILLed: its socket
    directory (the authkey) goes at once and the whole group within seconds."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER_SCRIPT)
    trainer = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir), str(tmp_path), in_process],
                               stdout=subprocess.PIPE, text=True, cwd=ROOT,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        pid, socket_dir = trainer.stdout.readline().split()
        worker_pid = int(pid)
        names = [p.name() for p in group_members(worker_pid)]
        assert ("VLLM::EngineCore" in names) == (in_process == "false"), names
        time.sleep(3)  # well into the batch
        trainer.kill()
        trainer.wait()
        killed = time.monotonic()
        while time.monotonic() - killed < 10 and (group_members(worker_pid) or os.path.exists(socket_dir)):
            time.sleep(0.1)
        gone_s = time.monotonic() - killed
        assert group_members(worker_pid) == [], "engine processes outlived their trainer by 10 s"
        assert not os.path.exists(socket_dir), "the authkey's directory outlived the trainer"
        print(f"worker group gone {gone_s:.1f} s after its trainer")
        assert gone_s < 6
        assert f"trainer {trainer.pid} is gone" in (tmp_path / "engine.log").read_text()
    finally:
        trainer.kill()


@pytest.mark.parametrize("argv, env", [(["-m", "trainer.lr=1e-4,3e-4"], {}), (["--help"], {}),
                                       (["hydra.mode=MULTIRUN"], {}), ([], {"COLO_RL_PRESPAWN": "0"}),
                                       ([], {"LOCAL_RANK": "0"})])
def test_no_worker_is_prespawned_for_a_multirun_a_flag_a_torchrun_rank_or_when_turned_off(argv, env, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert process_module.prespawn(argv) is None
    assert process_module._prespawned is None


def test_a_prespawned_worker_is_adopted_unless_a_variable_read_at_process_start_differs(tmp_path, monkeypatch):
    """`python -m colo_rl.run` spawns the engine's worker before it imports torch. The run adopts
    it when only variables read as the engine starts differ (they go in the start request); a
    different CUDA_VISIBLE_DEVICES or interpreter means a new worker, and the early one is gone
    with its socket directory and early log."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    for change, adopted in (({"VLLM_CACHE_ROOT": str(tmp_path / "cache")}, True),
                            ({"CUDA_VISIBLE_DEVICES": "7"}, False), ({}, False)):
        early = process_module.prespawn(["trainer.steps=1"])
        assert early is not None and early.alive() and early.early_log.exists()
        socket_dir, pgid = early.socket_dir, early.pid
        python = sys.executable if change else "/usr/bin/python3-other"
        env = {**process_module.worker_env(), **change}
        assert process_module.env_changes(early.env, env) == change
        process = process_module.adopt_prespawned(python, env, tmp_path / "engine.log")
        assert process_module._prespawned is None  # taken either way
        if adopted:
            assert process is early and process.log_path == tmp_path / "engine.log"
            # it imports vLLM first, then answers; the early log holds what it wrote so far
            assert process.request("ping", timeout=300)["pid"] == pgid
            assert "colo_rl worker: vLLM imported in" in early.early_log.read_text()
            assert process.close() == 0
        else:
            assert process is None
        assert group_members(pgid) == [] and not os.path.exists(socket_dir)
        assert not early.early_log.exists()


def test_env_changes_names_what_differs_and_what_is_unset():
    assert process_module.env_changes({"A": "1", "B": "2"}, {"A": "1", "B": "3", "C": "4"}) == {"B": "3", "C": "4"}
    assert process_module.env_changes({"A": "1"}, {}) == {"A": None}


def test_trace_cuda_init_prints_the_stack_of_the_first_cuda_initialisation():
    """COLO_RL_TRACE_CUDA_INIT=1 (issue #23): the worker reports what initialises CUDA before its
    engine core starts (which makes vLLM spawn the core instead of forking it). On this CPU host
    torch's lazy init fails after the report; the report names the caller and comes once."""
    code = textwrap.dedent("""
        import torch
        from colo_rl.generator.worker import trace_cuda_init
        trace_cuda_init()
        torch.cuda.is_initialized = lambda: False
        def caller_that_initialises_cuda():
            try:
                torch.cuda._lazy_init()
            except Exception:
                pass
        caller_that_initialises_cuda()
        caller_that_initialises_cuda()
    """)
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, timeout=120).stdout
    assert out.count("colo_rl worker: CUDA initialised here:") == 1
    assert "caller_that_initialises_cuda" in out


DEVICE_QUERY_PROBE = textwrap.dedent("""
    import sys, types
    import torch
    import torch.utils._triton as triton_utils
    real_has_triton = triton_utils.has_triton
    real_capability = torch.cuda.get_device_capability
    queries = []
    # a CUDA host as torch's device helpers see it: every query that would initialise CUDA is recorded
    torch.version.cuda = "13.0"  # a CUDA build: torchao's capability checks look at it first
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: queries.append("current_device") or 0
    torch.cuda.get_device_properties = lambda device=None: queries.append("get_device_properties") or \\
        types.SimpleNamespace(major=9, minor=0, name="H100", total_memory=80 << 30, multi_processor_count=132)
    if sys.argv[1] == "worker":
        # the host's NVML, which answers without CUDA: one H100 (its handle is its index)
        from vllm.third_party import pynvml
        pynvml.nvmlInit = pynvml.nvmlShutdown = lambda: None
        pynvml.nvmlDeviceGetHandleByIndex = lambda index: index
        pynvml.nvmlDeviceGetCudaComputeCapability = lambda handle: (9, 0)
        from colo_rl.generator.worker import import_vllm_without_cuda
        import_vllm_without_cuda()
    else:
        from vllm import LLM
    print("QUERIES", queries, triton_utils.has_triton is real_has_triton
          and torch.cuda.get_device_capability is real_capability)
""")


@pytest.mark.parametrize("how, queried", [("plain", True), ("worker", False)])
def test_the_worker_imports_vllm_without_asking_cuda_for_a_device(how, queried):
    """Issue #23: `from vllm import LLM` asks CUDA for the current device's properties (vLLM ->
    transformers' quantizers -> torchao's mx_formats kernels -> torch's has_triton() and
    get_device_capability()), which on a GPU host initialises CUDA, so vLLM spawns its engine core
    (importing vLLM again) instead of forking it. The worker's import answers has_triton from the
    package and the capability from NVML while vLLM imports, then puts the real ones back. The probe
    fakes a CUDA build on an H100 (the 2026-12-06d lease found the capability query this way after a
    probe without `torch.version.cuda` had missed it)."""
    out = subprocess.run([sys.executable, "-c", DEVICE_QUERY_PROBE, how], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, timeout=300)
    line = [x for x in out.stdout.splitlines() if x.startswith("QUERIES")]
    assert line, out.stderr[-3000:]
    if queried and "get_device_properties" not in line[0]:
        pytest.skip("this vLLM/transformers/torchao set no longer asks for the device while vLLM imports")
    assert ("get_device_properties" in line[0]) is queried, line[0]
    assert line[0].endswith("True")  # torch's has_triton and get_device_capability are its own again
