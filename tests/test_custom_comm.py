"""``FSDPModule.set_custom_all_gather`` and ``set_custom_reduce_scatter``: a unit's all-gathers
and gradient reduce-scatters go through the user's objects of torch FSDP2's ``Comm`` protocol
(``allocate`` for the buffers, a call for the collective). Here the objects wrap
torch.distributed's collectives and record each call; the calls (how many, the input sizes and
dtypes, the group size), the losses and the parameters are torch FSDP2's, bit for bit, at 4
ranks 1-D and 2x2 HSDP, in fp32 and bf16, with and without reshard after forward.

``set_allocate_memory_from_process_group_for_comm`` is here too: the buffers come from the
process group's allocator hook (recorded), training is unchanged and torch's, and it refuses
a unit with a custom comm.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dist_utils import native_linear, assert_same_run, full_params, load_impl, raises_exactly, ref_impl, run_distributed, run_grid
from models import BlockStack, ResidualMLP, shard_stack, train_steps



class RecordingComm:
    """Allocates plain buffers and records each collective (kind, input numel, dtype, group
    size, allocations so far)."""

    def __init__(self, calls: list):
        self.calls = calls
        self.allocated = 0

    def allocate(self, size, *, dtype, device):
        self.allocated += 1
        return torch.empty(*size, dtype=dtype, device=device)


class AllGather(RecordingComm):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls.append(("all_gather", input_tensor.numel(), str(input_tensor.dtype), dist.get_world_size(group)))
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class ReduceScatter(RecordingComm):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls.append(("reduce_scatter", input_tensor.numel(), str(input_tensor.dtype), dist.get_world_size(group)))
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _train(impl, hsdp: bool, mp: bool, reshard: bool) -> dict:
    torch.manual_seed(0)
    model = shard_stack(impl, BlockStack(ResidualMLP, 6, 3), hsdp=hsdp, mp=mp, reshard_after_forward=reshard)
    calls = {"blocks.1": [], "root": []}
    comms = []
    for name, m in (("blocks.1", model.blocks[1]), ("root", model)):
        ag, rs = AllGather(calls[name]), ReduceScatter(calls[name])
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(rs)
        comms += [ag, rs]
    losses = train_steps(model, 2, batch=5)
    return dict(losses=losses, params=full_params(model), calls=calls, allocated=[c.allocated for c in comms])


def check(hsdp: bool = False, mp: bool = False, reshard: bool = True) -> None:
    impl = load_impl()
    what = f"[{impl.name} vs torch] hsdp={hsdp} mp={mp} reshard={reshard}"
    a = _train(impl, hsdp, mp, reshard)
    b = _train(ref_impl(), hsdp, mp, reshard)
    assert a["calls"] == b["calls"], f"{what}: collectives {a['calls']} vs {b['calls']}"
    # A unit's all-gathers: one a forward, one more a backward where it resharded after forward.
    per_step = 2 if reshard else 1
    assert [c[0] for c in a["calls"]["blocks.1"]].count("all_gather") == 2 * per_step, a["calls"]
    assert all(n > 0 for n in a["allocated"]), f"{what}: a comm's allocate was not used: {a['allocated']}"
    assert_same_run(what, a, b)


def check_errors() -> None:
    m = native_linear()
    if m is None:  # the messages are fsdp_native's
        return
    for name in ("set_custom_all_gather", "set_custom_reduce_scatter"):
        raises_exactly(
            TypeError,
            f"{name}: argument 'comm' must have an allocate(size, *, dtype, device) method and be callable "
            "(torch.distributed.fsdp's Comm protocol), got function",
            lambda: getattr(m, name)(lambda *a, **k: None),
        )


def _train_pg_alloc(impl, enable: bool, hsdp: bool, mp: bool) -> dict:
    torch.manual_seed(0)
    model = shard_stack(impl, BlockStack(ResidualMLP, 6, 3), hsdp=hsdp, mp=mp)
    if enable:
        for m in (model.blocks[1], model):  # the module's own unit only, as in torch
            m.set_allocate_memory_from_process_group_for_comm(True)
    return dict(losses=train_steps(model, 2, batch=5), params=full_params(model))


def check_pg_alloc(hsdp: bool = False, mp: bool = False) -> None:
    """``set_allocate_memory_from_process_group_for_comm``: the units' collective buffers come
    from ``_comm.group_allocate`` (gloo has no allocator of its own, so it falls back to
    ``torch.empty``), and training is bit for bit the same as without it and as torch's."""
    impl = load_impl()
    what = f"[{impl.name}] pg alloc hsdp={hsdp} mp={mp}"
    calls = []
    if impl.name == "fsdp_native":
        from fsdp_native import _comm

        orig = _comm.group_allocate

        def recording(group, size, *, dtype, device):
            calls.append((dist.get_world_size(group), tuple(size), str(dtype)))
            return orig(group, size, dtype=dtype, device=device)

        _comm.group_allocate = recording
    try:
        got = _train_pg_alloc(impl, True, hsdp, mp)
    finally:
        if impl.name == "fsdp_native":
            _comm.group_allocate = orig
    if impl.name == "fsdp_native":
        # Per step and unit: the all-gather output (forward; the root's twice, blocks.1 again in
        # backward) and the reduce-scatter input and output.
        assert calls and {c[0] for c in calls} == {dist.get_world_size() // (2 if hsdp else 1)}, f"{what}: {calls}"
        assert len(calls) >= 2 * 4, f"{what}: {len(calls)} allocations: {calls}"
    assert_same_run(f"{what} vs off", got, _train_pg_alloc(impl, False, hsdp, mp))
    assert_same_run(f"{what} vs torch", got, _train_pg_alloc(ref_impl(), True, hsdp, mp))


def check_pg_alloc_errors() -> None:
    m = native_linear()
    if m is None:  # the messages are fsdp_native's
        return
    raises_exactly(
        TypeError,
        "set_allocate_memory_from_process_group_for_comm: argument 'enable' must be a bool, got int",
        lambda: m.set_allocate_memory_from_process_group_for_comm(1),
    )
    m.set_custom_reduce_scatter(ReduceScatter([]))
    raises_exactly(
        RuntimeError,
        "set_allocate_memory_from_process_group_for_comm: this unit has a custom all-gather or reduce-scatter "
        "(set_custom_all_gather / set_custom_reduce_scatter), which allocates its own buffers",
        lambda: m.set_allocate_memory_from_process_group_for_comm(True),
    )


def _grid():
    configs = [dict(), dict(mp=True), dict(reshard=False), dict(hsdp=True), dict(hsdp=True, mp=True)]
    run_grid(configs, check, name="custom-comm")
    run_grid([{}], check_errors, name="custom-comm-errors")
    run_grid([dict(), dict(hsdp=True, mp=True)], check_pg_alloc, name="pg-alloc")
    run_grid([{}], check_pg_alloc_errors, name="pg-alloc-errors")


def test_custom_all_gather_and_reduce_scatter_match_torch():
    run_distributed(_grid, 4, timeout=300)
