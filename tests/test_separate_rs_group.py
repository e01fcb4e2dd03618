"""``FSDPModule.set_separate_reduce_scatter_group`` (torch 2.15): gradient reduce-scatters on a
process group of their own over the shard ranks, so that they can progress beside the
backward's all-gathers. The reduce-scatters then get another group than the all-gathers, with
the same ranks (seen through recording comms of ``set_custom_*``), and training is unchanged:
losses and parameters bit for bit those without it, and torch FSDP2's where torch has the
method; turned off again, the shard group is used. 4 ranks, 1-D and 2x2 HSDP, fp32 and bf16.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dist_utils import native_linear, assert_same_run, full_params, load_impl, raises_exactly, ref_impl, run_distributed, run_grid
from models import BlockStack, ResidualMLP, shard_stack, train_steps
from test_custom_comm import AllGather, ReduceScatter


class GroupAllGather(AllGather):
    """Records the group of each all-gather."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.groups.append(group)
        return super().__call__(output_tensor, input_tensor, group, async_op)


class GroupReduceScatter(ReduceScatter):
    """Records the group of each reduce-scatter."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.groups.append(group)
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _train(impl, separate: bool, hsdp: bool, mp: bool, off_again: bool = False) -> dict:
    torch.manual_seed(0)
    model = shard_stack(impl, BlockStack(ResidualMLP, 6, 3), hsdp=hsdp, mp=mp)
    ag, rs = GroupAllGather([]), GroupReduceScatter([])
    ag.groups, rs.groups = [], []
    model.blocks[1].set_custom_all_gather(ag)
    model.blocks[1].set_custom_reduce_scatter(rs)
    if separate:
        model.set_separate_reduce_scatter_group()
        if off_again:
            model.set_separate_reduce_scatter_group(False)
    losses = train_steps(model, 2, batch=5)
    assert ag.groups and rs.groups and len(set(ag.groups)) == 1 and len(set(rs.groups)) == 1, (ag.groups, rs.groups)
    return dict(losses=losses, params=full_params(model), ag=ag.groups[0], rs=rs.groups[0])


def check(hsdp: bool = False, mp: bool = False) -> None:
    impl = load_impl()
    if not hasattr(impl.FSDPModule, "set_separate_reduce_scatter_group"):  # FSDP_TEST_IMPL=torch before 2.15
        return
    what = f"[{impl.name}] hsdp={hsdp} mp={mp}"
    got = _train(impl, True, hsdp, mp)
    assert got["rs"] is not got["ag"], f"{what}: the reduce-scatters ran on the all-gathers' group"
    assert dist.get_process_group_ranks(got["rs"]) == dist.get_process_group_ranks(got["ag"]), what
    plain = _train(impl, False, hsdp, mp)
    assert plain["rs"] is plain["ag"], f"{what}: without it, the reduce-scatters' group is the shard group"
    assert_same_run(f"{what}: separate vs not", got, plain)
    off = _train(impl, True, hsdp, mp, off_again=True)
    assert off["rs"] is off["ag"], f"{what}: turned off again, the shard group"
    torch_impl = ref_impl()
    if hasattr(torch_impl.FSDPModule, "set_separate_reduce_scatter_group"):  # torch 2.15
        assert_same_run(f"{what}: vs torch", got, _train(torch_impl, True, hsdp, mp))


def check_errors() -> None:
    m = native_linear()
    if m is None:  # the message is fsdp_native's
        return
    raises_exactly(
        TypeError,
        "set_separate_reduce_scatter_group: argument 'enable' must be a bool, got str",
        lambda: m.set_separate_reduce_scatter_group("yes"),
    )


def _grid():
    run_grid([dict(), dict(mp=True), dict(hsdp=True)], check, name="separate-rs-group")
    run_grid([{}], check_errors, name="separate-rs-group-errors")


def test_separate_reduce_scatter_group():
    run_distributed(_grid, 4, timeout=300)
