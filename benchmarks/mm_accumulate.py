"""Weight-gradient accumulation in fp32 by the matmul itself (issue #24): what PyTorch's CUDA
`addmm(..., out_dtype=torch.float32)` gives over autograd's bf16 weight gradient, its cast and the
fp32 add that mixed precision pays per micro-batch and linear. Prints one JSON line.

    python benchmarks/mm_accumulate.py [--tokens 6144]
"""
import argparse
import json

import torch


def timed(fn, repeat: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=6144)  # micro-batch 16 x 384 positions
    args = parser.parse_args()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens, "shapes": {}}
    for name, (n_out, n_in) in {"qkv_o": (2048, 2048), "up": (8192, 2048), "down": (2048, 8192),
                                "head": (100352, 2048)}.items():
        g = torch.randn(args.tokens, n_out, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(args.tokens, n_in, device="cuda", dtype=torch.bfloat16)
        main_grad = torch.zeros(n_out, n_in, device="cuda", dtype=torch.float32)
        row = {}
        try:
            reference = (g.float().t() @ x.float())
            acc = torch.zeros_like(main_grad)
            torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc)
            torch.addmm(acc, g.t(), x, out_dtype=torch.float32, out=acc)
            row["addmm_out_dtype_rel_err"] = float((acc - 2 * reference).norm() / (2 * reference).norm())
            row["fused_s"] = timed(lambda: torch.addmm(main_grad, g.t(), x, out_dtype=torch.float32, out=main_grad))
        except Exception as error:  # noqa: BLE001 - the probe reports what this torch does
            row["addmm_out_dtype_error"] = f"{type(error).__name__}: {error}"[:300]
        row["bf16_mm_s"] = timed(lambda: g.t() @ x)
        row["mm_cast_add_s"] = timed(lambda: main_grad.add_((g.t() @ x).float()))
        row["mm_mixed_add_s"] = timed(lambda: main_grad.add_(g.t() @ x))
        out["shapes"][name] = row
    print(json.dumps(out))


if __name__ == "__main__":
    main()
