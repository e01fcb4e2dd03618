"""Where a training step's time goes, on one of bench_step.py's models.

    .venv/bin/python benchmarks/step_anatomy.py                       # fsdp_native, overhead model
    .venv/bin/python benchmarks/step_anatomy.py --impl torch --model compute --steps 5
    .venv/bin/python benchmarks/step_anatomy.py --impl fsdp_native:fp8_rowwise --model compute --precision bf16

2 ranks (CPU, gloo, OMP_NUM_THREADS=1), AdamW, mean-square loss, as bench_step.py. Prints for
rank 0: the wall time per step; the CPU time per step of every thread of the process (from
/proc/self/task/*/stat: the main thread, gloo's TCP loop and worker threads); and, for
fsdp_native, the spans of `fsdp_native.record_trace()` summed per step (collectives from issue
to completion, stalls = compute waiting on a collective, packing copies).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import harness as H  # noqa: E402
from benchmarks.models import MODEL_CONFIGS, build_model, shard_model  # noqa: E402


def _thread_cpu_ms() -> dict[tuple[str, str], float]:
    tick_ms = 1000.0 / os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread exited
            continue
        out[(tid, name)] = (int(fields[11]) + int(fields[12])) * tick_ms  # utime + stime
    return out


def _rank(rank: int, world_size: int, port: int, impl_name: str, model: str, steps: int, precision: str = "fp32") -> None:
    H.init_pg(rank, world_size, port)
    impl = H.load_impl(impl_name)
    cfg = MODEL_CONFIGS[model]
    m = shard_model(build_model(cfg), impl.fully_shard, H.mixed_precision(impl, precision))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x, target = torch.randn(cfg.input_shape, generator=g), torch.randn(cfg.input_shape, generator=g)

    def step():
        H.train_step(m, opt, x, target)

    for _ in range(3):
        step()
    dist.barrier()
    before, t0 = _thread_cpu_ms(), time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    wall = (time.perf_counter() - t0) / steps * 1e3
    after = _thread_cpu_ms()
    spans = None
    if impl_name.startswith("fsdp_native"):
        import fsdp_native

        with fsdp_native.record_trace() as rec:
            for _ in range(steps):
                dist.barrier()
                step()
        spans = rec.spans
    if rank != 0:
        return
    print(f"{impl_name}, {model} model ({precision}), rank 0: {wall:.1f} ms/step over {steps} steps")
    print("CPU per step by thread (ms):")
    for key in sorted(after, key=lambda k: -(after[k] - before.get(k, 0.0))):
        ms = (after[key] - before.get(key, 0.0)) / steps
        if ms >= 0.5:
            print(f"  {key[1]:<18} {ms:7.1f}")
    if spans is not None:
        total, count = collections.defaultdict(float), collections.Counter()
        for s in spans:
            total[(s.lane, s.name)] += (s.end_us - s.start_us) / 1e3 / steps
            count[(s.lane, s.name)] += 1
        print("record_trace spans per step (ms, count); compute spans of nested units overlap:")
        for key in sorted(total, key=lambda k: -total[k]):
            print(f"  {key[0] + ' / ' + key[1]:<40} {total[key]:7.1f}  {count[key] / steps:5.0f}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", default="fsdp_native", help="fsdp_native or torch")
    ap.add_argument("--model", default="overhead", choices=list(MODEL_CONFIGS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = ap.parse_args()
    H.run_ranks(_rank, args.impl, args.model, args.steps, args.precision, world_size=2)


if __name__ == "__main__":
    main()
