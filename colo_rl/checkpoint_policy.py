"""The run's checkpoint policy, in one object: every trainer.checkpoint.every steps, the final one
(beside the engine's close), in the background from host copies (trainer.checkpoint.background),
and after an interruption or a failure (when the trainer's state is whole)."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from colo_rl.config import TrainerConfig
from colo_rl.parallel import Parallel
from colo_rl.trainer.checkpoint import BackgroundWriter, CheckpointError, save_checkpoint

log = logging.getLogger("colo_rl")


class CheckpointPolicy:
    """When the run writes checkpoints and what it does with a write in flight. `done` (the
    loop's) is what a checkpoint holds: the steps fully applied and logged, and the prompt
    sampler's position before the next step."""

    def __init__(self, t: TrainerConfig, par: Parallel, directory: Path, trainer, describe: dict,
                 start_step: int):
        self.t, self.par, self.directory, self.trainer, self.describe = t, par, directory, trainer, describe
        self.start_step = start_step
        # trainer.checkpoint.background: checkpoints are written on a thread from a host copy;
        # whatever writes or ends next waits for the write in flight first
        self.writer = BackgroundWriter() if t.checkpoint.background else None
        self.checkpointed = None  # the step of the last periodic checkpoint

    def after_step(self, done: dict) -> dict[str, float]:
        """The periodic checkpoint, when one is due; its metrics for the next record."""
        if not (self.t.checkpoint.every and done["step"] % self.t.checkpoint.every == 0):
            return {}
        written = _wait_for_write(self.writer)
        stall = _checkpoint(self.par, self.directory, self.trainer, done, self.describe, self.writer)
        self.checkpointed = done["step"]
        return {**written, "checkpoint/stall_s": stall}

    def finish(self, done: dict, close_engine: Callable[[], None] | None) -> None:
        """All steps done: the engine closed (`close_engine`, None when the run does not own it)
        and the final checkpoint written. The engine first: the checkpoint does not need it, and
        if writing fails none is left. In the background, the final checkpoint is written while
        the engine closes. A periodic checkpoint of the last step is the final one: it is not
        written twice."""
        t, par, directory, writer = self.t, self.par, self.directory, self.writer
        final = t.checkpoint.final and self.checkpointed != done["step"]
        background = final and writer is not None
        if t.checkpoint.final and not final:
            log.info("the checkpoint of step %d (trainer.checkpoint.every) is the final one", done["step"])
        start = time.perf_counter()
        if background:
            _wait_for_write(writer)
            _checkpoint(par, directory, self.trainer, done, self.describe, writer)
        log.info("all %d steps done: closing the engine%s", t.steps,
                 ", then writing the final checkpoint" if final and not background else
                 " while the final checkpoint is written" if background else "")
        if close_engine is not None:
            closing = time.perf_counter()
            close_engine()
            log.info("engine closed (%.1f s)", time.perf_counter() - closing)
        if final and not background:
            start = time.perf_counter()
            _checkpoint(par, directory, self.trainer, done, self.describe)
        else:
            _wait_for_write(writer)  # the final write beside the close, or a periodic one still in flight
        if final:
            log.info("final checkpoint of step %d written to %s (%.1f s%s)", done["step"], directory,
                     time.perf_counter() - start, ", beside the engine's close" if background else "")

    def on_interrupt(self, done: dict, exc: BaseException) -> None:
        """SIGINT/SIGTERM between updates: the last applied step checkpointed (unless the write
        in flight already holds it)."""
        written = _written_step(self.writer)
        if self.par.mode == "fsdp":  # gathering shards needs every rank, and some may be gone
            log.error("interrupted after %d steps (%s); trainer.parallel=fsdp writes no "
                      "checkpoint on interruption", done["step"], exc)
        elif self.par.is_main:
            if written != done["step"]:
                _save(self.directory, self.trainer, done, self.describe)
            log.error("interrupted after %d steps (%s); checkpoint written to %s; resume with "
                      "trainer.checkpoint.resume=%s", done["step"], exc, self.directory, self.directory)

    def on_failure(self, done: dict, exc: BaseException, *, intact: bool) -> None:
        """A failure: what it left intact written, and how to go on from it said."""
        _written_step(self.writer)
        if self.par.is_main:
            _checkpoint_after_failure(exc, self.par, self.directory, self.trainer, done, self.start_step,
                                      self.describe, intact=intact, resumed_from=self.t.checkpoint.resume)


def _checkpoint_after_failure(exc: BaseException, par: Parallel, directory: Path,
                              trainer, done: dict, start_step: int, describe: dict, *,
                              intact: bool, resumed_from: str | None) -> None:
    """Write what the failure left intact and say how to go on from it."""
    what = f"{type(exc).__name__} after {done['step']} steps"
    earlier = (f"trainer.checkpoint.resume={resumed_from} still holds step {start_step}" if resumed_from
               else "a run without trainer.checkpoint.resume starts it again")
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
                  "trainer.checkpoint.resume=%s", what, done["step"], path, directory)


def _save(directory: Path, trainer, done: dict, describe: dict,
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
                              f"and resume from it with trainer.checkpoint.resume={directory}") from None


def _checkpoint(par: Parallel, directory: Path, trainer, done: dict, describe: dict,
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
