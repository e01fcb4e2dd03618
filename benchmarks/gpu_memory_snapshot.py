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

Without a GPU, ``--cpu`` replays a config on the CPU with the llama8b model scaled down
(``--dims``; by default every size / 8, and 4 heads of 128 so that the CPU attention's
seq x seq scores stay as small a share as flash attention's): the CPU allocator's every
allocation and free from torch's profiler (``profile_memory``), the highest bytes over the
step's start in the forward and in each block's backward (a marker allocation where a block's
output gradient arrives splits them), for both implementations, then who holds the memory at
the top of the segment where the two differ most:

    python3 benchmarks/gpu_memory_snapshot.py llama8b-bf16 --cpu

Found the unsharded parameters held over the reduce-scatter input's allocation (+81 MiB at
llama8b-bf16's step peak on an H100; BENCHMARKS.md, GPU).
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import sys

if "--cpu" in sys.argv:
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    os.environ.setdefault("FSDP_NATIVE_SPIN_US", "0")  # fake works never complete: no polling

import torch  # noqa: E402

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


_MARK = 100003  # marker allocation sizes: _MARK + i where block i's backward starts


def _frames(node) -> list[str]:
    out = []
    while node is not None:
        out.append(node.name)
        node = node.parent
    return out


def cpu_segments(run) -> tuple[dict, dict]:
    """One profiled step of `run` on the CPU: ({segment: highest bytes over the step's start},
    {segment: Counter of the live allocations at that point, by innermost frame of ours})."""
    handles = []
    for i, blk in enumerate(run.model.blocks):
        def on_output(mod, inp, out, i=i):
            def at_backward(grad):
                torch.empty(_MARK + i, dtype=torch.uint8)

            if out.requires_grad:
                out.register_hook(at_backward)

        handles.append(blk.register_forward_hook(on_output))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        run.step()
    for h in handles:
        h.remove()

    def walk(n):
        yield n
        for c in n.children:
            yield from walk(c)

    events = [n for r in prof.profiler.kineto_results.experimental_event_tree() for n in walk(r)
              if n.tag == torch._C._profiler._EventType.Allocation]  # fmt: skip
    events.sort(key=lambda n: n.start_time_ns)
    total, seg, tops, at = 0, "forward and loss", {}, {}
    for i, n in enumerate(events):
        size = n.extra_fields.alloc_size
        if _MARK <= size < _MARK + len(run.model.blocks):
            seg = f"backward of blocks.{size - _MARK}"
        total += size
        if total > tops.get(seg, -1):
            tops[seg], at[seg] = total, i
    held = {}
    for seg, i in at.items():
        live = {}
        for n in events[: i + 1]:
            f = n.extra_fields
            if f.alloc_size > 0:
                live[f.ptr] = n
            else:
                live.pop(f.ptr, None)
        c: collections.Counter = collections.Counter()
        for n in live.values():
            fr = _frames(n)
            c[next((x for x in fr if any(o in x for o in _OURS)), fr[1] if len(fr) > 1 else "(other)")] += n.extra_fields.alloc_size
        held[seg] = c
    return tops, held


def main_cpu(args) -> None:
    d, h, layers, heads, kv, vocab, seq = args.dims
    B.LLAMA_SMOKE = B.LlamaConfig(dim=d, hidden=h, n_layers=layers, n_heads=heads, n_kv_heads=kv, vocab=vocab, seq=seq)
    H.init_fake_process_group(B.WORLD_SIZE)
    env = B.Env(torch.device("cpu"), smoke=True)
    mesh = B.make_mesh(env)
    tc = B.CONFIGS[args.config]
    result = {}
    for impl in tc.impls:
        gc.collect()
        run = B.Run(impl, tc, env, mesh)
        for _ in range(2):
            run.step()
        gc.collect()
        result[impl] = cpu_segments(run)
        del run
    (a, (ta, ha)), (b, (tb, hb)) = result.items()
    print(f"== {args.config} on the CPU, dims {args.dims}: highest MiB over the step's start, {a} / {b}")
    for seg in ta:
        print(f"   {seg:22s} {ta[seg] / 2**20:9.2f} / {tb.get(seg, 0) / 2**20:9.2f}  ({(tb.get(seg, 0) - ta[seg]) / 2**20:+.2f})")
    worst = max(ta, key=lambda s: tb.get(s, 0) - ta[s])
    for name, held in ((a, ha), (b, hb)):
        print(f"== held at the top of the {worst}, {name}")
        for k, v in held[worst].most_common(args.top):
            print(f"   {v / 2**20:9.2f} MiB  {k[:120]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", choices=list(B.CONFIGS))
    ap.add_argument("--at", choices=["between", "loss", "peak"], default="between",
                    help="after two steps (between steps), after the third step's forward, or at the "
                         "highest point of three steps (the step's peak; found by replaying the allocator's trace)")  # fmt: skip
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--cpu", action="store_true", help="replay on the CPU with a scaled model (above); llama configs")
    ap.add_argument("--dims", type=int, nargs=7, default=[512, 1792, 4, 4, 1, 4000, 512],
                    metavar=("DIM", "HIDDEN", "LAYERS", "HEADS", "KV_HEADS", "VOCAB", "SEQ"), help="with --cpu")  # fmt: skip
    args = ap.parse_args()
    if args.cpu:
        if not args.config.startswith("llama") or args.config == "llama8b-float8":
            ap.error("--cpu replays the llama configs without torchao's float8 (its matmuls need a GPU)")
        return main_cpu(args)
    if not torch.cuda.is_available():
        ap.error("needs a GPU (or --cpu)")
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
