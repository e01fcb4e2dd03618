"""fsdp_native.record_trace: trace structure and bytes accounting.

The recorder is fsdp_native's own (torch FSDP2 has none), so these tests always run
fsdp_native, whatever ``FSDP_TEST_IMPL`` says. They assert the structure of the trace and
its byte counts against the analytic count for a known model, never timings:

* every unit has one all-gather in forward and, when it reshards after forward (also to an
  int group size), one in backward (the root, which keeps its parameters, has none in backward);
* the reduce-scatters of a step cover exactly the units with gradients, once each;
* HSDP: one all-reduce per unit with gradients;
* spans are well formed, the Chrome trace loads with the lanes as thread names, and
  ``plot_timeline`` writes a PNG;
* bytes per unit and step, with ``ws`` the shard-group size and ``padded`` the unit's padded
  shard numel (``sum(ceil(dim0 / ws) * prod(shape[1:]))`` over its parameters):
  all-gather ``n_all_gathers * ws * padded * itemsize(param_dtype or orig dtype)``,
  reduce-scatter ``ws * padded * itemsize(reduce dtype)``,
  HSDP all-reduce ``padded * itemsize(reduce dtype)``; the reduce dtype defaults to the
  parameter dtype.

The model has odd sizes (7, 5, 3 rows) so dim 0 is not divisible by the shard-group size.
"""
from __future__ import annotations

import json
import math
import os
import time

import pytest

from dist_utils import ctx, grid, run_distributed, run_grid

DIM, HIDDEN, OUT, N_BLOCKS = 6, 7, 5, 3
STEPS = 2


def _model():
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.fc1 = nn.Linear(DIM, HIDDEN)  # weight (7, 6), bias (7,)
            self.fc2 = nn.Linear(HIDDEN, DIM)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(3, DIM)  # weight (6, 3), bias (6,): 3 rows per rank of 2
            self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))
            self.out = nn.Linear(DIM, OUT)  # weight (5, 6), bias (5,)

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.out(x)

    torch.manual_seed(0)
    return Net()


def _unit_shapes(model) -> dict[str, list[tuple[int, ...]]]:
    """Parameter shapes of every unit (block FQN, "" for the root), before sharding."""
    units = {f"blocks.{i}": [tuple(p.shape) for p in b.parameters()] for i, b in enumerate(model.blocks)}
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    units[""] = [tuple(p.shape) for p in model.parameters() if id(p) not in in_blocks]
    return units


def _padded_numel(shapes, ws: int) -> int:
    return sum(-(-s[0] // ws) * math.prod(s[1:]) for s in shapes)


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _shard(model, mesh, raf: bool, mp, frozen: bool):
    import fsdp_native

    if frozen:  # a unit without gradients: all-gathered, never reduced
        model.blocks[1].requires_grad_(False)
    for b in model.blocks:
        fsdp_native.fully_shard(b, mesh=mesh, reshard_after_forward=raf, mp_policy=mp)
    fsdp_native.fully_shard(model, mesh=mesh, mp_policy=mp)  # root: keeps its parameters
    return model


def _traced_steps(model, rec_ctx):
    """STEPS forward+backward steps inside `rec_ctx`; returns (recorder, [(fwd_end, bwd_end)])."""
    import torch
    import torch.distributed as dist
    from fsdp_native import _trace

    g = torch.Generator().manual_seed(dist.get_rank())
    marks = []
    with rec_ctx as rec:
        for _ in range(STEPS):
            x = torch.randn(4, 3, generator=g)
            out = model(x)
            t_fwd = _trace.now_us()
            out.float().pow(2).sum().backward()
            marks.append((t_fwd, _trace.now_us()))
            model.zero_grad(set_to_none=True)
    dist.barrier()
    return rec, marks


def _check_trace(model, rec, marks, *, ws, raf, mp, frozen, hsdp) -> None:
    import torch
    from fsdp_native._trace import LANES

    shapes = _unit_shapes(model)
    units = sorted(shapes)
    with_grad = {u for u in units if not (frozen and u == "blocks.1")}
    param_dtype = mp.param_dtype or torch.float32
    # reduce_dtype=None: param_dtype before torch 2.15, the (fp32) original dtype from 2.15
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    reduce_dtype = mp.reduce_dtype or (torch.float32 if (major, minor) >= (2, 15) else param_dtype)

    # Well-formed spans.
    assert rec.spans, "no spans recorded"
    for s in rec.spans:
        assert s.lane in LANES, s
        assert s.end_us >= s.start_us, f"span ends before it starts: {s}"
        assert 0 <= s.step < STEPS, s
        assert s.nbytes >= 0, s
    assert sorted({s.step for s in rec.spans}) == list(range(STEPS))

    summary = rec.bytes_summary()
    assert sorted(summary) == list(range(STEPS)), summary.keys()
    for step, (t_fwd, t_bwd) in enumerate(marks):
        spans = [s for s in rec.spans if s.step == step]
        for s in spans:
            assert s.start_us <= t_bwd, f"step {step}: span starts after the step's backward returned: {s}"

        # All-gathers: one per unit in forward; in backward one per resharded unit.
        ags = [s for s in spans if s.lane == "all_gather"]
        n_ag = {}
        for u in units:
            fwd = [s for s in ags if s.unit == u and s.start_us < t_fwd]
            bwd = [s for s in ags if s.unit == u and s.start_us >= t_fwd]
            # The root keeps its parameters (reshard_after_forward=None); every other unit,
            # the forward's last block included, is gathered again in backward (as torch does).
            regather = raf and u != ""
            assert len(fwd) == 1, f"step {step}, unit {u!r}: {len(fwd)} all-gathers in forward, expected 1"
            assert len(bwd) == int(regather), (
                f"step {step}, unit {u!r}: {len(bwd)} all-gathers in backward, expected {int(regather)} "
                f"(reshard_after_forward={raf if u else 'root'})"
            )
            n_ag[u] = len(fwd) + len(bwd)
        assert {s.unit for s in ags} == set(units), {s.unit for s in ags}

        # Compute spans: forward and backward of every unit.
        for phase in ("forward", "backward"):
            have = {s.unit for s in spans if s.lane == "compute" and s.name == phase}
            assert have == set(units), f"step {step}: {phase} compute spans for {sorted(have)}, expected {units}"

        # Reduce-scatters cover exactly the units with gradients, each once.
        rss = [s for s in spans if s.lane == "reduce_scatter"]
        covered = [u for s in rss for u in s.args.get("per_unit", {s.unit: s.nbytes})]
        assert sorted(covered) == sorted(with_grad), f"step {step}: reduce-scatters cover {covered}, expected {sorted(with_grad)}"
        for s in rss:  # a bucket's bytes are its units' bytes
            assert s.nbytes == sum(s.args["per_unit"].values()), s
        ars = [s for s in spans if s.lane == "all_reduce"]
        if hsdp:
            assert sorted(s.unit for s in ars) == sorted(with_grad), f"step {step}: all-reduces {[s.unit for s in ars]}"
        else:
            assert not ars, ars
        assert any(s.lane == "copy" for s in spans), "no copy-in/copy-out spans"

        # Bytes against the analytic count.
        for u in units:
            padded = _padded_numel(shapes[u], ws)
            want = {"all_gather": n_ag[u] * ws * padded * _itemsize(param_dtype)}
            if u in with_grad:
                want["reduce_scatter"] = ws * padded * _itemsize(reduce_dtype)
                if hsdp:
                    want["all_reduce"] = padded * _itemsize(reduce_dtype)
            got = summary[step].get(u)
            assert got == want, f"step {step}, unit {u!r}: bytes {got}, expected {want} (padded shard numel {padded})"
        assert set(summary[step]) == set(units), summary[step].keys()


def _body(*, raf, precision, frozen, hsdp, files=False):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_native

    ws_all = dist.get_world_size()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, ws_all // 2), mesh_dim_names=("replicate", "shard"))
        ws = ws_all // 2
    else:
        mesh = init_device_mesh("cpu", (ws_all,))
        ws = ws_all
    mp = {
        "fp32": fsdp_native.MixedPrecisionPolicy(),
        "bf16": fsdp_native.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "bf16-reduce-none": fsdp_native.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    }[precision]
    model = _shard(_model(), mesh, raf, mp, frozen)
    rec, marks = _traced_steps(model, fsdp_native.record_trace())
    assert fsdp_native._trace.active is None
    # Shapes from an unsharded copy of the model.
    _check_trace(_model(), rec, marks, ws=ws, raf=raf, mp=mp, frozen=frozen, hsdp=hsdp)
    if files:
        _check_files(rec)


def _check_files(rec) -> None:
    import torch.distributed as dist

    import fsdp_native
    from fsdp_native._trace import LANES

    c = ctx()
    paths = [os.path.join(c.tmpdir, f"trace_rank{r}.json") for r in range(dist.get_world_size())]
    assert rec.export_chrome_trace(paths[dist.get_rank()]) == paths[dist.get_rank()]
    dist.barrier()
    if dist.get_rank() != 0:
        return
    lanes_seen = set()
    for r, path in enumerate(paths):
        with open(path) as f:
            trace = json.load(f)
        events = trace["traceEvents"]
        threads = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
        assert set(threads.values()) == set(LANES), threads
        spans = [e for e in events if e.get("ph") == "X"]
        assert len(spans) == len(rec.spans) or r != 0, (len(spans), len(rec.spans))
        for e in spans:
            assert e["pid"] == r and e["dur"] > 0 and e["ts"] >= 0, e
            assert threads[e["tid"]] == e["cat"], e  # each span sits on its lane's thread
            lanes_seen.add(e["cat"])
            if e["cat"] in ("all_gather", "reduce_scatter"):
                assert e["args"]["bytes"] >= 0, e
    assert {"compute", "all_gather", "reduce_scatter", "copy", "stall"} <= lanes_seen, lanes_seen
    png = os.path.join(c.tmpdir, "timeline.png")
    assert fsdp_native.plot_timeline(paths, png, title="test", step=1) == png
    with open(png, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 1000


def _off_by_default_body() -> None:
    """No recorder is active unless asked for; nothing is recorded after the context exits."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_native
    from fsdp_native import _trace

    assert _trace.active is None, "a recorder is active by default"
    model = _shard(_model(), init_device_mesh("cpu", (dist.get_world_size(),)), True, fsdp_native.MixedPrecisionPolicy(), False)
    x = torch.randn(4, 3)
    model(x).sum().backward()  # untraced step (lazy init)
    assert _trace.active is None
    rec, _ = _traced_steps(model, fsdp_native.record_trace())
    assert _trace.active is None, "record_trace did not deactivate on exit"
    n = len(rec.spans)
    assert n and {s.step for s in rec.spans} == set(range(STEPS))
    for _ in range(2):
        model(x).sum().backward()
    dist.barrier()
    time.sleep(0.2)  # completion callbacks of the last collectives, if any were still pending
    assert len(rec.spans) == n, f"{len(rec.spans) - n} spans recorded after record_trace exited"


def _ws2() -> None:
    configs = grid(raf=[True, False], precision=["fp32"], frozen=[False], hsdp=[False])
    configs += [
        dict(raf=True, precision="bf16", frozen=True, hsdp=False, files=True),
        dict(raf=False, precision="bf16-reduce-none", frozen=False, hsdp=False),
    ]
    run_grid(configs, _body, name="trace ws2")
    run_grid([{}], _off_by_default_body, name="off by default")


def _hsdp() -> None:
    configs = [
        dict(raf=True, precision="fp32", frozen=False, hsdp=True),
        dict(raf=False, precision="bf16", frozen=True, hsdp=True),
    ]
    run_grid(configs, _body, name="trace hsdp 2x2")


def _int_reshard() -> None:
    # reshard_after_forward=2 on 4 ranks: backward all-gathers come from the 2-rank post-forward
    # shard (same output size, ws * padded shard numel).
    run_grid([dict(raf=2, precision="fp32", frozen=False, hsdp=False)], _body, name="trace int reshard_after_forward")


def test_trace_world_size_2():
    run_distributed(_ws2, 2)


def test_trace_hsdp_2x2():
    run_distributed(_hsdp, 4)


def test_trace_int_reshard_after_forward():
    run_distributed(_int_reshard, 4)


def test_nested_record_trace_raises():
    import fsdp_native
    from fsdp_native import _trace

    assert _trace.active is None
    with fsdp_native.record_trace() as outer:
        assert _trace.active is outer
        with pytest.raises(RuntimeError):
            with fsdp_native.record_trace():
                pass
        assert _trace.active is outer, "a failed nested record_trace must leave the outer one active"
    assert _trace.active is None
    with pytest.raises(ValueError):
        with fsdp_native.record_trace():
            raise ValueError("inside")
    assert _trace.active is None, "record_trace must deactivate when its body raises"
    with fsdp_native.record_trace() as again:  # usable again
        assert _trace.active is again
    assert _trace.active is None
