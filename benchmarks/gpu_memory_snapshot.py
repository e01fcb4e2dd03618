"""Who holds the GPU memory: live CUDA blocks of a bench_gpu.py training config, torch FSDP2
against fsdp_native (or the config's two implementations), grouped by the innermost frame of
each block's allocation stack that lies in fsdp_native, torch's FSDP2, torchao, the optimizers
or the benchmarks.

    python3 benchmarks/gpu_memory_snapshot.py llama8b-nf4-qlora            # between steps
    python3 benchmarks/gpu_memory_snapshot.py llama8b-bf16 --at loss       # after the forward
    python3 benchmarks/gpu_memory_snapshot.py llama8b-bf16 --at peak       # at the third step's peak

Found the NF4 shards that kept the whole unsharded NF4 weights alive (BENCHMARKS.md, GPU).
Needs a GPU (torch.cuda.memory._record_memory_history); the fake process group at world size 8
as in bench_gpu.py.
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import sys

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import bench_gpu as B  # noqa: E402
from benchmarks import harness as H  # noqa: E402

_OURS = ("fsdp_native/", "fully_shard/", "torchao/", "benchmarks/", "torch/optim/")


def _where(frames: list[dict]) -> str:
    for f in frames:
        fn = f.get("filename", "")
        if any(s in fn for s in _OURS):
            return f"{fn.split('site-packages/')[-1]}:{f.get('line')} {f.get('name')}"
    return "(other)"


def groups(snapshot: dict) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for seg in snapshot["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated":
                out[_where(blk.get("frames", []))] += blk["size"]
    return out


def peak_groups(snapshot: dict, device: int = 0) -> tuple[int, int, collections.Counter]:
    """The live blocks at the highest point of the recorded allocations, by replaying the
    allocator's trace (every ``alloc``, less every ``free_requested``: when
    ``memory_allocated`` drops) from the start of the recording: (the highest bytes over the
    recording's start, the index of the trace event that reached it, those bytes grouped as
    ``groups`` does). Blocks allocated before the recording started are not seen."""
    trace = snapshot["device_traces"][device]
    total = best = best_at = 0
    sizes: dict[int, int] = {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            sizes[e["addr"]] = e["size"]
            total += e["size"]
            if total > best:
                best, best_at = total, i
        elif e["action"] == "free_requested" and e["addr"] in sizes:
            total -= sizes.pop(e["addr"])
    live: dict[int, dict] = {}
    for e in trace[: best_at + 1] if best else []:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_requested":
            live.pop(e["addr"], None)
    out: collections.Counter = collections.Counter()
    for e in live.values():
        out[_where(e.get("frames", []))] += e["size"]
    return best, best_at, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", choices=list(B.CONFIGS))
    ap.add_argument("--at", choices=["between", "loss", "peak"], default="between",
                    help="after two steps (between steps), after the third step's forward, or at the "
                         "highest point of three steps (the step's peak; found by replaying the allocator's trace)")  # fmt: skip
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a GPU")
    H.init_fake_process_group(B.WORLD_SIZE)
    env = B.Env(torch.device("cuda", torch.cuda.current_device()), smoke=False)
    mesh = B.make_mesh(env)
    tc = B.CONFIGS[args.config]
    for impl in tc.impls:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
        run = B.Run(impl, tc, env, mesh)
        for _ in range(2):
            run.step()
        loss = None
        if args.at == "peak":
            torch.cuda.reset_peak_memory_stats()
            run.step()
        if args.at == "loss":
            tokens, target = run.batch()
            loss = torch.nn.functional.cross_entropy(run.model(tokens).flatten(0, 1).float(), target.flatten())
        torch.cuda.synchronize()
        gc.collect()
        snap = torch.cuda.memory._snapshot()
        if args.at == "peak":
            top, at, g = peak_groups(snap, torch.cuda.current_device())
            print(f"== {args.config} {impl} (peak): {top / 2**20:.1f} MiB over its start at trace event {at} "
                  f"of {len(snap['device_traces'][torch.cuda.current_device()])} "
                  f"(max_memory_allocated: {(torch.cuda.max_memory_allocated() - base) / 2**20:.1f} MiB)")  # fmt: skip
        else:
            g = groups(snap)
            print(f"== {args.config} {impl} ({args.at}): {(torch.cuda.memory_allocated() - base) / 2**20:.1f} MiB over its start")
        for k, v in g.most_common(args.top):
            print(f"   {v / 2**20:9.1f} MiB  {k}")
        torch.cuda.memory._record_memory_history(enabled=None)
        del run, loss


if __name__ == "__main__":
    main()
