"""``FSDPModule.set_reduce_scatter_max_input_buffers`` (torch 2.15): up to k gradient reductions
in flight when a unit issues its own, the oldest completed first.

* **In flight**, seen through the public API: each block's reduce-scatter goes through a
  recording ``set_custom_reduce_scatter`` comm, and a post-accumulate-grad hook on each
  block's sharded weight marks when its reduction completed. At every reduce-scatter call the
  reductions issued but not completed are at most k - 1, and reach k - 1 (with 6 blocks); by
  default (k = 1) none is.
* **Training is unchanged:** losses and parameters bit for bit those of k = 1, and torch
  FSDP2's with the same setting where torch has the method; with accumulation without sync,
  bf16 and HSDP. 4 ranks.
* Bad values raise as torch's checks do, with fsdp_native's messages.
"""
from __future__ import annotations

import torch

from dist_utils import assert_same_run, full_params, load_impl, native_linear, raises_exactly, ref_impl, run_distributed, run_grid
from models import BlockStack, ResidualMLP, shard_stack, train_steps
from test_custom_comm import ReduceScatter


class EventReduceScatter(ReduceScatter):
    """Records ("rs", unit) at each call into a shared event list."""

    def __init__(self, events: list, name: str):
        super().__init__([])
        self.events, self.name = events, name

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.events.append(("rs", self.name))
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _train(impl, k: int | None, hsdp: bool = False, mp: bool = False, accum: int = 1) -> dict:
    torch.manual_seed(0)
    model = shard_stack(impl, BlockStack(ResidualMLP, 6, 6), hsdp=hsdp, mp=mp)
    events: list = []
    for i, block in enumerate(model.blocks):
        block.set_custom_reduce_scatter(EventReduceScatter(events, f"b{i}"))
        w = next(p for p in block.parameters() if p.requires_grad)
        w.register_post_accumulate_grad_hook(lambda p, i=i: events.append(("done", f"b{i}")))
    if k is not None:
        model.set_reduce_scatter_max_input_buffers(k)
    losses = train_steps(model, 2, accum=accum, batch=5)
    return dict(losses=losses, params=full_params(model), events=events)


def _outstanding(events: list) -> list[int]:
    """At each reduce-scatter call, the reductions issued before it and not yet completed."""
    issued, done, out = [], set(), []
    for kind, name in events:
        if kind == "rs":
            out.append(sum(1 for n in issued if n not in done))
            issued.append(name)
        else:
            done.add(name)
            issued.remove(name)
    return out


def check(k: int, hsdp: bool = False, mp: bool = False, accum: int = 1) -> None:
    impl = load_impl()
    what = f"[{impl.name}] k={k} hsdp={hsdp} mp={mp} accum={accum}"
    if not hasattr(impl.FSDPModule, "set_reduce_scatter_max_input_buffers"):  # FSDP_TEST_IMPL=torch before 2.15
        return
    got = _train(impl, k, hsdp, mp, accum)
    base = _train(impl, None, hsdp, mp, accum)
    if impl.name == "fsdp_native":
        seen, default = _outstanding(got["events"]), _outstanding(base["events"])
        assert max(default) == 0, f"{what}: by default a reduction was left in flight: {default}"
        assert max(seen) == k - 1, f"{what}: reductions in flight at each reduce-scatter {seen}, expected at most and up to {k - 1}"
    assert_same_run(f"{what} vs k=1", got, base)
    torch_impl = ref_impl()
    if hasattr(torch_impl.FSDPModule, "set_reduce_scatter_max_input_buffers"):  # torch 2.15 and later
        assert_same_run(f"{what} vs torch", got, _train(torch_impl, k, hsdp, mp, accum))


def check_errors() -> None:
    m = native_linear()
    if m is None:  # the messages are fsdp_native's
        return
    raises_exactly(
        TypeError,
        "set_reduce_scatter_max_input_buffers: argument 'max_input_buffers' must be an int, got bool",
        lambda: m.set_reduce_scatter_max_input_buffers(True),
    )
    raises_exactly(
        ValueError,
        "set_reduce_scatter_max_input_buffers: argument 'max_input_buffers' is 0, expected an int >= 1",
        lambda: m.set_reduce_scatter_max_input_buffers(0),
    )


def _grid():
    configs = [dict(k=2), dict(k=3), dict(k=2, mp=True), dict(k=2, hsdp=True), dict(k=3, accum=2)]
    run_grid(configs, check, name="rs-max-inputs")
    run_grid([{}], check_errors, name="rs-max-inputs-errors")


def test_reduce_scatter_max_input_buffers():
    run_distributed(_grid, 4)
