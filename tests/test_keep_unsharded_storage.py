"""``FSDPModule.set_keep_unsharded_storage`` (torch 2.15): resharding keeps the unsharded
parameters' storage, so each unsharded parameter has the same data pointer at every unshard
(what CUDA graph capture needs), and the unsharded bytes stay held between unshards. Training
is unchanged: the losses and parameters equal those of the same run without it bit for bit,
and torch FSDP2's where torch has the method.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import native_linear, assert_same_run, full_params, load_impl, raises_exactly, ref_impl, run_distributed, run_grid
from models import BlockStack, ResidualMLP, shard_stack

STEPS = 3


def _train(impl, keep: bool, reshard: bool, mp: bool, recurse: bool = True) -> dict:
    torch.manual_seed(0)
    model = shard_stack(impl, BlockStack(lambda: ResidualMLP(6, 12), 6, 3), mp=mp, reshard_after_forward=reshard)
    if keep:
        (model.blocks[1] if not recurse else model).set_keep_unsharded_storage(True, recurse=recurse)
    # Each unsharded parameter's data pointer at every forward of its module (the parameter
    # registered on the module during its forward is the unsharded one).
    pointers: dict[str, list[int]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            mod.register_forward_pre_hook(lambda m, a, name=name: pointers.setdefault(name, []).append(m.weight.data_ptr()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    losses, held = [], []
    for _ in range(STEPS):
        loss = model(torch.randn(5, 4, generator=gen)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if impl.unsharded_stats is not None and impl.name != "torch":
            held.append(impl.unsharded_stats(model).units)
    return dict(losses=losses, params=full_params(model), pointers=pointers, held=held, model=model)


def check(reshard: bool, mp: bool = False) -> None:
    impl = load_impl()
    if not hasattr(impl.FSDPModule, "set_keep_unsharded_storage"):  # FSDP_TEST_IMPL=torch before 2.15
        return
    what = f"[{impl.name}] reshard_after_forward={reshard} mp={mp}"
    kept = _train(impl, True, reshard, mp)
    plain = _train(impl, False, reshard, mp)
    assert_same_run(f"{what}, kept vs not", kept, plain)
    for name, ptrs in kept["pointers"].items():
        assert len(ptrs) == STEPS and len(set(ptrs)) == 1, f"{what}: {name}.weight's unsharded data pointers {ptrs}"
    if impl.name == "fsdp_native":
        # Between steps every unit holds its whole unsharded size when kept, and nothing when not.
        for units in kept["held"]:
            assert {k: s.current_bytes for k, s in units.items()} == {k: s.unsharded_bytes for k, s in units.items()}, what
        for units in plain["held"]:
            assert all(s.current_bytes == 0 for s in units.values()), what
        # recurse=False on one block: that unit alone keeps its storage.
        one = _train(impl, True, reshard, mp, recurse=False)
        held = {k: s.current_bytes > 0 for k, s in one["held"][-1].items()}
        assert held == {"": False, "blocks.0": False, "blocks.1": True, "blocks.2": False}, f"{what}: {held}"
        # Turned off again: the next reshard frees it.
        model = one["model"]
        model.blocks[1].set_keep_unsharded_storage(False)
        model(torch.randn(5, 4)).sum().backward()
        assert impl.unsharded_stats(model).current_bytes == 0, what
    torch_impl = ref_impl()
    if hasattr(torch_impl.FSDPModule, "set_keep_unsharded_storage"):  # torch 2.15 and later
        ref = _train(torch_impl, True, reshard, mp)
        assert_same_run(f"{what} vs torch", kept, ref)


def check_errors() -> None:
    m = native_linear()
    if m is None:  # the messages are fsdp_native's
        return
    raises_exactly(TypeError, "set_keep_unsharded_storage: argument 'keep' must be a bool, got int", lambda: m.set_keep_unsharded_storage(1))
    # The method of torch's FSDPModule (up to 2.15) that fsdp_native lacks names itself.
    raises_exactly(NotImplementedError, "fsdp_native: FSDPModule.set_symm_mem_for_comm is not implemented", lambda: m.set_symm_mem_for_comm())


def _grid():
    run_grid([dict(reshard=True), dict(reshard=False), dict(reshard=True, mp=True)], check, name="keep-unsharded")
    run_grid([{}], check_errors, name="keep-unsharded-errors")


def test_keep_unsharded_storage():
    run_distributed(_grid, 2, timeout=300)
