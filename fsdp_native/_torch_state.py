"""torch FSDP2's per-module state, as code outside FSDP2 reads it.

torch's ``fully_shard`` is a composable API: ``fully_shard.state(module)`` and
``module._get_fsdp_state()`` return the module's ``FSDPState``. Code outside FSDP2 reads a few
of its members:

* torch's ``register_fsdp_forward_method`` (the Trainer wraps ``generate``): ``_pre_forward`` /
  ``_post_forward``;
* ``torch.distributed.pipelining``'s stages before torch 2.15 (``perform_reduce_grad``), and
  frameworks that finish a pipeline stage's or a mixture-of-experts model's backward by hand
  (OLMo-core's pipeline stage, NeMo Automodel's MoE mixin): with sync and reshard turned on,
  ``post_backward()`` of each param group of ``state._state_ctx.all_states``
  (``_fsdp_param_group``, or ``_fsdp_param_groups`` from 2.13), then
  ``state._root_post_backward_final_callback()``;
* torch 2.15's pipeline schedules with ``defer_reduce_grad_wait``: ``_comm_ctx``, whose
  identity says which stages share a communication context (``share_comm_ctx``);
* NeMo Automodel's losses and logits: ``lm_head._get_fsdp_state()._mp_policy.param_dtype``, the
  dtype the head computes in.

:class:`StateView` has those members for an fsdp_native module and runs fsdp_native's own
hooks and finalization in them: a unit's post-backward reduces what the backwards left (or
reshards), the final callback does every unit's and completes the reductions. ``register``
puts it where both of torch's getters look, so ``torch.distributed.fsdp.fully_shard.state``,
fsdp_native's ``fully_shard.state`` and ``FSDPModule._get_fsdp_state()`` return it.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import fully_shard as _torch_fully_shard

from fsdp_native._state import post_forward, pre_forward

# The module, not the `contract` function that torch.distributed._composable exports.
_contract = importlib.import_module("torch.distributed._composable.contract")
_ATTR = "_fsdp_native_state"


class _ParamGroupView:
    """One unit, as a param group."""

    def __init__(self, unit) -> None:
        self._unit = unit

    def post_backward(self) -> None:
        unit = self._unit
        if unit.ctx is not None:  # None: no forward ran, nothing to reduce
            unit.ctx.finish_unit(unit)


class _StateCtxView:
    def __init__(self, units) -> None:
        # The registered states, one per fully_shard call: a unit with parameters on several
        # meshes (ShardPlacementResult) is one state whose param groups are its units.
        self.all_states = [state(u.modules[0]) for u in units if u.primary is None]


class StateView:
    """What ``fully_shard.state(module)`` and ``module._get_fsdp_state()`` return for a module
    sharded by fsdp_native."""

    __slots__ = ("_unit",)

    def __init__(self, unit) -> None:
        self._unit = unit

    def __repr__(self) -> str:
        return f"fsdp_native state of unit '{self._unit.fqn or '<root>'}'"

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        new = pre_forward(self._unit, module, args, kwargs)
        return (args, kwargs) if new is None else new

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        res = post_forward(self._unit, module, args, output)
        return output if res is None else res

    @property
    def _mp_policy(self):
        """The unit's MixedPrecisionPolicy."""
        return self._unit.mp

    @property
    def _fsdp_param_groups(self) -> list[_ParamGroupView]:
        return [_ParamGroupView(u) for u in self._unit.group]

    @property
    def _fsdp_param_group(self) -> _ParamGroupView:
        groups = self._fsdp_param_groups  # a unit's group holds the unit itself at least
        if len(groups) > 1:
            raise AssertionError(
                f"unit '{self._unit.fqn}' has {len(groups)} param groups (parameters on several meshes); "
                "use _fsdp_param_groups"
            )
        return groups[0]

    @property
    def _state_ctx(self) -> _StateCtxView:
        ctx = self._unit.ctx  # None before the first forward: no units to reduce yet
        return _StateCtxView(ctx.units if ctx is not None else [])

    @property
    def _comm_ctx(self) -> object:
        """The communication context's identity: share_comm_ctx's shared one, else the root's."""
        ctx = self._unit.ctx
        root = ctx.root._fsdp_native_unit if ctx is not None else self._unit
        return root.shared_comm if root.shared_comm is not None else root

    def _root_post_backward_final_callback(self) -> None:
        ctx = self._unit.ctx
        if ctx is not None:  # nothing ran forward yet: nothing to reduce
            ctx.finish_all()


def register(module: nn.Module, view: StateView) -> None:
    """Makes ``view`` ``module``'s state (both libraries' ``fully_shard.state``,
    ``_get_fsdp_state()``); the modules of one ``fully_shard([a, b])`` share one, as in torch."""
    module.__dict__[_ATTR] = view
    key = getattr(_torch_fully_shard, "__wrapped__", None)
    if key is not None:
        module.__dict__.setdefault(_contract.STATE_KEY, {})[key] = view


def state(module: nn.Module) -> StateView | None:
    """``fully_shard.state(module)``: the module's state, None for a module that
    ``fully_shard`` did not shard (as torch's)."""
    return module.__dict__.get(_ATTR)
