"""colo_rl's entry point: `python -m colo_rl.run [overrides]` (Hydra).

`run(cfg)` reads top to bottom: validate -> plan memory -> set up (model, task, trainer,
offloader, generator, the switch between them, logger) -> train (sample prompts, generate through
the switch: the engine wakes, generates and sleeps; score, GRPO update, log) -> report. It works
without `@hydra.main` (tests call it through Hydra's compose API).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # torch, transformers and the rest take seconds to import: say so first
    print("colo_rl: starting (importing torch, transformers, Hydra)", flush=True)  # stderr: errors only
    # ...and start the engine's worker first: it imports vLLM while this process imports torch
    from colo_rl.generator.process import prespawn

    prespawn(sys.argv[1:])

import logging
import os
import shutil
import signal
import time
from contextlib import nullcontext
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import mean

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from colo_rl.cli import boundary, run_cli
from colo_rl.config import (ConfigError, RunConfig, SamplingConfig, package_dir, register_configs,
                            resolve_device, trainer_precision, validate)
from colo_rl.export import check_export_target, export_checkpoint, export_target
from colo_rl.generator import Rollouts, VLLMGenerator
from colo_rl.generator.client import shared_model_dir, vllm_cache_root
from colo_rl.generator.process import check_engine_settings
from colo_rl.lora import check_targets, load_trainer_policy
from colo_rl.metrics import SWITCH_PHASES, MetricsLogger, print_summary
from colo_rl.models import DTYPES, load_tokenizer, prepare_model_dir
from colo_rl.parallel import Parallel, reduce_step_metrics
from colo_rl.planner import plan_run
from colo_rl.rundir import RunDirLock, claim
from colo_rl.switch import Switch
from colo_rl.tasks import Batch, Task
from colo_rl.timing import SetupStages, StepTimer, engine_log_status, host_metrics
from colo_rl.trainer import (CheckpointError, GRPOTrainer, Offloader, TrainingDiverged, load_checkpoint,
                             save_checkpoint)
from colo_rl.trainer.checkpoint import BackgroundWriter, check_compatible, verify_checkpoint
from colo_rl.trainer.flops import peak_tflops, perf_metrics
from colo_rl.trainer.grpo import group_advantages
from colo_rl.trainer.kernels import check_kernels

log = logging.getLogger("colo_rl")
register_configs()


class Interrupted(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: checkpoint, close the engine, exit non-zero."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class InterruptGuard:
    """Turns SIGINT/SIGTERM into exceptions, deferred while a step's update is applied and
    logged, so a checkpoint never holds a half-applied optimizer step."""

    def __init__(self) -> None:
        self.deferring = False
        self.pending: int | None = None
        self.update_failed = False
        self.kill_engine = lambda: None  # for a second signal: set once the run has an engine

    def _handler(self, signum, frame):
        self.shutting_down(self.kill_engine)  # the first signal starts the shutdown
        if self.deferring:
            self.pending = signum
            return
        raise Interrupted(signum)

    @contextmanager
    def installed(self):
        previous = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    @contextmanager
    def deferred(self):
        """The update window: an exception inside leaves the trainer's state unknown, unless it
        says otherwise (`state_intact`, e.g. TrainerOutOfMemory before any optimizer step)."""
        self.deferring = True
        try:
            yield
        except BaseException as exc:
            if not getattr(exc, "state_intact", False):
                self.update_failed = True
            raise
        finally:
            self.deferring = False
        if self.pending is not None:
            raise Interrupted(self.pending)

    def shutting_down(self, kill_engine) -> None:
        """From now on SIGINT/SIGTERM end the process at once: the user asked twice, or asked
        while a failure is being handled. `kill_engine` takes the engine's group down first."""

        def exit_now(signum, frame):
            name = signal.Signals(signum).name
            print(f"colo_rl: {name} while shutting down: exiting now (exit code {128 + signum}); "
                  "the last complete checkpoint is kept", file=sys.stderr, flush=True)
            kill_engine()
            os._exit(128 + signum)

        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, exit_now)


def _hydra_run_info() -> tuple[Path | None, str | None, str | None]:
    """(output dir, W&B group, W&B name) from Hydra when it is running this job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None, None, None
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        return Path(hc.runtime.output_dir), Path(hc.sweep.dir).name, hc.job.override_dirname or None
    return Path(hc.runtime.output_dir), None, None


@dataclass
class RunResult:
    """What a finished run leaves besides its files: the metrics of every step, the final
    reward, and the W&B run's summary and config as they were just before it finished."""

    output_dir: Path
    records: list[dict]
    final_reward: float
    wandb_summary: dict | None
    wandb_config: dict | None


def run(cfg: DictConfig, generator: VLLMGenerator | None = None) -> float:
    """Train for `trainer.steps` steps; returns the mean reward of the last steps (for sweepers)."""
    return train(cfg, generator).final_reward


def train(cfg: DictConfig, generator: VLLMGenerator | None = None) -> RunResult:
    """The whole run. `generator`: an already started engine for the same model (tests share
    one); by default the run starts and closes its own."""
    stages = SetupStages()
    settings = validate(cfg)
    stages.mark("config", "config checked")
    if settings.model.source != cfg.model.source:
        log.warning("model.path=%s is set, so model.source=hf: training that model, not the "
                    "embedded one", settings.model.path)
    hydra_dir, group, name = _hydra_run_info()
    output_dir = Path(settings.output_dir) if settings.output_dir else hydra_dir
    if output_dir is None:
        raise ValueError("output_dir is unset and Hydra is not running: pass output_dir=PATH")
    t = settings.trainer

    # -- setup: everything that can fail on bad input fails here, before any engine starts ---
    par = Parallel.from_torchrun(t.parallel, resolve_device(t.device))
    try:
        # rank 0's directory is every rank's (broadcast in _train); rank 0 holds it
        with RunDirLock(output_dir) if par.is_main else nullcontext():
            return _train(cfg, settings, generator, par, output_dir, group, name, stages)
    finally:
        par.close()


def _train(cfg: DictConfig, settings: RunConfig, generator: VLLMGenerator | None, par: Parallel,
           output_dir: Path, group: str | None, name: str | None, stages: SetupStages) -> RunResult:
    t, s = settings.trainer, settings.sampling
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if t.resume:  # before any model is built: a config the checkpoint does not fit stops here
        check_compatible(t.resume, resolved)
    if par.is_main:  # nothing the user has is replaced: another run's checkpoint, an export target
        claim(output_dir, cfg, t.resume, settings.overwrite_output_dir)
        if t.export_final:
            check_export_target(t.export_dir, output_dir, t.resume)
    device = par.device(resolve_device(t.device))
    par.shard(range(t.prompts_per_step))  # fails now, naming the key, if they do not split
    # every rank writes into rank 0's directory (Hydra names one per process, by the clock)
    output_dir = Path(par.broadcast(str(output_dir)))
    model_dir = Path(par.broadcast(str(prepare_model_dir(settings.model, output_dir))
                                   if par.is_main else None))
    tokenizer = load_tokenizer(settings.model, model_dir)
    stages.mark("tokenizer", f"model files in {model_dir}, tokenizer of {len(tokenizer)} tokens")
    task = Task.setup(settings, tokenizer)  # data, prompt lengths, rewards: before any engine
    stages.mark("task", f"task {settings.task.name} ready: {len(task.train)} training prompts")
    # trainer.kernels: auto becomes liger or none here (the plan counts Liger's smaller activations)
    t.kernels = check_kernels(t.kernels, device, model_dir, settings.model.trust_remote_code, t.compile)
    # The memory plan: trainer.offload and generator.gpu_memory_utilization `auto` become values
    # here, and a config whose trainer or engine cannot fit is refused, before anything is built.
    plan = plan_run(settings, model_dir, device, task, show=par.is_main)
    check_engine_settings(settings.generator, model_dir, resolve_device(settings.generator.device) == "cpu")
    if t.lora.rank > 0:  # LoRA's target modules against the model's linear layers
        check_targets(model_dir, t.lora, settings.model.trust_remote_code)
    if t.resume:  # its files' checksums and step count too, before the engine is spawned: a
        # damaged checkpoint or one with no steps left to do stops here
        done_steps = verify_checkpoint(t.resume).get("step", 0)
        if done_steps >= t.steps:
            raise ConfigError(f"trainer.resume={t.resume} holds a run that already did {done_steps} "
                              f"steps, so trainer.steps={t.steps} leaves none to do: raise trainer.steps "
                              f"above {done_steps}")
    if s.n == 1:
        log.warning("sampling.n=1: every GRPO advantage is zero, so this run measures generation "
                    "and switching only; use sampling=default to learn")
    owns_generator = generator is None
    engine_model_dir = model_dir
    if owns_generator and settings.model.source == "embedded":  # one path per shape: see shared_model_dir
        try:
            engine_model_dir = shared_model_dir(model_dir, vllm_cache_root(settings.generator))
        except OSError as exc:
            log.warning("the engine reads the model files from %s, so vLLM's compile cache is not "
                        "shared with other runs of this shape (%s; see generator.cache_dir)", model_dir, exc)
    generator = generator or VLLMGenerator(
        settings.generator, model_dir=engine_model_dir, dtype=settings.model.dtype, log_dir=output_dir,
        seed=t.seed, trust_remote_code=settings.model.trust_remote_code,
        tokenizer=settings.model.tokenizer,
        log_name=f"engine_rank{par.rank}.log" if par.enabled else "engine.log",
        gpu=par.engine_gpu() if device.startswith("cuda") else None)
    checkpoint_dir = output_dir / "checkpoint"
    guard = InterruptGuard()
    guard.kill_engine = _engine_killer(generator if owns_generator else None)
    # The engine starts first, in the background, and the trainer is built while vLLM loads and
    # compiles; they meet at the engine's weight mapping check and then the first weight push.
    # On CUDA the trainer allocates no GPU memory until the engine has started and gone to
    # sleep: vLLM sizes its KV cache (generator.gpu_memory_utilization) from the free memory it
    # profiles while it starts, and trainer allocations inside that window would shrink it or
    # fail its profiling check. There the window reads a pretrained policy into host memory, and
    # the policy moves (random init: is built) on the GPU once the engine is asleep. On CPU the
    # whole trainer is built in the window.
    on_cuda = device.startswith("cuda")
    early_device = "cpu" if on_cuda else device
    policy = trainer = offloader = None
    start_step = 0
    with guard.installed():
        try:
            if not generator.running:
                generator.begin_start()
                early = ", spawned as the command started" if generator.prespawned else ""
                stages.mark("engine_spawn", f"engine starting in the background (vLLM in its own "
                                            f"process{early}; log: {generator.log_path})")
            if not on_cuda or settings.model.source != "embedded":
                torch.manual_seed(t.seed)
                policy = load_trainer_policy(settings, model_dir, early_device)
                if on_cuda:
                    stages.mark("policy_read", f"policy read into host memory, to move onto {device} "
                                               "once the engine is asleep")
            if not on_cuda:
                trainer, offloader, start_step = _build_trainer(settings, policy, device, par, tokenizer,
                                                                task, stages)
            # A bad engine setting (path, memory) fails here with vLLM's own message, before step 0
            # moves any trainer state; the worker's group is gone when it fails.
            waited = time.perf_counter()
            if generator.starting:
                with engine_log_status("engine starting", generator.log_path):
                    generator.wait_started()
                stages.mark("engine", f"engine ready (waited {time.perf_counter() - waited:.1f} s; "
                                      f"{time.perf_counter() - generator.start_began:.1f} s since it "
                                      "was spawned)")
            if on_cuda:
                if policy is None:  # random init, directly on the GPU (load_policy)
                    torch.manual_seed(t.seed)
                    policy = load_trainer_policy(settings, model_dir, device)
                trainer, offloader, start_step = _build_trainer(settings, policy.to(device), device, par,
                                                                tokenizer, task, stages)
                if plan.engine_wake_bytes:  # trainer.keep_cache: the cache stays where the engine wakes beside it
                    offloader.keep_cache_if_free = int(plan.engine_wake_bytes)
            with engine_log_status("engine starting", generator.log_path):
                generator.ensure_started(trainer.model)  # the weight mapping; a full start if none ran
            if not stages.metrics.get("setup/engine_s"):
                stages.mark("engine", "engine ready")
            else:
                stages.mark("engine_check", "the engine's weight mapping checked against the policy")
        except KeyboardInterrupt as exc:
            if owns_generator:
                generator.abandon_start()
            log.error("%s during set-up: the engine was stopped, no step ran", exc)
            raise SystemExit(128 + getattr(exc, "signum", signal.SIGINT)) from None
        except BaseException:
            if owns_generator:
                generator.abandon_start()  # the error itself is what the user needs to see
            raise
        # the W&B config shows what ran: the plan's choices where the config said auto
        config = OmegaConf.to_container(cfg, resolve=True)
        config["trainer"]["offload"] = settings.trainer.offload
        config["trainer"]["kernels"] = settings.trainer.kernels
        config["trainer"]["micro_batch_size"] = settings.trainer.micro_batch_size
        config["trainer"]["logprob_recompute"] = settings.trainer.logprob_recompute
        config["generator"]["gpu_memory_utilization"] = settings.generator.gpu_memory_utilization
        logger = MetricsLogger(settings.logger, output_dir=output_dir, config=config, group=group,
                               name=name, total_steps=t.steps, initial_step=start_step,
                               enabled=par.is_main)
        with logger:
            stages.mark("logger", f"logging to {logger.path}" + (" and a W&B run" if logger.run else ""))
            logger.add_to_next({**stages.finish(), **task.setup_metrics, **plan.metrics()})
            switch = Switch(generator, trainer.model, offloader,
                            restart_on_failure=settings.generator.restart_on_failure)
            _loop(settings, task, trainer, switch, logger, guard, par, start_step, checkpoint_dir,
                  owns_generator, {"config": resolved, "model_dir": model_dir})
    if t.export_final and par.is_main:
        export_checkpoint(checkpoint_dir, export_target(t.export_dir, output_dir))

    # -- report ---------------------------------------------------------------------------
    if par.is_main:
        print_summary(logger.records, output_dir)
    steps = [r for r in logger.records if "reward/mean" in r]  # not the final evaluation's record
    tail = steps[-max(1, min(5, len(steps))):]
    return RunResult(output_dir, logger.records,
                     mean(r["reward/mean"] for r in tail) if tail else float("nan"),
                     logger.final_summary, logger.final_config)


def _build_trainer(settings: RunConfig, policy: torch.nn.Module, device: str, par: Parallel, tokenizer,
                   task: Task, stages: SetupStages) -> tuple[GRPOTrainer, Offloader, int]:
    """The trainer around `policy` (already on `device`): optimizer, reference model, offloader,
    and the resumed checkpoint's state; returns them with the step to start from."""
    t, s = settings.trainer, settings.sampling
    mixed = trainer_precision(settings) == "mixed"
    trainer = GRPOTrainer(policy, t, pad_token_id=tokenizer.pad_token_id,
                          temperature=s.temperature, max_tokens=s.max_tokens, device=device,
                          parallel=par, autocast_dtype=DTYPES[settings.model.dtype] if mixed else None)
    offloader = Offloader(policy, trainer.optimizer, t.offload, overlap_restore=t.overlap_restore,
                          restore_while_awake=t.restore_while_awake)
    stages.mark("policy", f"policy of {sum(p.numel() for p in policy.parameters()) / 1e6:.2f} M parameters "
                          f"on {device} in {str(next(policy.parameters()).dtype).removeprefix('torch.')}, "
                          f"{t.optimizer} optimizer" + (", Liger's kernels" if trainer.kernels == "liger" else "")
                          + (f", computing in {settings.model.dtype} throughout" if trainer.copies == "all" else ""))
    start_step = 0
    if t.resume:
        # its config, checksums and step count were checked before the engine was spawned
        extra = load_checkpoint(t.resume, trainer, verified=True)
        task.sampler.load_state(extra["sampler"])
        start_step = extra["step"]
        stages.mark("resume", f"resumed from {t.resume} after {start_step} steps")
    return trainer, offloader, start_step


def _loop(settings: RunConfig, task: Task, trainer: GRPOTrainer, switch: Switch, logger: MetricsLogger,
          guard: InterruptGuard, par: Parallel, start_step: int, checkpoint_dir: Path,
          owns_generator: bool, describe: dict) -> None:
    """The steps, then the final checkpoint; on an interruption or a failure, a checkpoint of
    the last applied step (when the trainer's state is intact) and the engine closed."""
    t = settings.trainer
    generator = switch.engine
    # `done` is what a checkpoint holds: steps fully applied and logged, and the prompt sampler's
    # position before the next step, so a resumed run draws the same prompts as an uninterrupted one.
    done = {"step": start_step, "sampler": task.sampler.state()}
    # trainer.checkpoint_background: checkpoints are written on a thread from a host copy; whatever
    # writes or ends next waits for the write in flight first
    writer = BackgroundWriter() if t.checkpoint_background else None
    checkpointed = None  # the step of the last periodic checkpoint
    try:
        for step in range(start_step, t.steps):
            train_one_step(step, settings, task, trainer, switch, logger, guard, done, par)
            if t.checkpoint_every and done["step"] % t.checkpoint_every == 0:
                written = _wait_for_write(writer)
                stall = _checkpoint(par, checkpoint_dir, trainer, done, describe, writer)
                checkpointed = done["step"]
                logger.add_to_next({**written, "checkpoint/stall_s": stall})
        if task.held_out is not None:
            final_evaluation(t.steps, settings, task, switch, logger, par)
        # The engine first: the checkpoint does not need it, and if writing fails none is left.
        # In the background, the final checkpoint is written while the engine closes. A periodic
        # checkpoint of the last step is the final one: it is not written twice.
        final = t.checkpoint_final and checkpointed != done["step"]
        background = final and writer is not None
        if t.checkpoint_final and not final:
            log.info("the checkpoint of step %d (trainer.checkpoint_every) is the final one", done["step"])
        start = time.perf_counter()
        if background:
            _wait_for_write(writer)
            _checkpoint(par, checkpoint_dir, trainer, done, describe, writer)
        log.info("all %d steps done: closing the engine%s", t.steps,
                 ", then writing the final checkpoint" if final and not background else
                 " while the final checkpoint is written" if background else "")
        if owns_generator:
            closing = time.perf_counter()
            generator.close()
            log.info("engine closed (%.1f s)", time.perf_counter() - closing)
        if final and not background:
            start = time.perf_counter()
            _checkpoint(par, checkpoint_dir, trainer, done, describe)
        else:
            _wait_for_write(writer)  # the final write beside the close, or a periodic one still in flight
        if final:
            log.info("final checkpoint of step %d written to %s (%.1f s%s)", done["step"], checkpoint_dir,
                     time.perf_counter() - start, ", beside the engine's close" if background else "")
    except KeyboardInterrupt as exc:
        # The switch has put the engine to sleep and restored the trainer before this.
        guard.shutting_down(guard.kill_engine)
        written = _written_step(writer)
        if par.mode == "fsdp":  # gathering shards needs every rank, and some may be gone
            log.error("interrupted after %d steps (%s); trainer.parallel=fsdp writes no "
                      "checkpoint on interruption", done["step"], exc)
        elif par.is_main:
            if written != done["step"]:
                _save(checkpoint_dir, trainer, done, describe)
            log.error("interrupted after %d steps (%s); checkpoint written to %s; resume with "
                      "trainer.resume=%s", done["step"], exc, checkpoint_dir, checkpoint_dir)
        if owns_generator:
            generator.close()
        raise SystemExit(128 + getattr(exc, "signum", signal.SIGINT)) from exc
    except BaseException as exc:
        guard.shutting_down(guard.kill_engine)
        if owns_generator and generator.process is not None:
            generator.process.close()  # the error itself is what the user needs to see
        _written_step(writer)
        if par.is_main:
            _checkpoint_after_failure(exc, par, checkpoint_dir, trainer, done, start_step, describe,
                                      intact=not guard.update_failed, resumed_from=t.resume)
        raise


def _engine_killer(generator: VLLMGenerator | None):
    def kill() -> None:
        if generator is not None and generator.process is not None:
            generator.process.kill_now()
    return kill


def _checkpoint_after_failure(exc: BaseException, par: Parallel, directory: Path,
                              trainer: GRPOTrainer, done: dict, start_step: int, describe: dict, *,
                              intact: bool, resumed_from: str | None) -> None:
    """Write what the failure left intact and say how to go on from it."""
    what = f"{type(exc).__name__} after {done['step']} steps"
    earlier = (f"trainer.resume={resumed_from} still holds step {start_step}" if resumed_from
               else "a run without trainer.resume starts it again")
    if not intact:
        log.error("%s, in the middle of a step's update: the trainer's state is not that of a "
                  "whole step, so no checkpoint is written; the last one written (if any) is in "
                  "%s", what, directory)
    elif par.mode == "fsdp":  # gathering shards needs every rank, and some may be gone
        log.error("%s; trainer.parallel=fsdp writes no checkpoint on a failure", what)
    elif done["step"] == start_step:
        log.error("%s: no step was applied, nothing new to checkpoint (%s)", what, earlier)
    else:
        try:
            path = _save(directory, trainer, done, describe)
        except CheckpointError as save_error:
            log.error("%s; the checkpoint of step %d could not be written either: %s",
                      what, done["step"], save_error)
            return
        log.error("%s; checkpoint of the last applied step (%d) written to %s; resume with "
                  "trainer.resume=%s", what, done["step"], path, directory)


def _save(directory: Path, trainer: GRPOTrainer, done: dict, describe: dict,
          state: dict | None = None, rng: dict | None = None) -> Path:
    """save_checkpoint, with a failed write (a full disk, a size limit, no permission) reported
    as what it is, naming the directory; the previous checkpoint there stays as it was."""
    try:
        return save_checkpoint(directory, trainer, done, state=state, rng=rng, **describe)
    except CheckpointError:
        raise
    except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as a RuntimeError
        cause = exc  # torch's RuntimeError holds the file's OSError in its context
        while cause is not None and getattr(cause, "errno", None) is None:
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            reason = os.strerror(cause.errno)
        else:
            try:
                free = shutil.disk_usage(directory).free / 2**20
                reason = f"the write failed with {free:.0f} MiB free on that disk (full, or a file size limit)"
            except OSError:
                reason = "the write failed"
        raise CheckpointError(f"could not write a checkpoint into {directory}: {reason}. The "
                              "previous checkpoint there (if any) is unchanged; free space there "
                              f"and resume from it with trainer.resume={directory}") from None


def _checkpoint(par: Parallel, directory: Path, trainer: GRPOTrainer, done: dict, describe: dict,
                writer: BackgroundWriter | None = None) -> float:
    """Rank 0 writes the checkpoint; under FSDP every rank first helps gather the full state.
    With a `writer` (nothing in flight), rank 0 takes a host copy and the writer writes it.
    Returns the seconds the run waited."""
    start = time.perf_counter()
    state = trainer.state_dict() if par.mode == "fsdp" else None
    if par.is_main:
        if writer is None:
            _save(directory, trainer, done, describe, state=state)
        else:
            snap = writer.snapshot(trainer, done, state)
            writer.submit(lambda: _save(directory, trainer, snap.extra, describe, state=snap.state,
                                        rng=snap.rng), snap.step)
    return time.perf_counter() - start


def _wait_for_write(writer: BackgroundWriter | None) -> dict[str, float]:
    """Waits for the background write in flight, if any; its seconds as a metric. A failed write
    raises its CheckpointError here (the previous checkpoint is whole)."""
    if writer is None or not writer.busy:
        return {}
    writer.wait()
    step, seconds = writer.written
    log.info("checkpoint of step %d written in the background (%.1f s)", step, seconds)
    return {"checkpoint/write_s": seconds}


def _written_step(writer: BackgroundWriter | None) -> int | None:
    """After an interruption or a failure: waits for the write in flight; the step the checkpoint
    directory holds if the writer wrote the latest one, None otherwise (a failed write is logged)."""
    if writer is None:
        return None
    try:
        _wait_for_write(writer)
    except CheckpointError as exc:
        log.error("%s", exc)
        return None
    return writer.written[0] if writer.written else None


def step_seed(s: SamplingConfig, step: int, num_prompts: int, shard: slice, rank: int) -> int | list[int] | None:
    """The seed of this rank's generate call at `step`: under sampling.seed_scope=batch one int
    (the engine's sampler is seeded with it before the call; ranks differ), under prompt one per
    prompt of the shard (prompt_seeds); None for unseeded sampling."""
    if s.seed is None:
        return None
    if s.seed_scope == "prompt":
        return prompt_seeds(s.seed, step, num_prompts, s.n)[shard]
    return ((s.seed + step) * 1_000_003 + rank) % 2**31


def prompt_seeds(sampling_seed: int | None, step: int, num_prompts: int, n: int) -> list[int] | None:
    """One sampling seed per prompt of the global batch (vLLM gives completion j seed + j), so
    what a prompt samples depends on the step and its index, not on the batch it shares."""
    if sampling_seed is None:
        return None
    base = (sampling_seed + step) * num_prompts * n
    return [(base + i * n) % 2**31 for i in range(num_prompts)]


def logprobs_due(settings: RunConfig, step: int) -> bool:
    """Whether step `step` asks the engine for sampled-token log-probs: every step with
    trainer.tis_cap (its importance weights need them), else steps 0, K, 2K... of
    sampling.logprobs_every=K (null: 10), which log train/engine_logprob_gap. The loss without
    TIS does not read them, so the other steps train identically, at the engine's full speed."""
    s = settings.sampling
    if not s.logprobs:
        return False
    every = s.logprobs_every or (1 if settings.trainer.tis_cap is not None else 10)
    return step % every == 0


def step_sampling(settings: RunConfig, step: int) -> SamplingConfig:
    """sampling, with log-probs asked for only on the steps `logprobs_due` names."""
    s = settings.sampling
    due = logprobs_due(settings, step)
    return s if due == s.logprobs else replace(s, logprobs=due)


def eval_sampling(settings: RunConfig) -> SamplingConfig:
    """How held-out prompts are sampled: eval.n completions at eval.temperature (greedy by
    default), with the training run's length and stop settings and a fixed seed."""
    s, e = settings.sampling, settings.eval
    return SamplingConfig(name="eval", n=e.n, temperature=e.temperature, max_tokens=s.max_tokens,
                          stop=list(s.stop), seed=s.seed, logprobs=False)


def _eval_shard(task: Task, par: Parallel) -> Batch:
    """This rank's share of the held-out prompts (every world_size-th, so any count splits)."""
    return task.held_out.slice(slice(par.rank, None, par.world_size))


def evaluation_metrics(task: Task, batch: Batch, rollouts: Rollouts, settings: RunConfig,
                       step: int, par: Parallel) -> dict[str, float]:
    """eval/*: the held-out prompts' mean reward (and each function's), the share of prompts
    with a completion reaching eval.pass_reward (pass@n), and the completions' mean length."""
    e = settings.eval
    totals, values = task.score(batch, rollouts.texts, e.n, f"at step {step} (evaluation)")
    lengths = [len(ids) for ids in rollouts.completion_ids]
    passed = [max(totals[i:i + e.n]) >= e.pass_reward for i in range(0, len(totals), e.n)]
    gathered = par.gather((totals, values, lengths, passed))
    totals = [x for g in gathered for x in g[0]]
    values = {name: [v for g in gathered for v in g[1][name]] for name in values}
    lengths = [x for g in gathered for x in g[2]]
    passed = [x for g in gathered for x in g[3]]
    return {"eval/reward/mean": mean(totals), **task.rewards.metrics(values, "eval/reward/"),
            f"eval/pass_at_{e.n}": float(mean(passed)), "eval/mean_length": float(mean(lengths)),
            "eval/prompts": float(len(passed))}


def final_evaluation(step: int, settings: RunConfig, task: Task, switch: Switch,
                     logger: MetricsLogger, par: Parallel) -> None:
    """The held-out evaluation of the trained policy, in a wake of its own; logged as a record
    of its own at `step` (the number of steps trained)."""
    logger.phase("eval")
    batch = _eval_shard(task, par)
    start = time.perf_counter()
    rollouts = switch.generate(batch.prompt_ids, eval_sampling(settings))
    metrics = evaluation_metrics(task, batch, rollouts, settings, step, par)
    metrics["timing/eval_s"] = time.perf_counter() - start
    logger.log(step, metrics, count_step=False)


def sample_rows(step: int, batch: Batch, texts: list[str], rewards: list[float],
                values: dict[str, list], settings: RunConfig) -> list[dict]:
    """The first logger.log_completions completions of the step, each with its prompt, every
    reward function's value, the weighted reward and the GRPO advantage."""
    n, count = settings.sampling.n, settings.logger.log_completions
    advantages = group_advantages(torch.tensor(rewards, dtype=torch.float64), n,
                                  settings.trainer.advantage_norm, std=settings.trainer.advantage_std).tolist()
    prompts, _ = batch.repeated(n)
    return [{"step": step, "prompt": prompts[i], "completion": texts[i], "reward": rewards[i],
             "rewards": {name: vals[i] for name, vals in values.items()},
             "advantage": advantages[i]} for i in range(min(count, len(texts)))]


def train_one_step(step: int, settings: RunConfig, task: Task, trainer: GRPOTrainer, switch: Switch,
                   logger: MetricsLogger, guard: InterruptGuard, done: dict,
                   par: Parallel | None = None) -> None:
    """Sample prompts, generate, score, update, log: one RL step. Under data parallelism every
    rank draws the same global batch and works on its shard; the metrics are reduced. When an
    evaluation is due, the held-out prompts are generated in the same wake as the rollouts."""
    par = par or Parallel.single()
    s, e = settings.sampling, settings.eval
    timer = StepTimer()
    step_start = time.perf_counter()
    global_batch = task.next_batch(settings.trainer.prompts_per_step)
    shard = par.shard(global_batch.prompts)
    batch, seed = global_batch.slice(shard), step_seed(s, step, len(global_batch), shard, par.rank)
    evaluating = task.held_out is not None and step % e.every == 0
    eval_batch = _eval_shard(task, par) if evaluating else None
    logger.phase("generate")
    rollouts = switch.generate(batch.prompt_ids, step_sampling(settings, step), seed=seed, step=step,
                               eval_batch=(eval_batch.prompt_ids, eval_sampling(settings)) if evaluating else None)
    logger.phase("train")
    with timer.phase("score"):
        rewards, values = task.score(batch, rollouts.texts, s.n, f"at step {step}")
        eval_metrics = (evaluation_metrics(task, eval_batch, rollouts.evaluation, settings, step, par)
                        if evaluating else {})
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with guard.deferred():  # an interrupt waits until this step is applied and logged
        with timer.phase("train"):
            train_metrics = trainer.train_step(batch.prompt_ids, rollouts.completion_ids, rewards, s.n,
                                               engine_logprobs=rollouts.logprobs)
        metrics = {**rollouts.metrics, **timer.metrics, **train_metrics, **switch.offloader.background_stats(),
                   "train/trainable_params": float(trainer.trainable_params)}
        metrics.update(perf_metrics(trainer.last_step_flops, timer.metrics["timing/train_s"],
                                    peak_tflops(settings.trainer.peak_tflops, trainer.device)))
        if torch.cuda.is_available():
            metrics["memory/trainer_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        metrics.update(host_metrics(switch.engine.pid))
        step_s = time.perf_counter() - step_start
        switch_s = sum(metrics.get(f"timing/{phase}_s", 0.0) for phase in SWITCH_PHASES)
        metrics.update({
            "timing/step_s": step_s,
            "timing/switch_s": switch_s,
            "timing/switch_overhead_frac": switch_s / step_s,
            "reward/mean": mean(rewards),
            "reward/max": max(rewards),
            "reward/min": min(rewards),
            **task.rewards.metrics(values),
        })
        if par.enabled:
            gathered = par.gather((metrics, rewards))
            metrics = reduce_step_metrics([m for m, _ in gathered], [r for _, r in gathered])
        metrics.update(eval_metrics)
        logger.log(step, metrics)
        if settings.logger.log_completions:
            logger.log_samples(sample_rows(step, batch, rollouts.texts, rewards, values, settings))
        done.update(step=step + 1, sampler=task.sampler.state())
    limit = settings.trainer.max_nonfinite_steps
    if trainer.nonfinite_in_a_row >= limit:
        raise TrainingDiverged(
            f"step {step}: the loss or gradient norm was not finite in {trainer.nonfinite_in_a_row} "
            f"steps in a row (trainer.max_nonfinite_steps={limit}); their updates were skipped, so the "
            "trainer holds the last finite update's state: lower trainer.lr (or trainer.kl_coef, "
            "trainer.max_grad_norm), or look for inf/NaN rewards (task.rewards, task.reward_weights), "
            "before resuming")


@hydra.main(version_base="1.3", config_path=str(package_dir("conf")), config_name="run")
def _hydra_main(cfg: DictConfig) -> float:
    with boundary(debug=bool(cfg.get("debug"))):
        return run(cfg)


def main() -> None:
    """`python -m colo_rl.run [overrides]`: input errors end as one `colo_rl: error:` line."""
    run_cli(_hydra_main, whole_process=True)


if __name__ == "__main__":
    main()
