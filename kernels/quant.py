"""Triton kernels of fsdp_native's quantized all-gather formats (``fsdp_native.quant``), for
CUDA tensors; tested on CPU tensors with ``TRITON_INTERPRET=1``.

Ops: ``fsdp_native::quantize_copy_in_triton``, ``dequantize_copy_out_triton`` and
``quantize_amax_triton``, with the schemas, argument checks and error messages of the C++
ops (csrc/quant.cpp), and the same bytes and values bit for bit (the math of
csrc/quant_math.h restated: integer bit manipulation for the e4m3 and bf16 roundings, or on
GPUs of compute capability 8.9 and up the conversion instructions, which give the same bits
for every fp32 value (HW_CVT); ``div_rn`` for the correctly rounded reciprocals; no fused
multiply-adds but the NF4 code's cubic, whose result is exact whichever way it rounds).

One launch covers a whole unit (one per source or destination dtype present, usually one;
fp8_tensorwise adds the amax launch): every program finds its parameter by a binary search
over a table of per-parameter task counts and reaches the parameter's tensor through a table
of data pointers. A variable number of tensors behind a pointer table is also why these are
``torch.library.custom_op``s and not ``triton_op``s: ``triton_op`` lets torch.compile trace
into the implementation and infer what each kernel reads and writes from its tensor
arguments, which cannot see tensors reached through pointers, and it runs the implementation
on fake tensors, which have no data pointers. An opaque custom op with the mutated arguments
in its schema stays correct under torch.compile; in eager mode fsdp_native.quant calls the
``*_eager`` implementations directly.

Speed: a program takes 4096 elements (fp8_rowwise: a row); a tile wholly inside its tensors
moves 16 bytes per access where the launch found its pointers aligned, and only a tensor's
last tile is masked. A call's launches are worked out once per unit (``_PLANS``).
``benchmarks/triton_sass.py`` shows what they compile to on a GPU, without one.
"""
from __future__ import annotations

import os
import re
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fsdp_native import quant as Q
from fsdp_native._quant_ref import NF4_MIDPOINTS, NF4_VALUES

# Elements per tile of the fp8 kernels (a program's share: large enough that its fixed cost,
# finding its parameter in the table, is small per element); elements per program of NF4.
BLOCK = 4096
TASK = 4096
# Tiles per program of the amax pass (fewer atomics on one amax).
AMAX_TILES = 8
# fp8_rowwise rows up to this many elements are quantized by programs that hold whole rows in
# registers (ROW_ELEMS elements a program where rows are shorter): their amaxes, then their
# codes, one read of the rows. Longer rows take an amax pass over the unit and then the codes,
# two launches.
ROW_FUSE_MAX = 16384
ROW_ELEMS = 4096
# Launch shapes (``benchmarks/tune_quant_gpu.py`` times the alternatives on a GPU; none
# changes a result): warps per program of the amax pass, the fp8 codes and the NF4 quantize;
# the whole-row fp8_rowwise programs take a warp per ROW_WARP_ELEMS elements (up to 16). The
# dequantize of each format takes tiles of up to DEQ_SHAPES[format][0] elements (fp8_rowwise:
# within rows) in up to DEQ_SHAPES[format][1] warps, at least 8 elements a thread. Picked on an
# H200 (BENCHMARKS.md, "Launch shapes"): the programs' fixed work weighs against both more
# warps and smaller tiles. fp8_tensorwise's (2048, 1) compiles to fp8_rowwise's SASS (see
# _dequantize_kernel): 92 % of the floor there. NF4's dequantize since it gathers each
# element's value from its block's 16 (tl.gather): (1024, 1), picked on an H100, 97 % of the
# floor against 90 % for the (4096, 4) it had.
AMAX_WARPS = 4
# Registers a thread of the amax pass may take (None: as the compiler likes; the "amax
# registers" tune group times a cap). With its bf16 tiles read as 32-bit words (_load_whole)
# it takes 20-27 % fewer instructions an element, and Triton 3.6 and 3.7 give it 72 registers
# instead of 64 (7 programs an SM instead of 8). A cap of 64 keeps their instructions without
# a spill, but Triton 3.8 and 3.9 (96-149 registers uncapped) spill under a cap of up to 80
# (sm_90 SASS, benchmarks/triton_sass.py with each Triton), so there is none by default.
AMAX_MAXNREG = None
FP8_WARPS = 4
NF4_WARPS = 2
# The NF4 quantize's code steps after the cubic in one piece of inline PTX (_nf4_code_from, ASM
# 2): the truncation to an unsigned int (negatives and NaN become 0, so no maximum), the
# midpoint's load, and the compare's -1 / 0 subtracted (no select). In sm_90 SASS (Triton 3.6,
# benchmarks/triton_sass.py): 24.0 -> 22.4 instructions an element, but 216 registers instead
# of 168; with NF4_MAXNREG = 96, 23.3 and 96 (10 programs an SM instead of 6), no spill (Triton
# 3.9: 23.4 and 96, one 8-byte spill). Off until a GPU has run it bit for bit and timed it (the
# "nf4 code" tune group does both): the interpreter cannot run inline PTX.
NF4_CODE_ASM = False
NF4_MAXNREG = None  # a register cap for the NF4 quantize (None: the compiler's choice)
ROW_WARP_ELEMS = 512
DEQ_SHAPES = {"fp8_tensorwise": (2048, 1), "fp8_rowwise": (2048, 1), "nf4": (1024, 1)}


def _triton_release() -> tuple[int, int]:
    """The installed Triton's (major, minor); (0, 0) where its version string has neither."""
    m = re.match(r"(\d+)\.(\d+)", triton.__version__)
    return (int(m[1]), int(m[2])) if m else (0, 0)


# How the NF4 dequantize finds an element's value: gathered from its block's 16 (tl.gather,
# warp shuffles), or loaded from the NF4 table and multiplied by the block's scale. The gather
# takes fewer instructions up to Triton 3.8, but Triton 3.9 (torch 2.15's) lowers it with 2.6x
# the shuffles and 4.6x the selects: in sm_90 SASS (benchmarks/triton_sass.py, tiles of 1024),
# gather / load: Triton 3.6 12.9 / 19.0 instructions an element, 3.7 14.0 / 16.7, 3.8 14.4 /
# 16.7, 3.9 24.8 / 16.7. The same bits either way (each value the same product and rounding).
NF4_DEQ_GATHER = _triton_release() < (3, 9)

# Whether kernels on GPUs of compute capability 8.9 and up round fp32 to e4m3 and bf16, and
# decode e4m3, with the GPU's conversion instructions (the same bits as the integer math, which
# the interpreter and older GPUs run; FSDP_NATIVE_TRITON_CVT=0 turns them off). Read when a
# call's launches are worked out.
HW_CVT = os.environ.get("FSDP_NATIVE_TRITON_CVT", "1") != "0"

_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Compile options: no fused multiply-adds, and libdevice (div_rn) without flushing subnormals
# to zero, so the GPU rounds as the C++ kernels and the reference do.
_OPTS = dict(enable_fp_fusion=False, enable_reflect_ftz=False)


# --------------------------------------------------------------------------------------------
# memory access. A tile that lies wholly inside its tensors is loaded and stored without masks
# and, where the launch checked that its pointers and strides are 16-byte aligned (HINT), with
# the compiler told so: 16 bytes per thread per access instead of one element (the pointers
# come from a table, so the compiler cannot know their alignment). Only the last tile of a
# tensor takes the masked path. A whole tile's pointers are built another way than the masked
# path's (base + lo, then + j), or the compiler merges the two and drops the hint.


@triton.jit
def _typed_ptrs(addr, j, KIND: tl.constexpr, HINT: tl.constexpr = False, V: tl.constexpr = 1):
    """Pointers to elements ``j`` (1-D, or 2-D / 3-D with contiguous rows) at raw address ``addr``,
    of KIND 0 fp32, 1 uint16, 2 fp16, 3 uint32; HINT: as runs of V elements, each starting
    16-byte aligned. (A hint acts only in the function that made the pointers, hence here.)"""
    if KIND == 0:
        p = addr.to(tl.pointer_type(tl.float32)) + j
    elif KIND == 1:
        p = addr.to(tl.pointer_type(tl.uint16)) + j
    elif KIND == 2:
        p = addr.to(tl.pointer_type(tl.float16)) + j
    else:
        p = addr.to(tl.pointer_type(tl.uint32)) + j
    if HINT:
        if len(j.shape) == 1:
            p = tl.max_contiguous(tl.multiple_of(p, 16), V)
        elif len(j.shape) == 2:
            p = tl.max_contiguous(tl.multiple_of(p, [16, 16]), [1, V])
        else:
            p = tl.max_contiguous(tl.multiple_of(p, [16, 16, 16]), [1, 1, V])
    return p


@triton.jit
def _src_ptrs(addr, j, SRC: tl.constexpr, HINT: tl.constexpr = False, V: tl.constexpr = 1):
    """A source of dtype SRC (0 fp32, 1 bf16 as its bits, 2 f16)."""
    return _typed_ptrs(addr, j, SRC, HINT, V)


@triton.jit
def _byte_ptrs(base, j, HINT: tl.constexpr = False, V: tl.constexpr = 1):
    """``base + j`` (u8 pointers; 1-D, or 2-D / 3-D with contiguous rows); HINT: as runs of V bytes,
    each starting V-byte aligned."""
    p = base + j
    if HINT:
        if len(j.shape) == 1:
            p = tl.max_contiguous(tl.multiple_of(p, V), V)
        elif len(j.shape) == 2:
            p = tl.max_contiguous(tl.multiple_of(p, [V, V]), [1, V])
        else:
            p = tl.max_contiguous(tl.multiple_of(p, [V, V, V]), [1, 1, V])
    return p


@triton.jit
def _store_scales(table, idx, v, mask, SA: tl.constexpr):
    """fp32 ``v`` as scales ``idx`` of the table at u8 pointer ``table``: 4-byte stores where it
    is 4-byte aligned (SA; a GPU faults on a misaligned one), else byte by byte."""
    if SA:
        tl.store(table.to(tl.pointer_type(tl.float32)) + idx, v, mask=mask)
    else:
        u = v.to(tl.uint32, bitcast=True)
        for k in tl.static_range(4):
            tl.store(table + idx * 4 + k, ((u >> (8 * k)) & 255).to(tl.uint8), mask=mask)


@triton.jit
def _load_scales(table, idx, SA: tl.constexpr):
    """Scales ``idx`` of the table at u8 pointer ``table`` (see _store_scales)."""
    if SA:
        return tl.load(table.to(tl.pointer_type(tl.float32)) + idx)
    u = tl.load(table + idx * 4).to(tl.uint32)
    for k in tl.static_range(1, 4):
        u = u | (tl.load(table + idx * 4 + k).to(tl.uint32) << (8 * k))
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _widen(x, SRC: tl.constexpr):
    """fp32 values of loaded SRC elements; bf16 widens by its bits (exact everywhere,
    subnormals included)."""
    if SRC == 1:
        return (x.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _load_whole(addr, j, jw, SRC: tl.constexpr, HINT: tl.constexpr, V: tl.constexpr, mask=None):
    """fp32 values of the source elements ``j`` of a whole tile at raw address ``addr`` (runs
    along the last axis; ``mask``: constant along it); ``jw``: the same tile as 32-bit words,
    j's last axis halved. An aligned bf16 tile (HINT) is loaded as words, and the two elements
    of each are widened by one operation each (the low half shifted up, the high half
    masked), where loading elements makes the compiler unpack each before its shift."""
    if SRC == 1 and HINT:
        p = _typed_ptrs(addr, jw, 3, HINT, V // 2)
        w = tl.load(p) if mask is None else tl.load(p, mask=mask, other=0)
        return tl.interleave((w << 16).to(tl.float32, bitcast=True), (w & 0xFFFF0000).to(tl.float32, bitcast=True))
    p = _src_ptrs(addr, j, SRC, HINT, V)
    return _widen(tl.load(p) if mask is None else tl.load(p, mask=mask, other=0), SRC)


@triton.jit
def _out_ptrs(addr, j, OUT: tl.constexpr, HINT: tl.constexpr = False, V: tl.constexpr = 1):
    """The bits of a destination of dtype OUT (0 fp32, else 16-bit)."""
    return _typed_ptrs(addr, j, 3 if OUT == 0 else 1, HINT, V)


# --------------------------------------------------------------------------------------------
# element math (csrc/quant_math.h)


@triton.jit
def _find_param(starts, n_params, pid, LOG2: tl.constexpr):
    """The last parameter p with starts[p] <= pid (parameters without tasks are skipped), and
    pid's task within it, pid - starts[p] (int64), from the search's own loads (starts[0] is
    0): one dependent load fewer before the program's first data. In 32 bits (the grid's task
    indices fit them; ``starts`` is int32): half the instructions of a 64-bit search, which
    every thread of the program runs."""
    pid = pid.to(tl.int32)
    lo = pid * 0
    hi = lo + n_params - 1
    first = lo
    for _ in tl.static_range(LOG2):
        mid = (lo + hi + 1) // 2
        s = tl.load(starts + mid)
        go = (s <= pid).to(tl.int32)  # arithmetic, not tl.where: scalars
        lo = lo + go * (mid - lo)
        hi = mid - 1 + go * (hi - mid + 1)
        first = first + go * (s - first)
    return lo, (pid - first).to(tl.int64)


@triton.jit
def _fp8_scale(amax):
    s = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)
    return tl.where((amax > 0.0) & (amax <= 3.4028234663852886e38), s, 1.0)


@triton.jit
def _finite_abs_bits(x):
    a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.where(a < 0x7F800000, a, 0)


@triton.jit
def _amax_key(x):
    """A uint32 key of fp32 ``x`` whose largest value over some x gives their largest finite
    |x| (``_amax_of_key``): 2|x| + 2^24 modulo 2^32, one shift-add an element. It puts every
    inf and NaN (2|x| >= 0xFF000000, wrapped below 2^24) under every finite value (from 2^24
    up, zero included), without a compare and select per element. The fp8_rowwise rows take
    it (64 % of the floor against 58 % on an H100); the tensorwise amax pass does not (78
    against 81 %: its registers went from 64 to 96 a thread)."""
    return (x.to(tl.uint32, bitcast=True) << 1) + 0x01000000


@triton.jit
def _amax_of_key(m):
    """The largest finite |x| (int32 bits; 0 where every x was inf or NaN) from the largest
    ``_amax_key``."""
    return tl.where(m >= 0x01000000, (m - 0x01000000) >> 1, 0).to(tl.int32)


@triton.jit
def _fp8_encode(x, inv_scale, CVT: tl.constexpr):
    """The e4m3 code of x * inv_scale, saturated to +-448, rounded to nearest even; NaN and
    +-inf x: 0x7F. CVT: by the GPU's conversion (sm_89+), else by integer math."""
    finite = (x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) < 0x7F800000
    if CVT:
        # A non-finite x becomes the positive NaN before the conversion, which makes it code
        # 0x7F: selecting 0x7F after it would unpack each converted pair of codes.
        return _fp8_encode_finite(tl.where(finite, x, float("nan")), inv_scale, CVT)
    return tl.where(finite, _fp8_encode_finite(x, inv_scale, CVT), 0x7F).to(tl.uint8)


@triton.jit
def _fp8_encode_finite(x, inv_scale, CVT: tl.constexpr):
    """_fp8_encode for finite x (CVT: and NaN x, which give 0x7F)."""
    q = x * inv_scale
    if CVT:  # cvt.rn.satfinite saturates to +-448 itself: no clamp
        return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    c = tl.minimum(tl.maximum(q, -448.0), 448.0)
    u = c.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    normal = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
    sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)
    return (tl.where(a < 0x3C800000, sub, normal) | sign).to(tl.uint8)


@triton.jit
def _e4m3_value(c, CVT: tl.constexpr):
    """The value of e4m3 code ``c`` (uint8). CVT: by the GPU's conversion (sm_89+). Else its
    bits moved into an fp16 are the value times 2^-8, normal or subnormal (the exponent biases
    differ by 8), so the exact fp16 -> fp32 conversion and an exact multiply by 256 give it."""
    if CVT:
        return c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    b = c.to(tl.uint32)
    h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    v = h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((b & 0x7F) == 0x7F, 0x7FC00000, v.to(tl.uint32, bitcast=True)).to(tl.float32, bitcast=True)


# _nf4_code_from's cubic, c0 + c1 v + c2 v^2 + c3 v^3: fitted to k + 0.5 at the k-th NF4 midpoint
# (largest miss 0.1), then checked for every fp32 with |v| <= 1.001.
NF4_CUBIC = (7.120029926300049, 11.414050102233887, 0.64410001039505, -4.424630165100098)
_H0, _H1, _H2, _H3 = (tl.constexpr(c) for c in NF4_CUBIC)


@triton.jit
def _nf4_code_from(v, mids, ASM: tl.constexpr):
    """The NF4 code of v: the number of NF4 midpoints (``mids``: _quant_ref.NF4_MIDPOINTS as an
    fp32 table) below v. A cubic h (NF4_CUBIC, fused multiply-adds) truncated is that count or
    one less for every fp32 with |v| <= 1.001, so one compare with midpoint k finishes it (each
    such v checked, with fused and with separate multiply-adds, by ``python
    tests/test_quant_kernels.py --nf4-cubic``; the suite checks those near every midpoint and
    every step of h, and 2^24 others). A NaN v: h truncates to 0 (an interpreter's NaN -> int
    is negative, hence the maximum) and the compare is false: code 0. ASM: the table read by
    inline PTX (NVIDIA GPUs), the same load, where Triton would move the tensors to another
    layout for it and compute h three times. About 10 instructions an element where a binary
    search over the midpoints took about 20."""
    h = tl.fma(tl.fma(tl.fma(v, _H3, _H2), v, _H1), v, _H0)
    if ASM == 2:  # (NF4_CODE_ASM) k = trunc(h) as unsigned (PTX clamps: negatives, NaN -> 0), then k - (v > m ? -1 : 0)
        return tl.inline_asm_elementwise(
            "{ .reg .u32 k, c; .reg .u64 a; .reg .f32 m; cvt.rzi.u32.f32 k, $1; mul.wide.u32 a, k, 4; add.u64 a, a, $3; "
            "ld.global.nc.f32 m, [a]; set.gt.u32.f32 c, $2, m; sub.s32 $0, k, c; }", "=r,f,f,l",
            [h, v, tl.broadcast_to(mids.to(tl.int64, bitcast=True), v.shape)], dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    k = tl.maximum(h.to(tl.int32), 0)
    if ASM:
        m = tl.inline_asm_elementwise(
            "{ .reg .u64 a; mul.wide.u32 a, $1, 4; add.u64 a, a, $2; ld.global.nc.f32 $0, [a]; }", "=f,r,l",
            [k, tl.broadcast_to(mids.to(tl.int64, bitcast=True), k.shape)], dtype=tl.float32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        m = tl.load(mids + k)
    return k + (v > m).to(tl.int32)


@triton.jit
def _out_bits(v, OUT: tl.constexpr, CVT: tl.constexpr):
    """fp32 ``v`` as the bits of OUT (0 fp32, 1 bf16, 2 f16), rounding to nearest even, every
    NaN as the dtype's one NaN (CVT: bf16 by the GPU's conversion)."""
    u = v.to(tl.uint32, bitcast=True)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if OUT == 0:
        return tl.where(nan, 0x7FC00000, u)
    elif OUT == 1:
        if CVT:
            r = v.to(tl.bfloat16).to(tl.uint16, bitcast=True)
        else:
            r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16)
        return tl.where(nan, 0x7FC0, r).to(tl.uint16)
    else:
        h = v.to(tl.float16).to(tl.uint16, bitcast=True)
        return tl.where(nan, 0x7E00, h).to(tl.uint16)


# Per-parameter table columns (int64). AIDX: where the parameter's amax lives in the amax
# array (tensorwise: its index; rowwise: the index of its first row). TILES: the dequantize's
# tiles per rank (no 64-bit division in the kernel).
_PTR, _NUMEL, _PADDED, _ROW, _SEG, _DATA_END, _SCALES, _SCALES_END, _SEG_END, _AIDX, _TILES = range(11)
_COLS = 11


@triton.jit
def _load_meta(meta, p, col: tl.constexpr):
    return tl.load(meta + p * 11 + col)


# --------------------------------------------------------------------------------------------
# kernels. Loops have compile-time trip counts (the interpreter cannot run loops with run-time
# bounds with numpy 2.4); a tile's own bounds are run-time branches.


@triton.jit
def _tile_in(t, meta, p, ROWWISE: tl.constexpr, BLOCK: tl.constexpr):
    """Tile ``t`` (int32) of parameter p's padded shard: its row ``r`` (0 unless ROWWISE) and
    elements [lo, hi); a rowwise tile lies within one row."""
    if ROWWISE:
        row = _load_meta(meta, p, 3)
        per_row = ((row + BLOCK - 1) // BLOCK).to(tl.int32)
        r32 = t // per_row
        r = r32.to(tl.int64)
        lo = r * row + ((t - r32 * per_row) * BLOCK).to(tl.int64)
        hi = tl.minimum(lo + BLOCK, r * row + row)
    else:
        lo = t.to(tl.int64) * BLOCK
        r = lo * 0
        hi = tl.minimum(lo + BLOCK, _load_meta(meta, p, 2))
    return r, lo, hi


@triton.jit
def _fp8_tile(meta, starts, n_params, ROWWISE: tl.constexpr, LOG2: tl.constexpr, BLOCK: tl.constexpr,
              REVERSE: tl.constexpr = False):  # fmt: skip
    """This program's parameter and tile [lo, hi) of its padded shard; a rowwise tile lies
    within one row (row index ``r``). REVERSE: the programs take the tiles last first."""
    if REVERSE:
        pid = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)
    else:
        pid = tl.program_id(0).to(tl.int64)
    p, t = _find_param(starts, n_params, pid, LOG2)
    r, lo, hi = _tile_in(t.to(tl.int32), meta, p, ROWWISE, BLOCK)  # task indices fit 32 bits (the grid does)
    return p, r, lo, hi


@triton.jit
def _tile_amax(src, lo, hi, numel, SRC: tl.constexpr, FULL: tl.constexpr, HINT: tl.constexpr, BLOCK: tl.constexpr, V: tl.constexpr):
    """The largest finite |x| (as int32 bits) of elements [lo, min(hi, numel)) of a source."""
    j = tl.arange(0, BLOCK)
    if FULL:
        x = _load_whole(src + lo * (16 // V), j, tl.arange(0, BLOCK // 2), SRC, HINT, V)
    else:
        x = _widen(tl.load(_src_ptrs(src, lo + j, SRC), mask=(lo + j < hi) & (lo + j < numel), other=0), SRC)
    return tl.max(_finite_abs_bits(x), axis=0)


@triton.jit
def _tile_codes(src, codes, lo, hi, numel, inv, SRC: tl.constexpr, FULL: tl.constexpr, HINT: tl.constexpr, BLOCK: tl.constexpr,
                V: tl.constexpr, CVT: tl.constexpr):  # fmt: skip
    """The fp8 codes of elements [lo, hi) of a source (zero past numel) into ``codes`` (the
    codes of element 0)."""
    j = tl.arange(0, BLOCK)
    if FULL:
        x = _load_whole(src + lo * (16 // V), j, tl.arange(0, BLOCK // 2), SRC, HINT, V)
        tl.store(_byte_ptrs(codes + lo, j, HINT, V), _fp8_encode(x, inv, CVT))
    else:
        x = _widen(tl.load(_src_ptrs(src, lo + j, SRC), mask=(lo + j < hi) & (lo + j < numel), other=0), SRC)
        tl.store(codes + (lo + j), _fp8_encode(x, inv, CVT), mask=lo + j < hi)


@triton.jit
def _amax_kernel(
    meta, starts, amax_bits, n_params,
    SRC: tl.constexpr, ROWWISE: tl.constexpr, LOG2: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr,
    V: tl.constexpr, HINT: tl.constexpr,
):  # fmt: skip
    p, r, lo, hi = _fp8_tile(meta, starts, n_params, ROWWISE, LOG2, BLOCK * TILES)
    src = _load_meta(meta, p, 0)
    numel = _load_meta(meta, p, 1)
    if (lo + BLOCK * TILES <= hi) & (lo + BLOCK * TILES <= numel):  # whole tiles: loaded at once, one reduction
        m = _tile_amax(src, lo, hi, numel, SRC, True, HINT, BLOCK * TILES, V)
    else:
        m = tl.full([], 0, tl.int32)
        for k in range(TILES):
            a = lo + k * BLOCK
            if (a + BLOCK <= hi) & (a + BLOCK <= numel):
                m = tl.maximum(m, _tile_amax(src, a, hi, numel, SRC, True, HINT, BLOCK, V))
            else:
                m = tl.maximum(m, _tile_amax(src, a, hi, numel, SRC, False, HINT, BLOCK, V))
    tl.atomic_max(amax_bits + _load_meta(meta, p, 9) + r, m)


@triton.jit
def _fp8_quantize_kernel(
    meta, starts, out, amax, n_params,
    SRC: tl.constexpr, ROWWISE: tl.constexpr, LOG2: tl.constexpr, BLOCK: tl.constexpr, V: tl.constexpr, HINT: tl.constexpr,
    CVT: tl.constexpr, SA: tl.constexpr, REVERSE: tl.constexpr,
):  # fmt: skip
    """The codes of one tile, from the amaxes of the call (given, or made by the amax pass just
    before: then REVERSE, so that the tiles that pass read last, still in the GPU's L2 cache,
    are read again first)."""
    p, r, lo, hi = _fp8_tile(meta, starts, n_params, ROWWISE, LOG2, BLOCK, REVERSE)
    src = _load_meta(meta, p, 0)
    numel = _load_meta(meta, p, 1)
    codes = out + _load_meta(meta, p, 4)
    scale = _fp8_scale(tl.load(amax + _load_meta(meta, p, 9) + r))
    first = lo == r * _load_meta(meta, p, 3) if ROWWISE else lo == 0
    _store_scales(out + _load_meta(meta, p, 6), r, scale, first, SA)
    inv = tl.math.div_rn(1.0, scale)
    if (lo + BLOCK <= hi) & (lo + BLOCK <= numel):
        _tile_codes(src, codes, lo, hi, numel, inv, SRC, True, HINT, BLOCK, V, CVT)
    else:
        _tile_codes(src, codes, lo, hi, numel, inv, SRC, False, HINT, BLOCK, V, CVT)
    _zero_gaps_if(out, meta, p, hi == _load_meta(meta, p, 2))


@triton.jit
def _rows_encode(x, CVT: tl.constexpr):
    """Each row's scale (from its largest finite |x|) and the fp8 codes of rows ``x`` (R rows
    of TPR tiles of TB elements)."""
    m = _amax_of_key(tl.max(tl.max(_amax_key(x), axis=2), axis=1))
    scale = _fp8_scale(m.to(tl.float32, bitcast=True))
    q = x * tl.math.div_rn(1.0, scale)[:, None, None]
    # The scale comes from the rows' own largest finite |x|, so x * (1 / scale) is finite
    # exactly where x is (|q| <= 448 (1 + 2^-22)): the test on q, after the multiply, is one
    # compare with |.| for free, where the test on x (bits, mask, compare) is held across the
    # rows' reduction and the scale's division and spills the predicates.
    finite = tl.abs(q) <= 3.4028234663852886e38
    if CVT:
        return scale, tl.where(finite, q, float("nan")).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return scale, tl.where(finite, _fp8_encode_finite(q, 1.0, CVT), 0x7F).to(tl.uint8)


@triton.jit
def _fp8_rows_kernel(
    meta, starts, out, n_params,
    SRC: tl.constexpr, LOG2: tl.constexpr, R: tl.constexpr, TPR: tl.constexpr, TB: tl.constexpr, V: tl.constexpr,
    HINT: tl.constexpr, EXACT: tl.constexpr, CVT: tl.constexpr, SA: tl.constexpr,
):  # fmt: skip
    """fp8_rowwise, R whole rows per program, held in registers: a row as up to TPR tiles of TB
    elements (TB divides every row of the launch; EXACT: every row is TPR tiles). The rows are
    loaded at once, then each row's amax (one reduction), scale and codes, with no second read.
    (A program taking 2 or 4 such groups in turn, each group's load issued before the one
    before is encoded, ran at 25-40 % of the floor on an H200 against this kernel's 46 %.)
    Rows past the shard's data (padding), and a row's elements past it, read as zeros: codes 0
    and scale 1. Column 10 of the table holds the parameter's rows."""
    pid = tl.program_id(0).to(tl.int64)
    p, t = _find_param(starts, n_params, pid, LOG2)
    src = _load_meta(meta, p, 0)
    numel = _load_meta(meta, p, 1)
    row = _load_meta(meta, p, 3)
    n_rows = _load_meta(meta, p, 10)
    i = tl.arange(0, R)[:, None, None]
    k = tl.arange(0, TPR)[None, :, None]
    e = i * row + k * TB + tl.arange(0, TB)[None, None, :]  # elements of the rows, from the first
    tiles = k < row // TB  # the row's tiles (a mask constant along each tile)
    codes = out + _load_meta(meta, p, 4)
    lo = t * R * row  # the program's first element
    if lo + R * row <= numel:  # R rows of data
        ew = i * (row // 2) + k * (TB // 2) + tl.arange(0, TB // 2)[None, None, :]  # as words
        cptrs = _byte_ptrs(codes + lo, e, HINT, V)
        if EXACT:
            scale, c = _rows_encode(_load_whole(src + lo * (16 // V), e, ew, SRC, HINT, V), CVT)
            tl.store(cptrs, c)
        else:
            scale, c = _rows_encode(_load_whole(src + lo * (16 // V), e, ew, SRC, HINT, V, tiles), CVT)
            tl.store(cptrs, c, mask=tiles)
    else:  # the last rows of data, padding rows, or a row that the shard's end cuts
        in_rows = tiles & (t * R + i < n_rows)
        scale, c = _rows_encode(_widen(tl.load(_src_ptrs(src, lo + e, SRC), mask=in_rows & (lo + e < numel), other=0), SRC), CVT)
        tl.store(codes + (lo + e), c, mask=in_rows)
    r = t * R + tl.arange(0, R)
    _store_scales(out + _load_meta(meta, p, 6), r, scale, r < n_rows, SA)
    _zero_gaps_if(out, meta, p, (t + 1) * R >= n_rows)


@triton.jit
def _zero_gaps_if(out, meta, p, last):
    # A branch on the scalar, not `last & vector` as the mask: Triton 3.9's interpreter (the
    # Triton of torch 2.15) rejects a scalar-and-vector mask ("mask has unsupported dtype").
    if last:
        k = tl.arange(0, 16).to(tl.int64)
        data_end = _load_meta(meta, p, 5)
        scales = _load_meta(meta, p, 6)
        scales_end = _load_meta(meta, p, 7)
        seg_end = _load_meta(meta, p, 8)
        tl.store(out + data_end + k, tl.zeros([16], tl.uint8), mask=data_end + k < scales)
        tl.store(out + scales_end + k, tl.zeros([16], tl.uint8), mask=scales_end + k < seg_end)


@triton.jit
def _nf4_quantize_kernel(
    meta, starts, out, mids, n_params,
    SRC: tl.constexpr, LOG2: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr, V: tl.constexpr, HINT: tl.constexpr,
    SA: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    p, t = _find_param(starts, n_params, pid, LOG2)
    src = _load_meta(meta, p, 0)
    numel = _load_meta(meta, p, 1)
    padded = _load_meta(meta, p, 2)
    lo = t * NB * BS
    blk = t * NB + tl.arange(0, NB)
    e = tl.arange(0, NB)[:, None] * BS + tl.arange(0, BS)[None, :]  # elements of the tile
    if lo + NB * BS <= numel:
        x = _widen(tl.load(_src_ptrs(src + lo * (16 // V), e, SRC, HINT, V)), SRC)
    else:
        x = _widen(tl.load(_src_ptrs(src, lo + e, SRC), mask=lo + e < numel, other=0), SRC)
    m = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    m = tl.where(m == 0, 0x3F800000, tl.maximum(m, 0x00800000))  # 1, or at least 2^-126
    scale = tl.where(m >= 0x7F800000, 0x7FC00000, m).to(tl.float32, bitcast=True)
    inv = tl.math.div_rn(1.0, scale)
    hi4, lo4 = tl.split(tl.reshape(_nf4_code_from(x * inv[:, None], mids, ASM), [NB, BS // 2, 2]))
    byte = ((hi4 << 4) | lo4).to(tl.uint8)
    b = tl.arange(0, NB)[:, None] * (BS // 2) + tl.arange(0, BS // 2)[None, :]  # bytes of the tile
    codes = out + _load_meta(meta, p, 4)
    if lo + NB * BS <= padded:
        tl.store(_byte_ptrs(codes + lo // 2, b, HINT, V // 2), byte)
    else:
        tl.store(codes + (lo // 2 + b), byte, mask=lo // 2 + b < (padded + 1) // 2)
    _store_scales(out + _load_meta(meta, p, 6), blk, scale, blk < (padded + BS - 1) // BS, SA)
    _zero_gaps_if(out, meta, p, lo + NB * BS >= padded)


@triton.jit
def _fp8_values(codes, dst, lo, hi, scale, OUT: tl.constexpr, FULL: tl.constexpr, HINT: tl.constexpr, BLOCK: tl.constexpr,
                V: tl.constexpr, CVT: tl.constexpr):  # fmt: skip
    """Elements [lo, hi) of one rank's fp8 codes times ``scale`` into ``dst`` (element 0 of
    the rank's slice of the unsharded parameter)."""
    j = tl.arange(0, BLOCK)
    if FULL:
        v = _e4m3_value(tl.load(_byte_ptrs(codes + lo, j, HINT, V)), CVT) * scale
        tl.store(_out_ptrs(dst + lo * (16 // V), j, OUT, HINT, V), _out_bits(v, OUT, CVT))
    else:
        mask = lo + j < hi
        v = _e4m3_value(tl.load(codes + (lo + j), mask=mask, other=0), CVT) * scale
        tl.store(_out_ptrs(dst, lo + j, OUT), _out_bits(v, OUT, CVT), mask=mask)


@triton.jit
def _nf4_values(codes, scales, table, dst, lo, hi, OUT: tl.constexpr, FULL: tl.constexpr, HINT: tl.constexpr, BS: tl.constexpr,
                NB: tl.constexpr, V: tl.constexpr, CVT: tl.constexpr, SA: tl.constexpr, GATHER: tl.constexpr):  # fmt: skip
    """Elements [lo, hi) (lo a block's first) of one rank's NF4 codes (their scales: the table
    at ``scales``) into ``dst``. Each block's 16 possible outputs are made once (the value
    times the scale, rounded), and each element gathers its own from them (a warp shuffle on
    a GPU): 14.2 instructions an element on sm_90 where a table load, multiply and rounding
    per element took 19.6 (benchmarks/triton_sass.py; the kernel is bound by instruction
    issue). The same bits: each output is the same product and rounding. Without GATHER
    (NF4_DEQ_GATHER: Triton 3.9), each element's value is loaded from the table and multiplied."""
    k = tl.arange(0, NB)
    b = k[:, None] * (BS // 2) + tl.arange(0, BS // 2)[None, :]  # bytes of the tile
    e = k[:, None] * BS + tl.arange(0, BS)[None, :]  # elements of the tile
    if FULL:
        s = _load_scales(scales, lo // BS + k, SA)
        c = tl.load(_byte_ptrs(codes + lo // 2, b, HINT, V // 2)).to(tl.int32)
    else:
        s = _load_scales(scales, lo // BS + tl.where(lo + k * BS < hi, k, 0), SA)  # (past hi: the first's)
        c = tl.load(codes + (lo // 2 + b), mask=lo + 2 * b < hi, other=0).to(tl.int32)
    if GATHER:
        t = _out_bits(tl.load(table + tl.arange(0, 16))[None, :] * s[:, None], OUT, CVT)  # [NB, 16]
        bits = tl.interleave(tl.gather(t, c >> 4, 1), tl.gather(t, c & 15, 1))
    else:
        bits = _out_bits(tl.interleave(tl.load(table + (c >> 4)), tl.load(table + (c & 15))) * s[:, None], OUT, CVT)
    if FULL:
        tl.store(_out_ptrs(dst + lo * (16 // V), e, OUT, HINT, V), bits)
    else:
        tl.store(_out_ptrs(dst, lo + e, OUT), bits, mask=lo + e < hi)


@triton.jit
def _dequantize_kernel(
    meta, starts, gathered, rank_stride, table, n_params,
    FMT: tl.constexpr, OUT: tl.constexpr, LOG2: tl.constexpr, BS: tl.constexpr, BLOCK: tl.constexpr, V: tl.constexpr,
    HINT: tl.constexpr, CVT: tl.constexpr, SA: tl.constexpr, GATHER: tl.constexpr,
):  # fmt: skip
    """One tile of one rank's slice of a parameter: BLOCK elements (fp8_rowwise: within one
    row, so one scale), or BLOCK // BS whole NF4 blocks (GATHER: see _nf4_values)."""
    pid = tl.program_id(0).to(tl.int64)
    p, t = _find_param(starts, n_params, pid, LOG2)
    t = t.to(tl.int32)  # task indices fit 32 bits (the grid does)
    numel = _load_meta(meta, p, 1)
    padded = _load_meta(meta, p, 2)
    per_rank = _load_meta(meta, p, 10).to(tl.int32)
    r = t // per_rank
    u = t - r * per_rank
    r = r.to(tl.int64)
    # rr: the row, for fp8_rowwise. fp8_tensorwise takes the same path with one row per rank
    # (its table's row column holds the padded shard): the same tiles, and the same SASS as
    # fp8_rowwise's, where its own path (lo = t * BLOCK) led the compiler to hold a 1-warp
    # tile in 254 registers, against 86 (sm_90, benchmarks/triton_sass.py).
    rr, lo, hi = _tile_in(u, meta, p, FMT != 2, BLOCK)
    hi = tl.minimum(hi, tl.maximum(numel - r * padded, 0))  # this rank's real elements
    chunk = gathered + r * rank_stride
    codes = chunk + _load_meta(meta, p, 4)
    scales = chunk + _load_meta(meta, p, 6)
    dst = _load_meta(meta, p, 0) + r * padded * (4 if OUT == 0 else 2)
    if FMT == 2:
        if lo + BLOCK <= hi:
            _nf4_values(codes, scales, table, dst, lo, hi, OUT, True, HINT, BS, BLOCK // BS, V, CVT, SA, GATHER)
        else:
            _nf4_values(codes, scales, table, dst, lo, hi, OUT, False, HINT, BS, BLOCK // BS, V, CVT, SA, GATHER)
    else:
        scale = _load_scales(scales, rr, SA)
        if lo + BLOCK <= hi:
            _fp8_values(codes, dst, lo, hi, scale, OUT, True, HINT, BLOCK, V, CVT)
        else:
            _fp8_values(codes, dst, lo, hi, scale, OUT, False, HINT, BLOCK, V, CVT)


# --------------------------------------------------------------------------------------------
# launches


def _log2(n: int) -> int:
    return max(1, (max(n, 1) - 1).bit_length() + 1)


def _warps(block: int, most: int) -> int:
    """Warps for a dequantize tile of `block` elements: at least 8 elements per thread (16-byte
    accesses of 16-bit values), at most ``most``."""
    return max(1, min(most, block // 256))


_CAPABILITY: dict[int, tuple[int, int]] = {}


def _cvt(device: torch.device) -> bool:
    """Whether launches on ``device`` use the conversion instructions (HW_CVT): NVIDIA GPUs of
    compute capability 8.9 and up (checked on sm_90; ROCm's "cuda" devices take the integer
    math)."""
    if not HW_CVT or device.type != "cuda" or torch.version.hip is not None:
        return False
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _CAPABILITY:
        _CAPABILITY[i] = torch.cuda.get_device_capability(i)
    return _CAPABILITY[i] >= (8, 9)


def _nf4_asm(device: torch.device) -> int:
    """The NF4 quantize's ASM: 0 no inline PTX (the interpreter, AMD GPUs), 1 the midpoint
    table read by it (NVIDIA GPUs), 2 the code's last steps too (NF4_CODE_ASM)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return 0
    return 2 if NF4_CODE_ASM else 1


def _aligned(*values: int, to: int = 16) -> bool:
    """Whether every address and byte offset is a multiple of ``to`` (16: the launch may tell
    the compiler that its runs of 16 bytes are aligned; 4: fp32 scales may be accessed as such)."""
    return all(v % to == 0 for v in values)


# Device copies of the launch tables, by content. A unit's buffers stay put from step to step,
# so its tables repeat: without this, every call made two host-to-device copies from pageable
# memory, each of which synchronizes the stream before it starts. The kernels only read them.
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}
_TABLES_MAX = 1024


def _launch_tables(rows: list[list[int]], counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    key = (str(device), tuple(v for r in rows for v in r), tuple(counts))
    hit = _TABLES.get(key)
    if hit is not None:
        return hit
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    meta = torch.tensor(rows, dtype=torch.int64).reshape(-1, _COLS).to(device)
    hit = (meta, torch.tensor(starts, dtype=torch.int32).to(device), starts[-1])
    if len(_TABLES) >= _TABLES_MAX:  # the oldest first
        del _TABLES[next(iter(_TABLES))]
    _TABLES[key] = hit
    return hit


_NF4_TABLES: dict[tuple, torch.Tensor] = {}


def _nf4_table(device, values: list[float] = NF4_VALUES) -> torch.Tensor:
    """``values`` (NF4's values, or its midpoints) as an fp32 table on ``device``, made once."""
    key = (str(device), tuple(values))
    t = _NF4_TABLES.get(key)
    if t is None:
        t = _NF4_TABLES[key] = torch.tensor(values, dtype=torch.float32).to(device)
    return t


def _groups(tensors) -> dict[torch.dtype, list[int]]:
    g: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        g.setdefault(t.dtype, []).append(i)
    return g


def _meta_row(ptr, numel, padded, row, seg: Q.Segment, aidx, tiles: int = 0) -> list[int]:
    return [
        ptr, numel, padded, row, seg.offset, seg.offset + seg.data_nbytes, seg.offset + seg.scale_offset,
        seg.offset + seg.scale_offset + 4 * seg.n_scales, seg.offset + seg.nbytes, aidx, tiles,
    ]  # fmt: skip


def _nf4_blocks_per_program(block_size: int) -> int:
    return max(1, TASK // block_size)


def _fp8_tiles(padded: int, row: int, rowwise: bool, block: int) -> int:
    if padded == 0:
        return 0
    return (padded // row) * -(-row // block) if rowwise else -(-padded // block)


class _Launch(NamedTuple):
    """One kernel launch of a plan: the grid, its tables, its other arguments (names of the
    call's tensors, "out", "amax", "bits", "gathered", or values, the NF4 tables among them)
    and constexprs."""

    kernel: object
    n: int
    meta: torch.Tensor
    starts: torch.Tensor
    args: tuple
    kwargs: dict


# The launches of a call, by everything they depend on (the tensors' addresses, sizes, dtypes,
# devices and layouts, the unit's sizes, the format): a unit makes the same calls every step,
# so its launches are worked out, and its arguments checked, at its first call only. A plan
# holds no tensor of the call (only the device tables), so it keeps no buffer alive.
_PLANS: dict[tuple, tuple[int, list[_Launch]]] = {}
_PLANS_MAX = 1024


def _tkey(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)


def _remember(key: tuple, plan):
    if len(_PLANS) >= _PLANS_MAX:  # the oldest first
        del _PLANS[next(iter(_PLANS))]
    _PLANS[key] = plan
    return plan


def _run(launches: list[_Launch], env: dict) -> None:
    for L in launches:
        L.kernel[(L.n,)](L.meta, L.starts, *(env[a] if isinstance(a, str) else a for a in L.args), **L.kwargs)


def _fp8_launches(kernel, shards, padded_numels, row_numels, segs, rowwise, aidx, device, args: tuple,
                  tiles: int = 0, out_ptr: int = 0, reverse: bool = False) -> list[_Launch]:  # fmt: skip
    """One launch of ``kernel`` per source dtype over every fp8 tile of the unit (``tiles``
    tiles per program for the amax kernel; ``out_ptr``: where the codes go; ``reverse``: the
    codes' tiles last first)."""
    launches = []
    for dtype, idx in _groups(shards).items():
        rows = [_meta_row(shards[i].data_ptr(), shards[i].numel(), padded_numels[i], row_numels[i], segs[i], aidx[i]) for i in idx]
        counts = [_fp8_tiles(padded_numels[i], row_numels[i], rowwise, BLOCK * max(tiles, 1)) for i in idx]
        meta, starts, n = _launch_tables(rows, counts, device)
        v = 16 // dtype.itemsize
        hint = _aligned(out_ptr, *(shards[i].data_ptr() for i in idx)) and (
            not rowwise or all(row_numels[i] % v == 0 for i in idx)
        )
        if tiles:
            extra = {"TILES": tiles, "num_warps": AMAX_WARPS, **({"maxnreg": AMAX_MAXNREG} if AMAX_MAXNREG else {})}
        else:
            extra = {"CVT": _cvt(device), "SA": _aligned(out_ptr, to=4), "REVERSE": reverse, "num_warps": FP8_WARPS}
        if n:
            launches.append(_Launch(kernel, n, meta, starts, args + (len(idx),), dict(
                SRC=_KIND[dtype], ROWWISE=rowwise, LOG2=_log2(len(idx)), BLOCK=BLOCK, V=v, HINT=hint, **extra, **_OPTS,
            )))  # fmt: skip
    return launches


def _row_block(rows: list[int], most: int) -> int:
    """Dequantize tile size for tiles within rows: the largest power of two up to ``most`` that
    divides every row if that is at least 128 (whole tiles), else one power of two covering the
    longest row, up to ``most``."""
    even = min(most, min(r & -r for r in rows))
    return even if even >= 128 else min(most, max(16, 1 << (max(rows) - 1).bit_length()))


def _fp8_rows_launches(shards, padded_numels, row_numels, segs, out) -> list[_Launch]:
    """fp8_rowwise with whole rows in registers, for rows of at most ROW_FUSE_MAX elements: one
    launch per source dtype and row width (the power of two at or above a row), its rows as
    tiles of the largest power of two (up to BLOCK) that divides them all; ROW_ELEMS // width
    rows a program, or one."""
    launches = []
    for dtype, idx in _groups(shards).items():
        widths: dict[int, list[int]] = {}
        for i in idx:
            if padded_numels[i]:
                widths.setdefault(1 << (row_numels[i] - 1).bit_length(), []).append(i)
        v = 16 // dtype.itemsize
        for rb, sub in sorted(widths.items()):
            tb = min([BLOCK] + [row_numels[i] & -row_numels[i] for i in sub])
            per = max(1, ROW_ELEMS // rb)
            n_rows = [padded_numels[i] // row_numels[i] for i in sub]
            rows = [_meta_row(shards[i].data_ptr(), shards[i].numel(), padded_numels[i], row_numels[i], segs[i], 0, m)
                    for i, m in zip(sub, n_rows)]  # fmt: skip
            meta, starts, n = _launch_tables(rows, [-(-m // per) for m in n_rows], out.device)
            hint = tb % v == 0 and _aligned(out.data_ptr(), *(shards[i].data_ptr() for i in sub))
            launches.append(_Launch(_fp8_rows_kernel, n, meta, starts, ("out", len(sub)), dict(
                SRC=_KIND[dtype], LOG2=_log2(len(sub)), R=per, TPR=rb // tb, TB=tb, V=v, HINT=hint,
                EXACT=all(row_numels[i] == rb for i in sub), CVT=_cvt(out.device), SA=_aligned(out.data_ptr(), to=4),
                num_warps=max(1, min(16, per * rb // ROW_WARP_ELEMS)), **_OPTS,
            )))  # fmt: skip
    return launches


def quantize_amax_eager(shards: list[torch.Tensor], out: torch.Tensor) -> None:
    key = ("amax", out.dtype, tuple(out.shape), out.device, tuple(_tkey(s) for s in shards))
    plan = _PLANS.get(key)
    if plan is None:
        Q.check_amax_args(shards, out)
        numels = [s.numel() for s in shards]
        empty = [Q.Segment(0, 0, 0, 0, 0)] * len(shards)
        plan = _remember(key, (len(shards), _fp8_launches(
            _amax_kernel, shards, numels, [1] * len(shards), empty, False, range(len(shards)), out.device, ("bits",),
            tiles=AMAX_TILES,
        )))  # fmt: skip
    bits = torch.zeros(plan[0], dtype=torch.int32, device=out.device)
    _run(plan[1], {"bits": bits})
    out.copy_(bits.view(torch.float32))


def quantize_copy_in_eager(
    shards: list[torch.Tensor],
    padded_numels: list[int],
    row_numels: list[int],
    format: str,
    block_size: int,
    amax: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    key = (
        "quantize", HW_CVT, format, block_size, tuple(padded_numels), tuple(row_numels), _tkey(out),
        None if amax is None else (amax.dtype, tuple(amax.shape), amax.device), tuple(_tkey(s) for s in shards),
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        layout = Q.check_quantize_args(shards, padded_numels, row_numels, format, block_size, amax, out)
        plan = _remember(key, _quantize_plan(shards, padded_numels, row_numels, format, block_size, amax is not None, out, layout))
    env = {"out": out, "amax": amax}
    if plan[0]:  # the amaxes of this call, made by its first launch
        bits = env["bits"] = torch.zeros(plan[0], dtype=torch.int32, device=out.device)
        env["amax"] = bits.view(torch.float32)
    _run(plan[1], env)


def _quantize_plan(shards, padded_numels, row_numels, format, block_size, amax_given, out, layout) -> tuple[int, list[_Launch]]:
    """(elements of the amax array to make, 0 for none; the launches)."""
    segs = layout.segments
    if format == Q.NF4:
        launches = []
        for dtype, idx in _groups(shards).items():
            nb = _nf4_blocks_per_program(block_size)
            rows = [_meta_row(shards[i].data_ptr(), shards[i].numel(), padded_numels[i], row_numels[i], segs[i], 0) for i in idx]
            counts = [-(-segs[i].n_scales // nb) for i in idx]
            meta, starts, n = _launch_tables(rows, counts, out.device)
            v = 16 // dtype.itemsize
            hint = _aligned(out.data_ptr(), *(shards[i].data_ptr() for i in idx)) and block_size % v == 0
            if n:
                launches.append(_Launch(_nf4_quantize_kernel, n, meta, starts, ("out", _nf4_table(out.device, NF4_MIDPOINTS), len(idx)), dict(
                    SRC=_KIND[dtype], LOG2=_log2(len(idx)), BS=block_size, NB=nb, V=v, HINT=hint,
                    SA=_aligned(out.data_ptr(), to=4), ASM=_nf4_asm(out.device),
                    num_warps=NF4_WARPS, **_OPTS, **({"maxnreg": NF4_MAXNREG} if NF4_MAXNREG else {}),
                )))  # fmt: skip
        return 0, launches
    rowwise = format == Q.FP8_ROWWISE
    if rowwise and max(row_numels, default=0) <= ROW_FUSE_MAX:
        return 0, _fp8_rows_launches(shards, padded_numels, row_numels, segs, out)
    if rowwise:  # amax of every row of the unit, then the codes
        aidx, total = [], 0
        for s in segs:
            aidx.append(total)
            total += s.n_scales
    else:
        aidx, total = list(range(len(shards))), len(shards)
    launches = []
    if not amax_given:
        launches += _fp8_launches(_amax_kernel, shards, padded_numels, row_numels, segs, rowwise, aidx, out.device, ("bits",),
                                  tiles=1 if rowwise else AMAX_TILES)  # fmt: skip
    codes = _fp8_launches(_fp8_quantize_kernel, shards, padded_numels, row_numels, segs, rowwise, aidx, out.device,
                          ("out", "amax"), out_ptr=out.data_ptr(), reverse=not amax_given)  # fmt: skip
    launches += codes if amax_given else codes[::-1]  # after an amax pass: what it read last, first
    return (0 if amax_given else total), launches


def dequantize_copy_out_eager(
    gathered: torch.Tensor,
    padded_numels: list[int],
    row_numels: list[int],
    world_size: int,
    format: str,
    block_size: int,
    outs: list[torch.Tensor],
) -> None:
    key = (
        "dequantize", HW_CVT, format, block_size, world_size, tuple(padded_numels), tuple(row_numels), _tkey(gathered),
        tuple(_tkey(o) for o in outs),
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        layout = Q.check_dequantize_args(gathered, padded_numels, row_numels, world_size, format, block_size, outs)
        plan = _remember(key, (0, _dequantize_launches(gathered, padded_numels, row_numels, world_size, format, block_size, outs, layout)))
    _run(plan[1], {"gathered": gathered})


def _dequantize_launches(gathered, padded_numels, row_numels, world_size, format, block_size, outs, layout) -> list[_Launch]:
    rank_stride = gathered.stride(0) if gathered.dim() == 2 else layout.rank_nbytes
    fmt = Q.FORMATS.index(format)
    most, warps = DEQ_SHAPES[format]
    launches = []
    for dtype, idx in _groups(outs).items():
        live = [i for i in idx if outs[i].numel()]
        if not live:
            continue
        v = 16 // dtype.itemsize
        if format == Q.FP8_ROWWISE:  # tiles within rows: a launch per tile size, so that one
            # parameter's short rows do not shrink (or stretch) another's tiles
            blocks: dict[int, list[int]] = {}
            for i in live:
                blocks.setdefault(_row_block([row_numels[i]], most), []).append(i)
            parts = sorted(blocks.items())
        else:
            parts = [(max(most, block_size) if format == Q.NF4 else most, live)]
        for block, sub in parts:
            if format == Q.FP8_ROWWISE:
                tiles = [(padded_numels[i] // row_numels[i]) * -(-row_numels[i] // block) for i in sub]
            else:
                tiles = [-(-padded_numels[i] // block) for i in sub]
            rows = [
                _meta_row(outs[i].data_ptr(), outs[i].numel(), padded_numels[i],
                          max(padded_numels[i], 1) if format == Q.FP8_TENSORWISE else row_numels[i], layout.segments[i], 0, t)
                for i, t in zip(sub, tiles)
            ]
            meta, starts, n = _launch_tables(rows, [world_size * t for t in tiles], gathered.device)
            hint = (
                _aligned(gathered.data_ptr(), rank_stride, *(outs[i].data_ptr() for i in sub))
                and all(padded_numels[i] % v == 0 for i in sub)
                and (format != Q.FP8_ROWWISE or all(row_numels[i] % v == 0 for i in sub))
                and (format != Q.NF4 or block_size % v == 0)
            )
            launches.append(_Launch(_dequantize_kernel, n, meta, starts, ("gathered", rank_stride, _nf4_table(gathered.device), len(sub)), dict(
                FMT=fmt, OUT=_KIND[dtype], LOG2=_log2(len(sub)), BS=block_size, BLOCK=block, V=v, HINT=hint,
                CVT=_cvt(gathered.device), SA=_aligned(gathered.data_ptr(), rank_stride, to=4), num_warps=_warps(block, warps),
                GATHER=NF4_DEQ_GATHER or format != Q.NF4, **_OPTS,
            )))  # fmt: skip
    return launches


# The ops (what torch.compile traces; fsdp_native.quant calls the *_eager functions directly in
# eager mode, without the dispatcher's cost per call).
quantize_amax_triton = torch.library.custom_op("fsdp_native::quantize_amax_triton", mutates_args=("out",))(quantize_amax_eager)
quantize_copy_in_triton = torch.library.custom_op("fsdp_native::quantize_copy_in_triton", mutates_args=("out",))(
    quantize_copy_in_eager
)
dequantize_copy_out_triton = torch.library.custom_op("fsdp_native::dequantize_copy_out_triton", mutates_args=("outs",))(
    dequantize_copy_out_eager
)


@quantize_copy_in_triton.register_fake
def _(shards, padded_numels, row_numels, format, block_size, amax, out):
    Q.check_quantize_args(shards, padded_numels, row_numels, format, block_size, amax, out)


@dequantize_copy_out_triton.register_fake
def _(gathered, padded_numels, row_numels, world_size, format, block_size, outs):
    Q.check_dequantize_args(gathered, padded_numels, row_numels, world_size, format, block_size, outs)


@quantize_amax_triton.register_fake
def _(shards, out):
    Q.check_amax_args(shards, out)
