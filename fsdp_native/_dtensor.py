"""The DTensor type of sharded parameters, their gradients and whatever is derived from them.

``ShardedDTensor`` is a :class:`~torch.distributed.tensor.DTensor` (``isinstance`` holds, the
spec, placements, ``to_local``, ``full_tensor``, ``redistribute`` and every op behave as
DTensor's) with these differences:

* **Elementwise fast path.** An optimizer step is a dozen elementwise ops per parameter, and
  DTensor's dispatch of an op with a Python-number argument (``p.mul_(beta)``, ``d / c``,
  ``d.add_(eps)``) builds a replicated spec for the wrapped number every call: about 3x the
  cost of the op on a small shard. When every DTensor argument of such an op has the same
  spec (a parameter, its gradient and the optimizer states created from it share one spec
  object; states loaded from a checkpoint have an equal one) and the others are numbers or
  0-dim tensors, sharding propagation is the identity: the op runs on the local tensors and
  the result keeps that spec. fsdp_native's specs are Shard/Replicate only, never Partial.
  Anything else is handed to DTensor.
* **torch.compile sees a ShardedDTensor**: its traced inputs are rebuilt as ShardedDTensors
  (``__tensor_unflatten__``), and AOT autograd's cache key names the type
  (``_stable_hash_for_caching``), so functions compiled over plain DTensors are not reused for
  it (a compiled optimizer step, torchao's low-bit optimizers).
* **Pickles as a plain DTensor** whose wrapper has storage offset 0. The local tensors view
  one flat buffer per unit, and a wrapper carrying the view's storage offset cannot be saved
  by ``torch.save``; loading needs no fsdp_native (``weights_only=True`` works).

Torch 2.10 and 2.11 never call a DTensor subclass's ``__torch_dispatch__``: their C++ DTensor
dispatch takes every DTensor subclass (``fsdp_native._compat.DTENSOR_SUBCLASS_DISPATCH``; 2.9's
DTensor dispatch was Python and calls it), so ``detach`` gave a plain DTensor and
``nn.Parameter(ShardedDTensor)`` failed. There,
ShardedDTensor has a ``__torch_function__`` that runs each call under a dispatch mode whose
handler is ``ShardedDTensor.__torch_dispatch__``: the mode is consulted before any subclass,
below autograd, exactly where a subclass's own dispatch would run, so both paths and their
results are the same on every version. Calls that never reach Python (C++-internal ops) take
DTensor's own dispatch there and return plain DTensors, as every op did before.
"""
from __future__ import annotations

import hashlib

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing
from torch.utils._pytree import tree_map

from fsdp_native import _compat
from fsdp_native._compat import DTENSOR_SUBCLASS_DISPATCH

aten = torch.ops.aten

# Ops whose DTensor sharding propagation, for arguments that all share one Shard/Replicate spec
# (plus numbers and 0-dim tensors), returns that same spec.
_INPLACE = frozenset(
    {
        aten.add_.Tensor, aten.add_.Scalar, aten.sub_.Tensor, aten.sub_.Scalar,
        aten.mul_.Tensor, aten.mul_.Scalar, aten.div_.Tensor, aten.div_.Scalar,
        aten.lerp_.Scalar, aten.lerp_.Tensor, aten.addcmul_.default, aten.addcdiv_.default,
        aten.sqrt_.default, aten.neg_.default, aten.zero_.default, aten.fill_.Scalar,
        aten.copy_.default, aten.clamp_.default,
    }
)  # fmt: skip
_OUT_OF_PLACE = frozenset(
    {
        aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar,
        aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar,
        aten.sqrt.default, aten.neg.default, aten.abs.default, aten.sign.default,
        aten.maximum.default, aten.clamp.default, aten.lerp.Scalar,
        aten.addcmul.default, aten.addcdiv.default,
        aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.clone.default,
        aten.detach.default, aten.alias.default,
    }
)  # fmt: skip

# The multi-tensor (foreach) forms of elementwise ops, which torch's optimizers run on CUDA
# (and with foreach=True anywhere): position i of every list is one parameter's tensors, and
# its sharding propagation is position i's spec, as for the single-tensor op. Only the overloads
# DTensor itself has a strategy for: the others raise there, and must raise here too.
_FOREACH_ELEMENTWISE = (
    "add", "sub", "mul", "div", "lerp", "addcmul", "addcdiv", "sqrt", "neg", "abs", "sign",
    "maximum", "minimum", "clamp_min", "clamp_max", "reciprocal", "exp", "pow", "zero",
)  # fmt: skip


def _foreach_overloads(inplace: bool) -> frozenset:
    prop = DTensor._op_dispatcher.sharding_propagator
    known = set(getattr(prop, "op_strategy_funcs", ())) | set(getattr(prop, "op_single_dim_strategy_funcs", ()))
    ops = set()
    for base in _FOREACH_ELEMENTWISE:
        packet = getattr(aten, f"_foreach_{base}_" if inplace else f"_foreach_{base}", None)
        if packet is not None:
            ops.update(getattr(packet, name) for name in packet.overloads() if not name.endswith("out"))
    return frozenset(ops & known)


_FOREACH_INPLACE = _foreach_overloads(True)
_FOREACH_OUT_OF_PLACE = _foreach_overloads(False)


def _wrap(cls, local: torch.Tensor, spec, requires_grad: bool):
    """A `cls` DTensor over `local` with `spec` whose wrapper has storage offset 0 whatever
    `local`'s is (see the module docstring)."""
    base = local if local.storage_offset() == 0 else local.as_strided(local.size(), local.stride(), 0)
    r = _compat.new_dtensor(cls, base, spec, requires_grad)
    r._local_tensor = local
    return r


def make_sharded(local: torch.Tensor, spec, requires_grad: bool = False) -> "ShardedDTensor":
    """A ShardedDTensor over `local` with `spec`."""
    return _wrap(ShardedDTensor, local, spec, requires_grad)


class ShardedDTensor(DTensor):
    # No __slots__ of its own (not even an empty one): code that copies a DTensor by walking
    # ``type(x).__slots__`` must find DTensor's ``_local_tensor`` and ``_spec``. DCP's async
    # staging (StateDictStager) does; with ``__slots__ = ()`` it found none and wrote
    # uninitialized memory into async checkpoints. (Instances have a __dict__ either way.)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        inplace = func in _INPLACE
        if inplace or func in _OUT_OF_PLACE:
            out = _fast(func, args, kwargs, inplace)
            if out is not NotImplemented:
                return out
        elif func in _FOREACH_INPLACE or func in _FOREACH_OUT_OF_PLACE:
            out = _fast_foreach(func, args, kwargs, func in _FOREACH_INPLACE)
            if out is not NotImplemented:
                return out
        return _delegate(func, args, kwargs)

    def __reduce_ex__(self, protocol):
        return _wrap(DTensor, self._local_tensor, self._spec, self.requires_grad).__reduce_ex__(protocol)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):
        # DTensor's rebuilds a plain DTensor. torch.compile rebuilds its subclass inputs with
        # this to trace them, and its compiled function then requires inputs of the rebuilt
        # type: a compiled optimizer step (torch.compile(opt.step), torchao's low-bit
        # optimizers) raised "expected DTensor, got ShardedDTensor" on sharded parameters.
        d = DTensor.__tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride)
        return _wrap(ShardedDTensor, d._local_tensor, d._spec, d.requires_grad)

    if hasattr(DTensor, "_stable_hash_for_caching"):  # torch >= 2.13: AOT autograd's cache key

        def _stable_hash_for_caching(self) -> str:
            # DTensor's key (spec, requires_grad, device) names no type, so a function compiled
            # for plain DTensor inputs (torch FSDP2's parameters, in this process or on disk)
            # was reused for ShardedDTensor ones, and its check of the input types raised.
            key = "fsdp_native.ShardedDTensor" + DTensor._stable_hash_for_caching(self)
            return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


class _RouteToShardedDispatch(TorchDispatchMode):
    """torch 2.10 and 2.11 (see the module docstring): while a ShardedDTensor call runs, hands its
    ops to ShardedDTensor.__torch_dispatch__ (with this mode off, as a mode's handler runs)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return ShardedDTensor.__torch_dispatch__(func, types, args, kwargs)

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True  # not a user mode: code that checks for one should not see it


_ROUTE = _RouteToShardedDispatch()


def _torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    with torch._C.DisableTorchFunctionSubclass():
        if getattr(func, "__name__", None) == "__get__":  # a property (.shape, .grad): no op
            return func(*args, **kwargs)
        with _ROUTE:
            return func(*args, **kwargs)


if not DTENSOR_SUBCLASS_DISPATCH:
    ShardedDTensor.__torch_function__ = classmethod(_torch_function)  # type: ignore[assignment]


def _replicated_scalar(a: DTensor) -> bool:
    """A 0-dim DTensor replicated on every mesh dim (``clip_grad_norm_``'s clip coefficient):
    each rank's local tensor is the value, so for an elementwise op it is a 0-dim operand like
    any other (checked to be on the other operands' mesh once that is known)."""
    return a.dim() == 0 and all(p.is_replicate() for p in a._spec.placements)


def _same_mesh(a, b) -> bool:
    return a is b or a == b


def _plain_kwargs(kwargs) -> bool:
    """No tensor among the keyword arguments, and no device to move to."""
    return not kwargs or not any(isinstance(v, torch.Tensor) or (k == "device" and v is not None) for k, v in kwargs.items())


def _same_layout(out: torch.Tensor, local: torch.Tensor) -> bool:
    """`out` can take `local`'s spec: same dtype, shape and strides."""
    return out.dtype == local.dtype and out.shape == local.shape and out.stride() == local.stride()


def _fast(func, args, kwargs, inplace: bool):
    spec = None
    first = None
    scalars = None
    local_args = []
    for a in args:
        if isinstance(a, DTensor):
            if a._spec is not spec and _replicated_scalar(a):
                scalars = (scalars or []) + [a]
            elif spec is None:
                spec, first = a._spec, a._local_tensor
            elif a._spec is not spec and a._spec != spec:  # e.g. optimizer states loaded from a checkpoint
                return NotImplemented
            local_args.append(a._local_tensor)
        elif isinstance(a, torch.Tensor) and a.dim() != 0:
            return NotImplemented
        else:
            local_args.append(a)
    if scalars:
        if spec is None:  # every DTensor operand is a replicated 0-dim one: they share one spec
            spec, first = scalars[0]._spec, scalars[0]._local_tensor
            if any(t._spec is not spec and t._spec != spec for t in scalars):
                return NotImplemented
        elif (inplace and args[0] is scalars[0]) or any(not _same_mesh(t._spec.mesh, spec.mesh) for t in scalars):
            return NotImplemented
    if spec is None:
        return NotImplemented
    if not _plain_kwargs(kwargs):
        return NotImplemented
    out = func(*local_args, **(kwargs or {}))
    if inplace:
        return args[0]
    if not _same_layout(out, first):
        return NotImplemented  # e.g. zeros_like(p, dtype=...): the spec would not describe it
    return make_sharded(out, spec)


def _fast_foreach(func, args, kwargs, inplace: bool):
    """The foreach form of ``_fast``: the first tensor list is all DTensors, and position i of
    every other tensor list has position i's spec (or is a 0-dim plain tensor); other arguments
    are numbers, lists of numbers or 0-dim plain tensors. Runs on the local tensors; each result
    keeps its position's spec."""
    specs = firsts = None
    local_args = []
    for a in args:
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            if specs is None:
                for t in a:  # ShardedDTensor specs are never Partial; a plain DTensor's may be
                    if not isinstance(t, DTensor) or (type(t) is not ShardedDTensor and any(pl.is_partial() for pl in t._spec.placements)):
                        return NotImplemented
                specs = [t._spec for t in a]
                firsts = [t._local_tensor for t in a]
                local_args.append(firsts)
                continue
            if len(a) != len(specs):
                return NotImplemented
            locals_ = []
            for t, spec in zip(a, specs):
                if isinstance(t, DTensor):
                    if t._spec is not spec and t._spec != spec:
                        return NotImplemented
                    locals_.append(t._local_tensor)
                elif isinstance(t, torch.Tensor) and t.dim() == 0:
                    locals_.append(t)
                else:
                    return NotImplemented
            local_args.append(locals_)
        elif isinstance(a, DTensor):
            if specs is None or not _replicated_scalar(a) or not _same_mesh(a._spec.mesh, specs[0].mesh):
                return NotImplemented
            local_args.append(a._local_tensor)
        elif isinstance(a, torch.Tensor) and a.dim() != 0:
            return NotImplemented
        else:
            local_args.append(a)
    if specs is None:
        return NotImplemented
    if not _plain_kwargs(kwargs):
        return NotImplemented
    out = func(*local_args, **(kwargs or {}))
    if inplace:
        return out
    if not all(_same_layout(o, first) for o, first in zip(out, firsts)):
        return NotImplemented
    return [make_sharded(o, spec) for o, spec in zip(out, specs)]


def _delegate(func, args, kwargs):
    """DTensor's own dispatch, on plain DTensor wrappers of the same locals; an in-place op's
    spec change is copied back to the ShardedDTensor it returns."""
    originals: dict[int, tuple[DTensor, ShardedDTensor]] = {}

    def unwrap(t):
        if type(t) is ShardedDTensor:
            plain = DTensor(t._local_tensor, t._spec, requires_grad=t.requires_grad)
            originals[id(plain)] = (plain, t)
            return plain
        return t

    out = func(*_map_one(unwrap, args), **({k: _map_one(unwrap, v) for k, v in kwargs.items()} if kwargs else {}))

    def rewrap(o):
        hit = originals.get(id(o)) if isinstance(o, DTensor) else None
        if hit is not None and hit[0] is o:
            hit[1]._spec = o._spec
            hit[1]._local_tensor = o._local_tensor
            return hit[1]
        return o

    out = _map_one(rewrap, out)
    if torch.Tag.inplace_view in func.tags:
        # squeeze_, t_, ...: the wrapper's own sizes change too, as DTensor does for itself.
        out = return_and_correct_aliasing(func, args, kwargs or {}, out)
    return out


# An op's arguments and results are tensors, numbers, None and lists or tuples of those; this
# maps them without pytree's flatten / unflatten (two thirds of a delegated call's Python
# time), and hands anything else to tree_map.
def _map_one(fn, x):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if type(x) is list:
        return [_map_one(fn, y) for y in x]
    if type(x) is tuple:
        return tuple(_map_one(fn, y) for y in x)
    if x is None or isinstance(x, (int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return x
    return tree_map(fn, x)


# torch's optimizers pick their foreach (multi-tensor) path only for parameters whose exact
# type is listed, and torch lists DTensor: list ShardedDTensor too, so on CUDA AdamW & co.
# take the same path (launches and rounding) as with torch FSDP2's plain DTensors.
def _register_foreach_support() -> None:
    from torch.optim import optimizer as _optimizer
    from torch.utils import _foreach_utils

    for types in (_optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if ShardedDTensor not in types:
            types.append(ShardedDTensor)


_register_foreach_support()
