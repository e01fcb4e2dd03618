"""Launch shapes of the Triton quantized all-gather kernels (``kernels/quant.py``),
timed on a GPU: tile sizes and warps per program, the module constants that pick them, each
alternative against the bandwidth floor, on bench_gpu.py's Llama-3-8B layer (rank 3's bf16
shards over 8 ranks).

For every setting it checks that the bytes and values of every format's ops (--smoke: of the
group's formats) are those of the default setting (a launch shape must not change a result), then times the ops it affects (device time: CUDA
events, a sleep kernel queued first, median) and reports each as % of the floor, one flat
uint8 copy of as many bytes (as bench_gpu.py does). The groups run in order until
``--budget-s`` is spent; each group's best setting is listed at the end.

    python3 benchmarks/tune_quant_gpu.py --json tune.json             # on a GPU
    TRITON_INTERPRET=1 python3 benchmarks/tune_quant_gpu.py --smoke   # CPU, tiny shapes over 2 ranks, one setting a group

``--against OTHER.py`` times another version of ``kernels/quant.py`` (e.g. an older commit's,
``git show REV:kernels/quant.py > OTHER.py``) against this checkout's, op by op, in the same
run: rounds alternate between the two, each version's bits are checked against the other's,
and the table gives each one's % of the floor and their time ratio. That is how a kernel
change made without a GPU (counted in SASS: benchmarks/triton_sass.py) is first timed.

    python3 benchmarks/tune_quant_gpu.py --against /tmp/quant_b02b361.py --json ab.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import harness as H  # noqa: E402
from benchmarks.bench_gpu import LLAMA, LLAMA_SMOKE, RANK, WORLD_SIZE, _numel, _rows  # noqa: E402
from fsdp_native import ops  # noqa: E402


def _settings(**axes) -> list[dict]:
    """Every combination of the axes' values."""
    out = [{}]
    for k, vals in axes.items():
        out = [dict(s, **{k: v}) for s in out for v in vals]
    return out


# group: (ops it times, settings).
def groups(smoke: bool) -> dict[str, tuple[list[str], list[dict]]]:
    g = {
        "dequantize": (["dequantize fp8_tensorwise", "dequantize fp8_rowwise", "dequantize nf4"], [
            {"DEQ_SHAPES": {f: (b, w) for f in ("fp8_tensorwise", "fp8_rowwise", "nf4")}}
            for b in (1024, 2048, 4096, 8192, 16384) for w in (1, 2, 4, 8, 16) if 8 <= b // (32 * w) <= 128
        ]),
        "nf4 quantize": (["quantize nf4"], [
            s for s in _settings(TASK=[1024, 2048, 4096, 8192], NF4_WARPS=[1, 2, 4, 8, 16])
            if 4 <= s["TASK"] // (32 * s["NF4_WARPS"]) <= 128
        ]),
        "fp8 codes": (["quantize fp8_tensorwise, amax given", "quantize fp8_tensorwise"], [
            s for s in _settings(BLOCK=[1024, 2048, 4096, 8192], FP8_WARPS=[2, 4, 8, 16])
            if 4 <= s["BLOCK"] // (32 * s["FP8_WARPS"]) <= 64
        ]),
        "amax": (["quantize_amax", "quantize fp8_tensorwise"], _settings(AMAX_TILES=[1, 2, 4, 8], AMAX_WARPS=[2, 4, 8, 16])),
        "fp8_rowwise rows": (["quantize fp8_rowwise"], [
            dict(ROW_WARP_ELEMS=1024), dict(ROW_ELEMS=8192, ROW_WARP_ELEMS=1024), dict(ROW_WARP_ELEMS=2048),
        ]),
        # The amax pass with its registers capped (AMAX_MAXNREG; by default the compiler's
        # choice: 72 a thread with Triton 3.6, no spill at 64).
        "amax registers": (["quantize_amax", "quantize fp8_tensorwise"], [dict(AMAX_MAXNREG=64), dict(AMAX_MAXNREG=56)]),
        # The NF4 quantize's code steps in inline PTX (NF4_CODE_ASM: fewer instructions, more
        # registers), alone and under register caps (sm_90 SASS: 22.4 instructions an element and
        # 216 registers uncapped, 23.3 and 96 at 96, against 24.0 and 168 by default).
        "nf4 code": (["quantize nf4"], [
            dict(NF4_CODE_ASM=True), *(dict(NF4_CODE_ASM=True, NF4_MAXNREG=r) for r in (96, 112, 144)),
        ]),
        # The NF4 dequantize's value by a gather or by a table load and multiply (NF4_DEQ_GATHER:
        # by default the gather up to Triton 3.8, the load from 3.9, from their SASS; both timed).
        "nf4 dequantize path": (["dequantize nf4"], [dict(NF4_DEQ_GATHER=True), dict(NF4_DEQ_GATHER=False)]),
        # NF4's alone (since each element gathers its block's value, its best shape may differ).
        "nf4 dequantize": (["dequantize nf4"], [
            {"DEQ_SHAPES": {"nf4": (b, w)}}  # merged into the defaults (below)
            for b in (1024, 2048, 4096, 8192, 16384) for w in (1, 2, 4, 8, 16) if 8 <= b // (32 * w) <= 128 and (b, w) != (1024, 1)
        ]),
        # Rows longer than ROW_FUSE_MAX take the amax pass and then the codes (two launches).
        "fp8_rowwise two launches": (["quantize fp8_rowwise"], [
            dict(ROW_FUSE_MAX=8192), *_settings(ROW_FUSE_MAX=[0], BLOCK=[2048, 4096], FP8_WARPS=[2, 4, 8]),
        ]),
    }
    if smoke:
        g = {k: (ops, sets[:1]) for k, (ops, sets) in g.items()}
    return g


class Work:
    """The layer's shards of `rank` over `world_size` ranks, their quantized chunk and gathered
    chunks, and the ops on them."""

    def __init__(self, shapes, device, K, world_size: int = WORLD_SIZE, rank: int = RANK):
        self.K = K
        self.shapes = shapes
        self.ws = world_size
        self.padded = [ops.padded_shard_numel(s, world_size) for s in shapes]
        self.rows = [_numel(s[1:]) for s in shapes]
        g = torch.Generator().manual_seed(0)
        self.shards = [
            (torch.randn(_numel(_rows(s, rank, world_size)), generator=g) * 0.02).to(torch.bfloat16).to(device) for s in shapes
        ]
        if self.shards[0].numel() > 5:  # special values where the checks see them
            self.shards[0][:3] = torch.tensor([float("nan"), float("inf"), 0.0], dtype=torch.bfloat16)
        self.device = device
        from fsdp_native import quant as Q

        self.Q = Q
        self.src_bytes = sum(2 * t.numel() for t in self.shards)
        self.chunk = {f: torch.empty(Q.unit_layout(self.padded, self.rows, f).rank_nbytes, dtype=torch.uint8, device=device)
                      for f in Q.FORMATS}  # fmt: skip
        self.amax = torch.empty(len(shapes), device=device)
        self.outs = [torch.empty(_numel(s), dtype=torch.bfloat16, device=device) for s in shapes]
        self.gathered = _Gathered(self)  # each format's at its first use (interpreted: each quantize takes seconds)

    def quantize(self, fmt, amax=None):
        self.K.quantize_copy_in_eager(self.shards, self.padded, self.rows, fmt, self.Q.DEFAULT_BLOCK_SIZE, amax, self.chunk[fmt])

    def dequantize(self, fmt):
        self.K.dequantize_copy_out_eager(self.gathered[fmt], self.padded, self.rows, self.ws, fmt, self.Q.DEFAULT_BLOCK_SIZE, self.outs)

    def op(self, name):
        """(the call, the bytes it reads plus writes)."""
        Q = self.Q
        if name == "quantize_amax":
            return (lambda: self.K.quantize_amax_eager(self.shards, self.amax)), self.src_bytes
        if name == "quantize fp8_tensorwise, amax given":
            self.K.quantize_amax_eager(self.shards, self.amax)
            return (lambda: self.quantize(Q.FP8_TENSORWISE, self.amax)), self.src_bytes + self.chunk[Q.FP8_TENSORWISE].numel()
        kind, fmt = name.split(" ", 1)
        if kind == "quantize":
            return (lambda: self.quantize(fmt)), self.src_bytes + self.chunk[fmt].numel()
        return (lambda: self.dequantize(fmt)), self.gathered[fmt].numel() + sum(2 * o.numel() for o in self.outs)

    def results(self, formats=None) -> list[torch.Tensor]:
        """Every op's output (of ``formats``' ops only, if given), from the shards as they are."""
        formats = self.Q.FORMATS if formats is None else formats
        out = []
        for f in formats:
            self.quantize(f)
            out.append(self.chunk[f].clone())
            self.gathered[f].copy_(self.chunk[f].repeat(self.ws))
            self.dequantize(f)
            out += [o.clone() for o in self.outs]
        if self.Q.FP8_TENSORWISE in formats:
            self.K.quantize_amax_eager(self.shards, self.amax)
            out.append(self.amax.clone())
            self.quantize(self.Q.FP8_TENSORWISE, self.amax)
            out.append(self.chunk[self.Q.FP8_TENSORWISE].clone())
        return out


class _Gathered(dict):
    """A Work's gathered chunks by format: `world_size` copies of the format's quantized chunk,
    made at the first use."""

    def __init__(self, work: Work) -> None:
        super().__init__()
        self.work = work

    def __missing__(self, fmt: str) -> torch.Tensor:
        self.work.quantize(fmt)
        t = self[fmt] = self.work.chunk[fmt].repeat(self.work.ws)
        return t


def op_formats(ops: list[str]) -> list[str]:
    """The formats the ops named in a group are of (quantize_amax: fp8_tensorwise's)."""
    from fsdp_native import quant as Q

    return [f for f in Q.FORMATS if any(f in name or (name == "quantize_amax" and f == Q.FP8_TENSORWISE) for name in ops)]


def _time(fn, cuda: bool, iters: int, reps: int) -> float:
    if cuda:
        return statistics.median(H.time_cuda(fn, iters, warmup=2, reps=reps, queue_ahead=True))
    return statistics.median(H.time_cpu(fn, iters, warmup=0))  # (--smoke: the code path, not the time)


# The ops --against times by default: every op of the groups.
AB_OPS = ["quantize_amax", "quantize fp8_tensorwise", "quantize fp8_tensorwise, amax given", "quantize fp8_rowwise",
          "quantize nf4", "dequantize fp8_tensorwise", "dequantize fp8_rowwise", "dequantize nf4"]  # fmt: skip


def load_other(path: str):
    """Another version of kernels/quant.py as its own module (the *_triton ops it registers
    again are not what the eager functions timed here call)."""
    from benchmarks.triton_sass import load_kernels

    if not os.path.isfile(path):
        raise SystemExit(f"tune_quant_gpu.py: argument --against: no such file {path!r}")
    return load_kernels(path, None, "_tune_against_kernels")


def against(works: dict, ops: list[str], rounds: int, time_of, floor_of, smoke: bool) -> dict:
    """Each op of ``ops`` timed with each kernels version of ``works`` ({label: Work}), the
    versions alternating round by round (which goes first alternates too), the median round
    kept; each version's outputs checked against the first's."""
    labels = list(works)
    fmts = tuple(op_formats(ops)) if smoke else None
    ref = works[labels[0]].results(fmts)
    same = {k: all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(w.results(fmts), ref))
            for k, w in works.items()}  # fmt: skip
    rows = {}
    for name in ops:
        fns = {k: w.op(name) for k, w in works.items()}
        times: dict[str, list[float]] = {k: [] for k in labels}
        for r in range(rounds):
            for k in labels if r % 2 == 0 else labels[::-1]:
                times[k].append(time_of(fns[k][0]))
        fl = floor_of(fns[labels[0]][1])
        rows[name] = {k: {"us": 1e6 * statistics.median(v), "of_floor": fl / statistics.median(v)} for k, v in times.items()}
        rows[name]["floor_us"] = 1e6 * fl
        a, b = (rows[name][k]["us"] for k in labels)
        cells = "  ".join(f"{k}: {rows[name][k]['us']:.1f} us {100 * rows[name][k]['of_floor']:.0f} %" for k in labels)
        print(f"[against] {name}  {cells}  {labels[0]}/{labels[1]} time {a / b:.3f}", flush=True)
    print(f"\n| op | {labels[0]}: % of floor | {labels[1]}: % of floor | time {labels[0]} / {labels[1]} |\n|---|---|---|---|")
    for name, row in rows.items():
        a, b = (row[k] for k in labels)
        print(f"| {name} | {100 * a['of_floor']:.0f} % ({a['us']:.1f} us) | {100 * b['of_floor']:.0f} % ({b['us']:.1f} us) | "
              f"{a['us'] / b['us']:.3f} |")  # fmt: skip
    return {"labels": labels, "same_bits": same, "rounds": rounds, "ops": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one setting a group (CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--groups", nargs="*", help="the groups to run (default: all)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="start no setting after this many seconds")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--against", metavar="OTHER.py", help="time another kernels/quant.py against this one (then no group runs "
                    "unless --groups names it)")
    ap.add_argument("--against-ops", nargs="*", default=AB_OPS, metavar="OP", help="the ops --against times (default: all)")
    ap.add_argument("--against-rounds", type=int, default=7, help="alternating rounds per op and version")
    args = ap.parse_args(argv)
    if unknown := sorted(set(args.against_ops) - set(AB_OPS)):
        ap.error(f"argument --against-ops: unknown ops {unknown}, expected some of {AB_OPS}")

    from fsdp_native import quant as Q

    Q._import_triton_kernels()
    from fsdp_native.kernels import quant as K

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    shapes = (LLAMA_SMOKE if args.smoke else LLAMA).layer_shapes()
    iters, reps = (1, 1) if args.smoke else (args.iters, args.reps)
    # --smoke: 2 ranks, not 8: the interpreter's time goes by programs, and a dequantize's programs
    # by each rank's tiles of each parameter (the 3-op dequantize group: 73 -> 57 s)
    w = Work(shapes, device, K, *((2, 1) if args.smoke else (WORLD_SIZE, RANK)))
    todo = groups(args.smoke)
    default = {n: getattr(K, n) for n in sorted({n for _, sets in groups(False).values() for st in sets for n in st})}
    # The results each setting must leave as they are: every format's on a GPU. --smoke checks
    # only the formats of the group's own ops (an interpreted fp8_rowwise dequantize of the
    # smoke layer's short rows takes 13 s on CPU, and the smoke test runs "nf4 dequantize").
    references: dict[tuple, list[torch.Tensor]] = {}

    def reference_for(fmts):
        if fmts not in references:
            references[fmts] = w.results(fmts)
        return references[fmts]
    floors: dict[int, float] = {}

    def floor_of(nbytes: int) -> float:
        if nbytes not in floors:
            src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            floors[nbytes] = _time(lambda: dst.copy_(src), cuda, iters, reps)
        return floors[nbytes]

    t0 = time.perf_counter()
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "default": default, "groups": {}}
    if args.against:
        other = Work(shapes, device, load_other(args.against), *((2, 1) if args.smoke else (WORLD_SIZE, RANK)))
        label = os.path.splitext(os.path.basename(args.against))[0]
        result["against"] = against({"this": w, label: other}, args.against_ops, 1 if args.smoke else args.against_rounds,
                                    lambda fn: _time(fn, cuda, iters, reps), floor_of, args.smoke)  # fmt: skip
        K._PLANS.clear()
    for gname in (args.groups or []) if args.against else (args.groups or list(todo)):
        ops, sets = todo[gname]
        fmts = tuple(op_formats(ops)) if args.smoke else None
        reference = reference_for(fmts)
        rows = result["groups"][gname] = []
        for s in [{}] + sets:  # the default first
            if time.perf_counter() - t0 > args.budget_s:
                print(f"[tune] budget spent: {gname} {s} and after not run", flush=True)
                break
            for n, v in s.items():
                setattr(K, n, {**default[n], **v} if isinstance(v, dict) else v)  # a dict: its keys changed
            K._PLANS.clear()
            try:
                same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(w.results(fmts), reference))
                row = {"setting": s or "default", "same_bits": same, "ops": {}}
                for name in ops:
                    fn, nbytes = w.op(name)
                    us, fl = _time(fn, cuda, iters, reps) * 1e6, floor_of(nbytes) * 1e6
                    row["ops"][name] = {"us": us, "floor_us": fl, "of_floor": fl / us}
            except Exception as e:  # a setting the compiler rejects (registers, shared memory)
                row = {"setting": s or "default", "error": f"{type(e).__name__}: {str(e)[:300]}"}
            finally:
                for n in s:
                    setattr(K, n, default[n])
            rows.append(row)
            cells = row.get("error") or "  ".join(f"{k}: {v['us']:.1f} us {100 * v['of_floor']:.0f} %" for k, v in row["ops"].items())
            print(f"[tune] {gname} {row['setting']} same_bits={row.get('same_bits')}  {cells}", flush=True)
    K._PLANS.clear()

    print("\n| group | op | default: % of floor | best setting | best: % of floor | same bits |\n|---|---|---|---|---|---|")
    for gname, rows in result["groups"].items():
        ok = [r for r in rows if "ops" in r]
        if not ok:
            continue
        for name in todo[gname][0]:
            best = max(ok, key=lambda r: r["ops"][name]["of_floor"])
            print(f"| {gname} | {name} | {100 * ok[0]['ops'][name]['of_floor']:.0f} % ({ok[0]['ops'][name]['us']:.1f} us) | "
                  f"{best['setting']} | {100 * best['ops'][name]['of_floor']:.0f} % ({best['ops'][name]['us']:.1f} us) | "
                  f"{all(r['same_bits'] for r in ok)} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    bad = [r["setting"] for rows in result["groups"].values() for r in rows if r.get("same_bits") is False]
    bad += [f"--against {k}" for k, same in result.get("against", {}).get("same_bits", {}).items() if not same]
    if bad:
        print(f"[tune] settings that changed a result: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
