"""Time to first step: a real `python -m colo_rl.run` (given overrides), N times in a row, each in
its own process and output directory: the first is the cold start, the later ones warm (the OS
file cache, and on a GPU vLLM's compile and CUDA-graph caches under VLLM_CACHE_ROOT, default
~/.cache/vllm). Per run it prints each set-up stage's seconds (`setup/<stage>_s` of the first
step's record in metrics.jsonl), `setup/total_s` (the run's start to its first step, imports not
included), the engine's own start (`timing/server_start_s`), the wall-clock seconds from the
command to the first step's record and to the process's exit, as JSON.

    python benchmarks/startup.py --runs 2                                   # CPU: the README's demo
    python benchmarks/startup.py --runs 2 --peer --out $OUT/startup.json    # H200: the 1B peer workload (6 steps)
    python benchmarks/startup.py --runs 2 --peer --model olmo2_7b_shape    # H200: the 7B shape
    python benchmarks/startup.py --runs 2 -- trainer.steps=3 model=...      # any overrides after --
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def engine_log_facts(engine_log: str) -> dict:
    """What vLLM's log says about the start (issue #23): whether its engine core was spawned (a
    second import of vLLM) rather than forked, Dynamo's tracing and torch.compile's seconds, and
    whether the AOT-compiled model was saved or loaded (vLLM 0.26 on a GPU; absent on a CPU)."""
    def seconds(pattern: str) -> float | None:
        found = re.search(pattern, engine_log)
        return float(found.group(1)) if found else None

    return {"engine_core_spawned": "We must use the `spawn` multiprocessing start method" in engine_log,
            "dynamo_s": seconds(r"Dynamo bytecode transform time: ([0-9.]+) s"),
            "torch_compile_s": seconds(r"torch.compile took ([0-9.]+) s in total"),
            "aot_saved": "saved AOT compiled function" in engine_log,
            "aot_loaded": "Directly load AOT compilation" in engine_log,
            "aot_save_failed": "unable to save AOT compiled function" in engine_log}


def one_run(overrides: list[str], output_dir: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    shutil.rmtree(output_dir, ignore_errors=True)  # --work-dir: an earlier call's run
    metrics = output_dir / "metrics.jsonl"
    start = time.perf_counter()
    first_record_s = None
    with open(output_dir.parent / f"{output_dir.name}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "colo_rl.run", *overrides, f"output_dir={output_dir}"],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if first_record_s is None and metrics.exists() and metrics.stat().st_size > 0:
                first_record_s = time.perf_counter() - start
            time.sleep(0.05)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"the run exited with {proc.returncode}; its output: {log.name}")
    first = json.loads(metrics.read_text().splitlines()[0])
    engine_log = (output_dir / "engine.log").read_text(errors="replace") if (output_dir / "engine.log").exists() else ""
    imported = re.search(r"colo_rl worker: vLLM imported in ([0-9.]+) s", engine_log)
    return {"worker_spawned_at_start": imported is not None,  # colo_rl.generator.process.prespawn
            "worker_vllm_import_s": float(imported.group(1)) if imported else None,
            **engine_log_facts(engine_log),
            "setup": {k.removeprefix("setup/"): round(v, 2) for k, v in first.items() if k.startswith("setup/")},
            "engine_start_s": round(first.get("timing/server_start_s", float("nan")), 2),
            "first_step_s": round(first["timing/step_s"], 2),
            "command_to_first_record_s": round(first_record_s or float("nan"), 2),
            # the first step's start: its record is written when it ends
            "command_to_first_step_s": round((first_record_s or float("nan")) - first["timing/step_s"], 2),
            "command_to_exit_s": round(wall, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=2, help="runs in a row: the first cold, the rest warm")
    p.add_argument("--peer", action="store_true", help="the peer workload (benchmarks/workload.py)")
    p.add_argument("--smoke", action="store_true", help="with --peer: the workload's CPU form")
    p.add_argument("--model", default=None, help="with --peer: the model preset (default: the workload's)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--work-dir", type=Path, help="keep the runs' directories here (default: a temporary one)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = p.parse_args()
    overrides = ["logger.mode=offline", *args.overrides]
    if args.peer:
        from workload import workload
        overrides = [*workload(args.smoke, args.model).overrides(), *overrides]
    results = {"overrides": overrides, "runs": []}
    with tempfile.TemporaryDirectory(prefix="colo_rl_startup_") as tmp:
        tmp = args.work_dir or tmp
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for i in range(args.runs):
            results["runs"].append({"run": i, "cache": "cold" if i == 0 else "warm",
                                    **one_run(overrides, Path(tmp) / f"run{i}")})
            print(json.dumps(results["runs"][-1]), flush=True)
            if args.out:  # after each run: a cut call keeps the runs done
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
