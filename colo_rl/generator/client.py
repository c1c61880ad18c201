"""The trainer's side of the sleeping vLLM generator: the engine client. Never imports vllm.

`VLLMGenerator` speaks to the worker through an `EngineProcess` (colo_rl.generator.process):
start the engine (and check the weight mapping), stage or share weights and load them, wake,
reset the prefix cache, generate, sleep, close. It knows nothing of the trainer's state:
colo_rl.switch sequences these requests into a wake that hands the GPU from the trainer to the
engine and back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from colo_rl.config import GeneratorConfig, SamplingConfig, engine_python, resolve_device
from colo_rl.generator.process import EngineProcess, GeneratorError, adopt_prespawned, env_changes, worker_env
from colo_rl.generator.staging import tensor_checksum, write_staged_file
from colo_rl.lora import hf_parameters, merged_weight

log = logging.getLogger(__name__)

def vllm_cache_root(cfg: GeneratorConfig) -> Path:
    """The engine's VLLM_CACHE_ROOT: generator.cache_dir, else vLLM's own default."""
    if cfg.cache_dir:
        return Path(os.path.abspath(os.path.expanduser(cfg.cache_dir)))
    default = os.path.join(os.getenv("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")), "vllm")
    return Path(os.path.expanduser(os.getenv("VLLM_CACHE_ROOT", default)))


def shared_model_dir(model_dir: Path, cache_root: Path) -> Path:
    """A copy of `model_dir`'s files (config and tokenizer: no weights) under `cache_root`, named
    by their contents, for the engine to load. vLLM's compile cache is keyed by a hash of its
    config that includes the model's path: the embedded model written into each run's own
    directory would make every run compile afresh, the same files at one path do not. Written
    whole, then renamed into place, so that concurrent multirun jobs share it safely."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file())
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    target = cache_root / "colo_rl_models" / digest.hexdigest()[:20]
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for path in files:
            shutil.copy2(path, staging / path.name)
        try:
            os.rename(staging, target)
        except OSError:  # another job put the same files there first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@dataclass
class Rollouts:
    """One step's generations, grouped: prompt i's completions are [i*n:(i+1)*n]."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    logprobs: list[list[float]] | None
    finish_reasons: list[str]
    group_size: int
    metrics: dict[str, float] = field(default_factory=dict)
    evaluation: "Rollouts | None" = None  # colo_rl.switch's eval_batch, from the same wake


class VLLMGenerator:
    """A vLLM engine in its own subprocess that sleeps while the trainer has the GPU."""

    def __init__(self, cfg: GeneratorConfig, *, model_dir: Path, dtype: str, log_dir: Path,
                 seed: int = 0, trust_remote_code: bool = False, tokenizer: str | None = None,
                 log_name: str = "engine.log", gpu: str | None = None):
        self.cfg = cfg
        self.model_dir, self.dtype, self.seed = Path(model_dir), dtype, seed
        self.trust_remote_code, self.tokenizer = trust_remote_code, tokenizer
        self.log_path = Path(log_dir) / log_name
        self.gpu = gpu  # CUDA_VISIBLE_DEVICES of the engine (data parallel: the rank's GPU)
        self.process: EngineProcess | None = None
        self.engine_info: dict = {}
        self.weight_sync: str | None = None
        self.pushes = 0
        self._unreported_start_s: float | None = None
        self._start_request: tuple[int, float] | None = None  # begin_start's request, sent at
        self._start_info: dict = {}
        self._unchecked = False  # an engine begin_start started whose weight mapping start() has not checked
        self.start_began = 0.0
        self.prespawned = False  # the worker was spawned as the command started (process.prespawn)

    @property
    def in_process(self) -> bool:
        """generator.in_process, with null resolved: vLLM's own engine-core process on a GPU
        (faster generation), the engine core inside the worker on CPU (faster start)."""
        if self.cfg.in_process is not None:
            return self.cfg.in_process
        return resolve_device(self.cfg.device) == "cpu"

    # -- lifecycle -------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = worker_env()
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cfg.cpu_kvcache_gib))
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if self.cfg.cache_dir:
            env["VLLM_CACHE_ROOT"] = os.path.abspath(os.path.expanduser(self.cfg.cache_dir))
        if self.in_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # hiding the GPUs matters only where there are some; elsewhere the environment stays that
        # of the worker `python -m colo_rl.run` spawned as it started, so the run can adopt it
        if self.cfg.device == "cpu" and torch.cuda.is_available():
            env["CUDA_VISIBLE_DEVICES"] = ""
        elif self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        return env

    def engine_kwargs(self) -> dict:
        kwargs = dict(model=str(self.model_dir), tokenizer=self.tokenizer or str(self.model_dir),
                      dtype=self.dtype, load_format="dummy", seed=self.seed,
                      gpu_memory_utilization=self.cfg.gpu_memory_utilization,
                      max_model_len=self.cfg.max_model_len, max_num_seqs=self.cfg.max_num_seqs,
                      enforce_eager=self.cfg.enforce_eager, trust_remote_code=self.trust_remote_code,
                      # the sampled tokens' log-probs after the temperature, as the trainer takes
                      # them (vLLM's default is before it): the engine/trainer gap and the TIS
                      # weights then compare like with like at any temperature
                      logprobs_mode="processed_logprobs")
        if self.in_process:
            kwargs["distributed_executor_backend"] = "uni"
        kwargs.update(self.cfg.engine_kwargs)
        return kwargs

    def ensure_started(self, model: torch.nn.Module) -> None:
        """Start the engine for `model` now, unless it runs (or finish the start `begin_start`
        began): the runner calls this during set-up so that a bad engine setting fails before
        the first step touches the trainer. The start's seconds are reported with the next
        step's metrics."""
        if self.process is not None and self.process.alive() and not self._unchecked:
            return
        self.start(self._hf_specs(model))

    @property
    def starting(self) -> bool:
        """A start `begin_start` began and nobody has waited for yet."""
        return self._start_request is not None

    def begin_start(self) -> None:
        """Spawn the worker and ask it to start its engine, without waiting: vLLM loads, compiles
        and (on GPU) profiles memory, captures graphs and goes to sleep while the caller builds
        the trainer. `wait_started` (or `ensure_started`/`start`) then waits for it. A no-op when
        an engine runs or is starting. On any failure, or an interruption, the worker's process
        group is gone before the error propagates; `abandon_start` ends a start the caller gives up."""
        if self._start_request is not None or (self.process is not None and self.process.alive()):
            return
        if self.process is not None:
            self.process.close()
        self.start_began = time.perf_counter()
        self._unchecked = True
        python, env = engine_python(self.cfg), self._env()
        # the worker `python -m colo_rl.run` spawned as it started, vLLM imported or importing
        self.process = adopt_prespawned(python, env, self.log_path)
        self.prespawned = self.process is not None
        try:
            if self.process is None:
                self.process = EngineProcess(python, self.log_path, env)
                self.process.spawn(connect_timeout=self.cfg.start_timeout_s)
            sent = time.monotonic()
            self._start_request = (self.process.send("start", engine_kwargs=self.engine_kwargs(),
                                                     sleep_level=self.cfg.sleep_level,
                                                     env=env_changes(self.process.env, env),
                                                     log_path=str(self.log_path)), sent)
        except BaseException as exc:
            self.abandon_start(polite=isinstance(exc, Exception))
            raise

    def wait_started(self) -> dict:
        """Wait for the start `begin_start` began (generator.start_timeout_s from its request):
        the engine is then up, and asleep on a GPU, so the trainer may allocate GPU memory."""
        if self._start_request is None:
            return self._start_info
        request_id, sent = self._start_request
        timeout = self.cfg.start_timeout_s
        try:
            self._start_info = self.process.reply(request_id, "start", sent + timeout, timeout)
        except BaseException as exc:
            self.abandon_start(polite=isinstance(exc, Exception))
            raise
        self._start_request = None
        return self._start_info

    def abandon_start(self, polite: bool = False) -> None:
        """Stop the worker (its whole process group) and remove its socket directory. Not
        `polite` (the default): a worker busy starting would answer `shutdown` only after that."""
        process, self.process, self._start_request = self.process, None, None
        if process is not None:
            process.close(polite=polite)

    def start(self, hf_specs: list[list]) -> dict:
        """Start the worker and its engine (asleep on GPU), or finish the start `begin_start`
        began, and check the weight mapping. On any failure the worker's process group is gone
        before the error propagates."""
        begun = self._unchecked and self.process is not None and self.process.alive()
        if self._start_request is None and not begun:  # nothing started, or an engine already checked
            if self.process is not None:
                process, self.process = self.process, None
                process.close()
            self.begin_start()
        self.wait_started()
        try:
            info = self._start(hf_specs)
        except BaseException as exc:
            self.abandon_start(polite=isinstance(exc, Exception))
            raise
        self._unchecked = False
        self._unreported_start_s = time.perf_counter() - self.start_began
        return info

    def _start(self, hf_specs: list[list]) -> dict:
        info = self._start_info
        plan = self.process.request("plan", timeout=self.cfg.request_timeout_s, hf_specs=hf_specs)
        if plan["unmapped"] or plan["uncovered"]:
            raise GeneratorError(
                f"the trainer's parameters do not map onto the engine's: unmapped "
                f"{plan['unmapped'][:10]}, engine parameters nothing loads {plan['uncovered'][:10]}. "
                f"Check that model.* describes the same architecture the engine runs",
                phase="plan", log_path=self.log_path)
        self.engine_info = {**info, **plan, "in_process": self.in_process}
        self.weight_sync = self._choose_weight_sync(info)
        log.info("engine up in %.0f s: vLLM %s on %s, %s, sleep mode %s, engine core %s, weight sync %s, "
                 "%d Hugging Face tensors into %d engine parameters (log: %s)", info["seconds"],
                 info["vllm_version"], info["platform"], "eager" if info["enforce_eager"] else "CUDA graphs",
                 "on" if info["sleep_supported"] else "off (not on CPU)",
                 "inside the worker" if self.in_process else "in its own process", self.weight_sync,
                 plan["hf_tensors"], plan["engine_params"], self.log_path)
        return self.engine_info

    def _choose_weight_sync(self, info: dict) -> str:
        mode = self.cfg.weight_sync
        if mode == "auto":
            return "cuda_ipc" if info["platform"] == "cuda" and torch.cuda.is_available() else "file"
        if mode == "cuda_ipc" and not (info["platform"] == "cuda" and torch.cuda.is_available()):
            raise GeneratorError("generator.weight_sync=cuda_ipc needs the trainer and the engine on "
                                 "one CUDA GPU; use generator.weight_sync=file", phase="start",
                                 log_path=self.log_path)
        return mode

    def close(self) -> int | None:
        if self.process is None:
            return None
        try:
            code = self.process.close()
        finally:  # kept until then: a trainer that exits at once kills it (run: kill_now)
            self.process = None
        if code not in (0, None):
            raise GeneratorError(f"engine worker exited with code {code}", phase="close",
                                 log_path=self.log_path)
        return code

    def __enter__(self) -> "VLLMGenerator":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif self.process is not None:
            self.process.close()  # already failing: don't mask the original error

    # -- requests to the running engine (colo_rl.switch sequences them into a wake) ----------

    @property
    def running(self) -> bool:
        """A worker is up (it may be starting: see `starting`)."""
        return self.process is not None and self.process.alive()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def take_start_seconds(self) -> float | None:
        """Seconds of the latest start, once: for the metrics of the step after a start that
        `ensure_started` made during set-up; None when they have been taken already."""
        seconds, self._unreported_start_s = self._unreported_start_s, None
        return seconds

    def wake(self, tags: list[str]) -> None:
        """Wake the engine's `weights` or `kv_cache`."""
        self.process.request("wake", timeout=self.cfg.request_timeout_s, tags=tags)

    def sleep(self, timeout: float | None = None) -> dict:
        """Put the engine to sleep (generator.sleep_level); {"skipped": True} where vLLM has no
        sleep mode (CPU)."""
        return self.process.request("sleep", timeout=timeout or self.cfg.request_timeout_s,
                                    level=self.cfg.sleep_level)

    def kill(self) -> bool:
        """Kill the worker's process group; True once none of it is left (the worker is then
        forgotten, and the next start is a fresh one) or when none runs."""
        if self.process is None:
            return True
        released = self.process.kill()
        if released:
            self.process.close()
            self.process = None
        return released

    def stage(self, model: torch.nn.Module) -> tuple[Path, str]:
        """Write `model`'s weights, in the engine's dtype, to a staged file (generator.staging_dir)
        for `load_file`: its path and fingerprint. The caller deletes the file."""
        return write_staged_file([(n, t.cpu()) for n, t in self._engine_tensors(model)], self._staging_dir())

    def load_file(self, path: Path, fingerprint: str) -> dict:
        """Load a staged file into the awake engine, which verifies it first; the load's stats."""
        stats = self.process.request("load_file", timeout=self.cfg.request_timeout_s, path=str(path),
                                     fingerprint=fingerprint)
        self.pushes += 1
        return stats

    def load_ipc(self, model: torch.nn.Module) -> dict:
        """Load `model`'s weights into the awake engine straight from the trainer's GPU memory
        (CUDA IPC, checksummed on both sides); the load's stats."""
        from torch.multiprocessing.reductions import reduce_tensor

        entries = []
        tensors = self._engine_tensors(model)  # held until the engine has copied them
        for name, t in tensors:
            rebuild, args = reduce_tensor(t)
            entries.append((name, rebuild, args, tensor_checksum(t)))
        stats = self.process.request("load_ipc", timeout=self.cfg.request_timeout_s,
                                     payload=pickle.dumps(entries))
        del tensors
        torch.cuda.ipc_collect()  # the engine dropped its mappings; let our allocator free them
        self.pushes += 1
        return {**stats, "cast_gib": self._cast_gib(model)}

    def reset_prefix_cache(self) -> None:
        """Drop the engine's cached KV: after a load it belongs to the previous weights."""
        self.process.request("reset_prefix_cache", timeout=self.cfg.request_timeout_s)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig,
                 seed: int | list[int] | None = None) -> Rollouts:
        """Generate `sampling.n` completions per prompt on the awake engine (`seed`: one for the
        batch or one per prompt); the result's metrics are the engine's own `generator/*`."""
        out = self.process.request("generate", timeout=self.cfg.request_timeout_s, prompts=prompt_ids,
                                   sampling=self._sampling_params(sampling, seed))
        return Rollouts(prompt_ids=prompt_ids, completion_ids=out["token_ids"], texts=out["texts"],
                        logprobs=out["logprobs"], finish_reasons=out["finish_reasons"], group_size=sampling.n,
                        metrics={f"generator/{k}": float(v) for k, v in out.get("stats", {}).items()})

    @staticmethod
    def _hf_specs(model: torch.nn.Module) -> list[list]:
        """[name, shape] of every tensor a push sends (an FSDP DTensor's shape is the full one)."""
        return [[name, list(p.shape)] for name, p, _ in hf_parameters(model)]

    def _engine_tensors(self, model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """What the engine gets: the trainer's parameters in the engine's dtype, cast where they
        differ (fp32 masters under trainer.memory.precision=mixed; a copy the caller holds until the
        engine has loaded it), the parameters themselves where they do not. Under LoRA each adapted
        weight is merged into a fresh copy (colo_rl.lora), named as in the base model."""
        dtype = getattr(torch, self.dtype)
        # named_parameters() yields tied parameters once: an alias is pushed and counted once.
        # FSDP shards are DTensors: full_tensor() all-gathers each (every rank calls this in the
        # same order, so the collectives match).
        return [(name, merged_weight(p, layer, dtype) if layer is not None else
                 (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).to(dtype))
                for name, p, layer in hf_parameters(model)]

    def _cast_gib(self, model: torch.nn.Module) -> float:
        """GPU memory the engine-dtype copies (cast or merged) of a push take."""
        dtype = getattr(torch, self.dtype)
        return sum(p.numel() * dtype.itemsize for _, p, layer in hf_parameters(model)
                   if layer is not None or p.dtype != dtype) / 2**30

    def _staging_dir(self) -> str:
        if self.cfg.staging_dir != "auto":
            return self.cfg.staging_dir
        return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()

    @staticmethod
    def _sampling_params(s: SamplingConfig, seed: int | list[int] | None) -> dict:
        return {"n": s.n, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                "max_tokens": s.max_tokens, "stop": list(s.stop), "seed": seed,
                "logprobs": 0 if s.logprobs else None, "ignore_eos": s.ignore_eos}
