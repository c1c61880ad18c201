"""SIGINT/SIGTERM during a run: turned into exceptions the loop handles (checkpoint, close the
engine, exit non-zero), deferred while a step's update is applied, and a second signal ends the
process at once."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from typing import Callable


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


def engine_killer(generator) -> Callable[[], None]:
    """What a second signal runs first: the engine's process group killed (None: not this run's engine)."""
    def kill() -> None:
        if generator is not None and generator.process is not None:
            generator.process.kill_now()
    return kill
