"""colo_rl's entry point: `python -m colo_rl.run [overrides]` (Hydra), and the run as a recipe.

`Run` reads top to bottom: `setup()` checks the config and builds the parts (task, memory plan,
engine, trainer, the switch between them, logger, rollout, checkpoint policy); `train()` is the
step loop (rollout through the switch -> GRPO update -> log -> checkpoint); `report()` the end.
`train(cfg)` works without `@hydra.main` (tests call it through Hydra's compose API).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # torch, transformers and the rest take seconds to import: say so first
    from colo_rl.cli import refuse_moved_keys

    refuse_moved_keys(sys.argv[1:])  # a key of the old trainer layout: its new place, at once
    print("colo_rl: starting (importing torch, transformers, Hydra)", flush=True)  # stderr: errors only
    # ...and start the engine's worker first: it imports vLLM while this process imports torch
    from colo_rl.generator.process import prespawn

    prespawn(sys.argv[1:])

import logging
import signal
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from colo_rl.checkpoint_policy import CheckpointPolicy
from colo_rl.cli import boundary, run_cli
from colo_rl.config import ConfigError, RunConfig, package_dir, register_configs, resolve_device, trainer_precision, validate
from colo_rl.export import check_export_target, export_checkpoint, export_target
from colo_rl.generator import VLLMGenerator
from colo_rl.generator.client import shared_model_dir, vllm_cache_root
from colo_rl.generator.process import check_engine_settings
from colo_rl.generator.process import check_engine_settings
from colo_rl.lora import check_targets, load_trainer_policy
from colo_rl.metrics import MetricsLogger, print_summary, step_metrics
from colo_rl.models import DTYPES, load_tokenizer, prepare_model_dir
from colo_rl.parallel import Parallel, reduce_step_metrics
from colo_rl.planner import Plan
from colo_rl.resolve import resolve_settings
from colo_rl.rollout import SingleTurnRollout, final_evaluation, sample_rows
from colo_rl.rundir import RunDirLock, claim
from colo_rl.signals import InterruptGuard, engine_killer
from colo_rl.sweep import objective
from colo_rl.switch import Switch
from colo_rl.tasks import Task
from colo_rl.timing import SetupStages, engine_log_status
from colo_rl.trainer.algorithms import check_algorithm
from colo_rl.trainer import GRPOTrainer, Offloader, TrainingDiverged, load_checkpoint
from colo_rl.trainer.checkpoint import check_compatible, verify_checkpoint

log = logging.getLogger("colo_rl")
register_configs()


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


@dataclass
class Components:
    """What set-up built, for the loop."""

    task: Task
    plan: Plan
    engine: VLLMGenerator
    trainer: GRPOTrainer
    switch: Switch
    logger: MetricsLogger
    rollout: SingleTurnRollout
    checkpoints: CheckpointPolicy
    start_step: int


def run(cfg: DictConfig, generator: VLLMGenerator | None = None) -> float:
    """Train for `trainer.steps` steps; returns the sweep objective (colo_rl.sweep.objective: the
    final held-out eval/reward/mean, to maximize)."""
    return objective(train(cfg, generator).records)


def train(cfg: DictConfig, generator: VLLMGenerator | None = None) -> RunResult:
    """The whole run. `generator`: an already started engine for the same model (tests share
    one); by default the run starts and closes its own."""
    return Run(cfg, generator).execute()


class Run:
    """One training run: `setup()` builds, `train()` is the loop, `report()` the end. `generator`:
    an already started engine for the same model; None: the run starts and closes its own."""

    def __init__(self, cfg: DictConfig, generator: VLLMGenerator | None = None):
        self.cfg = cfg
        self.stages = SetupStages()
        self.validated = self.settings = settings = validate(cfg)
        check_algorithm(settings)
        self.stages.mark("config", "config checked")
        if settings.model.source != cfg.model.source:
            log.warning("model.path=%s is set, so model.source=hf: training that model, not the "
                        "embedded one", settings.model.path)
        hydra_dir, self.group, self.name = _hydra_run_info()
        output_dir = Path(settings.output_dir) if settings.output_dir else hydra_dir
        if output_dir is None:
            raise ValueError("output_dir is unset and Hydra is not running: pass output_dir=PATH")
        self.output_dir = output_dir
        self.engine = generator
        self.owns_engine = generator is None
        self.guard = InterruptGuard()
        self.closing = ExitStack()  # the signal handlers and the logger, left in reverse order

    def execute(self) -> RunResult:
        """set-up, the loop, the export and the report; the run directory held throughout."""
        t = self.settings.trainer
        # everything that can fail on bad input fails in set-up, before any engine starts
        self.par = par = Parallel.from_torchrun(t.parallel, resolve_device(t.device))
        try:
            # rank 0's directory is every rank's (broadcast in setup); rank 0 holds it
            with RunDirLock(self.output_dir) if par.is_main else nullcontext():
                with self.closing:
                    parts = self.setup()
                    self.train(parts)
                if t.checkpoint.export and par.is_main:
                    self.export()
                return self.report(parts)
        finally:
            par.close()

    # -- set-up -----------------------------------------------------------------------------
    def setup(self) -> Components:
        """Checks what can be checked before any engine starts, then starts the engine and
        builds the trainer beside it, then the logger, the switch and the loop's parts."""
        settings, par, stages = self.settings, self.par, self.stages
        task, plan, model_dir = self._prepare()
        engine = self._engine(model_dir)
        self.guard.kill_engine = engine_killer(engine if self.owns_engine else None)
        self.closing.enter_context(self.guard.installed())
        trainer, offloader, start_step = self._start(engine, model_dir, task, plan)
        logger = self.closing.enter_context(self._logger(start_step))
        stages.mark("logger", f"logging to {logger.path}" + (" and a W&B run" if logger.run else ""))
        logger.add_to_next({**stages.finish(), **task.setup_metrics, **plan.metrics()})
        switch = Switch(engine, trainer.model, offloader, restart_on_failure=settings.generator.restart_on_failure)
        describe = {"config": self.composed, "model_dir": model_dir}
        checkpoints = CheckpointPolicy(settings.trainer, par, self.output_dir / "checkpoint", trainer, describe,
                                       start_step)
        rollout = SingleTurnRollout(settings, task, switch, logger, par)
        return Components(task, plan, engine, trainer, switch, logger, rollout, checkpoints, start_step)

    def _prepare(self) -> tuple[Task, Plan, Path]:
        """The run directory, the model files, the tokenizer, the task and the memory plan: every
        check of the input that needs no engine."""
        settings, par, stages = self.settings, self.par, self.stages
        t, s = settings.trainer, settings.sampling
        self.composed = OmegaConf.to_container(self.cfg, resolve=True)
        if t.checkpoint.resume:  # before any model is built: a config the checkpoint does not fit stops here
            check_compatible(t.checkpoint.resume, self.composed)
        if par.is_main:  # nothing the user has is replaced: another run's checkpoint, an export target
            claim(self.output_dir, self.cfg, t.checkpoint.resume, settings.overwrite_output_dir)
            if t.checkpoint.export:
                check_export_target(t.checkpoint.export_dir, self.output_dir, t.checkpoint.resume)
        self.device = device = par.device(resolve_device(t.device))
        par.shard(range(t.prompts_per_step))  # fails now, naming the key, if they do not split
        # every rank writes into rank 0's directory (Hydra names one per process, by the clock)
        self.output_dir = output_dir = Path(par.broadcast(str(self.output_dir)))
        model_dir = Path(par.broadcast(str(prepare_model_dir(settings.model, output_dir))
                                       if par.is_main else None))
        self.tokenizer = load_tokenizer(settings.model, model_dir)
        stages.mark("tokenizer", f"model files in {model_dir}, tokenizer of {len(self.tokenizer)} tokens")
        task = Task.setup(settings, self.tokenizer)  # data, prompt lengths, rewards: before any engine
        stages.mark("task", f"task {settings.task.name} ready: {len(task.train)} training prompts")
        # Every auto decided, once, into frozen settings the rest of the run reads: among them the
        # memory plan's, which refuses a config whose trainer or engine cannot fit, before anything is built.
        self.resolved = resolve_settings(settings, model_dir=model_dir, device=device, task=task)
        self.settings = settings = self.resolved.settings
        plan = self.resolved.plan
        check_engine_settings(settings.generator, model_dir, resolve_device(settings.generator.device) == "cpu")
        if par.is_main:
            print(plan.table(), self.resolved.table(), sep="\n", flush=True)
            self.resolved.write(output_dir)
        if t.lora.rank > 0:  # LoRA's target modules against the model's linear layers
            check_targets(model_dir, t.lora, settings.model.trust_remote_code)
        if t.checkpoint.resume:  # its files' checksums and step count too, before the engine is spawned: a
            # damaged checkpoint or one with no steps left to do stops here
            done_steps = verify_checkpoint(t.checkpoint.resume).get("step", 0)
            if done_steps >= t.steps:
                raise ConfigError(f"trainer.checkpoint.resume={t.checkpoint.resume} holds a run that already did {done_steps} "
                                  f"steps, so trainer.steps={t.steps} leaves none to do: raise trainer.steps "
                                  f"above {done_steps}")
        if s.n == 1:
            log.warning("sampling.n=1: every GRPO advantage is zero, so this run measures generation "
                        "and switching only; use sampling=default to learn")
        return task, plan, model_dir

    def _engine(self, model_dir: Path) -> VLLMGenerator:
        """The engine the run was given, or a new one (not started yet)."""
        settings, par = self.settings, self.par
        if not self.owns_engine:
            return self.engine
        engine_model_dir = model_dir
        if settings.model.source == "embedded":  # one path per shape: see shared_model_dir
            try:
                engine_model_dir = shared_model_dir(model_dir, vllm_cache_root(settings.generator))
            except OSError as exc:
                log.warning("the engine reads the model files from %s, so vLLM's compile cache is not "
                            "shared with other runs of this shape (%s; see generator.cache_dir)", model_dir, exc)
        self.engine = VLLMGenerator(
            settings.generator, model_dir=engine_model_dir, dtype=settings.model.dtype, log_dir=self.output_dir,
            seed=settings.trainer.seed, trust_remote_code=settings.model.trust_remote_code,
            tokenizer=settings.model.tokenizer,
            log_name=f"engine_rank{par.rank}.log" if par.enabled else "engine.log",
            gpu=par.engine_gpu() if self.device.startswith("cuda") else None)
        return self.engine

    def _start(self, generator: VLLMGenerator, model_dir: Path, task: Task,
               plan: Plan) -> tuple[GRPOTrainer, Offloader, int]:
        """The engine starts first, in the background, and the trainer is built while vLLM loads and
        compiles; they meet at the engine's weight mapping check and then the first weight push.
        On CUDA the trainer allocates no GPU memory until the engine has started and gone to
        sleep: vLLM sizes its KV cache (generator.gpu_memory_utilization) from the free memory it
        profiles while it starts, and trainer allocations inside that window would shrink it or
        fail its profiling check. There the window reads a pretrained policy into host memory, and
        the policy moves (random init: is built) on the GPU once the engine is asleep. On CPU the
        whole trainer is built in the window. A failure or a signal here stops the engine."""
        try:
            return self._start_beside_engine(generator, model_dir, task, plan)
        except KeyboardInterrupt as exc:
            if self.owns_engine:
                generator.abandon_start()
            log.error("%s during set-up: the engine was stopped, no step ran", exc)
            raise SystemExit(128 + getattr(exc, "signum", signal.SIGINT)) from None
        except BaseException:
            if self.owns_engine:
                generator.abandon_start()  # the error itself is what the user needs to see
            raise

    def _start_beside_engine(self, generator: VLLMGenerator, model_dir: Path, task: Task,
                             plan: Plan) -> tuple[GRPOTrainer, Offloader, int]:
        settings, stages, device = self.settings, self.stages, self.device
        t = settings.trainer
        on_cuda = device.startswith("cuda")
        early_device = "cpu" if on_cuda else device
        policy = trainer = offloader = None
        start_step = 0
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
            trainer, offloader, start_step = _build_trainer(settings, policy, device, self.par, self.tokenizer,
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
            trainer, offloader, start_step = _build_trainer(settings, policy.to(device), device, self.par,
                                                            self.tokenizer, task, stages)
            if plan.engine_wake_bytes:  # trainer.memory.keep_cache: the cache stays where the engine wakes beside it
                offloader.keep_cache_if_free = int(plan.engine_wake_bytes)
        with engine_log_status("engine starting", generator.log_path):
            generator.ensure_started(trainer.model)  # the weight mapping; a full start if none ran
        if not stages.metrics.get("setup/engine_s"):
            stages.mark("engine", "engine ready")
        else:
            stages.mark("engine_check", "the engine's weight mapping checked against the policy")
        return trainer, offloader, start_step

    def _logger(self, start_step: int) -> MetricsLogger:
        """The metrics logger; the W&B config is the resolved settings (what ran, every auto decided)."""
        settings = self.settings
        return MetricsLogger(settings.logger, output_dir=self.output_dir, config=self.resolved.config(),
                             group=self.group,
                             name=self.name, total_steps=settings.trainer.steps, initial_step=start_step,
                             enabled=self.par.is_main)

    # -- the loop ---------------------------------------------------------------------------
    def train(self, p: Components) -> None:
        """The steps, then the held-out evaluation and the final checkpoint; on an interruption or
        a failure, a checkpoint of the last applied step (when the trainer's state is intact) and
        the engine closed."""
        t = self.settings.trainer
        # what a checkpoint holds: steps fully applied and logged, and the prompt sampler's position
        # before the next step, so a resumed run draws the same prompts as an uninterrupted one
        done = {"step": p.start_step, "sampler": p.task.sampler.state()}
        try:
            for step in range(p.start_step, t.steps):
                self.step(step, p, done)
                p.logger.add_to_next(p.checkpoints.after_step(done))
            if p.task.held_out is not None:
                final_evaluation(t.steps, self.settings, p.task, p.switch, p.logger, self.par)
            p.checkpoints.finish(done, p.engine.close if self.owns_engine else None)
        except KeyboardInterrupt as exc:
            # The switch has put the engine to sleep and restored the trainer before this.
            self.guard.shutting_down(self.guard.kill_engine)
            p.checkpoints.on_interrupt(done, exc)
            if self.owns_engine:
                p.engine.close()
            raise SystemExit(128 + getattr(exc, "signum", signal.SIGINT)) from exc
        except BaseException as exc:
            self.guard.shutting_down(self.guard.kill_engine)
            if self.owns_engine and p.engine.process is not None:
                p.engine.process.close()  # the error itself is what the user needs to see
            p.checkpoints.on_failure(done, exc, intact=not self.guard.update_failed)
            raise

    def step(self, step: int, p: Components, done: dict) -> None:
        """One RL step: the rollout (generate through the switch, score), the update, the record.
        Under data parallelism the metrics are reduced over the ranks."""
        settings, par = self.settings, self.par
        r = p.rollout.collect(step)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        with self.guard.deferred():  # an interrupt waits until this step is applied and logged
            with r.timer.phase("train"):
                train_metrics = p.trainer.train_step(
                    r.batch.prompt_ids, r.rollouts.completion_ids, r.rewards, settings.sampling.n,
                    engine_logprobs=r.rollouts.logprobs,
                    truncated=[reason == "length" for reason in r.rollouts.finish_reasons])
            metrics = step_metrics(r, train_metrics, p.trainer, p.switch, settings.trainer.perf.peak_tflops,
                                   p.task.rewards.metrics(r.values))
            if par.enabled:
                gathered = par.gather((metrics, r.rewards))
                metrics = reduce_step_metrics([m for m, _ in gathered], [x for _, x in gathered])
            metrics.update(r.eval_metrics)
            p.logger.log(step, metrics)
            if settings.logger.log_completions:
                p.logger.log_samples(sample_rows(step, r.batch, r.rollouts.texts, r.rewards, r.values, settings,
                                                 r.rollouts.completion_ids))
            done.update(step=step + 1, sampler=p.task.sampler.state())
        _check_finite(p.trainer, step, settings.trainer.optim.max_nonfinite_steps)

    # -- the end ----------------------------------------------------------------------------
    def export(self) -> None:
        """trainer.checkpoint.export: the final checkpoint as a Hugging Face model directory."""
        t = self.settings.trainer
        export_checkpoint(self.output_dir / "checkpoint", export_target(t.checkpoint.export_dir, self.output_dir))

    def report(self, p: Components) -> RunResult:
        """The summary table, and what the run returns."""
        logger = p.logger
        if self.par.is_main:
            print_summary(logger.records, self.output_dir)
        steps = [r for r in logger.records if "reward/mean" in r]  # not the final evaluation's record
        tail = steps[-max(1, min(5, len(steps))):]
        return RunResult(self.output_dir, logger.records,
                         mean(r["reward/mean"] for r in tail) if tail else float("nan"),
                         logger.final_summary, logger.final_config)


def _check_finite(trainer: GRPOTrainer, step: int, limit: int) -> None:
    """Stops the run after trainer.optim.max_nonfinite_steps skipped updates in a row."""
    if trainer.nonfinite_in_a_row >= limit:
        raise TrainingDiverged(
            f"step {step}: the loss or gradient norm was not finite in {trainer.nonfinite_in_a_row} "
            f"steps in a row (trainer.optim.max_nonfinite_steps={limit}); their updates were skipped, so the "
            "trainer holds the last finite update's state: lower trainer.lr (or trainer.algo.kl_coef, "
            "trainer.optim.max_grad_norm), or look for inf/NaN rewards (task.rewards, task.reward_weights), "
            "before resuming")


def _build_trainer(settings: RunConfig, policy: torch.nn.Module, device: str, par: Parallel, tokenizer,
                   task: Task, stages: SetupStages) -> tuple[GRPOTrainer, Offloader, int]:
    """The trainer around `policy` (already on `device`): optimizer, reference model, offloader,
    and the resumed checkpoint's state; returns them with the step to start from."""
    t, s = settings.trainer, settings.sampling
    mixed = trainer_precision(settings) == "mixed"
    trainer = GRPOTrainer(policy, t, pad_token_id=tokenizer.pad_token_id,
                          temperature=s.temperature, max_tokens=s.max_tokens, device=device,
                          parallel=par, autocast_dtype=DTYPES[settings.model.dtype] if mixed else None)
    offloader = Offloader(policy, trainer.optimizer, t.memory.offload, overlap_restore=t.memory.overlap_restore,
                          restore_while_awake=t.memory.restore_while_awake)
    stages.mark("policy", f"policy of {sum(p.numel() for p in policy.parameters()) / 1e6:.2f} M parameters "
                          f"on {device} in {str(next(policy.parameters()).dtype).removeprefix('torch.')}, "
                          f"{t.optim.name} optimizer" + (", Liger's kernels" if trainer.kernels == "liger" else "")
                          + (f", computing in {settings.model.dtype} throughout" if trainer.copies == "all" else ""))
    start_step = 0
    if t.checkpoint.resume:
        # its config, checksums and step count were checked before the engine was spawned
        extra = load_checkpoint(t.checkpoint.resume, trainer, verified=True)
        task.sampler.load_state(extra["sampler"])
        start_step = extra["step"]
        stages.mark("resume", f"resumed from {t.checkpoint.resume} after {start_step} steps")
    return trainer, offloader, start_step


@hydra.main(version_base="1.3", config_path=str(package_dir("conf")), config_name="run")
def _hydra_main(cfg: DictConfig) -> float:
    with boundary(debug=bool(cfg.get("debug"))):
        return run(cfg)


def main() -> None:
    """`python -m colo_rl.run [overrides]`: input errors end as one `colo_rl: error:` line."""
    run_cli(_hydra_main, whole_process=True)


if __name__ == "__main__":
    main()
