"""``set_separate_reduce_scatter_group`` on CPU: the step time of one model trained with its
gradient reduce-scatters on the shard group (the default) and on a group of their own, 2 ranks
on gloo, the two alternating step by step in the same processes (one thread each). With
``--max-input-buffers K``, ``set_reduce_scatter_max_input_buffers(K)`` against the default (1)
instead.

    .venv/bin/python benchmarks/bench_separate_rs.py [--steps 12] [--dim 512] [--blocks 8] [--max-input-buffers K]

Model: ``--blocks`` residual MLP blocks (dim, 2 x dim hidden), each a unit, plus the root;
batch 32; AdamW. Prints the median step time (max over ranks) per mode, with its range, and
the ratio separate / shared (or k=K / k=1).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import harness as H  # noqa: E402


def _rank(rank: int, world_size: int, port: int, steps: int, dim: int, blocks: int, k: int | None) -> dict:
    H.init_pg(rank, world_size, port)
    torch.set_num_threads(1)
    import fsdp_native

    modes = ("shared", "separate") if k is None else ("k=1", f"k={k}")

    def make(mode: str):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, dim), *[H.ResidualMLP(dim, 2 * dim) for _ in range(blocks)], nn.Linear(dim, 1))
        for block in model[1:-1]:
            fsdp_native.fully_shard(block)
        fsdp_native.fully_shard(model)
        if mode == "separate":
            model.set_separate_reduce_scatter_group()
        elif mode == modes[1]:
            model.set_reduce_scatter_max_input_buffers(k)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    runs = {mode: make(mode) for mode in modes}
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(rank))
    for step in range(steps + 3):  # 3 warmup steps
        for mode in (modes if step % 2 else modes[::-1]):
            model, opt = runs[mode]
            dist.barrier()
            t0 = time.perf_counter()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if step >= 3:
                times[mode].append(t.item() * 1e3)
    return {mode: (statistics.median(v), min(v), max(v)) for mode, v in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--max-input-buffers", type=int, default=None, metavar="K")
    args = ap.parse_args(argv)
    res = H.run_ranks(_rank, args.steps, args.dim, args.blocks, args.max_input_buffers)
    for mode, (med, lo, hi) in res.items():
        print(f"{mode:9s} median {med:7.1f} ms  (range {lo:.1f}-{hi:.1f})")
    base, other = list(res)
    print(f"{other} / {base}: {res[other][0] / res[base][0]:.2f}")


if __name__ == "__main__":
    main()
