"""Achieved memory bandwidth of paged decode attention: Triton vs the torch reference.

Decode attention reads every cached key and value of every sequence once, so its speed
is bytes of KV read / time. For a batch x context grid this prints that bandwidth for
the Triton kernel and for the plain-torch reference (same inputs, same run), the kernel's
share of the device's peak HBM bandwidth, and its speedup over the reference.

    python benchmarks/kernels.py                 # on a CUDA machine
    python benchmarks/kernels.py --peak-gbps 4800  # when the device is not in the table
    python benchmarks/kernels.py --smoke         # tiny grid on the CPU interpreter

Without a GPU (and without --smoke) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Nominal peak HBM bandwidth in GB/s, by a substring of the device name (first match).
PEAK_HBM_GBPS = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "GH200": 4000.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "L4": 300.0,
    "A10G": 600.0,
    "RTX 4090": 1008.0,
}

BATCHES = (1, 8, 32, 128)
CONTEXTS = (512, 2048, 8192, 32768)
SMOKE_BATCHES = (1, 3)
SMOKE_CONTEXTS = (40, 600)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    parser.add_argument("--block-size", type=int, default=16, choices=(16, 32))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--iters", type=int, default=20, help="timed calls per cell")
    parser.add_argument("--peak-gbps", type=float, help="override the device's peak HBM GB/s")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny grid on the CPU under Triton's interpreter"
    )
    return parser.parse_args()


def main() -> int:
    args = _parse_args()
    if args.smoke:
        # Must precede the first import of triton (through kernels).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("No CUDA device: nothing to measure (decode attention runs the torch reference")
        print("on CPU). Run this on a GPU machine, or pass --smoke to exercise the script.")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton is not installed: nothing to measure. `pip install triton` first.")
        return 0

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kernels.decode_attention import decode_attention, decode_attention_ref

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    batches, contexts = (SMOKE_BATCHES, SMOKE_CONTEXTS) if args.smoke else (BATCHES, CONTEXTS)
    iters = 1 if args.smoke else args.iters
    name = "CPU (Triton interpreter)" if args.smoke else torch.cuda.get_device_name()
    peak_gbps = args.peak_gbps or _lookup_peak(name)
    print(
        f"device: {name}; peak HBM: "
        + (f"{peak_gbps:.0f} GB/s" if peak_gbps else "unknown (pass --peak-gbps)")
    )
    print(
        f"heads {args.num_heads}/{args.num_kv_heads} (GQA {args.num_heads // args.num_kv_heads}),"
        f" head_dim {args.head_dim}, block_size {args.block_size}, {str(dtype)[6:]},"
        f" {iters} timed calls per cell"
    )
    header = (
        f"{'batch':>5} {'context':>7} {'KV MB':>8} | {'triton us':>10} {'GB/s':>7}"
        f" {'% peak':>6} | {'torch us':>10} {'GB/s':>7} | {'speedup':>7}"
    )
    print(header)
    print("-" * len(header))
    best_fraction, speedups = 0.0, []
    for context in contexts:
        for batch in batches:
            case = _make_case(batch, context, args, dtype, device)
            kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * dtype.itemsize
            triton_s = _time(lambda c=case: decode_attention(*c), iters, device)
            try:
                expected = decode_attention_ref(*case)
                ref_s = _time(lambda c=case: decode_attention_ref(*c), iters, device)
            except torch.OutOfMemoryError:
                expected, ref_s = None, None  # the reference gathers K/V in fp32: huge
            if expected is not None:
                torch.testing.assert_close(decode_attention(*case), expected, atol=2e-2, rtol=2e-2)
            gbps = kv_bytes / triton_s / 1e9
            fraction = gbps / peak_gbps if peak_gbps else 0.0
            best_fraction = max(best_fraction, fraction)
            row = (
                f"{batch:>5} {context:>7} {kv_bytes / 1e6:>8.1f} | {triton_s * 1e6:>10.1f}"
                f" {gbps:>7.0f} {fraction * 100 if peak_gbps else float('nan'):>5.1f}% | "
            )
            if ref_s is None:
                row += f"{'oom':>10} {'-':>7} | {'-':>7}"
            else:
                speedups.append(ref_s / triton_s)
                row += (
                    f"{ref_s * 1e6:>10.1f} {kv_bytes / ref_s / 1e9:>7.0f} |"
                    f" {ref_s / triton_s:>6.1f}x"
                )
            print(row)
            del case
            if device == "cuda":
                torch.cuda.empty_cache()
    if speedups:
        print(
            f"speedup over the torch reference: min {min(speedups):.1f}x, max {max(speedups):.1f}x"
        )
    if peak_gbps:
        print(f"best share of peak HBM bandwidth: {best_fraction * 100:.1f}%")
    return 0


def _lookup_peak(device_name: str) -> float | None:
    for key, gbps in PEAK_HBM_GBPS.items():
        if key in device_name:
            return gbps
    return None


def _make_case(batch: int, context: int, args: argparse.Namespace, dtype, device: str):
    """Random q and a paged cache where every sequence has `context` tokens in shuffled
    blocks (so reads are scattered as in a real cache)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(
        (batch, args.num_heads, args.head_dim), generator=gen, device=device, dtype=dtype
    )
    return q, k_cache, v_cache, block_tables, context_lens, args.head_dim**-0.5


def _time(fn: Callable[[], object], iters: int, device: str) -> float:
    """Mean seconds per call after warm-up (compilation and autotuning excluded)."""
    import torch

    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    began = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - began) / iters


if __name__ == "__main__":
    sys.exit(main())
