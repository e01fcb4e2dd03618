"""Pipeline stages of ``torch.distributed.pipelining`` before torch 2.15.

Before 2.15 a stage reduces its FSDP2 gradients through torch's internal state, after the
micro-batches' backwards (run without gradient sync or reshard): ``perform_reduce_grad`` turns
sync and reshard on, takes ``torch.distributed.fsdp.fully_shard.state(stage_module)``, calls
``post_backward()`` on every param group of ``state._state_ctx.all_states``
(``_fsdp_param_group`` before 2.13, ``_fsdp_param_groups`` from 2.13) and then
``state._root_post_backward_final_callback()``. torch 2.15's stages use the public
``set_manual_backward_finalization`` / ``finalize_backward`` instead, which fsdp_native has.

For an fsdp_native module that state would be ``None``. ``register`` puts a view of the
module's units where ``fully_shard.state`` looks (the module's composable-API state dict,
under torch's ``fully_shard``), whose methods run fsdp_native's own finalization: each unit's
reduction of the accumulated gradients, then the wait and the reshard.
"""
from __future__ import annotations

import importlib

import torch.nn as nn
from torch.distributed.fsdp import fully_shard as _torch_fully_shard

from fsdp_native import _compat

# The module, not the `contract` function that torch.distributed._composable exports.
_contract = importlib.import_module("torch.distributed._composable.contract")


class _ParamGroupView:
    """One unit, as a stage sees a param group."""

    def __init__(self, unit) -> None:
        self._unit = unit

    def post_backward(self) -> None:
        unit = self._unit
        if unit.ctx is not None:
            unit.ctx.finish_unit(unit)


class _UnitStateView:
    def __init__(self, unit) -> None:
        self._fsdp_param_group = _ParamGroupView(unit)  # torch before 2.13
        self._fsdp_param_groups = [self._fsdp_param_group]  # torch 2.13, 2.14


class _StateCtxView:
    def __init__(self, units) -> None:
        self.all_states = [_UnitStateView(u) for u in units]


class PipelineStateView:
    """What ``torch.distributed.fsdp.fully_shard.state(module)`` returns for an fsdp_native
    module, for ``torch.distributed.pipelining``'s stages."""

    def __init__(self, unit) -> None:
        self._unit = unit

    @property
    def _state_ctx(self) -> _StateCtxView:
        ctx = self._unit.ctx  # None before the first forward: no units to reduce yet
        return _StateCtxView(ctx.units if ctx is not None else [])

    def _root_post_backward_final_callback(self) -> None:
        ctx = self._unit.ctx
        if ctx is not None:  # nothing ran forward yet: nothing to reduce
            ctx.finish_all()


def register(module: nn.Module, unit) -> None:
    """Makes ``torch.distributed.fsdp.fully_shard.state(module)`` a :class:`PipelineStateView`
    (torch before 2.15)."""
    key = getattr(_torch_fully_shard, "__wrapped__", None)
    if not _compat.PIPELINING_READS_FSDP_STATE or key is None:
        return
    states = module.__dict__.setdefault(_contract.STATE_KEY, {})
    states[key] = PipelineStateView(unit)
