"""Hugging Face Accelerate and Transformers on fsdp_native.

``use_with_accelerate()`` makes Accelerate's FSDP2 path (``Accelerator(fsdp_plugin=...)``,
``accelerate launch`` with an FSDP config, and the Transformers ``Trainer`` with ``fsdp=True``,
which goes through Accelerate) shard models with :func:`fsdp_native.fully_shard` instead of
torch's::

    import fsdp_native.integrations as fi

    with fi.use_with_accelerate():          # or: handle = fi.use_with_accelerate(); ...; handle.restore()
        trainer = Trainer(model, args=TrainingArguments(..., fsdp=True, fsdp_config={...}), ...)
        trainer.train()

What it patches, and why that is all it needs (Accelerate 1.15 and 1.16, Transformers 5.18 to 5.25):

* ``torch.distributed.fsdp.fully_shard``. Accelerate's ``fsdp2_prepare_model`` imports
  ``fully_shard``, ``FSDPModule`` and ``MixedPrecisionPolicy`` from ``torch.distributed.fsdp``
  when it is called, so replacing the module attribute reaches it. ``FSDPModule`` is not
  patched: fsdp_native's is a subclass of torch's, so Accelerate's and the Trainer's
  ``isinstance(model, FSDPModule)`` checks already hold. ``MixedPrecisionPolicy``,
  ``CPUOffloadPolicy`` and ``OffloadPolicy`` are not patched: Accelerate builds torch's policy
  objects (and validates that they are torch's), and fsdp_native's ``fully_shard`` accepts them.
  The Trainer's ``torch.distributed.fsdp.register_fsdp_forward_method(model, "generate")`` is
  torch's function applied to fsdp_native's ``FSDPModule`` (it calls ``_get_fsdp_state()``).
* With ``cpu=True`` only: real FSDP on CPU processes (gloo). Accelerate, and so the Trainer,
  run FSDP only on accelerators: on a CPU-only host a ``torchrun`` launch without ``--cpu``
  gives each rank its own non-distributed run, and with ``cpu=True`` / ``use_cpu=True``
  Accelerate sets up ``MULTI_CPU`` and the FSDP plugin is dropped (plain DDP). ``cpu=True``
  sets ``ACCELERATE_USE_CPU=true`` (read by ``AcceleratorState`` and by ``TrainingArguments``,
  as ``accelerate launch --cpu`` does) and wraps ``AcceleratorState.__init__`` so that a
  ``MULTI_CPU`` state asked for FSDP (an ``fsdp_plugin``, or ``ACCELERATE_USE_FSDP=true``)
  becomes ``DistributedType.FSDP``, as a multi-GPU one does.
* ``accelerate.utils.fsdp_utils.fsdp2_prepare_auto_wrap_policy`` (where it exists), in both
  functions: its policy no longer chooses ``nn.ModuleList`` / ``nn.ModuleDict``, which
  ``fully_shard`` refuses, nor a module holding the embeddings or the final norm that
  Accelerate carves into units of their own, so ``auto_wrap_policy: SIZE_BASED_WRAP`` works
  (:func:`_without_containers`).

The hook points are checked before anything is patched (feature detection, not version
strings); an Accelerate or Transformers whose hook points are not found raises
:class:`IntegrationError` naming the installed and the tested versions.

* ``transformers.distributed.fsdp.fully_shard`` (Transformers 5's own FSDP2 path,
  ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=...))``), where the
  installed Transformers has that module: it binds torch's ``fully_shard`` at import, and its
  ``apply_fully_sharded_data_parallelism`` calls the module global, so that global is replaced.
"""
from __future__ import annotations

import dis
import functools
import importlib
import importlib.util
import inspect
import os
import sys
import threading
import types
import warnings
from typing import Any, Callable

__all__ = [
    "AccelerateIntegration",
    "IntegrationError",
    "TESTED_VERSIONS",
    "enable_accelerate_cpu_fsdp",
    "use_with_accelerate",
]

# The versions the test suite (tests/test_hf_*.py) runs against; the Makefile pins them.
TESTED_VERSIONS: dict[str, tuple[str, ...]] = {
    "accelerate": ("1.15.0", "1.16.0"),
    "transformers": ("5.24.0", "5.25.0"),
}

_ACTIVE: list["AccelerateIntegration"] = []
_LOCK = threading.Lock()


class IntegrationError(RuntimeError):
    """An installed Accelerate or Transformers lacks a hook point fsdp_native patches."""


def _version(pkg: str) -> str:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:  # noqa: BLE001 - not installed or no metadata
        mod = sys.modules.get(pkg)
        return getattr(mod, "__version__", "unknown")


def _tested_text() -> str:
    return ", ".join(f"{pkg} {' / '.join(v)}" for pkg, v in TESTED_VERSIONS.items())


def _code_objects(fn) -> list[types.CodeType]:
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    out, stack = [], [code]
    while stack:
        c = stack.pop()
        out.append(c)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return out


def _imports_at_call_time(fn, module: str, name: str) -> bool:
    """True when ``fn``'s body (or a function nested in it) does ``from <module> import <name>``."""
    for code in _code_objects(fn):
        current = None
        for ins in dis.get_instructions(code):
            if ins.opname == "IMPORT_NAME":
                current = ins.argval
            elif ins.opname == "IMPORT_FROM" and current == module and ins.argval == name:
                return True
    return False


def _names_in(fn) -> set:
    """Every name and string constant in ``fn``'s code (nested functions included)."""
    names: set = set()
    for code in _code_objects(fn):
        names.update(code.co_names)
        names.update(c for c in code.co_consts if isinstance(c, str))
    return names


def _check_accelerate(cpu: bool, fully_shard: bool = True) -> list[str]:
    """The hook points fsdp_native needs in Accelerate; returns what is missing."""
    missing: list[str] = []
    try:
        fsdp_utils = importlib.import_module("accelerate.utils.fsdp_utils")
    except Exception as e:  # noqa: BLE001
        return [f"accelerate.utils.fsdp_utils cannot be imported ({type(e).__name__}: {e})"]
    prepare = getattr(fsdp_utils, "fsdp2_prepare_model", None)
    if prepare is None:
        missing.append("accelerate.utils.fsdp_utils.fsdp2_prepare_model does not exist")
    elif fully_shard and not _imports_at_call_time(prepare, "torch.distributed.fsdp", "fully_shard"):
        missing.append(
            "accelerate.utils.fsdp_utils.fsdp2_prepare_model does not import fully_shard from "
            "torch.distributed.fsdp when it is called"
        )
    import torch.distributed.fsdp as tfsdp

    torch_fully_shard = tfsdp.fully_shard
    bound = sorted(
        name
        for name, mod in list(sys.modules.items())
        if (name == "accelerate" or name.startswith("accelerate."))
        and mod is not None
        and getattr(mod, "fully_shard", None) is torch_fully_shard
    )
    if bound and fully_shard:
        missing.append(f"{', '.join(bound)} bind(s) torch's fully_shard at import time (a patch would not reach it)")
    if cpu:
        try:
            state = importlib.import_module("accelerate.state")
        except Exception as e:  # noqa: BLE001
            return missing + [f"accelerate.state cannot be imported ({type(e).__name__}: {e})"]
        acc_state = getattr(state, "AcceleratorState", None)
        partial = getattr(state, "PartialState", None)
        dtype = getattr(state, "DistributedType", None)
        if acc_state is None or partial is None or dtype is None:
            missing.append("accelerate.state has no AcceleratorState / PartialState / DistributedType")
        else:
            params = inspect.signature(acc_state.__init__).parameters
            for p in ("cpu", "fsdp_plugin"):
                if p not in params:
                    missing.append(f"AcceleratorState.__init__ has no parameter '{p}'")
            if not isinstance(getattr(partial, "_shared_state", None), dict):
                missing.append("PartialState._shared_state is not a dict")
            for member in ("MULTI_CPU", "MULTI_GPU", "FSDP"):
                if not hasattr(dtype, member):
                    missing.append(f"DistributedType.{member} does not exist")
            names = _names_in(acc_state.__init__)
            for needed in ("ACCELERATE_USE_CPU", "ACCELERATE_USE_FSDP", "MULTI_GPU", "FSDP"):
                if needed not in names:
                    missing.append(f"AcceleratorState.__init__ does not use {needed}")
    return missing


def _transformers_fsdp():
    """``transformers.distributed.fsdp`` (Transformers' own FSDP2 path), or None where the
    installed Transformers has none."""
    if importlib.util.find_spec("transformers") is None:
        return None
    try:
        if importlib.util.find_spec("transformers.distributed.fsdp") is None:
            return None
    except ModuleNotFoundError:
        return None
    return importlib.import_module("transformers.distributed.fsdp")


def _check_transformers(cpu: bool, fully_shard: bool = True) -> list[str]:
    """The hook points fsdp_native needs in Transformers (only when it is installed)."""
    if importlib.util.find_spec("transformers") is None:
        return []
    missing: list[str] = []
    if fully_shard:
        try:
            native = _transformers_fsdp()
        except Exception as e:  # noqa: BLE001
            return [f"transformers.distributed.fsdp cannot be imported ({type(e).__name__}: {e})"]
        if native is not None:
            apply = getattr(native, "apply_fully_sharded_data_parallelism", None)
            if apply is None or not hasattr(native, "fully_shard") or "fully_shard" not in apply.__code__.co_names:
                missing.append(
                    "transformers.distributed.fsdp.apply_fully_sharded_data_parallelism does not call the module's "
                    "fully_shard"
                )
    try:
        trainer_mod = importlib.import_module("transformers.trainer")
        args_mod = importlib.import_module("transformers.training_args")
    except Exception as e:  # noqa: BLE001
        return [f"transformers.trainer cannot be imported ({type(e).__name__}: {e})"]
    trainer = getattr(trainer_mod, "Trainer", None)
    args_cls = getattr(args_mod, "TrainingArguments", None)
    create = getattr(trainer, "create_accelerator_and_postprocess", None)
    if create is None:
        missing.append("Trainer.create_accelerator_and_postprocess does not exist")
    else:
        names = _names_in(create)
        if "Accelerator" not in names:
            missing.append("Trainer.create_accelerator_and_postprocess does not use Accelerator")
        # Transformers 5 hands Accelerator an FSDP plugin; Transformers 4 set ACCELERATE_USE_FSDP
        # (and FSDP_* variables) in TrainingArguments.__post_init__, from which Accelerator makes it.
        post_init = getattr(args_cls, "__post_init__", None)
        by_env = post_init is not None and "ACCELERATE_USE_FSDP" in _names_in(post_init)
        if "FullyShardedDataParallelPlugin" not in names and not by_env:
            missing.append(
                "Trainer.create_accelerator_and_postprocess does not use FullyShardedDataParallelPlugin, nor does "
                "TrainingArguments.__post_init__ set ACCELERATE_USE_FSDP"
            )
    if cpu:
        setup = inspect.getattr_static(args_cls, "_setup_devices", None) if args_cls is not None else None
        setup_fn = getattr(setup, "func", getattr(setup, "fget", None))
        if setup_fn is None:
            missing.append("TrainingArguments._setup_devices does not exist")
        elif "ACCELERATE_USE_CPU" not in _names_in(setup_fn):
            missing.append("TrainingArguments._setup_devices does not read ACCELERATE_USE_CPU")
    return missing


class AccelerateIntegration:
    """What :func:`use_with_accelerate` patched. ``restore()`` (or leaving the ``with`` block)
    puts everything back; calling it twice is harmless."""

    def __init__(self, cpu: bool, fsdp_native: bool = True, all_gather=None):
        self.cpu = cpu
        self.fsdp_native = fsdp_native
        self.all_gather = all_gather
        self._undo: list[Callable[[], None]] = []
        self.active = False

    # --- patching helpers ---------------------------------------------------------------
    def _set_attr(self, obj: Any, name: str, value: Any) -> None:
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, value)

        def undo():
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)

        self._undo.append(undo)

    def _set_env(self, name: str, value: str) -> None:
        old = os.environ.get(name)
        os.environ[name] = value

        def undo():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old

        self._undo.append(undo)

    # --- lifecycle ------------------------------------------------------------------------
    def _apply(self) -> None:
        import torch.distributed.fsdp as tfsdp

        if self.fsdp_native:
            import fsdp_native

            fn = fsdp_native.fully_shard if self.all_gather is None else _with_all_gather(fsdp_native.fully_shard, self.all_gather)
            self._set_attr(tfsdp, "fully_shard", fn)
            native = _transformers_fsdp()
            if native is not None:  # Transformers' own FSDP: from_pretrained(distributed_config=...)
                self._set_attr(native, "fully_shard", fn)
        fsdp_utils = importlib.import_module("accelerate.utils.fsdp_utils")
        prepare_policy = getattr(fsdp_utils, "fsdp2_prepare_auto_wrap_policy", None)
        if prepare_policy is not None:
            self._set_attr(fsdp_utils, "fsdp2_prepare_auto_wrap_policy", _without_containers(prepare_policy))
        if self.cpu:
            self._set_env("ACCELERATE_USE_CPU", "true")
            from accelerate.state import AcceleratorState

            self._set_attr(AcceleratorState, "__init__", _fsdp_on_cpu_init(AcceleratorState.__init__))
        self.active = True

    def restore(self) -> None:
        """Undo every patch, newest first."""
        with _LOCK:
            while self._undo:
                self._undo.pop()()
            self.active = False
            if self in _ACTIVE:
                _ACTIVE.remove(self)

    close = restore

    def __enter__(self) -> "AccelerateIntegration":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __repr__(self) -> str:
        ag = "" if self.all_gather is None else f", all_gather={self.all_gather!r}"
        return f"AccelerateIntegration(fsdp_native={self.fsdp_native}, cpu={self.cpu}{ag}, active={self.active})"


def _with_all_gather(fully_shard, policy):
    """``fully_shard`` that gives the blocks of Accelerate's auto-wrap policy the quantized
    all-gather ``policy``: a call with one module that holds no other unit and is not an
    embedding. Accelerate's other units gather unquantized: the input embedding, the tail
    (final norm and output layer, sharded as a list) and the root."""
    import torch.nn as nn

    import fsdp_native

    @functools.wraps(fully_shard)
    def wrapped(module, **kwargs):
        block = (
            isinstance(module, nn.Module)
            and not isinstance(module, nn.Embedding)
            and not any(isinstance(sub, fsdp_native.FSDPModule) for sub in module.modules() if sub is not module)
        )
        if block and kwargs.get("all_gather") is None:
            kwargs["all_gather"] = policy
        return fully_shard(module, **kwargs)

    return wrapped


def _without_containers(prepare):
    """Accelerate's ``fsdp2_prepare_auto_wrap_policy``, its policy choosing neither a container
    without a forward (``nn.ModuleList``, ``nn.ModuleDict``) nor a module holding one of the
    modules Accelerate carves into units of its own after the policy's (the input embedding,
    the output embedding and the final norm).

    Its SIZE_BASED_WRAP policy chooses every module of more than ``min_num_params``
    parameters (Accelerate 1.15, 1.16), and with torch FSDP2 that documented config fails on any
    model keeping its layers in a list:

    * the list of layers is chosen, and ``fully_shard`` refuses a container (torch's as well:
      "fully_shard does not support containers that do not implement forward"). FSDP1's
      size-based policy leaves containers out (its ``exclude_wrap_modules``); so does this, and
      their parameters stay in the parent's unit;
    * the base model (``model.model``, holding the embedding and the final norm) is chosen, and
      Accelerate's carving then shards the final norm, whose parameters that unit already
      holds (torch: "Invariant encountered: value was None when it should not be"). Left out
      here, the embedding and the final norm go to the carved units, as with
      TRANSFORMER_BASED_WRAP.

    The activation-checkpointing pass asks the same policy, and wraps neither."""
    import torch.nn as nn

    @functools.wraps(prepare)
    def wrapped(fsdp2_plugin, model, *args, **kwargs):
        policy = prepare(fsdp2_plugin, model, *args, **kwargs)
        if policy is None:
            return None
        holders = _holders_of_carved(model)

        def choose(module: nn.Module) -> bool:
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
                return False
            if id(module) in holders:
                return False
            return policy(module)

        return choose

    return wrapped


def _holders_of_carved(model) -> set:
    """The ids of the modules below `model` that hold (strictly) a module Accelerate's
    ``fsdp2_prepare_model`` carves into a unit after the policy's: the input and output
    embeddings and the final norm (its ``_find_final_norm``)."""
    import accelerate.utils.fsdp_utils as fu

    carved = []
    for get in ("get_input_embeddings", "get_output_embeddings"):
        try:
            carved.append(getattr(model, get, lambda: None)())
        except (AttributeError, NotImplementedError):  # a model without that embedding
            pass
    find_norm = getattr(fu, "_find_final_norm", None)
    if find_norm is not None:
        carved.append(find_norm(model))
    carved_ids = {id(m) for m in carved if m is not None}
    holders = set()
    for name, module in model.named_modules():
        if id(module) in carved_ids and name:
            parts = name.split(".")
            for i in range(1, len(parts)):
                holders.add(id(model.get_submodule(".".join(parts[:i]))))
    return holders


def _fsdp_on_cpu_init(orig_init):
    """Wraps ``AcceleratorState.__init__``: a MULTI_CPU state that asks for FSDP becomes FSDP.

    AcceleratorState turns a multi-device state into ``DistributedType.FSDP`` when it is given an
    FSDP plugin (or ``ACCELERATE_USE_FSDP=true``), but only for accelerator device types. The
    wrapper creates the PartialState first, exactly as ``__init__`` would (same ``cpu`` and
    extra arguments), presents it to ``__init__`` as multi-device, and puts ``MULTI_CPU`` back if
    ``__init__`` did not choose FSDP after all.
    """
    sig = inspect.signature(orig_init)

    def __init__(self, *args, **kwargs):
        from accelerate.state import DistributedType, PartialState
        from accelerate.utils import parse_flag_from_env

        try:
            bound = sig.bind(self, *args, **kwargs)
        except TypeError:
            return orig_init(self, *args, **kwargs)  # let __init__ report the bad call
        arguments = bound.arguments
        cpu = bool(arguments.get("cpu", False)) or parse_flag_from_env("ACCELERATE_USE_CPU")
        wants_fsdp = arguments.get("fsdp_plugin") is not None or (
            os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        )
        shared = PartialState._shared_state
        flipped = False
        if wants_fsdp and cpu:
            if shared == {}:
                extra = dict(arguments.get("kwargs", {}))
                PartialState(cpu, **extra)
                shared = PartialState._shared_state
            if shared.get("distributed_type") == DistributedType.MULTI_CPU:
                shared["distributed_type"] = DistributedType.MULTI_GPU
                flipped = True
        try:
            orig_init(self, *args, **kwargs)
        finally:
            if flipped and shared.get("distributed_type") == DistributedType.MULTI_GPU:
                shared["distributed_type"] = DistributedType.MULTI_CPU
                if getattr(self, "distributed_type", None) == DistributedType.MULTI_GPU:
                    self.distributed_type = DistributedType.MULTI_CPU

    __init__.__wrapped__ = orig_init
    __init__.__doc__ = orig_init.__doc__
    __init__.__signature__ = sig
    return __init__


def use_with_accelerate(*, cpu: bool = False, all_gather=None) -> AccelerateIntegration:
    """Make Accelerate (and the Transformers Trainer) shard with fsdp_native.

    Args:
        cpu: also run real FSDP on CPU processes (gloo) instead of Accelerate's fallback to
            DDP or to one non-distributed run per rank. Forces Accelerate onto the CPU, as
            ``accelerate launch --cpu`` does, even where a GPU is present.
        all_gather: a :class:`fsdp_native.QuantizedAllGather` for the transformer blocks of
            Accelerate's auto-wrap policy (each unit of one module that holds no other unit
            and is not an embedding); the embeddings, the final norm and output layer, and
            the root gather unquantized. ``None``: no quantized all-gather.

    Returns:
        A handle; ``handle.restore()``, or using it as a context manager, undoes the patches.
        Call it before ``Accelerator(...)`` / ``TrainingArguments(...)`` are created.

    Raises:
        IntegrationError: the installed Accelerate (or Transformers, if installed) lacks a hook
            point this relies on; the message names the installed and the tested versions.
        RuntimeError: another handle of this module is still active.
        ImportError: Accelerate is not installed.
    """
    if not isinstance(cpu, bool):
        raise TypeError(f"use_with_accelerate: argument 'cpu' is {cpu!r}, expected True or False")
    from fsdp_native import QuantizedAllGather

    if all_gather is not None and not isinstance(all_gather, QuantizedAllGather):
        raise TypeError(
            f"use_with_accelerate: argument 'all_gather' is a {type(all_gather).__name__}, expected a "
            "fsdp_native.QuantizedAllGather or None"
        )
    handle = _install("use_with_accelerate", fsdp_native=True, cpu=cpu, all_gather=all_gather)
    if not cpu:
        import torch

        if not torch.cuda.is_available():
            warnings.warn(
                "use_with_accelerate(cpu=False): no CUDA device, and Accelerate runs FSDP only on "
                "accelerators; pass cpu=True for FSDP on CPU processes",
                stacklevel=2,
            )
    return handle


def enable_accelerate_cpu_fsdp() -> AccelerateIntegration:
    """Only the ``cpu=True`` part of :func:`use_with_accelerate`: Accelerate and the Trainer run
    FSDP on CPU processes, with whichever ``fully_shard`` ``torch.distributed.fsdp`` holds
    (torch's own unless :func:`use_with_accelerate` is active). For comparing against torch
    FSDP2 on CPU. Returns a handle like :func:`use_with_accelerate`."""
    return _install("enable_accelerate_cpu_fsdp", fsdp_native=False, cpu=True)


def _install(what: str, *, fsdp_native: bool, cpu: bool, all_gather=None) -> AccelerateIntegration:
    if importlib.util.find_spec("accelerate") is None:
        raise ImportError(
            f"{what}: accelerate is not installed "
            f"(tested with {_tested_text()}): pip install accelerate=={TESTED_VERSIONS['accelerate'][-1]}"
        )
    with _LOCK:
        if _ACTIVE:
            raise RuntimeError(f"{what}: already active ({_ACTIVE[0]!r}); call restore() on that handle first")
    problems = [f"accelerate: {p}" for p in _check_accelerate(cpu, fully_shard=fsdp_native)]
    problems += [f"transformers: {p}" for p in _check_transformers(cpu, fully_shard=fsdp_native)]
    if problems:
        installed = f"accelerate {_version('accelerate')}"
        if importlib.util.find_spec("transformers") is not None:
            installed += f", transformers {_version('transformers')}"
        raise IntegrationError(
            f"fsdp_native.integrations.{what}({'cpu=True' if cpu and fsdp_native else ''}) does not know the "
            f"hook points of the installed {installed} (tested with {_tested_text()}): " + "; ".join(problems)
        )
    handle = AccelerateIntegration(cpu, fsdp_native=fsdp_native, all_gather=all_gather)
    with _LOCK:
        try:
            handle._apply()
        except BaseException:
            while handle._undo:
                handle._undo.pop()()
            raise
        _ACTIVE.append(handle)
    return handle
