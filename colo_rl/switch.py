"""The GPU time-share between the trainer and the sleeping vLLM engine, as one object.

`Switch.generate` runs one engine phase: offload the trainer's state -> stage or share its
weights -> start the engine (first call, or after a failure) -> wake weights -> load and verify
-> reset the prefix cache -> wake the KV cache -> generate (the step's rollouts, then, when
asked, the held-out evaluation's in the same wake) -> sleep -> restore the trainer. It returns
with the trainer's state back where it was, also when a phase fails: the engine is put to sleep
(or its process group killed) first. The engine client (colo_rl.generator.client) only speaks to
the worker; the offloader (colo_rl.trainer.offload) only moves tensors; this module sequences them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from colo_rl.config import SamplingConfig
from colo_rl.generator.client import GeneratorError, Rollouts, VLLMGenerator
from colo_rl.rewards import RewardError
from colo_rl.timing import StepTimer

if TYPE_CHECKING:
    from colo_rl.trainer.offload import Offloader

log = logging.getLogger(__name__)


class _NoOffload:
    """Stands in for the trainer's Offloader when the caller keeps its tensors where they are."""

    def offload(self, parts=()) -> dict:
        return {}

    def restore(self) -> dict:
        return {}

    def fits_beside_engine(self) -> bool:
        return False

    def background_stats(self) -> dict:
        return {}


class Switch:
    """Hands the GPU from the trainer (`model`, its `offloader`: None keeps its tensors where they
    are) to the engine client `engine` for one engine phase, and back."""

    def __init__(self, engine: VLLMGenerator, model: torch.nn.Module, offloader: Offloader | None = None,
                 *, restart_on_failure: bool = False):
        self.engine, self.model = engine, model
        self.offloader = offloader or _NoOffload()
        self.restart_on_failure = restart_on_failure  # generator.restart_on_failure

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, *,
                 seed: int | list[int] | None = None,
                 eval_batch: tuple[list[list[int]], SamplingConfig] | None = None,
                 step: int | None = None, refill=None) -> Rollouts:
        """Push the model's weights, generate `sampling.n` completions per prompt, hand the GPU back.

        `eval_batch`: (prompt ids, sampling) of a second batch generated in the same wake, after
        the first (evaluation), returned as the result's `evaluation`.

        `seed`: one for the whole batch, or one per prompt (a prompt's completions then do not
        depend on what else is in the batch: data-parallel ranks sample what one process would).

        `refill(rollouts, round_index)`: called with each generate call's rollouts (round 0: the
        step's), in the wake; returns (prompt ids, seed) of a further call with `sampling`, or None
        (colo_rl.dynamic_sampling). The result is round 0's rollouts.

        `step`: the training step this wake serves. With `restart_on_failure`, a step whose
        engine phase fails is retried once on a fresh engine (its metrics then carry
        `generator/restarts`); a call without a step (the final evaluation) is not retried.

        On any failure the engine is put to sleep (or its process group killed) before the
        trainer's tensors go back to the GPU; if it cannot be stopped, they stay on the CPU.
        """
        try:
            return self._engine_phase(prompt_ids, sampling, seed, eval_batch, refill)
        except GeneratorError as exc:
            if step is None or not self.restart_on_failure:
                raise
            log.error("step %d: %s; generator.restart_on_failure=true: starting a fresh engine", step, exc)
            rollouts = self._engine_phase(prompt_ids, sampling, seed, eval_batch, refill)
            rollouts.metrics["generator/restarts"] = 1.0
            return rollouts

    def _engine_phase(self, prompt_ids, sampling, seed, eval_batch, refill=None) -> Rollouts:
        """One wake, timed phase by phase; a failure is recovered from (`_recover`) and raised
        as a GeneratorError naming its phase (an interrupt as itself)."""
        timer = StepTimer()
        start = time.perf_counter()
        try:
            result = self._cycle(prompt_ids, sampling, seed, timer, eval_batch, refill)
        except BaseException as exc:
            phase = timer.current or "generate"
            log_path = self.engine.log_path
            if not self._recover():
                state = ("so the trainer's state stays on the CPU" if getattr(self.offloader, "offloaded", None)
                         else "the trainer's state is on its device")
                raise GeneratorError(f"{exc}; the engine could not be stopped, {state}", phase=phase,
                                     log_path=log_path) from exc
            if isinstance(exc, (GeneratorError, RewardError)) or not isinstance(exc, Exception):
                # already names its phase; an interrupt the runner checkpoints on; a reward function
                # that failed scoring a round for `refill` (the task's error, not the engine's)
                raise
            raise GeneratorError(f"{type(exc).__name__}: {exc}", phase=phase, log_path=log_path) from exc
        timer.metrics["timing/generator_total_s"] = time.perf_counter() - start
        m = timer.metrics
        m["timing/wake_s"] = m.get("timing/wake_weights_s", 0.0) + m.get("timing/wake_kv_s", 0.0)
        result.metrics.update(m)
        return result

    def _cycle(self, prompt_ids, sampling, seed, timer: StepTimer, eval_batch=None, refill=None) -> Rollouts:
        engine, offloader, model = self.engine, self.offloader, self.model
        m = timer.metrics
        timer.memory("trainer_step")
        if not engine.running:  # first step, or restart_on_failure
            with timer.phase("server_start"):
                engine.ensure_started(model)
            engine.take_start_seconds()  # in this step's server_start phase already
            timer.memory("server_start")
        else:
            started = engine.take_start_seconds()  # started by ensure_started() during set-up
            if started is not None:
                m["timing/server_start_s"] = started
        if engine.weight_sync == "cuda_ipc":
            with timer.phase("offload"):
                offloader.offload(("optimizer",))
            with timer.phase("wake_weights"):
                engine.wake(["weights"])
            with timer.phase("weight_load"):
                stats = engine.load_ipc(model)
            with timer.phase("offload"):
                offloader.offload(("params",))
        else:
            with timer.phase("offload"):
                offloader.offload(("optimizer", "params"))
            timer.memory("offload")
            with timer.phase("stage"):
                path, fingerprint = engine.stage(model)
            try:
                with timer.phase("wake_weights"):
                    engine.wake(["weights"])
                with timer.phase("weight_load"):
                    stats = engine.load_file(path, fingerprint)
            finally:
                path.unlink(missing_ok=True)
        with timer.phase("weight_load"):
            engine.reset_prefix_cache()
        m.update({f"sync/{k}": float(v) for k, v in stats.items()})
        timer.memory("wake_weights")
        with timer.phase("wake_kv"):
            engine.wake(["kv_cache"])
        timer.memory("wake_kv")
        with timer.phase("generate"):
            result = engine.generate(prompt_ids, sampling, seed)
            latest, round_index = result, 0
            while refill is not None and (request := refill(latest, round_index)) is not None:
                latest, round_index = engine.generate(request[0], sampling, request[1]), round_index + 1
        # llm.generate alone, and the garbage collector's pauses of the engine's process inside it
        m.update(result.metrics)
        evaluation = None
        if eval_batch is not None:
            eval_ids, eval_sampling = eval_batch
            with timer.phase("eval"):
                evaluation = engine.generate(eval_ids, eval_sampling, eval_sampling.seed)
            evaluation.metrics = _count_tokens(evaluation, {})
        # trainer.memory.restore_while_awake: with room for both, the trainer's copies run before the
        # engine frees its memory, not in the contended second after its sleep
        restore_awake = offloader.fits_beside_engine()
        if restore_awake:
            try:
                with timer.phase("restore"):
                    offloader.restore()
            except torch.OutOfMemoryError as exc:  # the offloader put everything back on the host
                log.warning("restoring beside the awake engine ran out of GPU memory (%s); restoring "
                            "after its sleep instead", str(exc).splitlines()[0])
                restore_awake = False
        with timer.phase("sleep"):
            slept = engine.sleep()
        timer.memory("sleep")  # restored awake: this reading includes the trainer's state, back already
        if not restore_awake:
            with timer.phase("restore"):
                offloader.restore()
        timer.memory("restore")
        m["generator/sleep_skipped"] = float(slept["skipped"])
        m["generator/restored_awake"] = float(restore_awake)
        result.metrics = _count_tokens(result, m)
        result.evaluation = evaluation
        return result

    def _recover(self) -> bool:
        """Free the GPU from the engine (sleep, else kill its group), then restore the trainer.

        Returns False when the engine could not be stopped; the trainer then stays on the CPU.
        """
        released = False
        if self.engine.running:
            try:
                self.engine.sleep(timeout=60)
                released = True
            except GeneratorError as exc:
                log.warning("engine did not go to sleep after a failure (%s); killing it", exc)
        if not released:
            released = self.engine.kill()
        if released:
            self.offloader.restore()
        return released


def _count_tokens(rollouts: Rollouts, metrics: dict) -> dict:
    """`metrics` with the rollouts' token count, mean length and tokens per second of generate."""
    lengths = [len(ids) for ids in rollouts.completion_ids]
    generated = sum(lengths)
    metrics.update({"rollout/tokens": float(generated),
                    "rollout/mean_length": generated / max(1, len(lengths)),
                    "rollout/tokens_per_s": generated / max(metrics.get("timing/generate_s", 0), 1e-9)})
    return metrics
