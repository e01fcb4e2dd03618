"""Packing ops of fsdp_native against torch FSDP2's own path for the same work, on CPU.

The work is one Llama-style decoder layer (dim 2048, hidden 5632: four 2048x2048, three
5632x2048 / 2048x5632 and two norms of 2048) sharded on dim 0 over 8 ranks; the local
shard is 1/8 of every parameter. Each op runs with 1 and 2 threads
(``torch.set_num_threads``) and is compared with

* torch: what FSDP2 (``torch.distributed.fsdp._fully_shard._fsdp_collectives``) runs for it;
* floor: one flat ``dst.copy_(src)`` of the same numel and dtypes (the same bytes).

GB/s counts the bytes the op must read plus write (padding zeroes included); torch's path
is credited with the same bytes although it moves more.

    .venv/bin/python -m pytest benchmarks/bench_ops.py --benchmark-only   # pytest-benchmark
    .venv/bin/python benchmarks/bench_ops.py [--rounds N] [--threads 1 2] [--clock wall|thread]

The script interleaves the implementations round by round (ours, torch, floor in turn), so
load from other processes hits them alike; GB/s come from the fastest round, ratios from the
fastest round and, in parentheses, from the medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401  (registers torch.ops.fsdp.*)

from fsdp_native import ops

WORLD_SIZE = 8
RANK = 3
DIM, HIDDEN = 2048, 5632
LAYER_SHAPES = [(DIM, DIM)] * 4 + [(HIDDEN, DIM), (HIDDEN, DIM), (DIM, HIDDEN)] + [(DIM,), (DIM,)]
THREADS = (1, 2)
DIVIDE = 8.0

bf16, fp32 = torch.bfloat16, torch.float32


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _rows_of_rank(shape, rank: int, world_size: int):
    """This rank's dim-0 shard of a tensor of ``shape`` (torch.chunk semantics)."""
    rows = -(-shape[0] // world_size)
    lo = min(rank * rows, shape[0])
    hi = min(lo + rows, shape[0])
    return (hi - lo,) + tuple(shape[1:])


PADDED = [ops.padded_shard_numel(s, WORLD_SIZE) for s in LAYER_SHAPES]
SHARD_SHAPES = [_rows_of_rank(s, RANK, WORLD_SIZE) for s in LAYER_SHAPES]
N_SHARD = sum(PADDED)  # one rank's flat buffer
N_FULL = N_SHARD * WORLD_SIZE  # all-gather output / reduce-scatter input


@dataclass
class Case:
    name: str
    ours: Callable[[], None]
    torch: Callable[[], None]
    floor: Callable[[], None]
    nbytes: int  # bytes read + written by the op
    floor_nbytes: int
    setup: Callable[[], None] | None = None  # untimed, before every timed call of any impl
    target: str = ""


def _randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=fp32).to(dtype)


def build_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    cases: list[Case] = []
    es = lambda dt: torch.empty((), dtype=dt).element_size()  # noqa: E731

    # --- all-gather copy-in: this rank's fp32 shards -> its slice of the bf16 all-gather buffer
    for src_dt, target in ((fp32, ">= 2x torch, >= 0.85 floor"), (bf16, "")):
        shards = [_randn(s, src_dt, gen) for s in SHARD_SHAPES]
        ag_out = torch.empty(N_FULL, dtype=bf16)
        my_slice = ag_out.narrow(0, RANK * N_SHARD, N_SHARD)
        flat_src = torch.empty(N_SHARD, dtype=src_dt).normal_(generator=gen)
        flat_dst = torch.empty(N_SHARD, dtype=bf16)

        def ours(shards=shards, my_slice=my_slice):
            ops.all_gather_copy_in(shards, PADDED, my_slice)

        def torch_path(shards=shards, ag_out=ag_out, src_dt=src_dt):
            # FSDP2 casts each sharded parameter to param_dtype first (FSDPParam.all_gather_inputs),
            # then foreach-copies into its slice of the all-gather output.
            # FSDP2's all-gather inputs are the flat (1-D) padded shards.
            flat = [s.view(-1) for s in shards]
            inputs = [s.to(bf16) for s in flat] if src_dt != bf16 else flat
            torch.ops.fsdp.all_gather_copy_in(inputs, ag_out, PADDED, N_SHARD, RANK)

        n_real = sum(_numel(s) for s in SHARD_SHAPES)
        nbytes = n_real * es(src_dt) + N_SHARD * es(bf16)
        label = "fp32->bf16" if src_dt == fp32 else "bf16"
        cases.append(
            Case(f"copy-in {label}", ours, torch_path, lambda d=flat_dst, s=flat_src: d.copy_(s),
                 nbytes, N_SHARD * (es(src_dt) + es(bf16)), target=target)
        )

    # --- all-gather copy-out: bf16 all-gather output -> unsharded bf16 parameters
    ag_out = _randn(N_FULL, bf16, gen)
    outs = [torch.empty(s, dtype=bf16) for s in LAYER_SHAPES]
    flat_src = _randn(N_FULL, bf16, gen)
    flat_dst = torch.empty(N_FULL, dtype=bf16)

    def copy_out_ours():
        ops.all_gather_copy_out(ag_out, PADDED, WORLD_SIZE, outs)

    ag_2d = ag_out.view(WORLD_SIZE, -1)
    outs_2d = [o.view(WORLD_SIZE, -1) for o in outs]  # exact fit: every dim 0 divides by 8

    def copy_out_torch():
        torch.split_with_sizes_copy(ag_2d, PADDED, dim=1, out=outs_2d)

    n_real = sum(_numel(s) for s in LAYER_SHAPES)
    cases.append(
        Case("copy-out bf16", copy_out_ours, copy_out_torch, lambda d=flat_dst, s=flat_src: d.copy_(s),
             2 * n_real * es(bf16), 2 * N_FULL * es(bf16), target=">= 1x torch")
    )

    # --- reduce-scatter copy-in: unsharded gradients -> reduce-scatter input (world_size chunks)
    for dst_dt in (bf16, fp32):
        grads = [_randn(s, bf16, gen) for s in LAYER_SHAPES]
        rs_in = torch.empty(N_FULL, dtype=dst_dt)
        rs_2d = rs_in.view(WORLD_SIZE, -1)
        flat_src = _randn(N_FULL, bf16, gen)
        flat_dst = torch.empty(N_FULL, dtype=dst_dt)

        def ours(grads=grads, rs_in=rs_in):
            ops.reduce_scatter_copy_in(grads, PADDED, WORLD_SIZE, rs_in)

        def torch_path(grads=grads, rs_2d=rs_2d):
            torch._chunk_cat(grads, 0, WORLD_SIZE, out=rs_2d)

        label = "bf16" if dst_dt == bf16 else "bf16->fp32"
        cases.append(
            Case(f"rs copy-in {label}", ours, torch_path, lambda d=flat_dst, s=flat_src: d.copy_(s),
                 n_real * es(bf16) + N_FULL * es(dst_dt), N_FULL * (es(bf16) + es(dst_dt)),
                 target=">= 1x torch")
        )

    # --- reduce-scatter copy-out: reduced flat shard / divide -> sharded gradients
    offsets = [sum(PADDED[:i]) for i in range(len(PADDED))]
    strides = [torch.empty(s).stride() for s in SHARD_SHAPES]
    n_real = sum(_numel(s) for s in SHARD_SHAPES)
    for src_dt, accumulate in ((fp32, False), (bf16, True)):
        shard_init = _randn(N_SHARD, src_dt, gen)
        shard = shard_init.clone()
        grads_init = [_randn(s, fp32, gen) for s in SHARD_SHAPES]
        grads = [g.clone() for g in grads_init]
        flat_src = _randn(N_SHARD, src_dt, gen)
        flat_dst = torch.empty(N_SHARD, dtype=fp32)

        def setup(shard=shard, shard_init=shard_init, grads=grads, grads_init=grads_init):
            # Both paths write their inputs in place (FSDP2 divides the reduce output in
            # place; accumulation grows the gradients): restore them, untimed.
            shard.copy_(shard_init)
            torch._foreach_copy_(grads, grads_init)

        def ours(shard=shard, grads=grads, accumulate=accumulate):
            ops.reduce_scatter_copy_out(shard, PADDED, grads, divide_factor=DIVIDE, accumulate=accumulate)

        def torch_path(shard=shard, grads=grads, accumulate=accumulate):
            # FSDP2 foreach_reduce: _div_if_needed, _to_dtype_if_needed, as_strided views that
            # become the gradients, or `grad += view` when a gradient exists.
            out = shard
            out.div_(DIVIDE)
            if out.dtype != fp32:
                out = out.to(fp32)
            for g, size, stride, off in zip(grads, SHARD_SHAPES, strides, offsets):
                view = torch.as_strided(out, size=size, stride=stride, storage_offset=off)
                if accumulate:
                    g += view

        if accumulate:
            nbytes = n_real * (es(src_dt) + 2 * es(fp32))
            floor = lambda d=flat_dst, s=flat_src: d.add_(s, alpha=1 / DIVIDE)  # noqa: E731
            floor_nbytes = N_SHARD * (es(src_dt) + 2 * es(fp32))
            label = "bf16->fp32 /8 acc"
        else:
            nbytes = n_real * (es(src_dt) + es(fp32))
            floor = lambda d=flat_dst, s=flat_src: d.copy_(s)  # noqa: E731
            floor_nbytes = N_SHARD * (es(src_dt) + es(fp32))
            label = "fp32 /8"
        cases.append(Case(f"rs copy-out {label}", ours, torch_path, floor, nbytes, floor_nbytes, setup=setup))
    return cases


IMPLS = ("ours", "torch", "floor")
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def measure(cases: list[Case], threads: int, rounds: int, warmup: int = 3, clock: str = "wall") -> dict:
    """{(case, impl): [seconds...]}, implementations interleaved round by round."""
    now = CLOCKS[clock]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    times: dict = {}
    try:
        for case in cases:
            fns = {"ours": case.ours, "torch": case.torch, "floor": case.floor}
            for r in range(warmup + rounds):
                order = IMPLS[r % 3:] + IMPLS[: r % 3]  # rotate who goes first
                for impl in order:
                    if case.setup is not None:
                        case.setup()
                    t0 = now()
                    fns[impl]()
                    dt = now() - t0
                    if r >= warmup:
                        times.setdefault((case.name, impl), []).append(dt)
    finally:
        torch.set_num_threads(prev)
    return times


def _machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = ""
    if hasattr(os, "getloadavg"):
        load = ", load average %.1f" % os.getloadavg()[0]
    return f"{model}, {os.cpu_count()} logical CPUs, torch {torch.__version__}{load}"


def table(rounds: int, threads_list=THREADS, clock: str = "wall", names=None) -> str:
    """Markdown table. GB/s from the fastest round; ratios from the fastest round, then (in
    parentheses) from the medians."""
    cases = [c for c in build_cases() if names is None or c.name in names]
    lines = [
        "| op | threads | ours GB/s | torch GB/s | floor GB/s | speed-up vs torch | ours / floor | target |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for threads in threads_list:
        times = measure(cases, threads, rounds, clock=clock)
        for c in cases:
            best = {i: min(times[(c.name, i)]) for i in IMPLS}
            med = {i: statistics.median(times[(c.name, i)]) for i in IMPLS}
            nbytes = {i: (c.floor_nbytes if i == "floor" else c.nbytes) for i in IMPLS}
            gbs = {i: nbytes[i] / best[i] / 1e9 for i in IMPLS}
            floor_ratio = lambda t: (nbytes["ours"] / t["ours"]) / (nbytes["floor"] / t["floor"])  # noqa: E731
            lines.append(
                f"| {c.name} | {threads} | {gbs['ours']:.1f} | {gbs['torch']:.1f} | {gbs['floor']:.1f} "
                f"| {best['torch'] / best['ours']:.2f}x ({med['torch'] / med['ours']:.2f}x) "
                f"| {floor_ratio(best):.2f} ({floor_ratio(med):.2f}) | {c.target} |"
            )
            print(
                f"{c.name:30s} t={threads} ms median/min: ours {med['ours'] * 1e3:7.2f}/{best['ours'] * 1e3:7.2f} "
                f"torch {med['torch'] * 1e3:7.2f}/{best['torch'] * 1e3:7.2f} "
                f"floor {med['floor'] * 1e3:7.2f}/{best['floor'] * 1e3:7.2f}",
                file=sys.stderr,
            )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- pytest-benchmark

try:
    import pytest
except ImportError:  # script use without pytest installed
    pytest = None

if pytest is not None:
    _CASES = None

    def _cases() -> list[Case]:
        global _CASES
        if _CASES is None:
            _CASES = build_cases()
        return _CASES

    _NAMES = [
        "copy-in fp32->bf16", "copy-in bf16", "copy-out bf16", "rs copy-in bf16",
        "rs copy-in bf16->fp32", "rs copy-out fp32 /8", "rs copy-out bf16->fp32 /8 acc",
    ]

    @pytest.mark.parametrize("threads", THREADS)
    @pytest.mark.parametrize("impl", IMPLS)
    @pytest.mark.parametrize("name", _NAMES)
    def test_packing_op(benchmark, name, impl, threads):
        case = next(c for c in _cases() if c.name == name)
        fn = {"ours": case.ours, "torch": case.torch, "floor": case.floor}[impl]
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            benchmark.group = f"{name} threads={threads}"
            benchmark.extra_info["bytes"] = case.floor_nbytes if impl == "floor" else case.nbytes
            benchmark.pedantic(fn, setup=case.setup, rounds=20, iterations=1, warmup_rounds=3)
        finally:
            torch.set_num_threads(prev)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per implementation (default 30)")
    p.add_argument("--threads", type=int, nargs="+", default=list(THREADS), help="torch.set_num_threads values")
    p.add_argument(
        "--clock", choices=sorted(CLOCKS), default="wall",
        help="wall: elapsed time; thread: CPU time of the calling thread, which leaves out time "
        "taken by other processes on a busy machine (meaningful with --threads 1 only)",
    )
    p.add_argument("--case", action="append", help="only this op (repeatable), e.g. 'copy-out bf16'")
    args = p.parse_args()
    print(f"Machine: {_machine()}; clock: {args.clock}; {args.rounds} rounds\n")
    print(table(args.rounds, args.threads, args.clock, args.case))


if __name__ == "__main__":
    main()
