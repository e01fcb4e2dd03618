"""Quantized all-gather kernels (fsdp_native.quant, C++ on CPU) against the bandwidth floor.

Work: one rank's bf16 shards of a Llama-style layer (dim 2048, hidden 5632, as
benchmarks/bench_ops.py; world size 8) and of the overhead model's block (benchmarks/models.py:
dim 128, hidden 256). For each format:

* quantize_copy_in: this rank's shards -> its encoded chunk (fp8_tensorwise also with the
  amax given, as after an all-reduce of quantize_amax: one pass instead of two);
* dequantize_copy_out: the gathered chunks of all 8 ranks -> the unsharded bf16 parameters
  (and fp32, as with fp32 compute).

Floor: one flat uint8 ``copy_`` that reads and writes as many bytes as the op must (source
bytes + destination bytes, split evenly between read and write). "% floor" is floor time / op
time. Implementations run interleaved round by round (op, floor, op, ...), so load from other
processes hits both alike; times are the fastest round, medians in parentheses.

    .venv/bin/python benchmarks/bench_quant.py [--rounds 15] [--threads 1 2] [--clock wall|thread] [--ops NAME ...]

``--ops`` keeps the ops whose names are given (e.g. "quantize nf4"); with another build first on
``PYTHONPATH`` it times that build (two builds alternated: before and after a kernel change).

``--clock thread`` times CPU time of the calling thread (with 1 thread the op runs on it),
which a loaded machine disturbs less than wall time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from fsdp_native import quant as Q
from fsdp_native.ops import padded_shard_numel

WORLD_SIZE, RANK = 8, 3
DIM, HIDDEN = 2048, 5632
LAYER = [(DIM, DIM)] * 4 + [(HIDDEN, DIM), (HIDDEN, DIM), (DIM, HIDDEN)] + [(DIM,), (DIM,)]
SMALL = [(128,), (128,), (256, 128), (256,), (128, 256), (128,)]  # LayerNorm, fc1, fc2


def _row(shape) -> int:
    n = 1
    for s in shape[1:]:
        n *= s
    return n


CLOCK = time.perf_counter


def _time(fn, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    t = CLOCK()
    fn()
    return CLOCK() - t


def _bench(op, floor, rounds: int) -> tuple[list[float], list[float]]:
    a, b = [], []
    for _ in range(rounds):
        a.append(_time(op, 1))
        b.append(_time(floor, 1))
    return a, b


def cases(shapes):
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen).mul_(0.02).to(torch.bfloat16) for s in shapes]
    padded = [padded_shard_numel(s, WORLD_SIZE) for s in shapes]
    rows = [_row(s) for s in shapes]
    shards = []
    for f, p in zip(fulls, padded):
        flat = f.reshape(-1)
        lo = min(RANK * p, flat.numel())
        shards.append(flat[lo : min(lo + p, flat.numel())].clone())
    src_bytes = sum(2 * s.numel() for s in shards)
    for fmt in Q.FORMATS:
        layout = Q.unit_layout(padded, rows, fmt)
        out = torch.empty(layout.rank_nbytes, dtype=torch.uint8)
        Q.quantize_copy_in(shards, padded, rows, out, format=fmt)
        yield f"quantize {fmt}", (lambda o=out, f=fmt: Q.quantize_copy_in(shards, padded, rows, o, format=f)), src_bytes + out.numel()
        if fmt == Q.FP8_TENSORWISE:
            amax = torch.empty(len(shards))
            Q.quantize_amax(shards, amax)
            yield "quantize fp8_tensorwise, amax given", (lambda o=out: Q.quantize_copy_in(shards, padded, rows, o, format=Q.FP8_TENSORWISE, amax=amax)), src_bytes + out.numel()
            yield "quantize_amax", (lambda: Q.quantize_amax(shards, amax)), src_bytes
        gathered = out.repeat(WORLD_SIZE)
        outs = [torch.empty(f.numel(), dtype=torch.bfloat16) for f in fulls]
        yield f"dequantize {fmt}", (lambda g=gathered, o=outs, f=fmt: Q.dequantize_copy_out(g, padded, rows, WORLD_SIZE, o, format=f)), gathered.numel() + sum(2 * o.numel() for o in outs)
        outs32 = [torch.empty(f.numel(), dtype=torch.float32) for f in fulls]  # fp32 compute
        yield f"dequantize {fmt} (fp32 out)", (lambda g=gathered, o=outs32, f=fmt: Q.dequantize_copy_out(g, padded, rows, WORLD_SIZE, o, format=f)), gathered.numel() + sum(4 * o.numel() for o in outs32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall")
    ap.add_argument("--ops", nargs="+", default=None, help="only these ops (names as printed)")
    args = ap.parse_args()
    global CLOCK
    if args.clock == "thread":
        CLOCK = time.thread_time
        args.threads = [1]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads available; world size {WORLD_SIZE}, rank {RANK}; "
          f"clock {args.clock}; load average {os.getloadavg()[0]:.1f}")
    for name, shapes in (("Llama-style layer (2048/5632)", LAYER), ("overhead block (128/256)", SMALL)):
        for threads in args.threads:
            torch.set_num_threads(threads)
            print(f"\n{name}, {threads} thread(s)")
            print(f"{'op':40s} {'MB':>8s} {'op ms':>16s} {'floor ms':>16s} {'GB/s':>6s} {'% floor':>14s}")
            for label, fn, nbytes in cases(shapes):
                if args.ops is not None and label not in args.ops:
                    continue
                half = max(nbytes // 2, 1)
                s, d = torch.empty(half, dtype=torch.uint8).fill_(1), torch.empty(half, dtype=torch.uint8)
                op, fl = _bench(fn, lambda: d.copy_(s), args.rounds)
                best, fbest = min(op), min(fl)
                med, fmed = statistics.median(op), statistics.median(fl)
                print(
                    f"{label:40s} {nbytes / 1e6:8.2f} {best * 1e3:7.3f} ({med * 1e3:6.3f}) {fbest * 1e3:7.3f} ({fmed * 1e3:6.3f}) "
                    f"{nbytes / best / 1e9:6.2f} {100 * fbest / best:5.0f}% ({100 * fmed / med:4.0f}%)"
                )


if __name__ == "__main__":
    main()
