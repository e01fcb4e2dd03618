"""fully_shard and FSDPModule: the public runtime surface."""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule
from torch.distributed.tensor import DTensor, Shard

from fsdp_native import _compat, _extension, _torch_state, _tp
from fsdp_native._api import (
    MixedPrecisionPolicy,
    OffloadPolicy,
    QuantizedAllGather,
    normalize_mp_policy,
    normalize_offload_policy,
    resolve_param_dtypes,
)
from fsdp_native._mesh import default_mesh, mesh_info, post_forward_group
from fsdp_native._state import GradientReductionHandle, _eager, post_forward, pre_forward
from fsdp_native._unit import Unit

_CLS_CACHE: dict[type, type] = {}


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims=None,
    all_gather: QuantizedAllGather | None = None,
):
    """Shards ``module``'s parameters (those not already in a unit below it) over ``mesh`` as
    one unit: all-gathered before its forward and backward, gradients reduce-scattered after
    backward. Same contract as ``torch.distributed.fsdp.fully_shard``; call it bottom-up.

    Args:
        module: the module, or a list of modules sharing one unit.
        mesh: a 1-D mesh (FSDP) or 2-D mesh (HSDP, dims ``(replicate, shard)``); default: the
            whole world on the default device type. Tensor-parallel DTensor parameters on
            other dims of the same device mesh are sharded over it too (``_tp``).
        reshard_after_forward: ``True`` frees the unsharded parameters after forward and
            all-gathers again in backward; ``False`` keeps them; an ``int`` reshards to that
            many ranks; ``None`` is ``True`` except for the root, which is ``False``.
        shard_placement_fn: per parameter, ``None`` (dim 0) or ``Shard(d)``; a dim other than 0
            must divide evenly over the shard ranks, as in torch FSDP2.
        mp_policy: mixed precision (fsdp_native's or torch's ``MixedPrecisionPolicy``).
        offload_policy: ``OffloadPolicy()`` or ``CPUOffloadPolicy()`` (fsdp_native's or torch's).
        ignored_params: parameters left unsharded and unreduced.
        dp_mesh_dims: a ``DataParallelMeshDims`` (torch 2.13's SPMD form): ``mesh`` is the full
            mesh, every parameter a DTensor on it, replicated on the named data-parallel dims
            (one shard dim, optionally one replicate dim).
        all_gather: fsdp_native only: a :class:`QuantizedAllGather` makes the unit's all-gather
            move fp8 or NF4 bytes, dequantized into ``param_dtype`` for compute; ``None``
            (the default) gathers the parameters as torch does.

    Returns:
        The module, now also an instance of :class:`FSDPModule`.
    """
    modules = module if isinstance(module, list) else [module]
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard: argument 'module' must be an nn.Module or a list of them, got {type(m).__name__}")
    if isinstance(module, list) and not module:
        raise ValueError("fully_shard: argument 'module' is an empty list, expected at least one module")
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"fully_shard: argument 'module' is a {type(m).__name__}, a container without forward; "
                "shard its children instead"
            )
    _check_all_gather(all_gather)
    mp = normalize_mp_policy(mp_policy)
    offload = normalize_offload_policy(offload_policy)
    if not isinstance(reshard_after_forward, (bool, int, type(None))):
        raise TypeError(
            f"fully_shard: argument 'reshard_after_forward' must be a bool or an int, got {type(reshard_after_forward).__name__}"
        )
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(
            "fully_shard: argument 'shard_placement_fn' must be a function of a parameter returning None or a "
            f"Shard placement, or None, got {type(shard_placement_fn).__name__}"
        )
    ignored = _ignored_set(ignored_params)
    mesh = mesh if mesh is not None else default_mesh()
    spmd = None
    if dp_mesh_dims is not None:
        info, spmd = _tp.spmd_mesh_info(mesh, dp_mesh_dims)
    else:
        info = mesh_info(mesh)
    if offload is not None and offload.pin_memory and info.device.type != "cpu" and not torch.cuda.is_available():
        raise ValueError("fully_shard: argument 'offload_policy' asks for pinned memory, expected a CUDA device for it")
    raf, post = _reshard_after_forward(reshard_after_forward, info)

    for m in modules:
        existing = getattr(m, "_fsdp_native_unit", None)
        if existing is not None:
            _check_same_settings(m, existing, info, mp, offload, raf, reshard_after_forward)
            return module
        if isinstance(m, _TorchFSDPModule):
            raise ValueError(
                f"fully_shard: argument 'module' ({type(m).__name__}) is already sharded by torch's "
                "torch.distributed.fsdp.fully_shard; a module can be sharded by one of the two libraries only"
            )
    params, owners = _collect_params(modules, ignored)
    names = _param_names(modules, params)
    _check_not_sharded(modules, params, owners, names, info, spmd)
    for p, name in zip(params, names):
        if p.dim() == 0:
            raise ValueError(
                f"fully_shard: argument 'module' has a scalar (0-dim) parameter '{name}'; FSDP shards dim 0, "
                "make it a 1-D tensor of size 1"
            )
        if _compat.GRAD_IN_REDUCE_DTYPE and getattr(p, "_has_grad_dtype_override", False) and p.grad_dtype != p.dtype:
            raise NotImplementedError(
                f"fully_shard: parameter '{name}' has grad_dtype {p.grad_dtype} and dtype {p.dtype}; fsdp_native keeps "
                "each sharded gradient in its parameter's dtype (torch 2.15's FSDP2 keeps the grad_dtype): set "
                "p.grad_dtype = p.dtype, and MixedPrecisionPolicy(reduce_dtype=...) for the dtype of the reduction"
            )
    _check_devices(params, names)
    units = []
    for g_info, idx, placements in _mesh_groups(shard_placement_fn, params, names, info, spmd):
        g_params, g_names, g_owners = [params[i] for i in idx], [names[i] for i in idx], [owners[i] for i in idx]
        g_raf, g_post = (raf, post) if g_info is info else _group_reshard(reshard_after_forward, g_info, g_names)
        local, tp_specs = _tp.split(g_params, g_names, g_info, g_post is not None, spmd)
        shard_dims = _shard_dims(placements, g_params, g_names, g_info, [p.shape for p in local])
        param_dtypes = resolve_param_dtypes(mp, g_params, g_names)  # the user's parameters, as torch calls it
        g_params = [_to_device(p, g_info.device) for p in local]
        units.append(
            Unit(modules, g_params, g_owners, g_info, mp, offload, g_raf, g_post, all_gather, param_dtypes, shard_dims, tp_specs, spmd)
        )
    unit = units[0]
    for u in units[1:]:
        u.primary = unit
    unit.group = tuple(units)
    pre_hook, post_hook = _eager_hooks()
    state = _torch_state.StateView(unit)
    for m in modules:
        m._fsdp_native_unit = unit
        m.register_forward_pre_hook(functools.partial(pre_hook, unit), prepend=True, with_kwargs=True)
        m.register_forward_hook(functools.partial(post_hook, unit), prepend=False)
        # Like torch: a state dict always holds the sharded DTensor parameters.
        m.register_state_dict_pre_hook(lambda mod, prefix, keep_vars, units=units: _each(units, Unit.reshard))
        # load_state_dict(assign=True) installs new tensors: reshard before, re-adopt after, so
        # the parameters are the unit's own (flat buffer, ShardedDTensor) before an optimizer
        # is built from them.
        m.register_load_state_dict_pre_hook(lambda mod, *args, units=units: _each(units, Unit.reshard))
        m.register_load_state_dict_post_hook(lambda mod, incompatible, units=units: _each(units, Unit.readopt))
        _torch_state.register(m, state)  # what fully_shard.state(m) and m._get_fsdp_state() return
        cls = type(m)
        if not isinstance(m, FSDPModule):
            new_cls = _CLS_CACHE.get(cls)
            if new_cls is None:
                new_cls = _CLS_CACHE[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"_orig_cls_mro_index": 3})
            m.__class__ = new_cls
    if len(modules) == 1:
        # Names relative to the outermost module sharded so far (the root, once it is sharded).
        for name, sub in modules[0].named_modules():
            sub_unit = getattr(sub, "_fsdp_native_unit", None)
            if sub_unit is not None:
                for u in sub_unit.group:
                    u.fqn = name
    return module


# As torch's (a composable API): fully_shard.state(module) is the module's state, None for a
# module fully_shard did not shard.
fully_shard.state = _torch_state.state


def _each(units, method) -> None:
    for u in units:
        method(u)


def _pre_hook(unit, module, args, kwargs):
    return _outside_inference_mode(pre_forward, unit, module, args, kwargs)


def _post_hook(unit, module, args, output):
    return _outside_inference_mode(post_forward, unit, module, args, output)


def _outside_inference_mode(fn, *args):
    """fn(*args), outside inference mode when a forward runs in it: the unsharded parameters
    and buffers a unit makes then outlive that forward as normal tensors, so a training
    forward can use them after an inference_mode one (torch FSDP2 raises there: "Inplace
    update to inference tensor outside InferenceMode"). Grad mode stays off."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return fn(*args)
    return fn(*args)


@functools.cache
def _eager_hooks():
    """The forward hooks, run eagerly under torch.compile (graph breaks around them, the
    modules' own forwards compiled), as torch FSDP2's hooks under dynamo's default
    ``skip_fsdp_hooks``: they issue collectives and change module state, which dynamo must not
    trace. Made at the first fully_shard, which imports torch._dynamo (as torch's first hook
    does), so that importing fsdp_native does not."""
    return _eager(_pre_hook), _eager(_post_hook)


def _ignored_set(ignored_params) -> set:
    """`ignored_params` as a set, checked to hold parameters: a name, or a lone tensor
    (iterated by rows), would leave every parameter sharded without a word (torch FSDP2 takes
    names silently)."""
    if ignored_params is None:
        return set()
    if isinstance(ignored_params, torch.Tensor) or not isinstance(ignored_params, Iterable):
        raise TypeError(
            f"fully_shard: argument 'ignored_params' must be a set of parameters or None, got {type(ignored_params).__name__}"
        )
    ignored = set(ignored_params)
    for p in ignored:
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"fully_shard: argument 'ignored_params' holds {p!r} ({type(p).__name__}), expected the parameters "
                "themselves (module.weight, not its name)"
            )
    return ignored


def _check_all_gather(policy) -> None:
    from fsdp_native import quant

    if policy is None:
        return
    if not isinstance(policy, QuantizedAllGather):
        raise TypeError(f"fully_shard: argument 'all_gather' must be a QuantizedAllGather or None, got {type(policy).__name__}")
    if policy.format not in quant.FORMATS:
        raise ValueError(
            f"fully_shard: argument 'all_gather.format' is {policy.format!r}, expected one of {', '.join(map(repr, quant.FORMATS))}"
        )
    bs = policy.block_size
    if not (isinstance(bs, int) and 2 <= bs <= quant.MAX_BLOCK_SIZE and bs & (bs - 1) == 0):
        raise ValueError(f"fully_shard: argument 'all_gather.block_size' is {bs!r}, expected a power of two from 2 to {quant.MAX_BLOCK_SIZE}")


def _reshard_after_forward(value, info) -> tuple[bool | None, tuple | None]:
    if value is None or isinstance(value, bool):
        return value, None
    size = info.shard_size
    if value < 1 or value > size or size % value:
        raise ValueError(
            f"fully_shard: argument 'reshard_after_forward' is {value}, expected a bool or a divisor of the shard group size {size}"
        )
    if value == 1:
        return False, None
    if value == size:
        return True, None
    group, index = post_forward_group(info, value)
    return True, (group, value, index)


def _check_same_settings(module, unit, info, mp, offload, raf, given) -> None:
    """Re-applying fully_shard with the same settings is a no-op; conflicting settings raise."""
    where = f"module {type(module).__name__}"
    if raf is not None and unit.reshard_after_forward != raf:
        raise ValueError(
            f"fully_shard: argument 'reshard_after_forward' is {given}, but {where} is already sharded with "
            f"reshard_after_forward={unit.reshard_after_forward}"
        )
    if unit.mp != mp:
        raise ValueError(f"fully_shard: argument 'mp_policy' is {mp}, but {where} is already sharded with mp_policy={unit.mp}")
    if (unit.offload is None) != (offload is None):
        raise ValueError(f"fully_shard: argument 'offload_policy' is {offload}, but {where} is already sharded with offload_policy={unit.offload}")
    if unit.info.mesh != info.mesh:
        raise ValueError(f"fully_shard: argument 'mesh' is {info.mesh}, but {where} is already sharded on {unit.info.mesh}")


def _is_placement_result(result) -> bool:
    """torch 2.13's ``ShardPlacementResult`` (a placement and a mesh), duck-typed."""
    return result is not None and not isinstance(result, Shard) and hasattr(result, "mesh_info") and hasattr(result, "placement")


def _mesh_groups(fn, params: list, names: list[str], info, spmd) -> list[tuple]:
    """The parameters grouped by the mesh they are sharded on, as torch FSDP2 (2.13+) groups
    them: ``(MeshInfo, indices, placements)`` per group, in the order of each group's first
    parameter. `shard_placement_fn` gives each parameter ``None`` or ``Shard(d)`` (the call's
    mesh, `info`), or a ``ShardPlacementResult`` whose ``mesh_info`` may name another mesh;
    parameters whose meshes have the same shard and replicate process groups share a group.
    Each group becomes a unit of its own (:attr:`Unit.group`)."""
    default_key = (info.shard_group, info.replicate_group)
    groups: dict[tuple, tuple] = {}
    for i, (p, name) in enumerate(zip(params, names)):
        result = None if fn is None else fn(p)
        placement, g_info, key = result, info, default_key
        if _is_placement_result(result):
            placement = result.placement
            g_info = _result_mesh_info(result.mesh_info, name, info, spmd)
            key = (g_info.shard_group, g_info.replicate_group)
            if key == default_key:
                g_info = info
        group = groups.get(key)
        if group is None:
            group = groups[key] = (g_info, [], [])
        group[1].append(i)
        group[2].append(placement)
    return list(groups.values()) or [(info, [], [])]


def _result_mesh_info(result_info, name: str, info, spmd):
    """fsdp_native's MeshInfo for the ``mesh_info`` of a ``ShardPlacementResult``: torch's
    ``FSDPMeshInfo(mesh, shard_mesh_dim=0)`` on a 1-D mesh, or ``HSDPMeshInfo(mesh,
    replicate_mesh_dim=0, shard_mesh_dim=1)`` on a 2-D one."""
    mesh = getattr(result_info, "mesh", None)
    shard_dim = getattr(result_info, "shard_mesh_dim", None)
    replicate_dim = getattr(result_info, "replicate_mesh_dim", None)
    where = f"fully_shard: argument 'shard_placement_fn' returned a ShardPlacementResult for parameter '{name}'"
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{where} whose mesh_info has no DeviceMesh (got {type(mesh).__name__}), expected an FSDPMeshInfo")
    if (mesh.ndim, shard_dim, replicate_dim) not in ((1, 0, None), (2, 1, 0)):
        raise NotImplementedError(
            f"{where} on a {mesh.ndim}-D mesh with shard_mesh_dim={shard_dim} and replicate_mesh_dim={replicate_dim}; "
            "fsdp_native takes FSDPMeshInfo(mesh, shard_mesh_dim=0) on a 1-D mesh or HSDPMeshInfo(mesh, "
            "replicate_mesh_dim=0, shard_mesh_dim=1) on a 2-D one"
        )
    if mesh.device_type != info.mesh.device_type:
        raise ValueError(f"{where} on a mesh of device type {mesh.device_type!r}, expected the unit's {info.mesh.device_type!r}")
    if spmd is not None and mesh != info.mesh:
        raise NotImplementedError(f"{where} with a mesh of its own, together with dp_mesh_dims; fsdp_native supports one of the two")
    return mesh_info(mesh)


def _group_reshard(value, g_info, names: list[str]) -> tuple[bool | None, tuple | None]:
    """``reshard_after_forward`` for the parameters on a mesh of their own: a bool as given; an
    int must divide that mesh's shard group too, as in torch, and may not reshard to a group
    smaller than it but larger than one."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 < value < g_info.shard_size and g_info.shard_size % value == 0:
        raise NotImplementedError(
            f"fully_shard: argument 'reshard_after_forward' is {value}, which would reshard parameters on a mesh of "
            f"their own ({', '.join(repr(n) for n in names[:3])}{', ...' if len(names) > 3 else ''}, {g_info.shard_size} "
            "shard ranks) to a smaller group after forward; fsdp_native supports that on the call's mesh only"
        )
    return _reshard_after_forward(value, g_info)


def _shard_dims(placements: list, params: list, names: list[str], info, shapes: list) -> list[int]:
    """Each parameter's shard dim from its placement (:func:`_mesh_groups`; ``None``: dim 0),
    as torch FSDP2 reads it: ``Shard(d)`` with d counted from the end when negative. A dim
    other than 0 must divide evenly over the shard group (torch FSDP2 pads dim 0 only).
    `shapes`: what the unit shards of each parameter (a tensor-parallel one's local shape)."""
    dims = []
    for p, placement, name, shape in zip(params, placements, names, shapes):
        if placement is None:
            dims.append(0)
            continue
        if type(placement) is not Shard:
            raise ValueError(
                f"fully_shard: argument 'shard_placement_fn' returned {placement!r} for parameter '{name}', "
                "expected None or a Shard placement"
            )
        d = placement.dim + len(shape) if placement.dim < 0 else placement.dim
        if not 0 <= d < len(shape):
            raise ValueError(
                f"fully_shard: argument 'shard_placement_fn' returned Shard({placement.dim}) for parameter '{name}' "
                f"of shape {tuple(shape)}, expected a dim in [{-len(shape)}, {len(shape) - 1}]"
            )
        if d and shape[d] % info.shard_size:
            raise NotImplementedError(
                f"fully_shard: argument 'shard_placement_fn' returned Shard({placement.dim}) for parameter '{name}' "
                f"of shape {tuple(shape)}, whose size {shape[d]} on dim {d} does not divide evenly over the "
                f"{info.shard_size} shard ranks; like torch FSDP2, fsdp_native shards a dim other than 0 evenly only"
            )
        local = p._local_tensor if isinstance(p, DTensor) else p.data  # a TP parameter's local tensor
        if d and _extension.has_extension(local):
            what = (
                f"fully_shard: argument 'shard_placement_fn' returned Shard({placement.dim}) for parameter '{name}', "
                f"a {type(local).__name__} gathered by its fsdp_pre_all_gather"
            )
            if isinstance(p, DTensor):
                raise NotImplementedError(f"{what}; fsdp_native shards tensor-parallel tensor-subclass parameters on dim 0 only")
            try:  # as torch FSDP2, a subclass sharded on dim d is split there (torchao's NF4 cannot be)
                torch.chunk(local, info.shard_size, dim=d)
            except Exception as e:  # noqa: BLE001 - the subclass's own error, named
                raise NotImplementedError(f"{what}, which cannot be split on dim {d}: {type(e).__name__}: {e}") from e
        dims.append(d)
    return dims


def _collect_params(modules: list[nn.Module], ignored: set) -> tuple[list[nn.Parameter], list[list[tuple[nn.Module, str]]]]:
    """Parameters of `modules` not already in a unit below them, with every (module, name)
    that holds each (tied parameters have several)."""
    taken: set[int] = set()
    for m in modules:
        for sub in m.modules():
            unit = getattr(sub, "_fsdp_native_unit", None)
            if unit is not None and sub not in modules:
                for u in unit.group:
                    taken.update(id(p) for p in u.sharded_params)
    params, owners, index = [], [], {}
    for m in modules:
        for sub in m.modules():
            for name, p in sub._parameters.items():
                if p is None or id(p) in taken or p in ignored:
                    continue
                if isinstance(p, DTensor) and getattr(sub, "_fsdp_native_unit", None) is not None:
                    continue
                if id(p) in index:
                    owners[index[id(p)]].append((sub, name))
                    continue
                index[id(p)] = len(params)
                params.append(p)
                owners.append([(sub, name)])
    return params, owners


def _check_bool(method: str, arg: str, value) -> None:
    """A setter's bool argument: anything else (an int included) raises TypeError naming both."""
    if not isinstance(value, bool):
        raise TypeError(f"{method}: argument '{arg}' must be a bool, got {type(value).__name__}")


def _check_not_sharded(modules, params, owners, names, info, spmd=None) -> None:
    """A parameter that is already a DTensor cannot be sharded again: by fsdp_native it means a
    parent was sharded before this submodule (fully_shard goes bottom-up); on the data-parallel
    mesh itself (or an unnamed mesh), torch's fully_shard made it. A DTensor of tensor
    parallelism, on another dim of the same device mesh, composes (:mod:`_tp`), and with
    ``dp_mesh_dims`` a DTensor on the full mesh is what is sharded."""
    for p, owner, name in zip(params, owners, names):
        if not isinstance(p, DTensor):
            continue
        mod = owner[0][0]
        unit = getattr(p, "_fsdp_native_unit", None)
        if unit is not None:
            holder_cls = type(unit.modules[0])
            holder = (holder_cls.__bases__[1] if issubclass(holder_cls, FSDPModule) else holder_cls).__name__
            raise ValueError(
                f"fully_shard: argument 'module' ({type(modules[0]).__name__}) has parameter '{name}' of "
                f"{type(mod).__name__} that is already sharded by fsdp_native in the unit of {holder}"
                f"{f' {unit.fqn!r}' if unit.fqn else ''}; call fully_shard on submodules before their parents"
            )
        if spmd is not None and p.device_mesh == spmd.mesh:
            continue
        if p.device_mesh == info.mesh or p.device_mesh.mesh_dim_names is None:
            raise ValueError(
                f"fully_shard: argument 'module' ({type(modules[0]).__name__}) has parameter '{name}' of "
                f"{type(mod).__name__} that is already a DTensor (placements {tuple(p.placements)}) on "
                f"{'the data-parallel mesh' if p.device_mesh == info.mesh else 'a mesh without dim names'}, e.g. sharded "
                "by torch's fully_shard; fsdp_native composes with DTensors of tensor parallelism on another named dim "
                "of the data-parallel mesh's device mesh only"
            )


def _param_names(modules, params) -> list[str]:
    """Qualified names of `params` relative to the module(s) being sharded."""
    names: dict[int, str] = {}
    for i, m in enumerate(modules):
        prefix = f"[{i}]." if len(modules) > 1 else ""
        for name, p in m.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), prefix + name)
    return [names.get(id(p), "?") for p in params]


def _check_devices(params, names) -> None:
    by_device: dict[str, list[str]] = {}
    for p, name in zip(params, names):
        by_device.setdefault(str(p.device), []).append(name)
    if len(by_device) > 1:
        detail = "; ".join(
            f"{d}: " + ", ".join(f"'{n}'" for n in ns[:3]) + (", ..." if len(ns) > 3 else "")
            for d, ns in sorted(by_device.items())
        )
        raise ValueError(f"fully_shard: argument 'module' has parameters on mixed devices ({detail}); expected one device")


def _to_device(p: nn.Parameter, device: torch.device) -> nn.Parameter:
    if p.is_meta or p.device == device:
        return p
    return nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)


class UnshardHandle:
    """Handle of an asynchronous :meth:`FSDPModule.unshard`; ``wait()`` makes the unsharded
    parameters usable and registers them."""

    def __init__(self, units: list[Unit]) -> None:
        self._units = units

    def wait(self) -> None:
        for u in self._units:
            u.wait_all_gather()
        self._units = []


def _units_below(module: nn.Module) -> list[Unit]:
    """The units of `module` and the modules below it (those of a call on several meshes
    included, after the module's own)."""
    units = []
    for sub in module.modules():
        u = getattr(sub, "_fsdp_native_unit", None)
        if u is not None and u not in units:
            units.extend(u.group)
    return units


class FSDPModule(_TorchFSDPModule):
    """Mixin of every module sharded by :func:`fully_shard`; also an instance of torch's
    ``FSDPModule`` so code that checks for FSDP2 modules recognises it."""

    _orig_cls_mro_index = 3

    @property
    def _unit(self) -> Unit:
        return self._fsdp_native_unit

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gathers this unit's parameters; with ``async_op`` returns a handle to wait on."""
        group = list(self._unit.group)
        for u in group:
            _outside_inference_mode(u.issue_all_gather)
        handle = UnshardHandle(group)
        if async_op:
            return handle
        _outside_inference_mode(handle.wait)
        return None

    def reshard(self) -> None:
        """Frees this unit's unsharded parameters and registers the sharded ones."""
        for u in self._unit.group:
            u.release()
            u.reshard()

    def _targets(self, recurse: bool) -> list[Unit]:
        """The units a setter applies to: every one below this module, or this module's
        (one per mesh its parameters are on)."""
        return _units_below(self) if recurse else list(self._unit.group)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for compatibility; every backward ends with all reductions completed."""
        self._is_last_backward = is_last_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Off: gradients accumulate unsharded and unreduced (micro-batches); on: reduce."""
        for u in self._targets(recurse):
            u.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: off keeps reduce-scattered gradients partial until an all-reducing backward."""
        for u in self._targets(recurse):
            u.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward: argument 'reshard_after_forward' is {reshard_after_forward!r}, expected a bool")
        for u in self._targets(recurse):
            u.reshard_after_forward = reshard_after_forward
            u.auto_reshard = False
            u.post_forward = None

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for u in self._targets(recurse):
            u.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Explicit forward prefetch: all-gather these modules' units right after this one's."""
        self._unit.forward_prefetch = [_require_fsdp(m, "modules")._unit for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Explicit backward prefetch: all-gather these modules' units in this one's pre-backward."""
        self._unit.backward_prefetch = [_require_fsdp(m, "modules")._unit for m in modules]

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next all-gather of this unit waits on ``event`` (recorded after optimizer.step)."""
        for u in self._unit.group:
            u.post_optim_event = event

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This unit's gradients are divided by ``factor`` instead of the data-parallel world
        size (this module's unit only, as in torch FSDP2: not the units below it)."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: argument 'factor' is {factor}, expected a positive number")
        for u in self._unit.group:
            u.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        self.set_gradient_divide_factor(factor)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this unit's parameters are not all-gathered in backward (their backward does
        not need them, e.g. an embedding)."""
        for u in self._unit.group:
            u.unshard_in_backward = unshard_in_backward

    def reset_iter_state(self) -> None:
        """Recovers after a forward or backward raised, as torch FSDP2 2.15: on the root
        module, waits on in-flight collectives, reshards every unit and discards the failed
        iteration's gradients (sharded ones, no-sync accumulations, HSDP partial sums), so
        the next iteration starts clean."""
        ctx = self._unit.ctx
        if ctx is None:  # no forward ran yet (or it raised before the root's lazy init)
            for u in _units_below(self):
                u.reset_iter()
            return
        if ctx.root._fsdp_native_unit is not self._unit:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        ctx.reset_iter_state()

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        group = self._unit.group
        fn = args[0] if args else kwargs["fn"]
        hidden = []
        for u in group:
            u.release()
            u.reshard()
            if u.apply_to_flat(fn):  # the unit's plain shards at once, in their flat buffer
                u.hide(True)
                hidden.append(u)
        try:
            ret = super(_TorchFSDPModule, self)._apply(*args, **kwargs)  # skip torch's FSDP2 override
        finally:
            for u in hidden:
                u.hide(False)
        for u in group:
            u.readopt()
        return ret

    def __deepcopy__(self, memo):
        raise AssertionError("fsdp_native: FSDP modules do not support deepcopy; use the state dict")

    def _single_mesh(self, method: str, what: str) -> None:
        """torch FSDP2's refusal of a per-unit communication setting for a unit whose parameters
        are on several meshes."""
        if len(self._unit.group) > 1:
            raise ValueError(
                f"{method} is not supported with multiple param groups (from per-param mesh via shard_placement_fn). "
                f"The {what} would be ambiguous across groups with different meshes."
            )

    def _not_implemented(self, name: str):
        raise NotImplementedError(f"fsdp_native: FSDPModule.{name} is not implemented")

    def set_custom_all_gather(self, comm) -> None:
        """This unit's all-gathers through `comm`, torch FSDP2's ``AllGather`` protocol:
        ``comm.allocate((numel,), dtype=, device=)`` makes the output buffer (this rank's slot
        of it is the input) and ``comm(output_tensor=, input_tensor=, group=, async_op=True)``
        gathers, returning a work to wait on or None."""
        _check_comm(comm, "set_custom_all_gather")
        self._single_mesh("set_custom_all_gather", "custom comm")
        self._unit.ag_comm = comm

    def set_custom_reduce_scatter(self, comm) -> None:
        """This unit's gradient reduce-scatters through `comm`, torch FSDP2's ``ReduceScatter``
        protocol: ``comm.allocate`` makes the input and output buffers and ``comm(output_tensor=,
        input_tensor=, group=, op=, async_op=True)`` reduces (the unit's gradients alone, not
        bucketed with other units')."""
        _check_comm(comm, "set_custom_reduce_scatter")
        self._single_mesh("set_custom_reduce_scatter", "custom comm")
        self._unit.rs_comm = comm

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None) -> None:
        """``hook(reduce_output)`` runs on this unit's reduced flat gradient (in the reduce
        dtype, the parameters that got a gradient in unit order) after its reduce-scatter, or
        after the all-reduce with HSDP, before the gradient divide factor and the cast, as in
        torch FSDP2; in place, e.g. an all-reduce over a replicate group of the user's own.
        ``stream``: the CUDA stream to run it on (not with HSDP, as in torch)."""
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook: argument 'hook' must be callable, got {type(hook).__name__}")
        self._single_mesh("set_all_reduce_hook", "hook")
        unit = self._unit
        if stream is not None and unit.info.replicate_group is not None:
            raise ValueError("set_all_reduce_hook: argument 'stream' cannot be set when using native HSDP (a 2-D mesh)")
        unit.all_reduce_hook = (hook, stream)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce this unit's gradients with SUM only (then divide), for backends without AVG /
        PREMUL_SUM (this module's unit only, as in torch FSDP2)."""
        for u in self._unit.group:
            u.force_sum = bool(enable)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Whether parameters that require grad but got no gradient in a backward are reduced
        as zeros, so every rank reduces the same parameters when ranks use different ones
        (conditional computation: mixture of experts, multi-modal models), as in torch FSDP2.
        Such a parameter then gets a zero gradient where it would have none."""
        _check_bool("set_reduce_scatter_unused_params", "reduce_scatter_unused_params", reduce_scatter_unused_params)
        for u in self._targets(recurse):
            u.reduce_unused = reduce_scatter_unused_params

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Whether resharding keeps the unsharded parameters' storage (as torch FSDP2 2.15): their
        data pointers then stay the same from one unshard to the next (CUDA graph capture), at
        the cost of holding the unsharded bytes between unshards. The parameters registered on
        the modules are still the sharded ones after a reshard."""
        _check_bool("set_keep_unsharded_storage", "keep", keep)
        for u in self._targets(recurse):
            u.keep_unsharded = keep

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """On the root module (as torch FSDP2 2.15): backwards then finish nothing at their end
        (no waiting on reductions, no reshard, gradients of units not synced kept unreduced),
        and :meth:`finalize_backward`, called after the step's last backward, does it once,
        following the gradient sync and reshard settings in force then. Set it before a
        backward; the mode of a backward iteration holds until it is finalized."""
        _check_bool("set_manual_backward_finalization", "enabled", enabled)
        unit = self._unit
        ctx = unit.ctx
        if ctx is not None:
            if ctx.root is not self:
                raise RuntimeError("set_manual_backward_finalization must be called on the root module (the first one forwarded)")
            if enabled != ctx.manual and (ctx.in_backward or torch._C._current_graph_task_id() != -1):
                raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")
            if ctx.manual_active is not None and enabled != ctx.manual_active:
                raise RuntimeError("set_manual_backward_finalization cannot change mode after backward starts, before finalize_backward")
        unit.manual_finalization = enabled

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """Completes what the backwards since the last finalization left (manual
        finalization, :meth:`set_manual_backward_finalization`): the post-backward of units the
        backward did not finish, the reduction of gradients accumulated without sync (enable
        sync first), waiting on the reductions, and the reshard after backward. With
        ``async_op`` the reductions are issued and the returned handle's ``wait()`` completes
        them. Before the first forward: nothing to do."""
        ctx = self._unit.ctx
        if ctx is None:
            return GradientReductionHandle(None) if async_op else None
        if ctx.root is not self:
            raise RuntimeError("finalize_backward must be called on the root module (the first one forwarded)")
        return ctx.finalize(async_op)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many gradient reductions (reduce-scatter inputs) may be in flight when this
        unit issues its own, as torch FSDP2 2.15: 1 (the default) completes the previous one
        first; k > 1 keeps up to k, completing the oldest first, so the backward waits less on
        an exposed reduce-scatter and holds up to k - 1 more reduce-scatter buffers."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                "set_reduce_scatter_max_input_buffers: argument 'max_input_buffers' must be an int, "
                f"got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(
                f"set_reduce_scatter_max_input_buffers: argument 'max_input_buffers' is {max_input_buffers}, expected an int >= 1"
            )
        for u in self._targets(recurse):
            u.rs_max_inputs = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Gradient reduce-scatters on a process group of their own over the same ranks (one
        per set of shard ranks), so they can progress beside the all-gathers of the backward,
        as torch FSDP2 2.15; ``False`` goes back to the shard group. Call it on every rank of
        the shard groups, in the same order."""
        _check_bool("set_separate_reduce_scatter_group", "enable", enable)
        groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for u in self._targets(recurse):
            if not enable:
                u.rs_group = None
                continue
            ranks = tuple(dist.get_process_group_ranks(u.info.shard_group))
            if ranks not in groups:
                groups[ranks] = u.rs_group if u.rs_group is not None else dist.new_group(list(ranks), use_local_synchronization=True)
            u.rs_group = groups[ranks]

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """This unit's all-gather and reduce-scatter buffers from the process group's own
        allocator where its backend has one (NCCL's: zero-copy transfers over NVLink SHARP or
        InfiniBand), else as before; this module's unit only, as in torch FSDP2. Not with a
        custom all-gather or reduce-scatter."""
        _check_bool("set_allocate_memory_from_process_group_for_comm", "enable", enable)
        unit = self._unit
        if enable and (unit.ag_comm is not None or unit.rs_comm is not None):
            raise RuntimeError(
                "set_allocate_memory_from_process_group_for_comm: this unit has a custom all-gather or reduce-scatter "
                "(set_custom_all_gather / set_custom_reduce_scatter), which allocates its own buffers"
            )
        for u in unit.group:
            u.pg_alloc = enable

    def set_symm_mem_for_comm(self, *args, **kwargs) -> None:
        self._not_implemented("set_symm_mem_for_comm")

    def _set_unshard_async_op(self, async_op: bool):
        self._not_implemented("_set_unshard_async_op")

    def _get_fsdp_state(self) -> _torch_state.StateView:
        """The module's state as torch FSDP2's own code reads it (``register_fsdp_forward_method``,
        pipeline stages): the same object as ``fully_shard.state(self)``."""
        return _torch_state.state(self)


def _check_comm(comm, where: str) -> None:
    if not (callable(comm) and callable(getattr(comm, "allocate", None))):
        raise TypeError(
            f"{where}: argument 'comm' must have an allocate(size, *, dtype, device) method and be callable "
            f"(torch.distributed.fsdp's Comm protocol), got {type(comm).__name__}"
        )


def _require_fsdp(m, arg: str) -> FSDPModule:
    if not isinstance(m, FSDPModule):
        raise TypeError(f"argument '{arg}' holds a {type(m).__name__}, expected modules sharded by fsdp_native.fully_shard")
    return m


class SharedComm:
    """The communication context that share_comm_ctx gives several roots: one set of CUDA
    streams for their all-gathers and reduce-scatters."""

    def __init__(self) -> None:
        self.streams = None


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Makes the roots of `modules` (each pipeline stage's model chunk, say) share their CUDA
    streams for all-gathers and reduce-scatters, as torch FSDP2's ``share_comm_ctx``: fewer
    streams, and no memory of one root's streams kept from another's. Call it before their
    first forward. A root whose first forward already ran takes the shared streams from
    then on."""
    if not modules:
        return
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"share_comm_ctx: argument 'modules' holds a {type(m).__name__}, expected modules sharded by fsdp_native.fully_shard")
    shared = SharedComm()
    for m in modules:
        unit = m._unit
        unit.shared_comm = shared
        ctx = unit.ctx
        if ctx is not None and ctx.root is m and ctx.units[0].streams.cuda:
            if shared.streams is None:
                shared.streams = ctx.units[0].streams
            for u in ctx.units:
                u.streams = shared.streams


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Makes ``module.<method_name>`` run the unit's forward hooks (e.g. ``generate``); a no-op
    for a module that is not sharded, like torch's."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method '{method_name}'")
    orig = getattr(module, method_name)

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        state = self._get_fsdp_state()
        args, kwargs = state._pre_forward(self, args, kwargs)
        return state._post_forward(self, args, orig(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))
