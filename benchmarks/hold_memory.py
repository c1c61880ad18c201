"""Holds GPU memory in a second process so that only --leave-gib stay free: an emulated smaller card.

    python benchmarks/hold_memory.py --leave-gib 24 -- python -m colo_rl.run model=olmo2_1b_shape ...
    python benchmarks/hold_memory.py --leave-gib 24            # holds until Ctrl-C or SIGTERM

With a command after `--`, the memory is held while the command runs and released after it; the
exit code is the command's. `benchmarks/peer_workload.py --leave-gib 24` does the same around each
of its arms. The holder is its own process (its own CUDA context, as another job on a shared card
would be): it measures the free memory once its context exists, allocates the difference with
torch, tops it up until at most `leave` + 64 MiB are free, prints one `held ...` line and waits for
its stdin to close, so it ends with whoever started it, even when that one is SIGKILLed.
vLLM's generator.gpu_memory_utilization is a fraction of the card's total memory, so under a
holder it must stay below (leave - what the trainer holds at engine start) / total.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator

GIB = 2**30
SLACK = 64 * 2**20  # the caching allocator rounds blocks; closer than this is not worth chasing


def hold(leave_gib: float, device: int) -> None:
    """The holder process: allocate down to `leave_gib` free, report, wait for stdin to close."""
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"error": "torch sees no CUDA GPU here: hold_memory emulates a smaller GPU only on a GPU"}),
              flush=True)
        raise SystemExit(2)
    torch.cuda.init()
    held = []
    free, total = torch.cuda.mem_get_info(device)
    while free > leave_gib * GIB + SLACK:
        held.append(torch.empty(int(free - leave_gib * GIB), dtype=torch.uint8, device=device))
        free, total = torch.cuda.mem_get_info(device)
    print(json.dumps({"held_gib": sum(t.numel() for t in held) / GIB, "free_gib": free / GIB,
                      "total_gib": total / GIB}), flush=True)
    sys.stdin.read()  # returns when the parent closes the pipe or dies


@contextmanager
def holding(leave_gib: float, device: int = 0) -> Iterator[dict]:
    """Runs a holder process for the duration of the block; yields its report (held_gib,
    free_gib, total_gib). Raises RuntimeError with the holder's message when it cannot hold."""
    proc = subprocess.Popen([sys.executable, __file__, "--hold", "--leave-gib", str(leave_gib),
                             "--device", str(device)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        report = json.loads(line) if line.strip() else {"error": f"the holder exited with {proc.wait()}"}
        if "error" in report:
            raise RuntimeError(f"hold_memory: {report['error']}")
        if report["free_gib"] > leave_gib + 1:
            raise RuntimeError(f"hold_memory: {report['free_gib']:.1f} GiB stay free, asked for {leave_gib}")
        yield report
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leave-gib", type=float, required=True, help="GPU memory left free for the command (GiB)")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)  # the holder process itself
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...: run it while the memory is held")
    args = p.parse_args(argv)
    if args.leave_gib <= 0:
        p.error(f"--leave-gib={args.leave_gib} must be > 0")
    if args.hold:
        hold(args.leave_gib, args.device)
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        with holding(args.leave_gib, args.device) as report:
            print(f"hold_memory: holding {report['held_gib']:.2f} GiB, {report['free_gib']:.2f} of "
                  f"{report['total_gib']:.2f} GiB free", flush=True)
            if not command:
                try:
                    subprocess.run(["sleep", "infinity"])
                except KeyboardInterrupt:
                    return 130  # Ctrl-C is how this mode ends; the holder goes with the block
            return subprocess.run(command).returncode
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
