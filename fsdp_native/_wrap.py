"""shard_model: auto-wrap a model into fsdp_native units, without Accelerate.

A policy picks the modules that become units (bottom-up, children before parents); the root is
always sharded last and holds every parameter no unit below it took. A Hugging Face
``fsdp_config`` (TrainingArguments / Accelerate keys, with or without the ``fsdp_`` prefix) may
give the policy and the other options instead.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule

from fsdp_native._api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["shard_model", "parse_fsdp_config", "KNOWN_FSDP_CONFIG_KEYS"]


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()

# Modules without a forward of their own: never a unit (their children are).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)

_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
_MP_NAMES = {"no": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}

# The keys of Hugging Face's fsdp_config (TrainingArguments) and of Accelerate's FSDP plugin /
# config file that mean something for FSDP2. Each may be spelled with the "fsdp_" prefix.
KNOWN_FSDP_CONFIG_KEYS = (
    "activation_checkpointing",
    "auto_wrap_policy",
    "cpu_offload",
    "cpu_ram_efficient_loading",
    "min_num_params",
    "mixed_precision",
    "mixed_precision_policy",
    "offload_params",
    "reshard_after_forward",
    "state_dict_type",
    "transformer_layer_cls_to_wrap",
    "version",
    "xla",
    "xla_fsdp_grad_ckpt",
    "xla_fsdp_v2",
)
# FSDP1 options (FullyShardedDataParallel); FSDP2 has no such knob.
_FSDP1_KEYS = (
    "backward_prefetch",
    "forward_prefetch",
    "limit_all_gathers",
    "sharding_strategy",
    "sync_module_states",
    "use_orig_params",
)

_TRUE = ("1", "true", "t", "yes", "y", "on")
_FALSE = ("0", "false", "f", "no", "n", "off")


@dataclasses.dataclass(frozen=True)
class FSDPConfig:
    """A parsed fsdp_config: ``None`` / empty where the dict did not say."""

    auto_wrap_policy: str | None = None
    transformer_layer_cls_to_wrap: tuple[str, ...] | None = None
    min_num_params: int | None = None
    reshard_after_forward: bool | None = None
    offload_params: bool | None = None
    mp_policy: MixedPrecisionPolicy | None = None
    mixed_precision_given: bool = False
    activation_checkpointing: bool | None = None
    cpu_ram_efficient_loading: bool = False
    state_dict_type: str | None = None


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"shard_model: fsdp_config['{key}'] is {value!r}, expected a bool or one of 'true' / 'false'")


def _dtype(key: str, value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower().removeprefix("torch.")]
    raise ValueError(
        f"shard_model: fsdp_config['{key}'] is {value!r}, expected a torch.dtype, None or one of "
        f"{sorted(_DTYPE_NAMES)}"
    )


def parse_fsdp_config(fsdp_config: dict) -> FSDPConfig:
    """Validates a Hugging Face ``fsdp_config`` dict (the ``fsdp_`` prefix optional) and returns
    what it asks for. Raises ``ValueError`` naming the key, its value and what was expected."""
    if not isinstance(fsdp_config, dict):
        raise TypeError(f"shard_model: argument 'fsdp_config' is a {type(fsdp_config).__name__}, expected a dict")
    cfg: dict[str, Any] = {}
    for raw_key, value in fsdp_config.items():
        if not isinstance(raw_key, str):
            raise ValueError(f"shard_model: fsdp_config key {raw_key!r} is not a string")
        key = raw_key[len("fsdp_") :] if raw_key.startswith("fsdp_") else raw_key
        if key in cfg:
            raise ValueError(f"shard_model: fsdp_config gives '{key}' twice (as '{key}' and as 'fsdp_{key}')")
        cfg[key] = value
    unknown = sorted(k for k in cfg if k not in KNOWN_FSDP_CONFIG_KEYS)
    if unknown:
        fsdp1 = [k for k in unknown if k in _FSDP1_KEYS]
        note = f"; {fsdp1} are FSDP1 options that FSDP2 does not have" if fsdp1 else ""
        raise ValueError(
            f"shard_model: fsdp_config has unknown key(s) {unknown}{note}. Known keys (each may also be "
            f"spelled with the 'fsdp_' prefix): {', '.join(KNOWN_FSDP_CONFIG_KEYS)}"
        )
    out: dict[str, Any] = {}
    if "version" in cfg:
        v = cfg["version"]
        if str(v) != "2":
            raise ValueError(f"shard_model: fsdp_config['version'] is {v!r}, expected 2 (fsdp_native implements FSDP2)")
    for key in ("xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt"):
        if key in cfg and _bool(key, cfg[key]):
            raise ValueError(f"shard_model: fsdp_config['{key}'] is {cfg[key]!r}, expected false (XLA FSDP is not fsdp_native)")
    if "auto_wrap_policy" in cfg:
        v = cfg["auto_wrap_policy"]
        if not isinstance(v, str) or v.upper() not in _WRAP_POLICIES:
            raise ValueError(
                f"shard_model: fsdp_config['auto_wrap_policy'] is {v!r}, expected one of {list(_WRAP_POLICIES)}"
            )
        out["auto_wrap_policy"] = v.upper()
    if cfg.get("transformer_layer_cls_to_wrap") is not None:
        v = cfg["transformer_layer_cls_to_wrap"]
        names = v.split(",") if isinstance(v, str) else v
        if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n.strip() for n in names):
            raise ValueError(
                f"shard_model: fsdp_config['transformer_layer_cls_to_wrap'] is {v!r}, expected a class name, "
                "a comma-separated string of them or a non-empty list of them"
            )
        out["transformer_layer_cls_to_wrap"] = tuple(n.strip() for n in names)
    if "min_num_params" in cfg:
        v = cfg["min_num_params"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"shard_model: fsdp_config['min_num_params'] is {v!r}, expected an int >= 0")
        out["min_num_params"] = v
    if "reshard_after_forward" in cfg:
        out["reshard_after_forward"] = _bool("reshard_after_forward", cfg["reshard_after_forward"])
    offload = {k: _bool(k, cfg[k]) for k in ("cpu_offload", "offload_params") if k in cfg}
    if len(set(offload.values())) > 1:
        raise ValueError(f"shard_model: fsdp_config gives cpu_offload and offload_params different values: {offload}")
    if offload:
        out["offload_params"] = next(iter(offload.values()))
    if "mixed_precision" in cfg and "mixed_precision_policy" in cfg:
        raise ValueError("shard_model: fsdp_config gives both 'mixed_precision' and 'mixed_precision_policy', expected one")
    if "mixed_precision" in cfg:
        v = cfg["mixed_precision"]
        key = v.lower() if isinstance(v, str) else v
        if key not in _MP_NAMES:
            raise ValueError(f"shard_model: fsdp_config['mixed_precision'] is {v!r}, expected one of {list(_MP_NAMES)}")
        d = _MP_NAMES[key]
        # As Accelerate does for FSDP2: parameters, reduction and outputs all in that dtype.
        out["mp_policy"] = None if d is None else MixedPrecisionPolicy(param_dtype=d, reduce_dtype=d, output_dtype=d)
        out["mixed_precision_given"] = True
    if "mixed_precision_policy" in cfg:
        v = cfg["mixed_precision_policy"]
        fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
        if isinstance(v, str):
            key = v.lower()
            if key not in _MP_NAMES:
                raise ValueError(
                    f"shard_model: fsdp_config['mixed_precision_policy'] is {v!r}, expected one of {list(_MP_NAMES)}, "
                    f"a dict with keys among {list(fields)} or a MixedPrecisionPolicy"
                )
            d = _MP_NAMES[key]
            out["mp_policy"] = None if d is None else MixedPrecisionPolicy(param_dtype=d, reduce_dtype=d, output_dtype=d)
        elif isinstance(v, dict):
            bad = sorted(set(v) - set(fields))
            if bad:
                raise ValueError(
                    f"shard_model: fsdp_config['mixed_precision_policy'] has unknown key(s) {bad}, expected keys among {list(fields)}"
                )
            kw = {f: _dtype(f"mixed_precision_policy']['{f}", v[f]) for f in fields[:3] if f in v}
            if "cast_forward_inputs" in v:
                kw["cast_forward_inputs"] = _bool("mixed_precision_policy']['cast_forward_inputs", v["cast_forward_inputs"])
            out["mp_policy"] = MixedPrecisionPolicy(**kw)
        elif all(hasattr(v, f) for f in fields):
            out["mp_policy"] = v
        else:
            raise ValueError(
                f"shard_model: fsdp_config['mixed_precision_policy'] is {v!r}, expected one of {list(_MP_NAMES)}, "
                f"a dict with keys among {list(fields)} or a MixedPrecisionPolicy"
            )
        out["mixed_precision_given"] = True
    if "activation_checkpointing" in cfg:
        out["activation_checkpointing"] = _bool("activation_checkpointing", cfg["activation_checkpointing"])
    if "cpu_ram_efficient_loading" in cfg:
        out["cpu_ram_efficient_loading"] = _bool("cpu_ram_efficient_loading", cfg["cpu_ram_efficient_loading"])
    if "state_dict_type" in cfg:
        v = cfg["state_dict_type"]
        if not isinstance(v, str) or v.upper() not in _STATE_DICT_TYPES:
            raise ValueError(f"shard_model: fsdp_config['state_dict_type'] is {v!r}, expected one of {list(_STATE_DICT_TYPES)}")
        out["state_dict_type"] = v.upper()
    return FSDPConfig(**out)


# ---------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class _Policy:
    kind: str  # "classes" | "size" | "none" | "callable"
    classes: tuple = ()
    min_num_params: int = 0
    fn: Callable[[nn.Module], bool] | None = None


_POLICY_EXPECTED = (
    "expected None, 'NO_WRAP', a layer class or class name (or a list of them), an int (min_num_params) "
    "or a callable(module) -> bool"
)


def _resolve_classes(model: nn.Module, items: Iterable, what: str) -> tuple:
    items = list(items)
    if not items:
        raise ValueError(f"shard_model: {what} is empty, expected at least one layer class or class name")
    classes, names = [], []
    for it in items:
        if isinstance(it, type) and issubclass(it, nn.Module):
            classes.append(it)
        elif isinstance(it, str) and it:
            names.append(it)
        else:
            raise ValueError(f"shard_model: {what} holds {it!r}, expected nn.Module subclasses or class names")
    if names:
        present = {}
        for m in model.modules():
            present.setdefault(type(m).__name__, type(m))
        missing = [n for n in names if n not in present]
        if missing:
            raise ValueError(
                f"shard_model: {what} names {missing}, which are not classes of modules in the model "
                f"(its classes: {sorted(present)})"
            )
        classes.extend(present[n] for n in names)
    return tuple(dict.fromkeys(classes))


def _default_classes(model: nn.Module) -> tuple[str, ...] | None:
    names = getattr(model, "_no_split_modules", None)
    return tuple(names) if names else None


def _make_policy(model: nn.Module, policy: Any, cfg: FSDPConfig) -> _Policy:
    from_config = cfg.auto_wrap_policy is not None or cfg.transformer_layer_cls_to_wrap is not None or bool(cfg.min_num_params)
    if policy is not None and from_config:
        raise ValueError(
            "shard_model: argument 'policy' and fsdp_config's auto_wrap_policy / transformer_layer_cls_to_wrap / "
            "min_num_params both choose the units, expected one of them"
        )
    if policy is None:
        kind = cfg.auto_wrap_policy
        if kind is None:
            if cfg.transformer_layer_cls_to_wrap is not None:
                kind = "TRANSFORMER_BASED_WRAP"
            elif cfg.min_num_params:
                kind = "SIZE_BASED_WRAP"
            else:
                # Hugging Face's default: the model's transformer layers; a model that names none
                # is one unit.
                return _policy_for_names(model, _default_classes(model), "the model's _no_split_modules", required=False)
        if kind == "NO_WRAP":
            return _Policy("none")
        if kind == "SIZE_BASED_WRAP":
            return _Policy("size", min_num_params=cfg.min_num_params or 0)
        names = cfg.transformer_layer_cls_to_wrap
        what = "fsdp_config['transformer_layer_cls_to_wrap']"
        if names is None:
            names, what = _default_classes(model), "the model's _no_split_modules"
            if names is None:
                raise ValueError(
                    f"shard_model: fsdp_config['auto_wrap_policy'] is 'TRANSFORMER_BASED_WRAP' without "
                    f"transformer_layer_cls_to_wrap, and the model ({type(model).__name__}) has no _no_split_modules; "
                    "expected the layer class names"
                )
        return _policy_for_names(model, names, what, required=True)
    if isinstance(policy, str) and policy.upper() in _WRAP_POLICIES:
        kind = policy.upper()
        if kind == "NO_WRAP":
            return _Policy("none")
        if kind == "TRANSFORMER_BASED_WRAP":
            names = _default_classes(model)
            if names is None:
                raise ValueError(
                    f"shard_model: argument 'policy' is {policy!r} but the model ({type(model).__name__}) has no "
                    "_no_split_modules; expected the layer classes (or their names)"
                )
            return _policy_for_names(model, names, "the model's _no_split_modules", required=True)
        raise ValueError(f"shard_model: argument 'policy' is {policy!r}; for size-based wrapping pass min_num_params as an int")
    if isinstance(policy, bool):
        raise TypeError(f"shard_model: argument 'policy' is {policy!r}, {_POLICY_EXPECTED}")
    if isinstance(policy, int):
        if policy < 0:
            raise ValueError(f"shard_model: argument 'policy' is {policy} (min_num_params), expected an int >= 0")
        return _Policy("size", min_num_params=policy)
    if isinstance(policy, (str, type)):
        return _Policy("classes", classes=_resolve_classes(model, [policy], "argument 'policy'"))
    if isinstance(policy, (list, tuple, set, frozenset)):
        return _Policy("classes", classes=_resolve_classes(model, policy, "argument 'policy'"))
    if callable(policy):
        return _Policy("callable", fn=policy)
    raise TypeError(f"shard_model: argument 'policy' is {policy!r} ({type(policy).__name__}), {_POLICY_EXPECTED}")


def _policy_for_names(model, names, what, required: bool) -> _Policy:
    if names is None:
        return _Policy("none")
    present = {type(m).__name__ for m in model.modules()}
    if not required:
        names = [n for n in names if n in present]
        if not names:
            return _Policy("none")
    return _Policy("classes", classes=_resolve_classes(model, names, what))


def _post_order(model: nn.Module) -> list[nn.Module]:
    """Every module once, children before parents (in registration order), the root last."""
    seen: set[int] = set()
    order: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        seen.add(id(m))
        for child in m.children():
            if id(child) not in seen:
                visit(child)
        order.append(m)

    visit(model)
    return order


def select_units(model: nn.Module, policy: _Policy) -> list[nn.Module]:
    """The modules (not the root) that become units, in the order to shard them."""
    if policy.kind == "none":
        return []
    covered: set[int] = set()
    for m in model.modules():
        if isinstance(m, _TorchFSDPModule):
            covered.update(id(p) for p in m.parameters())
    units: list[nn.Module] = []
    for m in _post_order(model)[:-1]:
        if isinstance(m, _TorchFSDPModule) or isinstance(m, _CONTAINERS):
            continue
        if policy.kind == "classes":
            take = isinstance(m, policy.classes)
        elif policy.kind == "size":
            own = sum(p.numel() for p in m.parameters() if id(p) not in covered)
            take = own > 0 and own >= policy.min_num_params
        else:
            take = bool(policy.fn(m))
        if take:
            units.append(m)
            covered.update(id(p) for p in m.parameters())
    return units


# ---------------------------------------------------------------------------
# shard_model
# ---------------------------------------------------------------------------
def _replace_module(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent in model.modules():
        for name, child in list(parent._modules.items()):
            if child is old and parent is not new:
                setattr(parent, name, new)


def _to_meta(model: nn.Module) -> None:
    """Parameters and buffers onto the meta device, keeping tied parameters tied."""
    new_params: dict[int, nn.Parameter] = {}
    new_bufs: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in new_params:
                new_params[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            m._parameters[name] = new_params[id(p)]
        for name, b in list(m._buffers.items()):
            if b is None:
                continue
            if id(b) not in new_bufs:
                new_bufs[id(b)] = torch.empty_like(b, device="meta")
            m._buffers[name] = new_bufs[id(b)]


def shard_model(
    model: nn.Module,
    policy: Any = None,
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | Any = _UNSET,
    reshard_after_forward: bool | int | None = _UNSET,
    offload_policy: OffloadPolicy | Any = _UNSET,
    activation_checkpointing: bool = _UNSET,
    ignored_params: set[nn.Parameter] | None = None,
    fsdp_config: dict | None = None,
) -> nn.Module:
    """Shards ``model`` with :func:`fsdp_native.fully_shard`: the modules ``policy`` picks become
    units (children before parents), then the root, which is always a unit.

    Args:
        model: the module to shard (not already sharded).
        policy: which modules become units:
            ``None``: those ``fsdp_config`` asks for; without one, the classes the model lists in
            ``_no_split_modules`` (Hugging Face models), else only the root.
            a layer class, a class name, or a list of them: every module of those classes.
            an ``int``: size-based, ``min_num_params``: bottom-up, a module whose parameters not
            already in a unit below it number at least that many (and at least one).
            ``"NO_WRAP"``: only the root. ``"TRANSFORMER_BASED_WRAP"``: ``_no_split_modules``.
            a callable ``fn(module) -> bool``, asked bottom-up.
            Containers (``ModuleList``, ``ModuleDict``, ...) and modules that are already units
            are never picked; the root is never asked.
        mesh, ignored_params: as for ``fully_shard``, the same for every unit.
        mp_policy, offload_policy: as for ``fully_shard``, the same for every unit.
        reshard_after_forward: for the units below the root; the root keeps ``fully_shard``'s
            default (``None``: not resharded after forward), as Accelerate does.
        activation_checkpointing: wrap each unit below the root in torch's ``checkpoint_wrapper``
            (activations recomputed in backward) before sharding it.
        fsdp_config: a Hugging Face ``fsdp_config`` dict (TrainingArguments keys, or Accelerate's
            with the ``fsdp_`` prefix): ``auto_wrap_policy``, ``transformer_layer_cls_to_wrap``,
            ``min_num_params``, ``reshard_after_forward``, ``cpu_offload`` / ``offload_params``,
            ``mixed_precision`` ('no', 'fp32', 'bf16', 'fp16': parameters, reduction and output in
            that dtype, as Accelerate) or ``mixed_precision_policy`` (a dict of dtypes),
            ``activation_checkpointing``, ``cpu_ram_efficient_loading`` (only rank 0's weights
            count: every rank's model goes to the meta device, is sharded, and rank 0's values
            and buffers are broadcast into it), ``state_dict_type`` (validated; it selects the
            checkpoint format of Accelerate / the Trainer, and ``state_dict()`` here is sharded
            DTensors as with torch), ``version`` (2). A key given both here and as an argument
            is an error.

    Returns:
        ``model``, now a :class:`fsdp_native.FSDPModule`.
    """
    import fsdp_native

    if not isinstance(model, nn.Module):
        raise TypeError(f"shard_model: argument 'model' is a {type(model).__name__}, expected an nn.Module")
    if isinstance(model, _TorchFSDPModule):
        raise ValueError(
            f"shard_model: argument 'model' ({type(model).__name__}) is already sharded (an FSDPModule), "
            "expected a model that fully_shard has not been applied to"
        )
    cfg = parse_fsdp_config(fsdp_config) if fsdp_config is not None else FSDPConfig()

    def pick(arg_name, arg_value, cfg_value, cfg_key, default):
        if arg_value is not _UNSET and cfg_value is not None:
            raise ValueError(
                f"shard_model: argument '{arg_name}' ({arg_value!r}) and fsdp_config['{cfg_key}'] both given, expected one"
            )
        if arg_value is not _UNSET:
            return arg_value
        return default if cfg_value is None else cfg_value

    if mp_policy is not _UNSET and cfg.mixed_precision_given:
        raise ValueError(
            f"shard_model: argument 'mp_policy' ({mp_policy!r}) and fsdp_config's mixed precision both given, expected one"
        )
    mp = mp_policy if mp_policy is not _UNSET else cfg.mp_policy
    mp = MixedPrecisionPolicy() if mp is None else mp
    raf = pick("reshard_after_forward", reshard_after_forward, cfg.reshard_after_forward, "reshard_after_forward", None)
    offload_flag = cfg.offload_params
    if offload_policy is not _UNSET and offload_flag is not None:
        raise ValueError(
            f"shard_model: argument 'offload_policy' ({offload_policy!r}) and fsdp_config's cpu_offload / offload_params "
            "both given, expected one"
        )
    if offload_policy is _UNSET:
        offload_policy = CPUOffloadPolicy() if offload_flag else OffloadPolicy()
    ac = pick("activation_checkpointing", activation_checkpointing, cfg.activation_checkpointing, "activation_checkpointing", False)
    if not isinstance(ac, bool):
        raise TypeError(f"shard_model: argument 'activation_checkpointing' is {ac!r}, expected True or False")

    pol = _make_policy(model, policy, cfg)
    units = select_units(model, pol)

    full_sd: dict | None = None
    buffers: dict | None = None
    if cfg.cpu_ram_efficient_loading:
        if not dist.is_initialized():
            raise RuntimeError(
                "shard_model: fsdp_config['cpu_ram_efficient_loading'] is true, expected an initialized process group "
                "(rank 0's weights are broadcast)"
            )
        if dist.get_rank() == 0:
            on_meta = [n for n, p in model.named_parameters() if p.is_meta]
            if on_meta:
                raise ValueError(
                    "shard_model: fsdp_config['cpu_ram_efficient_loading'] is true but rank 0's parameters "
                    f"{on_meta[:3]} are on the meta device, expected rank 0 to hold the weights"
                )
            full_sd = model.state_dict()
            buffers = dict(model.named_buffers())
        _to_meta(model)

    if ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        wrapped = []
        for m in units:
            w = checkpoint_wrapper(m)
            _replace_module(model, m, w)
            wrapped.append(w)
        units = wrapped

    kwargs = dict(mesh=mesh, mp_policy=mp, offload_policy=offload_policy, ignored_params=ignored_params)
    for m in units:
        fsdp_native.fully_shard(m, reshard_after_forward=raf, **kwargs)
    fsdp_native.fully_shard(model, **kwargs)

    if cfg.cpu_ram_efficient_loading:
        _load_from_rank0(model, full_sd, buffers)
    return model


def _load_from_rank0(model: nn.Module, full_sd: dict | None, buffers: dict | None) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    device = None
    for p in model.parameters():
        if isinstance(p, DTensor):
            dev_type = p.device_mesh.device_type
            device = torch.device(dev_type, torch.cuda.current_device()) if dev_type == "cuda" else torch.device(dev_type)
            break
    if device is None:
        device = torch.device("cpu")
    model.to_empty(device=device)
    set_model_state_dict(
        model,
        full_sd if full_sd is not None else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    # Buffers (persistent or not) are not sharded: rank 0's values, broadcast.
    for name, buf in model.named_buffers():
        if dist.get_rank() == 0:
            src = buffers.get(name.replace("._checkpoint_wrapped_module", "")) if buffers else None
            if src is None:
                src = buffers.get(name) if buffers else None
            if src is not None:
                buf.copy_(src)
        dist.broadcast(buf, src=0)
