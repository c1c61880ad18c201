"""How the Offloader's restore should allocate device memory: measured, not guessed.

    python benchmarks/offload_restore.py --out $OUT/offload_restore.json     # ~1 min on the H200

The trainer state of the 1B OLMo-2 shape after one GRPO step (bf16 params + AdamW moments,
~8.9 GB) is offloaded to colo_rl's pinned host buffers, then restored after `empty_cache` (as
after a generation, when the engine had the memory) in several ways, each --repeats times:
  - per_tensor: one `torch.empty_like` per tensor, then its copy: what `Offloader.restore` does;
  - chunk_<MiB>: runs of same-dtype tensors of at most that size carved from one allocation
    each, 512-byte aligned (`chunk_inf`: one allocation per dtype);
  - malloc_only: `torch.empty` of the whole state, no copy: what mapping fresh pages costs.
On 2026-12-03 per_tensor was fastest (93% of the pinned bandwidth; benchmarks/RESULTS.md), so the
Offloader keeps one allocation per tensor.
Every restore is checked against the state before the first offload (an exact
checksum per tensor, on the GPU). Bandwidths are
bytes restored per second of wall clock (synchronised), next to a 4 GiB pinned copy.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from colocation import copy_seconds, model_config, stepped_trainer, trainer_tensors  # noqa: E402

MIB = 2**20
GB = 1e9


def restore_chunked(offloader, chunk_bytes: int) -> None:
    """Runs of same-dtype tensors of at most `chunk_bytes`, each carved from one allocation with
    512-byte aligned views; a run's copies are issued before the next run is allocated."""
    import torch

    for part in sorted(offloader.offloaded):
        runs: dict[torch.dtype, list[torch.Tensor]] = {}
        for _, tensor, _ in offloader._moved[part]:
            run = runs.setdefault(tensor.dtype, [])
            if run and sum(t.nbytes for t in run) + tensor.nbytes > chunk_bytes:
                _restore_run(run, offloader.device)
                run = runs[tensor.dtype] = []
            run.append(tensor)
        for run in runs.values():
            _restore_run(run, offloader.device)
    torch.cuda.synchronize()
    offloader.offloaded.clear()


def _restore_run(run, device) -> None:
    import torch

    align = 512 // run[0].element_size()
    offsets, total = [], 0
    for tensor in run:
        offsets.append(-(-total // align) * align)
        total = offsets[-1] + tensor.numel()
    flat = torch.empty(total, dtype=run[0].dtype, device=device)
    for tensor, offset in zip(run, offsets):
        view = flat[offset:offset + tensor.numel()].view(tensor.shape)
        view.copy_(tensor.data, non_blocking=True)
        tensor.data = view


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--model", default="olmo2_1b_shape")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("offload_restore.py measures CUDA allocations and copies: run it on a GPU")
    from colo_rl.generator.staging import tensor_checksum
    from colo_rl.models import write_embedded_model
    from colo_rl.trainer import Offloader

    cfg = model_config(args.model)
    with tempfile.TemporaryDirectory() as work:
        trainer = stepped_trainer(cfg, write_embedded_model(cfg, Path(work) / "model"), 16)
    reference = {k: tensor_checksum(t) for k, t in trainer_tensors(trainer).items()}
    offloader = Offloader(trainer.model, trainer.optimizer, "all", overlap_restore=False)  # timed whole
    total = sum(t.nbytes for t in trainer_tensors(trainer).values())
    host = torch.empty(4 * 2**30, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    h2d = median(copy_seconds(device, host))
    del host, device

    def cycle(restore) -> float:
        offloader.offload()  # empties the cache: the next allocations are fresh cudaMallocs
        torch.cuda.synchronize()
        start = time.perf_counter()
        restore()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        for key, tensor in trainer_tensors(trainer).items():
            if tensor_checksum(tensor) != reference[key]:
                raise SystemExit(f"{key} changed in a restore: not bit-exact")
        return seconds

    results = {"state_bytes": total, "h2d_pinned_gbps": 4 * 2**30 / h2d, "strategies": {}}
    cycle(offloader.restore)  # allocates the pinned host buffers once
    strategies = {"per_tensor": offloader.restore}  # an allocation per tensor, then its copy
    for mib in (64, 256, 1024, None):
        strategies[f"chunk_{mib or 'inf'}"] = lambda mib=mib: restore_chunked(offloader, mib * MIB if mib else 2**62)
    for name, restore in strategies.items():
        seconds = [cycle(restore) for _ in range(args.repeats)]
        results["strategies"][name] = {"seconds": seconds, "median_s": median(seconds),
                                       "gbps": total / median(seconds) / GB}
    offloader.offload()
    mallocs = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        block = torch.empty(total, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        mallocs.append(time.perf_counter() - start)
        del block
        torch.cuda.empty_cache()
    results["malloc_only"] = {"seconds": mallocs, "median_s": median(mallocs)}
    offloader.restore()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"state {total / GB:.2f} GB; pinned H2D limit {results['h2d_pinned_gbps'] / GB:.1f} GB/s; "
          f"malloc of it all {results['malloc_only']['median_s']:.3f} s")
    for name, r in results["strategies"].items():
        share = r["gbps"] * GB / results["h2d_pinned_gbps"]
        print(f"{name:>12}: {r['median_s']:.3f} s  {r['gbps']:.1f} GB/s  ({share:.0%} of pinned)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
