"""The engine worker's process, light enough to start before torch is imported.

`EngineProcess` owns the worker subprocess (`python -m colo_rl.generator.worker`, in its own process
group) and its private, authenticated control socket; `colo_rl.generator.client.VLLMGenerator`
speaks to the engine through it. `prespawn` starts a worker as the command starts, so that the
worker imports vLLM while the trainer's process imports torch and transformers: the run's
generator adopts it when its settings allow, and closes it otherwise. This module imports
neither torch nor vLLM.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from glob import glob
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from pathlib import Path

import psutil

import colo_rl
from colo_rl.generator.channel import read_deadline

log = logging.getLogger(__name__)

SOCKET_DIR_PREFIX = "colo_rl-"  # tempfile.gettempdir()/colo_rl-PID-XXXX: the worker's socket and authkey
# Read as a process starts (the loader, Python, the CUDA driver): a worker spawned with other
# values cannot be given the run's. Every other variable vLLM reads when its engine starts, so a
# prespawned worker gets the run's values of those in its start request (`env_changes`).
PROCESS_START_ENV = ("CUDA_VISIBLE_DEVICES", "PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "LD_PRELOAD", "PATH")
CONNECT_TIMEOUT_S = 60.0  # a worker answers its handshake before it imports vLLM: seconds at most


class GeneratorError(RuntimeError):
    """The engine failed; the message names the phase and the engine's log."""

    def __init__(self, message: str, *, phase: str | None = None, log_path: Path | None = None):
        where = f" during {phase}" if phase else ""
        tail = f" (engine log: {log_path})" if log_path else ""
        super().__init__(f"generator failed{where}: {message}{tail}")
        self.phase = phase
        self.log_path = log_path


def _tail(path: Path, lines: int = 15) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of process group `pgid`."""
    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


class EngineProcess:
    """A worker subprocess in its own process group, reached over an authenticated AF_UNIX socket."""

    def __init__(self, python: str, log_path: Path, env: dict[str, str]):
        self.python, self.log_path, self.env = python, log_path, env
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.socket_dir: str | None = None
        self.early_log: Path | None = None
        self._socket_path: str | None = None
        self._authkey = b""
        self._next_id = 0
        self._broken = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self, connect_timeout: float) -> None:
        self.launch()
        self.connect(connect_timeout)

    def launch(self, early_log: Path | None = None) -> None:
        """Start the worker without waiting for it. Its output goes to `log_path`, or to
        `early_log` until the start request names the run's log: a worker spawned before the
        run's directory is known (`prespawn`), which imports vLLM as soon as it is connected."""
        remove_stale_socket_dirs()
        remove_stale_staged_files()
        # mode 0700; the pid in the name lets a later run find the directory if this one dies
        self.socket_dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
        self._socket_path = os.path.join(self.socket_dir, "control.sock")
        self._authkey = os.urandom(32)
        config_path = os.path.join(self.socket_dir, "worker.json")
        fd = os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"socket": self._socket_path, "authkey": self._authkey.hex(), "parent_pid": os.getpid(),
                       "parent_start_ticks": start_ticks(os.getpid()),
                       "early_log": str(early_log) if early_log else None,
                       "import_vllm": early_log is not None}, f)
        self.early_log = early_log
        output = early_log or self.log_path
        output.parent.mkdir(parents=True, exist_ok=True)
        with open(output, "ab") as log_file:
            self.proc = subprocess.Popen(
                [self.python, "-m", "colo_rl.generator.worker", config_path],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True)

    def connect(self, timeout: float) -> None:
        """Connect to the worker `launch` started (within `timeout`), once."""
        if self.conn is None:
            self.conn = self._connect(self._socket_path, self._authkey, timeout)

    def _connect(self, socket_path: str, authkey: bytes, timeout: float) -> Connection:
        """Connect and authenticate, all within `timeout` (generator.start_timeout_s): a worker
        that accepts but never answers the handshake ends in an error, not a wait forever."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._raise_if_dead("connect")
            if os.path.exists(socket_path):
                try:
                    conn = Client(socket_path, family="AF_UNIX")  # no authkey: the handshake is below
                except (ConnectionRefusedError, FileNotFoundError):
                    conn = None  # the listener is not accepting yet
                if conn is not None:
                    try:
                        with read_deadline(conn, max(0.1, deadline - time.monotonic())):
                            answer_challenge(conn, authkey)
                            deliver_challenge(conn, authkey)
                    except (OSError, EOFError, AuthenticationError) as exc:
                        conn.close()
                        self._raise_if_dead("connect")
                        raise GeneratorError(
                            f"the worker's control socket did not complete the handshake within "
                            f"generator.start_timeout_s={timeout:.0f} s ({type(exc).__name__}: {exc})",
                            phase="connect", log_path=self.log_path) from None
                    return conn
            time.sleep(0.05)
        raise GeneratorError(f"worker did not open its control socket within {timeout:.0f} s",
                             phase="connect", log_path=self.log_path)

    def tail(self) -> str:
        """The last lines the worker wrote: its early log's until it moves to the run's log."""
        return _tail(self.log_path) or (_tail(self.early_log) if self.early_log else "")

    def _raise_if_dead(self, op: str) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise GeneratorError(f"engine worker exited with code {self.proc.returncode} while "
                                 f"handling '{op}'; last log lines:\n{self.tail()}",
                                 phase=op, log_path=self.log_path)

    def send(self, op: str, **args) -> int:
        """Send a request without waiting; returns its id."""
        if self._broken:
            raise GeneratorError("the control connection was interrupted in the middle of a message "
                                 "earlier, so its framing is lost", phase=op, log_path=self.log_path)
        self._next_id += 1
        with self._whole_message():
            self.conn.send({"id": self._next_id, "op": op, "args": args})
        return self._next_id

    @contextmanager
    def _whole_message(self):
        """An interrupt (SIGINT/SIGTERM raised as an exception) can land between the reads or
        writes of one message; the stream is then unusable, and marked so."""
        try:
            yield
        except BaseException:
            self._broken = True
            raise

    def request(self, op: str, timeout: float, **args):
        """Send a request and wait for its reply; replies to earlier requests are discarded."""
        return self.reply(self.send(op, **args), op, time.monotonic() + timeout, timeout)

    def reply(self, request_id: int, op: str, deadline: float, timeout: float):
        """Wait until `deadline` (time.monotonic) for the reply to an earlier `send`."""
        while True:
            if self.conn.poll(0.1):
                try:
                    with self._whole_message():
                        reply = self.conn.recv()
                except (EOFError, ConnectionError):
                    try:
                        self.proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        self.kill()
                        raise GeneratorError("control connection closed by a worker that kept running; "
                                             "its process group was killed", phase=op,
                                             log_path=self.log_path) from None
                    self._raise_if_dead(op)
                    raise GeneratorError("control connection closed", phase=op, log_path=self.log_path)
                if reply.get("id") != request_id:
                    log.warning("discarding stale reply %s while waiting for request %s (%s)",
                                reply.get("id"), request_id, op)
                    continue
                if not reply["ok"]:
                    raise GeneratorError(reply["error"], phase=op, log_path=self.log_path)
                return reply["result"]
            self._raise_if_dead(op)
            if time.monotonic() > deadline:
                self.kill()
                raise GeneratorError(f"no reply within {timeout:.0f} s; the engine's process group "
                                     "was killed", phase=op, log_path=self.log_path)

    def kill(self, grace: float = 10.0) -> bool:
        """SIGTERM, then SIGKILL, the worker's own process group; True once none of it is left."""
        if self.proc is None:
            return True
        pgid = self.proc.pid  # start_new_session made the worker its group's leader
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not group_members(pgid):
                    return True
                time.sleep(0.1)
        return self.proc.poll() is not None and not group_members(pgid)

    def close(self, timeout: float = 60.0, polite: bool = True) -> int | None:
        """Ask the worker to shut down (unless not `polite`), wait, then kill its group; returns
        its exit code. Interrupted half-way, it still kills the group and removes the socket
        directory before the interruption goes on."""
        if self.proc is None:
            return None
        try:
            if polite and self.alive() and self.conn is not None:
                try:
                    self.request("shutdown", timeout=timeout)
                    self.proc.wait(timeout=timeout)
                except (GeneratorError, OSError, subprocess.TimeoutExpired) as exc:
                    log.warning("engine did not shut down politely (%s); killing its process group", exc)
        finally:
            released = self.kill()
            if self.conn is not None:
                self.conn.close()
            self._remove_files()
            code = self.proc.returncode
            self.proc, self.conn, self.socket_dir = None, None, None
        if not released:
            raise GeneratorError("processes of the engine's group survived SIGKILL",
                                 phase="close", log_path=self.log_path)
        return code

    def kill_now(self) -> None:
        """SIGKILL the worker's group and remove its socket directory, without waiting: for a
        trainer that exits at once."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._remove_files()

    def _remove_files(self) -> None:
        """The socket directory (authkey inside) and the early log, whatever the worker left."""
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
        if self.early_log is not None:
            self.early_log.unlink(missing_ok=True)


def remove_stale_socket_dirs() -> list[str]:
    """Remove the control-socket directories (authkey inside) and prespawned workers' early logs
    of colo_rl runs whose trainer is dead: one killed before it could clean up. Those of live
    runs are left alone."""
    removed = []
    for path in glob(os.path.join(tempfile.gettempdir(), f"{SOCKET_DIR_PREFIX}*")):
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            if os.path.isdir(path):
                owner = _socket_dir_owner(path)
                if owner is not None and not _running(*owner):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
            elif path.endswith(".log"):  # colo_rl-engine-PID-XXXX.log
                pid = os.path.basename(path).removeprefix(f"{SOCKET_DIR_PREFIX}engine-").split("-", 1)[0]
                if pid.isdigit() and not _running(int(pid), None):
                    os.unlink(path)
                    removed.append(path)
        except OSError:
            continue
    if removed:
        log.info("removed %d control-socket directories of dead colo_rl runs: %s", len(removed),
                 ", ".join(removed))
    return removed


STAGED_PREFIX = "colo_rl-weights-"  # colo_rl-weights-PID-UUID.safetensors (generator/staging.py)


def default_staging_dirs() -> list[str]:
    """Where generator.staging_dir=auto stages weights: /dev/shm when present, else the temp dir."""
    return ["/dev/shm", tempfile.gettempdir()] if os.path.isdir("/dev/shm") else [tempfile.gettempdir()]


def remove_stale_staged_files(directories: list[str] | None = None) -> list[str]:
    """Remove staged weight files whose trainer is dead (killed between staging and the load):
    in /dev/shm each pins its size in RAM until someone removes it."""
    removed = []
    for directory in directories or default_staging_dirs():
        for path in glob(os.path.join(directory, f"{STAGED_PREFIX}*.safetensors")):
            pid = os.path.basename(path)[len(STAGED_PREFIX):].split("-", 1)[0]
            try:
                if pid.isdigit() and os.stat(path).st_uid == os.getuid() and not _running(int(pid), None):
                    os.unlink(path)
                    removed.append(path)
            except OSError:
                continue
    if removed:
        log.info("removed %d staged weight files of dead colo_rl runs: %s", len(removed), ", ".join(removed))
    return removed


def check_engine_settings(g, model_dir: Path, engine_on_cpu: bool) -> None:
    """What vLLM would refuse only after it started, refused before, naming colo_rl's key: a
    generator.max_model_len beyond the model's positions, a CPU KV cache larger than the machine,
    a generator.staging_dir that is not a writable directory."""
    from colo_rl.config import ConfigError

    config_path = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        config = {}
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and not config.get("rope_scaling") and g.max_model_len > positions:
        raise ConfigError(f"generator.max_model_len={g.max_model_len} exceeds the model's "
                          f"max_position_embeddings={positions} ({config_path}): set "
                          f"generator.max_model_len={positions} or less")
    total = psutil.virtual_memory().total
    if engine_on_cpu and g.cpu_kvcache_gib * 2**30 > total:
        raise ConfigError(f"generator.cpu_kvcache_gib={g.cpu_kvcache_gib} is more than this machine's "
                          f"{total / 2**30:.1f} GiB of memory: give the engine's KV cache a part of it")
    if g.staging_dir != "auto" and not (os.path.isdir(g.staging_dir) and os.access(g.staging_dir, os.W_OK)):
        raise ConfigError(f"generator.staging_dir={g.staging_dir} is not a writable directory: create it, "
                          "or point generator.staging_dir elsewhere (auto: /dev/shm)")


def _socket_dir_owner(path: str) -> tuple[int, int | None] | None:
    """(trainer pid, its start_ticks) from worker.json, or the pid from the directory's name."""
    try:
        with open(os.path.join(path, "worker.json")) as f:
            info = json.load(f)
        return int(info["parent_pid"]), info.get("parent_start_ticks")
    except (OSError, ValueError, KeyError, TypeError):
        pid = os.path.basename(path)[len(SOCKET_DIR_PREFIX):].split("-", 1)[0]
        return (int(pid), None) if pid.isdigit() else None


def start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks after boot (/proc/PID/stat, field 22): with the
    pid it names one process. A wall-clock start time (psutil's create_time, boot time + ticks)
    moves when the clock is stepped or a paused VM resumes: a live trainer's directory was then
    taken for a dead one's and removed under its engine. None where /proc has no such file."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # fields after the name start at 3
    except (OSError, ValueError, IndexError):
        return None


def _running(pid: int, ticks: int | None) -> bool:
    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return False
    except psutil.NoSuchProcess:
        return False
    return ticks is None or start_ticks(pid) == ticks  # not a reused pid


def worker_env() -> dict[str, str]:
    """The environment every worker starts from: this process's, with colo_rl importable."""
    env = dict(os.environ)
    package_root = str(Path(colo_rl.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


_prespawned: EngineProcess | None = None


def prespawn(argv: list[str]) -> EngineProcess | None:
    """Start an engine worker now, before this process imports torch: it imports vLLM (tens of
    seconds on a GPU host) beside the trainer's own imports (about as long) instead of after them. Called by
    `python -m colo_rl.run` first thing. Not for a multirun (its jobs start their own), Hydra's
    informational flags, or a torchrun rank; COLO_RL_PRESPAWN=0 turns it off. The worker writes to
    a temporary log until the run adopts it (`adopt_prespawned`); one nobody adopts is closed when
    this process exits (and gets SIGTERM if this process dies)."""
    global _prespawned
    if (os.environ.get("COLO_RL_PRESPAWN", "1") == "0" or any(a.startswith("-") for a in argv)
            or any(a.startswith("hydra.mode=") for a in argv) or "LOCAL_RANK" in os.environ):
        return None
    fd, early_log = tempfile.mkstemp(prefix=f"{SOCKET_DIR_PREFIX}engine-{os.getpid()}-", suffix=".log")
    os.close(fd)
    process = EngineProcess(sys.executable, Path(early_log), worker_env())
    try:
        process.launch(early_log=Path(early_log))
        process.connect(CONNECT_TIMEOUT_S)
    except Exception as exc:  # the run spawns its own worker, and reports what fails then
        log.debug("no engine worker spawned at start-up: %s", exc)
        process.kill_now()
        return None
    except BaseException:
        process.kill_now()
        raise
    _prespawned = process
    atexit.register(_close_prespawned)
    return process


def adopt_prespawned(python: str, env: dict[str, str], log_path: Path) -> EngineProcess | None:
    """The worker `prespawn` started, for a run whose worker needs `python` and `env`: None when
    there is none, it died, or it runs another interpreter or environment (it is then closed).
    It moves its output to `log_path` when it receives the start request."""
    global _prespawned
    process, _prespawned = _prespawned, None
    if process is None:
        return None
    if (process.alive() and process.python == python
            and not set(env_changes(process.env, env)) & set(PROCESS_START_ENV)):
        process.log_path = Path(log_path)
        return process
    if process.alive():
        log.info("the engine worker spawned at start-up runs another interpreter or environment "
                 "than generator.* asks for: starting a new one")
    process.close(polite=False)
    return None


def env_changes(old: dict[str, str], new: dict[str, str]) -> dict[str, str | None]:
    """What turns environment `old` into `new` (None: unset)."""
    return {key: new.get(key) for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)}


def _close_prespawned() -> None:
    global _prespawned
    process, _prespawned = _prespawned, None
    if process is not None:  # it only imports vLLM: nothing to shut down
        process.kill_now()
