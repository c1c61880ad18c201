"""The command-line boundary: input errors end as one `colo_rl: error:` block and exit code 2.

An error caused by input (a config key, a file, a model or data set that is not here, a package
that is not installed) is the user's to fix, so a traceback only hides the one line that says
what to do. Everything else is a bug in colo_rl and keeps its full traceback. `HYDRA_FULL_ERROR=1`
or `debug=true` shows the traceback of input errors too.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

from colo_rl.config import ConfigError

EXIT_INPUT_ERROR = 2  # what argparse uses for a bad command line
EXIT_RUN_FAILED = 1  # the run stopped on a failure it reported (engine, reward function, divergence)
_TRUE = {"true", "yes", "on", "1"}
# Hydra's messages carry OmegaConf's object dump; the key is already in ours.
_NOISE = re.compile(r"^\s*(full_key|reference_type|object_type)\s*[:=]")


# Read once at import: run_cli sets the variable itself while Hydra runs.
_FULL_ERROR = os.environ.get("HYDRA_FULL_ERROR", "") == "1"


def debug_requested(argv: Sequence[str]) -> bool:
    """`HYDRA_FULL_ERROR=1` in the user's environment or `debug=true` among the overrides: show
    tracebacks. Read from the command line because composition itself may be what failed."""
    if _FULL_ERROR:
        return True
    for arg in argv:
        key, _, value = arg.lstrip("+~").partition("=")
        if key == "debug" and value.strip().lower() in _TRUE:
            return True
    return False


def input_error_message(exc: BaseException) -> str | None:
    """The `<key or file>: <what is wrong>. <what to do>` text of an input error, or None when
    `exc` is not one (a bug, which keeps its traceback)."""
    if isinstance(exc, ConfigError):
        return str(exc)
    if isinstance(exc, OSError) and _raised_by_hydras_job_setup(exc):
        return (f"hydra.run.dir: cannot create the run's directory {exc.filename} ({exc.strerror}). "
                "Give a directory this user can create (hydra.run.dir=PATH, or hydra.sweep.dir=PATH "
                "in a multirun)")
    if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] != "colo_rl":
        top = exc.name.split(".")[0]
        return (f"{top}: the package is not installed in {sys.executable}'s environment. Install "
                f"it (pip install {top}, or the colo_rl extra that needs it, see README.md)")
    from hydra.errors import (ConfigCompositionException, MissingConfigException,
                              OverrideParseException, SearchPathException)

    if isinstance(exc, MissingConfigException):
        return _missing_config_message(exc)
    if isinstance(exc, OverrideParseException):
        first, *rest = _lines(exc)
        key = _quoted(first) or "command line"
        detail = f" ({rest[0]})" if rest else ""
        return (f"{key}: cannot parse this override{detail}. Write overrides as key=value "
                "(grammar: https://hydra.cc/docs/advanced/override_grammar/basic/)")
    if isinstance(exc, (ConfigCompositionException, SearchPathException)):
        return _moved_key_message(exc) or _composition_message(exc)
    return None


def _raised_by_hydras_job_setup(exc: BaseException) -> bool:
    """Whether `exc` comes from Hydra making the job's output directory (run_job, before any
    colo_rl code runs): the directory the user named is what is wrong."""
    frames = traceback.extract_tb(exc.__traceback__)
    return any(f.name == "run_job" and f.filename.endswith(os.path.join("hydra", "core", "utils.py"))
               for f in frames) and frames[-1].name in ("mkdir", "makedirs")


def _lines(exc: BaseException) -> list[str]:
    text = str(exc)
    cause = exc.__cause__
    if cause is not None and str(cause) and str(cause) not in text:
        text += "\n" + str(cause)
    return [line.strip() for line in text.splitlines() if line.strip() and not _NOISE.match(line)]


def _quoted(line: str) -> str | None:
    match = re.search(r"'([^']+)'", line)
    return match.group(1) if match else None


def _full_key(exc: BaseException) -> str | None:
    for candidate in (exc, exc.__cause__):
        key = getattr(candidate, "full_key", None)
        if key:
            return str(key)
    return None


def _moved_key_message(exc: BaseException) -> str | None:
    """`OLD moved to NEW (docs/config.md)` when composition failed on a key of the old trainer
    layout (colo_rl.config_moves.OLD_KEYS), given on the command line or in a YAML file."""
    from colo_rl.config_moves import moved_message

    lines = _lines(exc)
    override = re.match(r"Could not override '([^']+)'", lines[0] if lines else "")
    keys = [override.group(1) if override else None, _full_key(exc)]
    cause: BaseException | None = exc
    while cause is not None:  # a YAML file's key: OmegaConf's report names it as full_key
        keys += re.findall(r"full_key:\s*(\S+)", str(cause))
        cause = cause.__cause__ or cause.__context__
    for key in keys:
        message = moved_message(key) if key else None
        if message:
            return message
    return None


def _composition_message(exc: BaseException) -> str:
    lines = _lines(exc)
    first = lines[0] if lines else type(exc).__name__
    override = re.match(r"Could not override '([^']+)'", first)
    if override:
        key = override.group(1)
        why = next((line for line in lines[1:] if not line.startswith("To append")), "")
        return (f"{key}: no such key ({why.rstrip('.')}). Check its spelling against "
                "`python -m colo_rl.run --cfg job`")
    merging = re.match(r"Error merging override (\S+)", first)
    if merging:
        key = _full_key(exc) or merging.group(1).split("=")[0]
        why = "; ".join(lines[1:]) or first
        return f"{key}: {why.rstrip('.')}. Give a value of the type the key takes (see conf/)"
    key = _full_key(exc) or _quoted(first) or "config"
    return f"{key}: {'; '.join(lines).rstrip('.')}. Fix the config or the override"


def _missing_config_message(exc: BaseException) -> str:
    # e.g. "In 'run': Could not find 'model/olmo3'" plus "Available options in 'model':" + a list
    lines = _lines(exc)
    missing = next((_quoted(line.split(":", 1)[1]) for line in lines
                    if "Could not find" in line and ":" in line), None) or _quoted(lines[0]) or "config"
    group, _, option = missing.rpartition("/")
    options = [line for line in lines if "/" not in line and ":" not in line and " " not in line]
    if group:
        choices = f"one of {', '.join(options)}" if options else "an existing option"
        return (f"{group}={option}: there is no config {missing}.yaml in the config search path. "
                f"Choose {choices}, or add your own directory with --config-dir DIR "
                f"(README.md: Configuration)")
    return f"{missing}: config not found. Check the name, or add its directory with --config-dir DIR"


def refuse_moved_keys(argv: Sequence[str]) -> None:
    """An override of a key of the old trainer layout (colo_rl.config_moves.OLD_KEYS): its one
    line naming the new key and exit code 2, before seconds of imports. With `debug` the override
    goes on to Hydra, whose error for it carries the same line after its traceback."""
    from colo_rl.config_moves import moved_message

    if debug_requested(argv):
        return
    for arg in argv:
        key = arg.partition("=")[0] if "=" in arg else arg if arg.startswith("~") else ""
        message = moved_message(key) if key and not key.startswith("-") else None
        if message:
            report_error(message)
            raise SystemExit(EXIT_INPUT_ERROR)


def report_error(message: str) -> None:
    print(f"colo_rl: error: {message}", file=sys.stderr, flush=True)


def run_failure(exc: BaseException) -> BaseException | None:
    """For a failure of the run that is not a bug in colo_rl (the engine failed, the user's reward
    function raised, the training diverged or ran out of GPU memory), the exception whose traceback is worth showing
    without `debug` (the reward function's own), or `exc` itself; None for anything else. The
    runner has already logged the checkpoint it wrote and how to resume."""
    from colo_rl.generator import GeneratorError
    from colo_rl.rewards import RewardError
    from colo_rl.trainer import TrainerOutOfMemory, TrainingDiverged

    if isinstance(exc, RewardError):
        return exc.__cause__ or exc
    if isinstance(exc, (GeneratorError, TrainerOutOfMemory, TrainingDiverged)):
        return exc
    return None


class JobFailed(Exception):
    """A sweep job's input error or run failure, already reported on stderr, handed to a sweeper
    that counts failed jobs (Optuna's `hydra.sweeper.max_failure_rate`) as the job's result, so
    that it ends one trial, not the sweep. `code` is the exit code the job would have had."""

    def __init__(self, code: int):
        super().__init__(code)  # args (code,): a launcher that pickles a job's result rebuilds it
        self.code = code

    def __str__(self) -> str:
        return f"the job stopped with exit code {self.code} (its colo_rl: error line is above)"


def _sweeper_counts_failures() -> bool:
    """Inside a multirun job whose sweeper records failed jobs and goes on (Optuna's): Hydra's
    basic sweeper has no such setting and stops at the first failed job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return False
    hc = HydraConfig.get()
    return hc.mode == RunMode.MULTIRUN and "max_failure_rate" in hc.sweeper


def exit_for(exc: BaseException, debug: bool) -> NoReturn:
    """Input errors: the one block (after the traceback with `debug`), exit code 2. A failure of
    the run (`run_failure`): its message, exit code 1, the user's own traceback if any. Anything
    else is a bug: re-raised with its traceback. A sweep that failed on too many jobs
    (`JobFailed`, reported as each job failed): their exit code."""
    if isinstance(exc, JobFailed):
        raise SystemExit(exc.code)
    message = input_error_message(exc)
    if message is None:
        shown = run_failure(exc)
        if shown is None:
            raise exc
        if debug or shown is not exc:
            traceback.print_exception(exc if debug else shown)
        report_error(str(exc))
        raise SystemExit(EXIT_RUN_FAILED)
    if debug:
        traceback.print_exception(exc)
    report_error(message)
    raise SystemExit(EXIT_INPUT_ERROR)


@contextmanager
def boundary(debug: bool = False):
    """Inside a Hydra job: an input error exits here, before Hydra adds its own report
    ("Error executing job with overrides"), and `debug` may come from the composed config. In a
    sweep that counts failed jobs, the job fails (`JobFailed`) instead of the process exiting."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - sorts input errors from bugs, re-raises bugs
        try:
            exit_for(exc, debug or debug_requested(sys.argv[1:]))
        except SystemExit as stop:
            if isinstance(exc, JobFailed) or not _sweeper_counts_failures():
                raise
            raise JobFailed(int(stop.code)) from None


def run_cli(entry: Callable[[], Any], argv: Sequence[str] | None = None, *,
            whole_process: bool = False) -> Any:
    """Run `entry` (a Hydra main or an argparse main) at the command-line boundary.
    `whole_process`: `entry` is all this process does, so it ends when `entry` does, even where
    user code (a reward module) left a thread running that is not a daemon."""
    argv = sys.argv[1:] if argv is None else argv
    # Hydra prints its own trimmed traceback for an error in composition unless
    # HYDRA_FULL_ERROR=1, in which case it re-raises: set it so that the error reaches us.
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        with boundary(debug_requested(argv)):
            result = entry()
    except SystemExit as exc:
        if whole_process:
            end_despite_threads(exc.code if isinstance(exc.code, int) else int(exc.code is not None))
        raise
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
    if whole_process:
        end_despite_threads(0)
    return result


def end_despite_threads(code: int) -> None:
    """Exit with `code` now (exit handlers run, output flushed) when a thread that is not a
    daemon is still running, which the interpreter would otherwise wait for, maybe forever; a
    no-op when there is none."""
    waited_for = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    for thread in waited_for:
        if thread.name.startswith("colo_rl-"):  # colo_rl's own (a checkpoint write) ends: wait
            thread.join()
    stray = [t.name for t in waited_for if t.is_alive()]
    if not stray:
        return
    logging.getLogger("colo_rl").warning(
        "exiting without waiting for %d thread(s) left running (not daemons: %s); a reward "
        "module's own, most likely", len(stray), ", ".join(stray))
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
