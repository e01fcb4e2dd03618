"""fsdp_native's quantized all-gather formats: the byte layout, and the ops that quantize a
unit's shards into one all-gather input and dequantize the gathered bytes.

Formats (one per call, for every parameter of the unit):

* ``"fp8_tensorwise"``: float8 e4m3fn codes, one fp32 scale per parameter *shard*;
* ``"fp8_rowwise"``: float8 e4m3fn codes, one fp32 scale per row (dim-0 slice) of the shard;
* ``"nf4"``: 4-bit NF4 codes (QLoRA's NormalFloat table), two per byte, first element in the
  high nibble, one fp32 absmax scale per block of ``block_size`` elements of the flat shard
  (blocks may span rows; the last block is padded with zeros). For frozen weights:
  0.5 byte per element + 4 bytes per block, 0.28x the bf16 bytes at block size 64.

Scales travel in the same all-gather as the codes, so no other collective is needed. With
``fp8_tensorwise`` each rank's shard has its own scale, computed from that shard alone: the
dequantized parameter is exact to e4m3 precision relative to the amax of each rank's rows,
which is at least as accurate as one global scale, and it needs no all-reduce of amaxes at
all (the issue asks for at most one per step). For a global scale, compute every shard's
amax with :func:`quantize_amax` (one call per unit), all-reduce those (MAX) in one
collective for as many units as wanted, and pass the result as ``amax=``. Rowwise scales need
neither: each row lives on exactly one rank.

Rules (the C++ kernels, the Triton kernels and the reference ``fsdp_native._quant_ref`` agree
bit for bit on the bytes and on the dequantized values):

* fp8 scale = amax / 448 (fp32 division), where amax is the largest |x| over the *finite*
  values of the shard (tensorwise) or row (rowwise); at least 2^-126; 1 when amax is 0, when
  nothing is finite, or when a given amax is not a positive finite number.
* fp8 code = e4m3fn(clamp(x * (1 / scale), -448, 448)): the reciprocal by one fp32
  division, one fp32 multiply per element (a division per element cost the CPU kernels a
  third of their time), round to nearest even (e4m3 subnormals included). **NaN, +inf and -inf all encode as the e4m3fn NaN (0x7f) and
  dequantize to NaN**: e4m3fn has no infinity, and saturating an infinite weight to a finite
  value would hide a diverged parameter; they are left out of the amax, so one bad element
  does not zero the rest of its tensor or row.
* NF4 scale = the largest |x| of the block (1 when it is 0, at least 2^-126 so that its
  reciprocal is finite). **A block holding a NaN or an infinity gets a NaN scale, so the
  whole block dequantizes to NaN** (NF4 has no code for them). Code = the number of the 15
  fp32 midpoints between neighbouring NF4 values that are below x * (1 / scale) (as for fp8):
  nearest value, a tie going to the lower code.
* dequantize = value(code) * scale (one fp32 rounding), cast to the output dtype (nearest
  even); every NaN is written as the dtype's single NaN (0x7fc00000, bf16 0x7fc0, f16 0x7e00).
  The sign of zero is kept by fp8 and lost by NF4.

Byte layout: one rank's chunk is the concatenation, parameter by parameter, of segments

    [codes][zeros to a multiple of 4][fp32 scales][zeros to a multiple of 16]

(codes: ``padded_numel`` bytes for fp8, ``ceil(padded_numel / 2)`` for NF4; a parameter with
no elements takes no bytes). :func:`segment_layout` / :func:`unit_layout` give the offsets;
:func:`encoded_nbytes` the size. The all-gather output is ``world_size`` chunks, back to back
or as the rows of a ``[world_size, rank_nbytes]`` view of a larger buffer (quantized bytes
first in each rank's chunk, other bytes after them).

Garbage input: dequantize never indexes memory with a value read from the buffer (codes are
at most 8 bits and index 16- or 256-entry tables), so bytes that no collective wrote (torch's
fake process group, a failed collective) give garbage values, possibly NaN or inf, never a
crash or an out-of-bounds access. Nothing here can tell such bytes from real ones, so the
runtime (``_codec.QuantCodec``) zeroes the other ranks' chunks before an all-gather on a group
whose backend may leave them unwritten (torch's fake process group, unknown backends): they
then dequantize to zeros (zero codes, zero scales; no format writes a zero scale), never to
garbage scales taken as valid.

Devices: CPU tensors run the C++ kernels (``torch.ops.fsdp_native.quantize_copy_in``, ...),
CUDA tensors the Triton kernels (``torch.ops.fsdp_native.quantize_copy_in_triton``, ..., from
``fsdp_native.kernels.quant``, loaded on first use; in eager mode their implementations are
called without the dispatcher).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from fsdp_native._env import one_of

# Which CPU kernels the ops may use (read by the C++ ops too; validated here at import):
# "auto" (the best the CPU has), "avx512", "avx2" or "portable". torch.ops.fsdp_native.quant_cpu_isa()
# says which run.
CPU_ISA = one_of("FSDP_NATIVE_QUANT_ISA", "auto", ("auto", "avx512", "avx2", "portable"))

__all__ = [
    "FP8_TENSORWISE",
    "FP8_ROWWISE",
    "NF4",
    "FORMATS",
    "DEFAULT_BLOCK_SIZE",
    "Segment",
    "UnitLayout",
    "segment_layout",
    "encoded_nbytes",
    "unit_layout",
    "quantize_copy_in",
    "dequantize_copy_out",
    "quantize_amax",
]

FP8_TENSORWISE = "fp8_tensorwise"
FP8_ROWWISE = "fp8_rowwise"
NF4 = "nf4"
FORMATS = (FP8_TENSORWISE, FP8_ROWWISE, NF4)
DEFAULT_BLOCK_SIZE = 64
MAX_BLOCK_SIZE = 4096
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


@dataclass(frozen=True)
class Segment:
    """One parameter's bytes in a rank's chunk.

    Attributes:
        offset: bytes from the chunk start to the segment.
        data_nbytes: bytes of codes (the segment starts with them).
        scale_offset: bytes from the segment start to the first fp32 scale.
        n_scales: fp32 scales (1, rows, or blocks; 0 for an empty parameter).
        nbytes: the whole segment, a multiple of 16.
    """

    offset: int
    data_nbytes: int
    scale_offset: int
    n_scales: int
    nbytes: int


@dataclass(frozen=True)
class UnitLayout:
    """The encoded layout of a unit: ``segments[i]`` for parameter ``i``; one rank's chunk
    is ``rank_nbytes`` bytes, the all-gather output ``world_size * rank_nbytes``.

    Attributes:
        format: one of :data:`FORMATS`.
        block_size: NF4 block size.
        segments: one per parameter.
        rank_nbytes: bytes of one rank's chunk (a multiple of 16).
    """

    format: str
    block_size: int
    segments: tuple[Segment, ...]
    rank_nbytes: int


def _check_format(fmt: str, block_size: int, op: str) -> None:
    if fmt not in FORMATS:
        raise RuntimeError(
            f"{op}: argument 'format' is '{fmt}', expected one of 'fp8_tensorwise', 'fp8_rowwise', 'nf4'"
        )
    if fmt == NF4 and not (2 <= block_size <= MAX_BLOCK_SIZE and block_size & (block_size - 1) == 0):
        raise RuntimeError(
            f"{op}: argument 'block_size' is {block_size}, expected a power of two from 2 to {MAX_BLOCK_SIZE}"
        )


def _segment(padded: int, row: int, fmt: str, block_size: int, offset: int, i: int, op: str) -> Segment:
    if padded < 0:
        raise RuntimeError(f"{op}: argument 'padded_numels[{i}]' is {padded}, expected a non-negative element count")
    if row < 0:
        raise RuntimeError(f"{op}: argument 'row_numels[{i}]' is {row}, expected a non-negative element count")
    if padded == 0:
        return Segment(offset, 0, 0, 0, 0)
    if fmt == NF4:
        data, n_scales = -(-padded // 2), -(-padded // block_size)
    else:
        if fmt == FP8_ROWWISE and (row <= 0 or padded % row):
            raise RuntimeError(
                f"{op}: argument 'padded_numels[{i}]' is {padded}, expected a multiple of row_numels[{i}] = {row} "
                "(fp8_rowwise has one scale per whole row)"
            )
        data, n_scales = padded, (padded // row if fmt == FP8_ROWWISE else 1)
    scale_offset = _align(data, 4)
    return Segment(offset, data, scale_offset, n_scales, _align(scale_offset + 4 * n_scales, 16))


def segment_layout(padded_numel: int, row_numel: int, fmt: str, *, block_size: int = DEFAULT_BLOCK_SIZE) -> Segment:
    """The segment of one parameter whose rank shard is padded to ``padded_numel`` elements
    of rows of ``row_numel`` (``offset`` 0)."""
    op = "fsdp_native.quant.segment_layout"
    _check_format(fmt, block_size, op)
    return _segment(padded_numel, row_numel, fmt, block_size, 0, 0, op)


def encoded_nbytes(padded_numel: int, row_numel: int, fmt: str, *, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes one rank's shard of a parameter takes in the all-gather (codes, scales, padding
    to 16 bytes), for a shard padded to ``padded_numel`` elements with rows of ``row_numel``."""
    return segment_layout(padded_numel, row_numel, fmt, block_size=block_size).nbytes


def unit_layout(
    padded_numels: Sequence[int], row_numels: Sequence[int], fmt: str, *, block_size: int = DEFAULT_BLOCK_SIZE
) -> UnitLayout:
    """The layout of one rank's chunk of a unit: its parameters' segments back to back."""
    return _layout(padded_numels, row_numels, fmt, block_size, "fsdp_native.quant.unit_layout", "padded_numels")


def _layout(padded_numels, row_numels, fmt, block_size, op, list_name) -> UnitLayout:
    _check_format(fmt, block_size, op)
    if len(row_numels) != len(padded_numels):
        raise RuntimeError(
            f"{op}: argument 'row_numels' has {len(row_numels)} entries, expected {len(padded_numels)} "
            f"(one per tensor of '{list_name}')"
        )
    segs, offset = [], 0
    for i, (p, r) in enumerate(zip(padded_numels, row_numels)):
        seg = _segment(int(p), int(r), fmt, block_size, offset, i, op)
        segs.append(seg)
        offset += seg.nbytes
    return UnitLayout(fmt, block_size, tuple(segs), offset)


# --------------------------------------------------------------------------------------------
# argument checks of the ops, as the C++ planning (csrc/quant.cpp) words them: the fake
# implementations and the Triton path use them


def _check_counts(op, n, padded_numels, row_numels, list_name):
    for name, v in (("padded_numels", padded_numels), ("row_numels", row_numels)):
        if len(v) != n:
            raise RuntimeError(f"{op}: argument '{name}' has {len(v)} entries, expected {n} (one per tensor of '{list_name}')")


def _check_tensor(op, t, name, device, buffer):
    if t.device != device:
        raise RuntimeError(f"{op}: argument '{name}' is on device {t.device}, expected {device} (the device of '{buffer}')")
    if t.dtype not in _FLOATS:
        raise RuntimeError(f"{op}: argument '{name}' has dtype {t.dtype}, expected torch.float32, torch.bfloat16 or torch.float16")
    if not t.is_contiguous():
        raise RuntimeError(
            f"{op}: argument '{name}' must be contiguous, got a tensor with sizes {list(t.shape)} and strides {list(t.stride())}"
        )


def _check_bytes(op, t, name):
    if t.dtype != torch.uint8:
        raise RuntimeError(f"{op}: argument '{name}' has dtype {t.dtype}, expected torch.uint8")


def check_quantize_args(shards, padded_numels, row_numels, format, block_size, amax, out) -> UnitLayout:
    """Validates quantize_copy_in's arguments; returns the unit's layout."""
    op = "fsdp_native::quantize_copy_in"
    _check_format(format, block_size, op)
    _check_counts(op, len(shards), padded_numels, row_numels, "shards")
    _check_bytes(op, out, "out")
    if not out.is_contiguous():
        raise RuntimeError(f"{op}: argument 'out' must be contiguous, got a tensor with sizes {list(out.shape)} and strides {list(out.stride())}")
    layout = _layout(padded_numels, row_numels, format, block_size, op, "shards")
    if out.numel() != layout.rank_nbytes:
        raise RuntimeError(
            f"{op}: argument 'out' has {out.numel()} bytes, expected {layout.rank_nbytes} (one rank's encoded chunk "
            "of the unit, fsdp_native.quant.unit_layout(...).rank_nbytes)"
        )
    for i, s in enumerate(shards):
        _check_tensor(op, s, f"shards[{i}]", out.device, "out")
        if s.numel() > padded_numels[i]:
            raise RuntimeError(
                f"{op}: argument 'shards[{i}]' has {s.numel()} elements, expected at most padded_numels[{i}] = {padded_numels[i]}"
            )
    if amax is not None:
        if format != FP8_TENSORWISE:
            raise RuntimeError(
                f"{op}: argument 'amax' is a tensor, expected None for format '{format}' (only fp8_tensorwise takes a given amax)"
            )
        if amax.device != out.device:
            raise RuntimeError(f"{op}: argument 'amax' is on device {amax.device}, expected {out.device} (the device of 'out')")
        if amax.dtype != torch.float32:
            raise RuntimeError(f"{op}: argument 'amax' has dtype {amax.dtype}, expected torch.float32")
        if amax.numel() != len(shards):
            raise RuntimeError(f"{op}: argument 'amax' has {amax.numel()} elements, expected {len(shards)} (one per tensor of 'shards')")
    return layout


def check_dequantize_args(gathered, padded_numels, row_numels, world_size, format, block_size, outs) -> UnitLayout:
    """Validates dequantize_copy_out's arguments; returns the unit's layout."""
    op = "fsdp_native::dequantize_copy_out"
    _check_format(format, block_size, op)
    if world_size < 1:
        raise RuntimeError(f"{op}: argument 'world_size' is {world_size}, expected a positive integer")
    _check_counts(op, len(outs), padded_numels, row_numels, "outs")
    _check_bytes(op, gathered, "gathered")
    layout = _layout(padded_numels, row_numels, format, block_size, op, "outs")
    n = layout.rank_nbytes
    if gathered.dim() == 2:
        ok = tuple(gathered.shape) == (world_size, n) and (gathered.stride(1) == 1 or n <= 1)
        ok = ok and (gathered.stride(0) >= n or world_size == 1) and gathered.stride(0) % 4 == 0
        if not ok:
            raise RuntimeError(
                f"{op}: argument 'gathered' has sizes {list(gathered.shape)} and strides {list(gathered.stride())}, "
                f"expected sizes [{world_size}, {n}] with strides [a multiple of 4 of at least {n}, 1]"
            )
    elif not (gathered.dim() == 1 and gathered.numel() == world_size * n and gathered.is_contiguous()):
        raise RuntimeError(
            f"{op}: argument 'gathered' has sizes {list(gathered.shape)}, expected a contiguous [{world_size * n}] "
            f"(world_size {world_size} x the encoded chunk of {n} bytes) or a [world_size, {n}] view with unit inner stride"
        )
    for i, o in enumerate(outs):
        _check_tensor(op, o, f"outs[{i}]", gathered.device, "gathered")
        cap = padded_numels[i] * world_size
        if o.numel() > cap:
            raise RuntimeError(
                f"{op}: argument 'outs[{i}]' has {o.numel()} elements, expected at most world_size x padded_numels[{i}] = {cap}"
            )
    return layout


def check_amax_args(shards, out) -> None:
    op = "fsdp_native::quantize_amax"
    if out.dtype != torch.float32:
        raise RuntimeError(f"{op}: argument 'out' has dtype {out.dtype}, expected torch.float32")
    if out.numel() != len(shards):
        raise RuntimeError(f"{op}: argument 'out' has {out.numel()} elements, expected {len(shards)} (one per tensor of 'shards')")
    for i, s in enumerate(shards):
        _check_tensor(op, s, f"shards[{i}]", out.device, "out")


# --------------------------------------------------------------------------------------------
# the ops: C++ on CPU, Triton on CUDA

_triton_ops: tuple | None = None  # (eager, traced) _Ops of the Triton kernels, once imported


def _import_triton_kernels() -> None:
    """Registers the *_triton ops. An install maps the repository's ``kernels/`` to
    ``fsdp_native.kernels`` (pyproject.toml's package-dir); a source checkout used from
    PYTHONPATH (setup.py build_ext --inplace) has no such package, so it is mapped here the
    same way."""
    try:
        import fsdp_native.kernels.quant  # noqa: F401
        return
    except ModuleNotFoundError as e:
        src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
        if e.name != "fsdp_native.kernels" or not os.path.isfile(os.path.join(src, "quant.py")):
            raise
    spec = importlib.util.spec_from_file_location(
        "fsdp_native.kernels", os.path.join(src, "__init__.py"), submodule_search_locations=[src]
    )
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["fsdp_native.kernels"] = pkg
    spec.loader.exec_module(pkg)
    import fsdp_native.kernels.quant  # noqa: F401,F811


class _Ops(NamedTuple):
    """The quantize / dequantize / amax callables for one device; ``bumps_versions``: they are
    ``custom_op``s that mutate their outputs, which bumps the outputs' autograd versions."""

    quantize: Callable
    dequantize: Callable
    amax: Callable
    bumps_versions: bool


def _ops_for(t: torch.Tensor) -> _Ops:
    """The ops for tensors on ``t``'s device: C++ kernels on CPU, Triton on CUDA. In eager mode
    the Triton ops' implementations are called directly: through the dispatcher a
    ``custom_op`` costs tens of microseconds of host time per call (more than the op's own
    host work), which small units pay at every all-gather. torch.compile traces the
    registered ops."""
    global _triton_ops
    if t.device.type != "cuda":
        ns = torch.ops.fsdp_native
        return _Ops(ns.quantize_copy_in, ns.dequantize_copy_out, ns.quantize_amax, False)
    if _triton_ops is None:
        try:
            _import_triton_kernels()
        except ImportError as e:
            raise RuntimeError(f"fsdp_native.quant on CUDA tensors needs Triton, which could not be imported ({e})") from e
        from fsdp_native.kernels import quant as K

        ns = torch.ops.fsdp_native
        _triton_ops = (
            _Ops(K.quantize_copy_in_eager, K.dequantize_copy_out_eager, K.quantize_amax_eager, False),
            _Ops(ns.quantize_copy_in_triton, ns.dequantize_copy_out_triton, ns.quantize_amax_triton, True),
        )
    return _triton_ops[1] if torch.compiler.is_compiling() else _triton_ops[0]


def quantize_copy_in(
    shards: Sequence[torch.Tensor],
    padded_numels: Sequence[int],
    row_numels: Sequence[int],
    out: torch.Tensor,
    *,
    format: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    amax: torch.Tensor | None = None,
) -> None:
    """Quantizes this rank's ``shards`` (contiguous float32 / bfloat16 / float16, each at most
    ``padded_numels[i]`` elements, the rest of its padded slot read as zeros; rows of
    ``row_numels[i]`` elements) into ``out``, a contiguous uint8 tensor of
    ``unit_layout(...).rank_nbytes`` bytes: one call for the whole unit. ``amax``
    (fp8_tensorwise only): float32, one per shard, e.g. all-reduced maxima of
    :func:`quantize_amax`; by default each shard's own."""
    _ops_for(out).quantize(list(shards), [int(p) for p in padded_numels], [int(r) for r in row_numels], format, int(block_size), amax, out)


def dequantize_copy_out(
    gathered: torch.Tensor,
    padded_numels: Sequence[int],
    row_numels: Sequence[int],
    world_size: int,
    outs: Sequence[torch.Tensor],
    *,
    format: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> None:
    """Dequantizes every rank's chunk of ``gathered`` (uint8: ``world_size * rank_nbytes``
    contiguous bytes, or a ``[world_size, rank_nbytes]`` view with unit inner stride) into
    the unsharded ``outs[i]`` (contiguous float32 / bfloat16 / float16, ``numel_i`` elements:
    rank ``r`` fills ``[r * padded_numels[i], ...)``), dropping padding.

    The outputs' autograd version counters are left as they were, as the C++ op leaves them
    (the Triton op, a ``custom_op`` that mutates ``outs``, bumps them): the outputs are
    unsharded parameters that the backward saved in the forward and that an all-gather
    refills before it uses them."""
    ops = _ops_for(gathered)
    args = (gathered, [int(p) for p in padded_numels], [int(r) for r in row_numels], int(world_size), format, int(block_size), list(outs))
    if not ops.bumps_versions:
        ops.dequantize(*args)
        return
    with torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
        ops.dequantize(*args)


def quantize_amax(shards: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """``out[i]`` = the largest |x| over the finite values of ``shards[i]`` (0 if none), in one
    call for the unit; ``out`` is float32 with one element per shard. All-reduce it (MAX) and
    pass it to :func:`quantize_copy_in` as ``amax`` for a global tensorwise scale."""
    _ops_for(out).amax(list(shards), out)


@torch.library.register_fake("fsdp_native::quantize_copy_in")
def _(shards, padded_numels, row_numels, format, block_size, amax, out):
    check_quantize_args(shards, padded_numels, row_numels, format, block_size, amax, out)


@torch.library.register_fake("fsdp_native::dequantize_copy_out")
def _(gathered, padded_numels, row_numels, world_size, format, block_size, outs):
    check_dequantize_args(gathered, padded_numels, row_numels, world_size, format, block_size, outs)


@torch.library.register_fake("fsdp_native::quantize_amax")
def _(shards, out):
    check_amax_args(shards, out)
