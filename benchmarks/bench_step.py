"""Training-step time of two FSDP2 implementations on the same model, in the same run.

    .venv/bin/python benchmarks/bench_step.py                      # torch vs fsdp_native
    .venv/bin/python benchmarks/bench_step.py --impl-b torch       # torch vs torch (validates the bench)
    .venv/bin/python benchmarks/bench_step.py --quick --configs overhead-fp32

For every config (model x precision) this runs, each in its own fresh processes:

1. timing: 2 ranks (CPU, gloo, OMP_NUM_THREADS=1) build the model twice from the same seed,
   shard one copy with implementation A and one with B, and run AdamW steps with a
   mean-square loss (output vs a random target of the same shape), alternating blocks of steps
   (A B, then B A, ...) after a warmup. Both copies see the same inputs at the same step, so
   their losses are compared as a sanity check. A step is zero_grad + forward + backward +
   optimizer.step; a barrier (not timed) precedes each step and the step time is the max over
   ranks. Medians are reported, of wall time and of the ranks' process CPU time (all threads),
   which is less sensitive to other load on the machine.
2. memory: 2 ranks running only implementation A (then only B), a few steps; peak RSS per rank
   via resource.getrusage(RUSAGE_SELF).ru_maxrss, and its growth over the RSS after importing
   torch and the implementation + init_process_group (before the model is built).
3. reference: the same model unsharded in one process (plain AdamW; for bf16 a bf16 compute
   copy with fp32 master weights, the math of FSDP2 mixed precision without communication).

An implementation is `torch` (torch.distributed.fsdp), `fsdp_native`, or any importable module
exposing `fully_shard`, `MixedPrecisionPolicy` and `FSDPModule`. Launching, the step and the
timing helpers are benchmarks/harness.py's.
"""
from __future__ import annotations

import argparse
import os
import sys

# Before torch is imported, here and in the spawned ranks (they re-import this module).
os.environ["OMP_NUM_THREADS"] = os.environ.get("BENCH_STEP_THREADS", "1")

import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import harness as H  # noqa: E402
from benchmarks.harness import LR, SEED, Trainer, load_impl, make_batch, max_over_ranks  # noqa: E402,F401
from benchmarks.models import MODEL_CONFIGS, ModelConfig, build_model  # noqa: E402

WORLD_SIZE = 2
CONFIG_NAMES = ["overhead-fp32", "compute-fp32", "compute-bf16"]
ALL_CONFIG_NAMES = [f"{m}-{p}" for m in MODEL_CONFIGS for p in ("fp32", "bf16")]

# (warmup steps per impl, measured steps per impl, steps per alternation block)
SCHEDULE = {
    "overhead": {"full": (5, 40, 2), "quick": (2, 10, 2)},
    "compute": {"full": (2, 16, 1), "quick": (1, 3, 1)},
    "comm": {"full": (2, 24, 1), "quick": (1, 4, 1)},
}
MEMORY_STEPS = {"full": 3, "quick": 2}


# --------------------------------------------------------------------------------------------
# helpers shared by all processes


def split_config(name: str) -> tuple[ModelConfig, str]:
    model, precision = name.rsplit("-", 1)
    if model not in MODEL_CONFIGS or precision not in ("fp32", "bf16"):
        raise ValueError(f"unknown config {name!r}; choose from {ALL_CONFIG_NAMES}")
    return MODEL_CONFIGS[model], precision


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


# --------------------------------------------------------------------------------------------
# rank bodies (run in spawned processes by harness.run_ranks)


def _timing_rank(rank: int, world_size: int, port: int, config: str, impls: list[str], sched):
    cfg, precision = split_config(config)
    H.init_pg(rank, world_size, port)
    trainers = [Trainer(impl, cfg, precision, rank) for impl in impls]
    warmup, measured, block = sched
    for _ in range(warmup):
        for tr in trainers:
            tr.step(record=False)
    rounds = -(-measured // block)
    for r in range(rounds):
        order = trainers if r % 2 == 0 else trainers[::-1]
        for tr in order:
            for _ in range(block):
                tr.step(record=True)
    times = [max_over_ranks(tr.times) for tr in trainers]
    cpu_times = [max_over_ranks(tr.cpu_times) for tr in trainers]
    dist.destroy_process_group()
    return {  # phases: rank 0's
        "times": times,
        "cpu_times": cpu_times,
        "phases": [tr.phases for tr in trainers],
        "losses": [tr.losses for tr in trainers],
    }


def _memory_rank(rank: int, world_size: int, port: int, config: str, impl: str, steps: int):
    cfg, precision = split_config(config)
    H.init_pg(rank, world_size, port)
    load_impl(impl)
    baseline = rss_mib()
    tr = Trainer(impl, cfg, precision, rank)
    for _ in range(steps):
        tr.step(record=True)
    dist.destroy_process_group()
    return {"rank": rank, "peak": rss_mib(), "baseline": baseline}


def _profile_rank(rank: int, world_size: int, port: int, config: str, impl: str, steps: int, out: str, clock: str):
    """Only `impl`; rank 0 runs `steps` steps (after a warmup) under cProfile.

    clock "wall": elapsed time; "thread": CPU time of rank 0's main thread (forward, backward and
    optimizer kernels and the Python around them; not gloo's threads, not time spent waiting)."""
    import cProfile
    import pstats

    cfg, precision = split_config(config)
    H.init_pg(rank, world_size, port)
    tr = Trainer(impl, cfg, precision, rank)
    for _ in range(3):
        tr.step(record=False)
    timer = {"wall": time.perf_counter, "thread": time.thread_time}[clock]
    prof = cProfile.Profile(timer) if rank == 0 else None
    if prof is not None:
        prof.enable()
    for _ in range(steps):
        tr.step(record=True)
    if prof is not None:
        prof.disable()
        prof.dump_stats(out)
        for key in ("tottime", "cumulative"):
            print(f"\n=== rank 0, {impl}, {config}, {steps} steps, {clock} clock, sorted by {key} ===")
            pstats.Stats(prof).strip_dirs().sort_stats(key).print_stats(30)
        sys.stdout.flush()
    times = max_over_ranks(tr.times)
    dist.destroy_process_group()
    return {"times": times}


def _reference_proc(config: str, steps: tuple[int, int]):
    """The same model unsharded in one process."""
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    cfg, precision = split_config(config)
    baseline = rss_mib()
    master = build_model(cfg, SEED)
    opt = torch.optim.AdamW(master.parameters(), lr=LR)
    if precision == "bf16":
        compute = build_model(cfg, SEED).to(torch.bfloat16)
        pairs = list(zip(master.parameters(), compute.parameters()))
    else:
        compute, pairs = master, []
    warmup, measured = steps
    times = []
    for i in range(warmup + measured):
        x, target = make_batch(cfg.input_shape, 0, i)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p32, p16 in pairs:
                p16.copy_(p32)
                p16.grad = None
        if pairs:
            x = x.to(torch.bfloat16)
        out = compute(x)
        loss = H.loss_fn(out, target)
        loss.backward()
        for p32, p16 in pairs:
            p32.grad = p16.grad.float()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"times": times, "peak": rss_mib(), "baseline": baseline}


_median_ms = H.median_ms
_iqr_ms = H.iqr_ms


def run_config(config: str, args) -> dict:
    cfg, _ = split_config(config)
    mode = "quick" if args.quick else "full"
    warmup, measured, block = SCHEDULE[cfg.name][mode]
    sched = (
        warmup if args.warmup is None else args.warmup,
        measured if args.steps is None else args.steps,
        block,
    )
    impls = [args.impl_a, args.impl_b]
    res: dict = {"config": config, "impls": impls, "schedule": sched}

    t0 = time.time()
    timing = H.run_ranks(_timing_rank, config, impls, sched, world_size=WORLD_SIZE)
    res["times"] = timing["times"]
    res["cpu_times"] = timing["cpu_times"]
    res["phases"] = timing["phases"]
    la, lb = timing["losses"]
    res["loss_first_last"] = [(ls[0], ls[-1]) for ls in timing["losses"]]
    res["max_rel_loss_diff"] = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(la, lb))
    print(f"  [{config}] timing done in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)

    if not args.no_memory:
        res["memory"] = []
        for impl in impls:
            ranks = H.run_ranks(_memory_rank, config, impl, MEMORY_STEPS[mode], world_size=WORLD_SIZE, all_ranks=True)
            res["memory"].append(sorted(ranks, key=lambda d: d["rank"]))
        print(f"  [{config}] memory done", file=sys.stderr, flush=True)

    if not args.no_reference:
        warmup, measured, _ = sched
        res["reference"] = H.run_single(_reference_proc, config, (warmup, measured))
        print(f"  [{config}] reference done", file=sys.stderr, flush=True)
    return res


def _label(impls: list[str], i: int) -> str:
    if impls[0] == impls[1]:
        return f"{impls[i]} ({'AB'[i]})"
    return impls[i]


def format_table(results: list[dict]) -> str:
    impls = results[0]["impls"]
    a, b = _label(impls, 0), _label(impls, 1)
    head = [
        "model",
        "precision",
        f"{a} ms/step",
        f"{b} ms/step",
        f"ratio {b}/{a}",
        f"CPU ms/step {a} / {b} (ratio)",
        "unsharded 1-proc ms/step",
        f"{a} peak RSS/rank MiB",
        f"{b} peak RSS/rank MiB",
        "max rel. loss diff",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        model, precision = r["config"].rsplit("-", 1)
        ta, tb = r["times"]
        cells = [model, precision]
        for t in (ta, tb):
            lo, hi = _iqr_ms(t)
            cells.append(f"{_median_ms(t):.0f} ({lo:.0f}-{hi:.0f})")
        cells.append(f"**{statistics.median(tb) / statistics.median(ta):.2f}**")
        ca, cb = (statistics.median(c) for c in r["cpu_times"])
        cells.append(f"{1e3 * ca:.0f} / {1e3 * cb:.0f} ({cb / ca:.2f})")
        ref = r.get("reference")
        cells.append(f"{_median_ms(ref['times']):.0f}" if ref else "-")
        for mem in r.get("memory", [None, None]):
            if mem is None:
                cells.append("-")
            else:
                peaks = " / ".join(f"{d['peak']:.0f}" for d in mem)
                growth = " / ".join(f"+{d['peak'] - d['baseline']:.0f}" for d in mem)
                cells.append(f"{peaks} ({growth})")
        cells.append(f"{r['max_rel_loss_diff']:.1e}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_phase_table(results: list[dict]) -> str:
    impls = results[0]["impls"]
    head = ["model", "precision", "implementation", "forward ms", "backward ms", "optimizer ms", "step ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        model, precision = r["config"].rsplit("-", 1)
        for i, phases in enumerate(r["phases"]):
            cols = [_median_ms([p[j] for p in phases]) for j in range(3)]
            total = _median_ms([sum(p) for p in phases])
            lines.append(
                "| " + " | ".join([model, precision, _label(impls, i), *(f"{c:.0f}" for c in cols), f"{total:.0f}"]) + " |"
            )
    return "\n".join(lines)


def describe_run(results: list[dict], argv: list[str]) -> str:
    sched = ", ".join(
        f"{r['config']}: {r['schedule'][0]} warmup + {r['schedule'][1]} measured steps/impl "
        f"in blocks of {r['schedule'][2]}"
        for r in results
    )
    return (
        f"Machine: {H.describe_machine()}; {WORLD_SIZE} ranks, gloo, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}.\n"
        f"Command: `{' '.join(['.venv/bin/python', 'benchmarks/bench_step.py', *argv])}`\n"
        f"Schedule: {sched}.\n"
        "Cells: median step time (interquartile range) over the measured steps, max over ranks; "
        "median CPU time per step (process CPU time of a rank, all its threads; max over ranks), "
        "less sensitive than wall time to other load on the machine; "
        "peak RSS per rank r0 / r1 (growth over the RSS after importing torch and the implementation + init_process_group), "
        "each implementation in its own processes."
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl-a", default="torch", help="baseline implementation (default: torch)")
    p.add_argument("--impl-b", default="fsdp_native", help="implementation under test (default: fsdp_native)")
    p.add_argument("--configs", nargs="+", default=CONFIG_NAMES, choices=ALL_CONFIG_NAMES)
    p.add_argument("--quick", action="store_true", help="fewer steps")
    p.add_argument("--steps", type=int, help="measured steps per implementation (overrides the schedule)")
    p.add_argument("--warmup", type=int, help="warmup steps per implementation (overrides the schedule)")
    p.add_argument("--no-memory", action="store_true", help="skip the per-implementation RSS runs")
    p.add_argument("--no-reference", action="store_true", help="skip the unsharded single-process reference")
    p.add_argument("--json", help="also write the raw results (all step times) to this file")
    p.add_argument(
        "--profile",
        metavar="IMPL",
        help="instead of the comparison: run only IMPL on the first --configs entry, cProfile rank 0, "
        "print the top functions and write the profile to --profile-out",
    )
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--profile-out", default="step.prof")
    p.add_argument("--profile-clock", choices=["wall", "thread"], default="wall")
    args = p.parse_args(argv)

    if args.profile:
        load_impl(args.profile)
        config = args.configs[0]
        res = H.run_ranks(
            _profile_rank,
            config,
            args.profile,
            args.profile_steps,
            args.profile_out,
            args.profile_clock,
            world_size=WORLD_SIZE,
        )
        print(f"{args.profile} {config}: median {_median_ms(res['times']):.0f} ms/step under cProfile; "
              f"profile written to {args.profile_out}")
        return

    for impl in {args.impl_a, args.impl_b}:
        load_impl(impl)  # fail early, in the launcher

    results = []
    for config in args.configs:
        print(f"running {config}: {args.impl_a} vs {args.impl_b}", file=sys.stderr, flush=True)
        results.append(run_config(config, args))

    print(describe_run(results, argv))
    print()
    print(format_table(results))
    print()
    print("Phases (rank 0, medians; forward includes zero_grad and the loss):")
    print()
    print(format_phase_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": argv, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
