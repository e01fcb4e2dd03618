"""Where a bench_gpu.py training config's step time goes, torch FSDP2 against fsdp_native.

    python3 benchmarks/profile_step_gpu.py llama8b-nf4-qlora [--steps 40] [--trace-dir DIR]
    python3 benchmarks/profile_step_gpu.py llama8b-bf16 --smoke        # CPU, tiny model

Both implementations are built as bench_gpu.py builds them (fake process group, world size 8)
and then, for each:

* **timing**: alternating blocks of 4 steps; the median step (synchronized before and after)
  and the median *host* time, from the step's start until ``step()`` returns, before the
  synchronization. A host time close to the step time means the GPU waits on the CPU;
* **profile** (``torch.profiler`` over 3 steps): the device's busy time (the union of its
  kernels and copies) and idle time within the profiled span, and the idle gaps of 50 us or
  more with the annotation (``FSDP::...``, ``Optimizer.step#...``) the host was inside when
  the gap began; the host time of each annotation per step; the ops with the most self CPU
  time; the launches per step: kernels, copies and fills on a GPU, and on a CPU the calls
  of the ops that would be one each (fills, copies, the packing ops). On CPU (``--smoke``)
  there are no device events: the host columns and those calls only.

The first 4 found on an H200 that torchao NF4 QLoRA's AdamW step spent 11.0 ms of CPU a step
with fsdp_native against 3.5 with torch FSDP2 (``BENCHMARKS.md``, "Measured on an H200,
eighth session"). ``--trace-dir`` also writes each implementation's Chrome trace, gzipped.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (_ROOT, os.path.join(_ROOT, "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

if "--smoke" in sys.argv:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench_gpu as B  # noqa: E402

GAP_US = 50  # device idle gaps reported one by one from this length


def _device_busy(events: list[dict]) -> tuple[float, float, list[tuple[float, float]]]:
    """(span, busy, gaps >= GAP_US as (length, start)) of the device events, in microseconds."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    if not spans:
        return 0.0, 0.0, []
    busy, gaps = 0.0, []
    cur_s, cur_e = spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            if s - cur_e >= GAP_US:
                gaps.append((s - cur_e, cur_e))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return cur_e - spans[0][0], busy, gaps  # the last merged interval ends last


def analyze_trace(trace: dict, steps: int) -> dict:
    """Device busy / idle and per-annotation host time per step from a Chrome trace."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    annotations = [e for e in ev if e.get("cat") == "user_annotation"]
    span, busy, gaps = _device_busy(device)
    # How many pieces of device work a step launches: on a GPU its kernels, copies and fills
    # (each a launch on the host and a gap on the device); on a CPU, the calls of the ops that
    # would launch one (fills and copies, torch's and fsdp_native's packing ops).
    if device:
        launches = collections.Counter(e["cat"] for e in device)
    else:
        launches = collections.Counter(
            e["name"] for e in ev if e.get("cat") == "cpu_op" and (e["name"] in _LAUNCHING_OPS or e["name"].startswith(("fsdp::", "fsdp_native::")))
        )
    gaps.sort(reverse=True)
    where = collections.Counter()
    for length, start in gaps:
        inside = [a for a in annotations if a["ts"] <= start <= a["ts"] + a["dur"]]
        name = min(inside, key=lambda a: a["dur"])["name"] if inside else "(no annotation)"
        where[_family(name)] += length
    host = collections.Counter()
    for a in annotations:
        host[_family(a["name"])] += a["dur"]
    return {
        "device_span_ms": span / 1e3 / steps,
        "device_busy_ms": busy / 1e3 / steps,
        "device_idle_ms": (span - busy) / 1e3 / steps,
        "idle_gaps_ms_by_annotation": {k: v / 1e3 / steps for k, v in where.most_common(8)},
        "host_ms_by_annotation": {k: v / 1e3 / steps for k, v in host.most_common(12)},
        "launches_per_step": {k: v / steps for k, v in sorted(launches.items())},
    }


# CPU ops counted as launches (``--smoke``): what would be one kernel each on a GPU.
_LAUNCHING_OPS = frozenset(
    {"aten::zeros", "aten::zero_", "aten::fill_", "aten::copy_", "aten::_foreach_copy_", "aten::split_with_sizes_copy", "aten::_chunk_cat", "aten::cat"}
)


def _family(name: str) -> str:
    """An annotation's name without its unit: 'FSDP::pre_backward (blocks.2)' -> 'FSDP::pre_backward'."""
    return name.split(" (", 1)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", choices=list(B.CONFIGS))
    ap.add_argument("--steps", type=int, default=40, help="timed steps per implementation (median)")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny model: exercise the code paths")
    ap.add_argument("--trace-dir", help="also write each implementation's Chrome trace here (gzipped)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.smoke:
        env = B.Env(torch.device("cpu"), smoke=True)
    else:
        if not torch.cuda.is_available():
            ap.error("no GPU: run with --smoke on a CPU")
        env = B.Env(torch.device("cuda", torch.cuda.current_device()), smoke=False)
    B.H.init_fake_process_group(B.WORLD_SIZE)
    mesh = B.make_mesh(env)
    tc = B.CONFIGS[args.config]
    runs = [B.Run(impl, tc, env, mesh) for impl in tc.impls]
    for _ in range(3):
        for r in runs:
            r.step()
    wall: dict[str, list[float]] = {r.impl: [] for r in runs}
    host: dict[str, list[float]] = {r.impl: [] for r in runs}
    for k in range(-(-args.steps // 4)):
        for r in runs if k % 2 == 0 else runs[::-1]:
            for _ in range(4):
                env.sync()
                t0 = time.perf_counter()
                r.step()
                t1 = time.perf_counter()
                env.sync()
                wall[r.impl].append(time.perf_counter() - t0)
                host[r.impl].append(t1 - t0)
    result: dict = {"config": tc.name, "device": str(env.device), "impls": {}}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.cuda else [])
    tmp = tempfile.mkdtemp()
    try:
        for r in runs:
            with profile(activities=activities) as prof:
                for _ in range(args.profile_steps):
                    r.step()
                env.sync()
            path = os.path.join(tmp, f"{r.impl}.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
            if args.trace_dir:
                os.makedirs(args.trace_dir, exist_ok=True)
                with open(path, "rb") as src, gzip.open(os.path.join(args.trace_dir, f"trace_{tc.name}_{r.impl}.json.gz"), "wb") as dst:
                    shutil.copyfileobj(src, dst)
            ka = prof.key_averages()
            top = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
            result["impls"][r.impl] = {
                "step_ms": 1e3 * statistics.median(wall[r.impl]),
                "host_ms": 1e3 * statistics.median(host[r.impl]),
                **analyze_trace(trace, args.profile_steps),
                "top_self_cpu_ms": {e.key: e.self_cpu_time_total / 1e3 / args.profile_steps for e in top},
            }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.destroy_process_group()
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def format_report(result: dict) -> str:
    impls = list(result["impls"])
    rows = [f"{result['config']} on {result['device']}: per step, ms", "", "| | " + " | ".join(impls) + " |",
            "|---|" + "---|" * len(impls)]
    keys = [("step_ms", "step (median)"), ("host_ms", "host, until step() returns (median)")]
    if any(result["impls"][i]["device_span_ms"] for i in impls):  # no device events on CPU
        keys += [("device_busy_ms", "device busy (profiled)"), ("device_idle_ms", "device idle within its span")]
    for key, label in keys:
        rows.append(f"| {label} | " + " | ".join(f"{result['impls'][i][key]:.2f}" for i in impls) + " |")
    for section, title in (("host_ms_by_annotation", "host time in"), ("idle_gaps_ms_by_annotation", "device idle (gaps >= 50 us) while the host was in"),
                           ("launches_per_step", "launches per step:"), ("top_self_cpu_ms", "self CPU time of")):
        names = list(dict.fromkeys(n for i in impls for n in result["impls"][i][section]))
        for n in names:
            rows.append(f"| {title} `{n}` | " + " | ".join(f"{result['impls'][i][section].get(n, 0.0):.2f}" for i in impls) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
