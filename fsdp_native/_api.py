"""Configuration objects of fully_shard. Torch's own policy objects are accepted as well."""
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Mixed precision of a unit's all-gather, compute and gradient reduction.

    Attributes:
        param_dtype: dtype of the unsharded parameters used in forward and backward, and of the
            all-gather. ``None`` keeps the original dtype.
        reduce_dtype: dtype of the gradient reduce-scatter (and HSDP all-reduce), and of the
            gradients accumulated while gradient sync is off. ``None`` follows the installed
            torch's FSDP2: before torch 2.15 gradients are reduced in ``param_dtype`` (or the
            original dtype); from 2.15 in the trainable parameters' original dtype (fp32 for
            fp32 parameters with ``param_dtype=torch.bfloat16``). With a
            ``param_dtype_override_fn`` the 2.15 rule holds on every torch.
        output_dtype: dtype the module's floating-point outputs are cast to. ``None`` leaves them.
        cast_forward_inputs: whether floating-point forward inputs are cast to ``param_dtype``.
        param_dtype_override_fn: keyword only, as in torch 2.15: called once per parameter at
            ``fully_shard``; returning the parameter's own dtype keeps it unsharded (and
            computed) in that dtype, returning ``None`` or ``param_dtype`` uses ``param_dtype``.
            Forward inputs are still cast to ``param_dtype``. Works on every supported torch.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    # Not in the repr: a function's repr holds its address (differs across ranks), and the
    # repr stays torch 2.13's for policies without one.
    param_dtype_override_fn: Callable[[torch.nn.Parameter], torch.dtype | None] | None = field(default=None, kw_only=True, repr=False)


@dataclass(frozen=True)
class QuantizedAllGather:
    """fsdp_native's own quantized all-gather, opt-in per ``fully_shard`` call
    (``fully_shard(block, all_gather=QuantizedAllGather("fp8_rowwise"))``): the all-gather moves
    quantized bytes and the copy-out dequantizes them into ``param_dtype`` for compute. The
    sharded parameters, gradients and optimizer stay in full precision; only what the forward
    and backward compute with is rounded (fp8 or NF4 communication, bf16 compute).

    Attributes:
        format: ``"fp8_rowwise"`` (e4m3, one fp32 scale per row), ``"fp8_tensorwise"``
            (e4m3, one fp32 scale per rank's shard) or ``"nf4"`` (4-bit NormalFloat, one fp32
            scale per ``block_size`` elements; frozen parameters only).
        block_size: NF4 block size (a power of two).
        min_numel: parameters with fewer elements, and all 1-D parameters (norms, biases),
            are gathered unquantized in the same all-gather.
    """

    format: str = "fp8_rowwise"
    block_size: int = 64
    min_numel: int = 1024


@dataclass
class _DataParallelMeshDims:
    """Which named dims of a full SPMD mesh are data parallel (torch 2.13's
    ``DataParallelMeshDims``, for torch versions without it): ``shard`` (FSDP) and optionally
    ``replicate`` (HSDP), each a dim name."""

    shard: "str | tuple[str, ...] | None" = None
    replicate: "str | tuple[str, ...] | None" = None

    def __post_init__(self):
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

    @property
    def shard_names(self) -> tuple:
        return _dim_names(self.shard)

    @property
    def replicate_names(self) -> tuple:
        return _dim_names(self.replicate)


def _dim_names(dims: "str | tuple[str, ...] | None") -> tuple:
    return () if dims is None else (dims,) if isinstance(dims, str) else tuple(dims)


try:  # torch 2.13+: torch's own, so that either import works with either library
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:
    DataParallelMeshDims = _DataParallelMeshDims
    DataParallelMeshDims.__name__ = DataParallelMeshDims.__qualname__ = "DataParallelMeshDims"


@dataclass
class OffloadPolicy:
    """The default: no offloading. Sharded parameters and gradients live on the mesh's device."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters and gradients live on CPU; the optimizer steps there. Each unit's
    parameters are copied to the device for its all-gather, gradients copied back after the
    reduce-scatter.

    Attributes:
        pin_memory: pin the CPU copies (CUDA only) so host-device copies can overlap compute.
    """

    pin_memory: bool = True


def normalize_mp_policy(policy) -> MixedPrecisionPolicy:
    """Accepts fsdp_native's or torch's MixedPrecisionPolicy (same fields)."""
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if not all(hasattr(policy, f) for f in fields):
        raise TypeError(f"fully_shard: argument 'mp_policy' must be a MixedPrecisionPolicy, got {type(policy).__name__}")
    values = {f: getattr(policy, f) for f in fields}
    for f in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = values[f]
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"fully_shard: argument 'mp_policy.{f}' is {dtype}, expected a floating dtype or None")
    override = getattr(policy, "param_dtype_override_fn", None)  # torch >= 2.15's policy has it too
    if override is not None and not callable(override):
        raise TypeError(
            f"fully_shard: argument 'mp_policy.param_dtype_override_fn' is a {type(override).__name__}, "
            "expected a callable taking a parameter, or None"
        )
    return MixedPrecisionPolicy(**values, param_dtype_override_fn=override)


def resolve_param_dtypes(mp: MixedPrecisionPolicy, params: list, names: list[str]) -> list:
    """Each parameter's unsharded dtype request: ``mp.param_dtype``, or what
    ``mp.param_dtype_override_fn`` returns for it (None, ``param_dtype`` or the parameter's own
    dtype, as torch 2.15 allows). A parameter that is not floating-point (an integer one, such
    as frozen quantized weights, or a complex one) keeps its dtype, as from torch 2.12 on
    (torch 2.9 to 2.11 cast it to ``param_dtype``, which drops a complex one's imaginary part)."""
    fn = mp.param_dtype_override_fn
    out = []
    for p, name in zip(params, names):
        if not p.dtype.is_floating_point:
            out.append(None)
            continue
        if fn is None:
            out.append(mp.param_dtype)
            continue
        got = fn(p)
        if got is not None and not isinstance(got, torch.dtype):
            raise ValueError(
                f"fully_shard: argument 'mp_policy.param_dtype_override_fn' returned a {type(got).__name__} for "
                f"parameter '{name}', expected a torch.dtype or None"
            )
        if got is not None and got not in (mp.param_dtype, p.dtype):
            raise ValueError(
                f"fully_shard: argument 'mp_policy.param_dtype_override_fn' returned {got} for parameter '{name}' "
                f"of dtype {p.dtype}, expected None, param_dtype ({mp.param_dtype}) or the parameter's own dtype"
            )
        out.append(mp.param_dtype if got is None else got)
    return out


def normalize_offload_policy(policy) -> CPUOffloadPolicy | None:
    """Returns the CPU offload policy, or None for no offloading (``OffloadPolicy()``, or None
    as torch FSDP2 takes it); rejects anything else."""
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPU, OffloadPolicy as TorchOffload

    if policy is None:
        return None
    if type(policy) in (CPUOffloadPolicy, TorchCPU):
        return CPUOffloadPolicy(pin_memory=bool(policy.pin_memory))
    if type(policy) in (OffloadPolicy, TorchOffload):
        return None
    if isinstance(policy, (OffloadPolicy, TorchOffload)):
        raise NotImplementedError(
            f"fully_shard: argument 'offload_policy' of type {type(policy).__name__} is not supported; "
            "use OffloadPolicy() or CPUOffloadPolicy()"
        )
    raise TypeError(
        f"fully_shard: argument 'offload_policy' must be an OffloadPolicy (OffloadPolicy() or "
        f"CPUOffloadPolicy()) or None, got {type(policy).__name__}"
    )
