"""Issue 11's rare segfault, reproduced without fsdp_native: two all-gathers in flight at once on
one gloo process group corrupt the heap, with torch alone.

Two ranks on this machine build a ProcessGroupGloo directly (no default group, no DTensor, no
functional collectives, no fsdp_native), then repeat: issue two all-gathers of the same random
shape (1 to 1024 rows, 1 to 768 columns, fp32 or bf16) without waiting, wait for both, check
the data. The gloo group runs its collectives on `--threads` worker threads (torch's default: 2).

    .venv/bin/python scripts/gloo_race_repro.py --kind coalesced --threads 2   # crashes
    .venv/bin/python scripts/gloo_race_repro.py --kind coalesced --threads 1
    .venv/bin/python scripts/gloo_race_repro.py --kind base --threads 2

--kind coalesced: ProcessGroupGloo.allgather_coalesced, what torch's functional all-gather
  (DTensor.full_tensor / redistribute, funcol.all_gather_tensor) reaches on gloo through
  allgather_into_tensor_coalesced.
--kind base: ProcessGroupGloo._allgather_base, what dist.all_gather_into_tensor and
  dist.all_gather_single use (fsdp_native's and torch FSDP2's all-gathers).

A crash shows as glibc's "malloc(): unaligned tcache chunk detected" (SIGABRT) or a SIGSEGV in
malloc on a gloo worker thread, with every thread's C++ frames (c10's fatal-signal handler):
the same signature as the crashes seen in the test suite. Exit status: 0 when every run
finished, 1 when one crashed or a rank raised (the rest are not run). Figures: README "Tests and benchmarks".
"""
from __future__ import annotations

import argparse
import datetime
import random
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, kind: str, threads: int, iters: int, port: int) -> None:
    from torch.distributed import ProcessGroupGloo

    torch.set_num_threads(1)
    torch._C._set_print_stack_traces_on_fatal_signal(True)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_default_device()]
    opts._threads = threads
    opts._timeout = datetime.timedelta(seconds=60)
    pg = ProcessGroupGloo(store, rank, 2, opts)
    shapes = random.Random(1234)
    for it in range(iters):
        rows, cols = shapes.choice([1, 2, 3, 5, 8, 64, 257, 1024]), shapes.choice([1, 7, 64, 768])
        dtype = shapes.choice([torch.float32, torch.bfloat16])
        torch.manual_seed(it)  # the same data on both ranks
        x = torch.randn(rows, cols).to(dtype)
        y = x * 2
        out_x, out_y = torch.empty(2 * rows, cols, dtype=dtype), torch.empty(2 * rows, cols, dtype=dtype)
        if kind == "coalesced":
            wx = pg.allgather_coalesced([[c] for c in out_x.chunk(2)], [x])
            wy = pg.allgather_coalesced([[c] for c in out_y.chunk(2)], [y])
        else:
            wx = pg._allgather_base(out_x, x)
            wy = pg._allgather_base(out_y, y)
        wx.wait()
        wy.wait()
        if not (torch.equal(out_x, torch.cat([x, x])) and torch.equal(out_y, torch.cat([y, y]))):
            raise AssertionError(f"rank {rank}: wrong all-gather result at iteration {it}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=["coalesced", "base"], default="coalesced")
    ap.add_argument("--threads", type=int, default=2, help="gloo worker threads (torch's default: 2)")
    ap.add_argument("--iters", type=int, default=10000, help="iterations per run")
    ap.add_argument("--runs", type=int, default=10)
    a = ap.parse_args()
    for run in range(1, a.runs + 1):
        t0 = time.perf_counter()
        try:
            mp.start_processes(_worker, args=(a.kind, a.threads, a.iters, _free_port()), nprocs=2, start_method="spawn")
        except ProcessException as e:  # a rank killed by a signal, or one that raised
            what = "CRASHED" if isinstance(e, ProcessExitedException) else "FAILED"
            print(f"run {run}: {what} after {time.perf_counter() - t0:.0f} s: {str(e).strip().splitlines()[-1]}", flush=True)
            return 1
        print(f"run {run}: {a.iters} iterations, no crash ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
