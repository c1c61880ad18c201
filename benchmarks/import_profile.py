"""Where importing vLLM goes (issue #23): the engine worker's `import_vllm_without_cuda` in a fresh
interpreter under `python -X importtime`, twice (the first may pay for byte-compiling), then the
modules with the most time of their own and the heaviest top-level packages. Prints one JSON line.

    python benchmarks/import_profile.py [--out FILE]
"""
import argparse
import json
import subprocess
import sys
import time

CODE = "from colo_rl.generator.worker import import_vllm_without_cuda; import_vllm_without_cuda()"


def profile() -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", CODE], capture_output=True, text=True)
    wall = time.perf_counter() - start
    rows = []  # (self s, cumulative s, depth, module)
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, cumulative, name = line[len("import time:"):].split("|", 2)
        rows.append((int(own) / 1e6, int(cumulative) / 1e6, (len(name) - len(name.lstrip())) // 2, name.strip()))
    packages: dict[str, float] = {}
    for own, _, _, name in rows:
        packages[name.split(".")[0]] = packages.get(name.split(".")[0], 0.0) + own
    return {"exit_code": done.returncode, "wall_s": wall, "modules": len(rows),
            "self_s_total": sum(r[0] for r in rows),
            "by_package_self_s": dict(sorted(packages.items(), key=lambda kv: -kv[1])[:25]),
            "top_self": [{"s": s, "module": m} for s, _, _, m in sorted(rows, reverse=True)[:40]],
            "top_level_cumulative": [{"s": c, "module": m} for _, c, d, m in sorted(rows, key=lambda r: -r[1])
                                     if d <= 1][:25],
            "stderr_tail": "\n".join(l for l in done.stderr.splitlines() if not l.startswith("import time:"))[-1500:]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    result = {"python": sys.version.split()[0], "runs": [profile(), profile()]}
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    for run in result["runs"]:
        print(f"[import_profile] wall {run['wall_s']:.1f} s, {run['modules']} modules, own time {run['self_s_total']:.1f} s; "
              f"by package: " + ", ".join(f"{k} {v:.2f}" for k, v in list(run["by_package_self_s"].items())[:12]))
    for row in result["runs"][1]["top_self"][:20]:
        print(f"[import_profile]   {row['s']:.3f} s  {row['module']}")


if __name__ == "__main__":
    main()
