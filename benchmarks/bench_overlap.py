"""Communication/compute overlap of torch FSDP2 and fsdp_native, side by side in the same run.

    .venv/bin/python benchmarks/bench_overlap.py --quick              # a few minutes (compute-bound model
                                                                        # on a quarter of its batch)
    .venv/bin/python benchmarks/bench_overlap.py --timeline-dir docs/img --markdown build/overlap/overlap.md
    bash scripts/overlap.sh                                             # the same: tables + docs/img PNGs

For each model of benchmarks/models.py (overhead-bound, compute-bound; fp32) and each
configuration (prefetch: implicit, explicit depth 1 or 2 via ``set_modules_to_forward_prefetch``
/ ``set_modules_to_backward_prefetch`` on every block with its next 1 or 2 blocks; blocks'
``reshard_after_forward`` True or False; the root keeps the default), 2 ranks (CPU, gloo,
OMP_NUM_THREADS=1) measure, alternating in every round (order reversed every other round):

(a) compute: the same model *unsharded* (a plain ``nn.Module`` built from the same seed, every
    rank holding all parameters), forward + backward on the same batches. Pure compute: no
    communication and no FSDP runtime work (hooks, copy-in/copy-out), which both
    implementations pay and which therefore counts as exposed time below.
(b) comm: each implementation's collectives with no compute. One step per implementation is
    run with torch.distributed's collectives wrapped (``all_gather_single`` /
    ``all_gather_into_tensor``, ``reduce_scatter_single`` / ``reduce_scatter_tensor``,
    ``all_reduce``) to log every collective it issues (sizes, dtype, op, group, order: torch
    FSDP2 one reduce-scatter per unit, fsdp_native one per 2 MiB bucket); the replay issues
    the same collectives one after the other, each waited before the next.
(c) step: forward + backward of the sharded model (``zero_grad`` included; no optimizer step,
    which has no communication).

Each timed item starts after a barrier and its time is the max over ranks; cells are medians.
    exposed communication = step - compute
    overlap efficiency    = (compute + comm - step) / min(compute, comm)
both computed per round (a step against the compute and comm timed in the same round), then
the median over rounds.
(1: communication fully hidden; 0: none hidden; negative: the step costs more than compute and
communication back to back, i.e. runtime overhead.)

After the warmup, one untimed step per implementation is traced: fsdp_native with
``fsdp_native.record_trace()``; torch FSDP2 (which has no recorder) with ``TorchTracer`` below,
timestamps around its hooks and collectives in the same span format. Their stall (time the
training thread waited on communication) is reported, and for one configuration (compute-bound,
implicit prefetch, reshard_after_forward=True) both are written as Chrome traces and drawn with
``fsdp_native.plot_timeline`` when ``--timeline-dir`` is given.

Launching, the batches and the timing helpers are benchmarks/harness.py's.
"""
from __future__ import annotations

import os
import sys

# Before torch is imported, here and in the spawned ranks (they re-import this module).
os.environ["OMP_NUM_THREADS"] = os.environ.get("BENCH_STEP_THREADS", "1")

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import harness as H  # noqa: E402
from benchmarks.models import MODEL_CONFIGS, build_model, shard_model  # noqa: E402

WORLD_SIZE = 2

IMPLS = ["torch", "fsdp_native"]
PREFETCH = ["implicit", "explicit-1", "explicit-2"]
RESHARD = [True, False]
TIMELINE_CONFIG = ("compute", "implicit", True)
# (warmup steps per implementation before the traced step, measured rounds)
SCHEDULE = {
    "overhead": {"full": (3, 15), "quick": (2, 7)},
    "compute": {"full": (1, 5), "quick": (0, 5)},
}
# --quick runs the compute-bound model on a quarter of its per-rank batch (2x128 tokens
# instead of 8x128): a quarter of the compute, the same communication.
QUICK_INPUT_SHAPE = {"compute": (2, 128, 768)}
SEED = H.SEED


def now_us() -> float:
    return time.perf_counter_ns() / 1e3  # the clock of fsdp_native's recorder


# --------------------------------------------------------------------------------------------
# Collective logging (both implementations) and torch FSDP2 tracing


class CommLog:
    """Wraps torch.distributed's collectives while active: logs every call (for the replay)
    and, with a recorder, records its span. A collective called synchronously is also a
    stall: the calling thread waited for it."""

    NAMES = {
        "all_gather_single": "all_gather",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_single": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
        "all_reduce": "all_reduce",
    }

    def __init__(self, rec=None, unit_of=lambda: "") -> None:
        self.entries: list[dict] = []
        self.issue_ms: dict[str, float] = {}  # time inside asynchronous calls, per kind
        self.rec = rec
        self.unit_of = unit_of
        self._orig: dict = {}

    def __enter__(self) -> "CommLog":
        for name, kind in self.NAMES.items():
            orig = getattr(dist, name, None)
            if orig is None:  # torch < 2.13 has only the older names
                continue
            self._orig[name] = orig
            setattr(dist, name, functools.partial(self._call, orig, kind))
        # fsdp_native's point-to-point exchanges on gloo (large messages) are collectives too.
        from fsdp_native import _comm

        self._p2p_orig = (_comm.all_gather, _comm.sum_into_own_chunk)
        _comm.all_gather = functools.partial(self._p2p_all_gather, _comm.all_gather)
        _comm.sum_into_own_chunk = functools.partial(self._p2p_reduce, _comm.sum_into_own_chunk)
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._orig.items():
            setattr(dist, name, orig)
        from fsdp_native import _comm

        _comm.all_gather, _comm.sum_into_own_chunk = self._p2p_orig

    def _p2p_all_gather(self, orig, out, inp, group, rank, size):
        work = orig(out, inp, group, rank, size)  # a collective below the threshold logs itself
        if getattr(work, "pollable", True) is False:
            self.entries.append(dict(kind="all_gather_p2p", dtype=out.dtype, out_numel=out.numel(), in_numel=inp.numel(), group=group, rank=rank, size=size))
        return work

    def _p2p_reduce(self, orig, inp, group, rank, average=False):
        self.entries.append(dict(kind="reduce_scatter_p2p", dtype=inp.dtype, out_numel=inp.numel(), in_numel=inp.numel(), group=group, rank=rank, average=average))
        return orig(inp, group, rank, average)

    def _call(self, orig, kind, *args, **kwargs):
        # Normalise positional/keyword forms of the three signatures.
        if kind == "all_reduce":
            names = ("tensor", "op", "group", "async_op")
        elif kind == "all_gather":
            names = ("output", "input", "group", "async_op")
        else:
            names = ("output", "input", "op", "group", "async_op")
        a = dict(zip(names, args))
        for k, v in kwargs.items():
            a[{"output_tensor": "output", "input_tensor": "input"}.get(k, k)] = v
        t = a.get("tensor", a.get("output"))
        inp = a.get("input")
        entry = {
            "kind": kind,
            "dtype": t.dtype,
            "out_numel": t.numel(),
            "in_numel": inp.numel() if inp is not None else 0,
            "op": a.get("op", dist.ReduceOp.SUM),
            "group": a.get("group"),
        }
        self.entries.append(entry)
        unit = self.unit_of()
        t0 = now_us()
        work = orig(*args, **kwargs)
        if work is not None:
            self.issue_ms[kind] = self.issue_ms.get(kind, 0.0) + (now_us() - t0) / 1e3
        if self.rec is not None:
            nbytes = (inp if kind == "reduce_scatter" else t).numel() * t.element_size()
            if work is None:  # synchronous: the caller stalled for the whole collective
                t1 = now_us()
                self.rec.span(kind, kind, unit, t0, t1, nbytes)
                self.rec.span(f"wait_{kind}", "stall", unit, t0, t1)
            else:
                self.rec.collective(kind, kind, unit, work, t0, nbytes)
        return work


class TorchTracer:
    """Spans of torch FSDP2 in fsdp_native's recorder format (lanes compute, all_gather,
    reduce_scatter, all_reduce, copy, stall), from timestamps around its hooks:

    * forward compute of a unit: a forward pre-hook registered after FSDP2's (so after its
      unshard and wait) to a forward hook registered before FSDP2's (so before its reshard);
    * backward compute: end of ``FSDPParamGroup.pre_backward`` to start of ``post_backward``;
    * collectives: ``CommLog`` (on CPU FSDP2 issues them with ``async_op=False``: streams are
      no-ops there, so each one is also a stall);
    * copy: ``foreach_all_gather_copy_out`` and ``foreach_reduce_scatter_copy_in``.
    """

    def __init__(self, model) -> None:
        from fsdp_native._trace import Recorder
        from torch.distributed.fsdp import FSDPModule

        self.rec = Recorder()
        self.rec.begin_step()
        self.modules = {fqn: m for fqn, m in model.named_modules() if isinstance(m, FSDPModule)}
        self._unit = threading.local()
        self.comm = CommLog(self.rec, lambda: getattr(self._unit, "name", "?"))
        self._undo: list = []

    def _set_unit(self, name):
        prev = getattr(self._unit, "name", "?")
        self._unit.name = name
        return prev

    def __enter__(self) -> "TorchTracer":
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

        rec, starts = self.rec, {}
        for fqn, m in self.modules.items():
            def pre(mod, args, fqn=fqn):
                starts[fqn] = now_us()

            def post(mod, args, out, fqn=fqn):
                rec.span("forward", "compute", fqn, starts.pop(fqn, now_us()), now_us())

            self._undo.append(m.register_forward_pre_hook(pre).remove)
            self._undo.append(m.register_forward_hook(post, prepend=True).remove)

        G = pg.FSDPParamGroup
        orig_unshard, orig_pre_bwd, orig_post_bwd = G.unshard, G.pre_backward, G.post_backward
        bwd_start: dict = {}
        tracer = self

        def unshard(group, *a, **k):
            prev = tracer._set_unit(group._module_fqn or "")
            try:
                return orig_unshard(group, *a, **k)
            finally:
                tracer._set_unit(prev)

        def pre_backward(group, *a, **k):
            out = orig_pre_bwd(group, *a, **k)
            bwd_start.setdefault(group, now_us())
            return out

        def post_backward(group, *a, **k):
            t0 = bwd_start.pop(group, None)
            if t0 is not None:
                rec.span("backward", "compute", group._module_fqn or "", t0, now_us())
            prev = tracer._set_unit(group._module_fqn or "")
            try:
                return orig_post_bwd(group, *a, **k)
            finally:
                tracer._set_unit(prev)

        def timed(orig, name):
            def f(*a, **k):
                t0 = now_us()
                try:
                    return orig(*a, **k)
                finally:
                    rec.span(name, "copy", getattr(tracer._unit, "name", "?"), t0, now_us())

            return f

        patches = [
            (G, "unshard", unshard),
            (G, "pre_backward", pre_backward),
            (G, "post_backward", post_backward),
            (pg, "foreach_all_gather_copy_out", timed(pg.foreach_all_gather_copy_out, "all_gather_copy_out")),
            (coll, "foreach_reduce_scatter_copy_in", timed(coll.foreach_reduce_scatter_copy_in, "reduce_scatter_copy_in")),
        ]
        for obj, name, new in patches:
            old = getattr(obj, name)
            setattr(obj, name, new)
            self._undo.append(functools.partial(setattr, obj, name, old))
        self.comm.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.comm.__exit__(*exc)
        for undo in reversed(self._undo):
            undo()
        self._undo = []


# --------------------------------------------------------------------------------------------
# rank body


class Runner:
    """One sharded model of one implementation in one configuration."""

    def __init__(self, impl: str, cfg, mesh, prefetch: str, raf: bool) -> None:
        fully_shard = H.load_impl(impl).fully_shard
        model = build_model(cfg, SEED)

        def shard(module, **kw):
            # Blocks get `raf`; the root keeps the default (it keeps its parameters).
            extra = {} if module is model else {"reshard_after_forward": raf}
            return fully_shard(module, mesh=mesh, **extra, **kw)

        self.model = shard_model(model, shard)
        if prefetch.startswith("explicit"):
            depth = int(prefetch.split("-")[1])
            blocks = list(model.blocks)
            for i, b in enumerate(blocks):
                if i + 1 < len(blocks):
                    b.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + depth])
                if i > 0:
                    b.set_modules_to_backward_prefetch(blocks[max(0, i - depth) : i][::-1])
        self.impl, self.cfg = impl, cfg
        self.steps = 0

    def step(self) -> None:
        step_fwd_bwd(self.model, self.cfg, self.steps)
        self.steps += 1


def step_fwd_bwd(model, cfg, i: int) -> None:
    x, target = H.make_batch(cfg.input_shape, dist.get_rank(), i)
    model.zero_grad(set_to_none=True)
    H.loss_fn(model(x), target).backward()


class Replay:
    """Issues a logged sequence of collectives, one after the other, each waited."""

    def __init__(self, entries: list[dict]) -> None:
        self.entries = entries
        sizes: dict = {}
        for e in entries:
            sizes[e["dtype"]] = max(sizes.get(e["dtype"], 0), e["out_numel"], e["in_numel"])
        self.bufs = {dt: (torch.zeros(n, dtype=dt), torch.zeros(n, dtype=dt)) for dt, n in sizes.items()}

    def run(self) -> None:
        from fsdp_native import _comm, _compat

        for e in self.entries:
            out, inp = self.bufs[e["dtype"]]
            out = out[: e["out_numel"]]
            if e["kind"] == "all_gather_p2p":
                _comm.all_gather(out, inp[: e["in_numel"]], e["group"], e["rank"], e["size"]).wait()
            elif e["kind"] == "reduce_scatter_p2p":
                _comm.sum_into_own_chunk(out, e["group"], e["rank"], e["average"]).wait()
            elif e["kind"] == "all_gather":
                _compat.all_gather_single(out, inp[: e["in_numel"]], group=e["group"])
            elif e["kind"] == "reduce_scatter":
                _compat.reduce_scatter_single(out, inp[: e["in_numel"]], op=e["op"], group=e["group"])
            else:
                dist.all_reduce(out, op=e["op"], group=e["group"])

    def describe(self) -> dict:
        kinds: dict = {}
        for e in self.entries:
            k = kinds.setdefault(e["kind"], {"count": 0, "bytes": 0})
            k["count"] += 1
            n = e["in_numel"] if e["kind"] == "reduce_scatter" else e["out_numel"]
            k["bytes"] += n * e["dtype"].itemsize
        return kinds


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _breakdown(rec) -> dict:
    """ms per (lane, name) of a traced step, summed over units; stall and copy lanes only."""
    out: dict = {}
    for s in rec.spans:
        if s.lane in ("stall", "copy"):
            out[s.name] = out.get(s.name, 0.0) + (s.end_us - s.start_us) / 1e3
    return out


def _traced_step(runner: Runner, trace_path: str | None) -> tuple[list[dict], dict]:
    """One untimed step with the collectives logged and the timeline recorded."""
    dist.barrier()  # both ranks' traces start together (each is relative to its own start)
    if runner.impl == "fsdp_native":
        import fsdp_native

        with fsdp_native.record_trace() as rec, CommLog() as log:
            runner.step()
    else:
        with TorchTracer(runner.model) as tracer:
            runner.step()
        rec, log = tracer.rec, tracer.comm
    dist.barrier()
    if trace_path:
        rec.export_chrome_trace(trace_path)
    breakdown = _breakdown(rec)
    for kind, ms in log.issue_ms.items():  # the synchronous part of asynchronous collectives
        breakdown[f"issue_{kind}"] = ms
    blocks = sum(s.end_us - s.start_us for s in rec.spans if s.lane == "compute" and s.unit != "") / 1e3
    info = {"stall_ms": rec.stall_us() / 1e3, "breakdown_ms": breakdown, "blocks_compute_ms": blocks}
    return log.entries, info


def model_config(model_name: str, quick: bool):
    cfg = MODEL_CONFIGS[model_name]
    if quick and model_name in QUICK_INPUT_SHAPE:
        cfg = dataclasses.replace(cfg, input_shape=QUICK_INPUT_SHAPE[model_name])
    return cfg


def _overlap_rank(rank: int, world_size: int, port: int, model_name: str, quick: bool, configs: list, sched, trace_dir):
    from torch.distributed.device_mesh import init_device_mesh

    H.init_pg(rank, world_size, port)
    cfg = model_config(model_name, quick)
    mesh = init_device_mesh("cpu", (world_size,))
    plain = build_model(cfg, SEED)
    warmup, measured = sched
    plain_steps = [0]

    def compute_step():
        step_fwd_bwd(plain, cfg, plain_steps[0])
        plain_steps[0] += 1

    compute_step()  # warmup of the unsharded model
    results = []
    for prefetch, raf in configs:
        t_cfg = time.time()
        runners = [Runner(impl, cfg, mesh, prefetch, raf) for impl in IMPLS]
        for _ in range(warmup):
            for r in runners:
                r.step()
        replays, traced = {}, {}
        for r in runners:
            path = None
            if trace_dir and (model_name, prefetch, raf) == TIMELINE_CONFIG:
                path = os.path.join(trace_dir, f"overlap_{r.impl}_rank{rank}.json")
            entries, traced[r.impl] = _traced_step(r, path)
            replays[r.impl] = Replay(entries)
            replays[r.impl].run()  # warmup of the replay buffers
        items = [("compute", compute_step)]
        for r in runners:
            items += [(f"step:{r.impl}", r.step), (f"comm:{r.impl}", replays[r.impl].run)]
        times: dict = {name: [] for name, _ in items}
        for k in range(measured):
            for name, fn in items if k % 2 == 0 else items[::-1]:
                times[name].append(_timed(fn))
        times = {name: H.max_over_ranks(ts) for name, ts in times.items()}
        results.append(
            {
                "model": model_name,
                "prefetch": prefetch,
                "reshard_after_forward": raf,
                "times": times,
                "traced": traced,
                "collectives": {impl: rp.describe() for impl, rp in replays.items()},
            }
        )
        if rank == 0:
            print(f"  [{model_name} {prefetch} raf={raf}] {time.time() - t_cfg:.0f}s", file=sys.stderr, flush=True)
        del runners, replays
        gc.collect()
    dist.destroy_process_group()
    return results


# --------------------------------------------------------------------------------------------
# launcher and report


def _med_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs)


def metrics(r: dict, impl: str) -> dict:
    """Medians of compute, comm and step, and of the per-round exposed communication and
    overlap efficiency (each round's step against the compute and comm timed in the same
    round, which cancels most of the drift of a shared machine's load)."""
    C, M, S = (r["times"][k] for k in ("compute", f"comm:{impl}", f"step:{impl}"))
    exposed = [s - c for c, s in zip(C, S)]
    eff = [(c + m - s) / min(c, m) for c, m, s in zip(C, M, S)]
    return {
        "compute": _med_ms(C), "comm": _med_ms(M), "step": _med_ms(S),
        "exposed": _med_ms(exposed), "eff": statistics.median(eff),
    }


def format_tables(results: list[dict]) -> str:
    t, n = IMPLS
    head = [
        "model", "reshard after fwd", "prefetch", "compute ms",
        f"comm ms {t} / {n}", f"step ms {t} / {n}",
        f"exposed comm ms {t} / {n}", f"overlap eff. {t} / {n}",
        f"rounds with {n} step < {t} step", f"traced stall ms {t} / {n}", "targets met",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        a, b = metrics(r, t), metrics(r, n)
        met = b["exposed"] <= a["exposed"] and b["eff"] > a["eff"]
        sa, sb = (r["traced"][i]["stall_ms"] for i in (t, n))
        # exposed_n - exposed_t = step_n - step_t within a round: the compute cancels.
        wins = sum(x < y for x, y in zip(r["times"][f"step:{n}"], r["times"][f"step:{t}"]))
        lines.append(
            "| " + " | ".join([
                r["model"], str(r["reshard_after_forward"]), r["prefetch"], f"{a['compute']:.0f}",
                f"{a['comm']:.0f} / {b['comm']:.0f}", f"{a['step']:.0f} / {b['step']:.0f}",
                f"{a['exposed']:.0f} / **{b['exposed']:.0f}**", f"{a['eff']:.2f} / **{b['eff']:.2f}**",
                f"{wins}/{len(r['times']['compute'])}", f"{sa:.0f} / {sb:.0f}", "yes" if met else "**no**",
            ]) + " |"
        )
    lines += ["", "Collectives per step (from the logged step; count, MiB):", ""]
    lines += ["| model | reshard after fwd | " + " | ".join(IMPLS) + " |", "|---|---|" + "---|" * len(IMPLS)]
    seen = set()
    for r in results:
        key = (r["model"], r["reshard_after_forward"])
        if key in seen:
            continue
        seen.add(key)
        cells = []
        for impl in IMPLS:
            d = r["collectives"][impl]
            cells.append(", ".join(f"{k} {v['count']} x ({v['bytes'] / 2**20:.1f} MiB)" for k, v in sorted(d.items())))
        lines.append(f"| {r['model']} | {r['reshard_after_forward']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Where the traced step waited (ms, rank 0): wait_* = the training thread blocked on a collective "
        "(torch: every collective, they are synchronous on CPU); issue_* = time inside the call that issues an "
        "asynchronous collective; *_copy_* = packing. Blocks' compute = sum of the blocks' forward and backward "
        "compute spans (the root's own layers excluded), against which compute alone can be compared: "
        "communication running beside compute on the same cores slows it down.",
        "",
    ]
    lines += [
        f"| model | reshard after fwd | prefetch | blocks' compute ms {t} / {n} | " + " | ".join(IMPLS) + " |",
        "|---|---|---|---|" + "---|" * len(IMPLS),
    ]
    for r in results:
        ca, cb = (r["traced"][i]["blocks_compute_ms"] for i in (t, n))
        cells = [f"{ca:.0f} / {cb:.0f}"]
        for impl in IMPLS:
            bd = r["traced"][impl]["breakdown_ms"]
            cells.append(", ".join(f"{k} {v:.0f}" for k, v in sorted(bd.items(), key=lambda kv: -kv[1]) if v >= 0.5) or "-")
        lines.append(f"| {r['model']} | {r['reshard_after_forward']} | {r['prefetch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def schedule(model_name: str, args) -> tuple[int, int]:
    warmup, rounds = SCHEDULE[model_name]["quick" if args.quick else "full"]
    return warmup, args.rounds or rounds


def describe_run(argv: list[str], args) -> str:
    sched = "; ".join(
        f"{m} (dim {c.dim}, hidden {c.hidden}, {c.n_blocks} blocks, per-rank input {'x'.join(map(str, c.input_shape))}): "
        f"{schedule(m, args)[0]} warmup + 1 traced step per implementation, {schedule(m, args)[1]} measured rounds"
        for m in args.models
        for c in [model_config(m, args.quick)]
    )
    return (
        f"Machine: {os.cpu_count()} cores ({H.cpu_name()}), torch {torch.__version__}; {WORLD_SIZE} ranks, gloo, "
        f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, fp32.\n"
        f"Command: `{' '.join(['.venv/bin/python', 'benchmarks/bench_overlap.py', *argv])}`\n"
        f"Schedule: {sched}; a round times compute, each implementation's step and its comm replay, "
        "in alternating order; each time is the max over ranks; cells are medians over rounds (exposed "
        "communication and overlap efficiency are computed per round, then the median taken)."
    )


def plot(trace_dir: str, impl: str, png: str) -> None:
    """Draws both ranks' traces of the timeline step with fsdp_native.plot_timeline. The root's
    compute spans enclose every block's, so they are left out of the drawing (not of the
    Chrome traces) to let the blocks' compute and the gaps between them show."""
    import fsdp_native

    paths = []
    for r in range(WORLD_SIZE):
        src = os.path.join(trace_dir, f"overlap_{impl}_rank{r}.json")
        with open(src) as f:
            trace = json.load(f)
        trace["traceEvents"] = [
            e for e in trace["traceEvents"] if not (e.get("cat") == "compute" and e["args"].get("unit") == "")
        ]
        dst = os.path.join(trace_dir, f"overlap_{impl}_rank{r}.blocks.json")
        with open(dst, "w") as f:
            json.dump(trace, f)
        paths.append(dst)
    model, pf, raf = TIMELINE_CONFIG
    how = "fsdp_native.record_trace" if impl == "fsdp_native" else "timestamps around FSDP2's hooks and collectives"
    fsdp_native.plot_timeline(
        paths, png, title=f"{impl}: {model}-bound model, {pf} prefetch, reshard_after_forward={raf}, one step ({how})"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps")
    p.add_argument("--rounds", type=int, help="measured rounds per configuration (default: from the schedule)")
    p.add_argument("--models", nargs="+", default=["overhead", "compute"], choices=list(MODEL_CONFIGS))
    p.add_argument("--prefetch", nargs="+", default=PREFETCH, choices=PREFETCH)
    p.add_argument("--reshard", nargs="+", default=["True", "False"], choices=["True", "False"])
    p.add_argument("--timeline-dir", help="write the timeline PNGs overlap_<impl>.png here")
    p.add_argument("--trace-dir", default="build/overlap/trace", help="Chrome traces of the timeline step (default: %(default)s)")
    p.add_argument("--markdown", help="also write the run description and tables to this file")
    p.add_argument("--json", help="also write the raw results to this file")
    args = p.parse_args(argv)

    for impl in IMPLS:
        H.load_impl(impl)
    configs = [(pf, raf == "True") for raf in args.reshard for pf in args.prefetch]
    trace_dir = None
    if args.timeline_dir:
        trace_dir = os.path.abspath(args.trace_dir)
        os.makedirs(trace_dir, exist_ok=True)
        os.makedirs(args.timeline_dir, exist_ok=True)
    results = []
    for model_name in args.models:
        print(f"running {model_name}: {len(configs)} configurations", file=sys.stderr, flush=True)
        res = H.run_ranks(
            _overlap_rank, model_name, args.quick, configs, schedule(model_name, args), trace_dir, world_size=WORLD_SIZE
        )
        results += res

    text = describe_run(argv, args) + "\n\n" + format_tables(results)
    if trace_dir and any((r["model"], r["prefetch"], r["reshard_after_forward"]) == TIMELINE_CONFIG for r in results):
        for impl in IMPLS:
            png = os.path.join(args.timeline_dir, f"overlap_{impl}.png")
            plot(trace_dir, impl, png)
            print(f"wrote {png}", file=sys.stderr)
    print(text)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": argv, "results": results}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
