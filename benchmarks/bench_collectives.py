"""gloo collectives against fsdp_native's point-to-point exchanges (``fsdp_native._comm``),
2 ranks on CPU, back to back, each waited before the next.

    .venv/bin/python benchmarks/bench_collectives.py [--sizes-kib 129 1024 4096 9216] [--iters 10]

Per size (bytes of this rank's shard = of each per-peer message): all-gather with
``dist.all_gather_single`` vs ``_comm.all_gather`` (point-to-point forced), and a reduce-scatter
of a 2-chunk buffer as ``dist.all_reduce`` (what the runtime uses on gloo below the threshold)
vs ``_comm.sum_into_own_chunk``. Cells: median wall ms per call (max over ranks) and the
process CPU ms per call (all threads, rank 0), over 3 rounds.
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

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import harness as H  # noqa: E402


def _rank(rank: int, world_size: int, port: int, sizes_kib: list[int], iters: int):
    H.init_pg(rank, world_size, port)
    from fsdp_native import _comm, _compat

    _comm.P2P_MIN_BYTES = 1
    group = dist.group.WORLD
    rows = []
    for kib in sizes_kib:
        n = kib * 1024 // 4
        shard, out, buf = torch.randn(n), torch.empty(2 * n), torch.randn(2 * n)
        cases = {
            "all-gather: all_gather_single": lambda: _compat.all_gather_single(out, shard, group=group, async_op=True).wait(),
            "all-gather: point-to-point": lambda: _comm.all_gather(out, shard, group, rank, 2).wait(),
            "reduce-scatter: all_reduce": lambda: dist.all_reduce(buf, group=group, async_op=True).wait(),
            "reduce-scatter: point-to-point": lambda: _comm.sum_into_own_chunk(buf, group, rank).wait(),
        }
        results = {name: ([], []) for name in cases}
        for _ in range(3):
            for name, fn in cases.items():
                fn()
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(iters):
                    fn()
                wall = torch.tensor((time.perf_counter() - t0) / iters * 1e3)
                cpu = (time.process_time() - c0) / iters * 1e3
                dist.all_reduce(wall, op=dist.ReduceOp.MAX)
                results[name][0].append(wall.item())
                results[name][1].append(cpu)
        for name, (walls, cpus) in results.items():
            rows.append((kib, name, statistics.median(walls), statistics.median(cpus)))
    dist.destroy_process_group()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-kib", type=int, nargs="+", default=[129, 1024, 4096, 9216])
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    rows = H.run_ranks(_rank, args.sizes_kib, args.iters, world_size=2)
    print("| KiB per peer | operation | wall ms | CPU ms (rank 0) |")
    print("|---|---|---|---|")
    for kib, name, wall, cpu in rows:
        print(f"| {kib} | {name} | {wall:.2f} | {cpu:.2f} |")


if __name__ == "__main__":
    main()
