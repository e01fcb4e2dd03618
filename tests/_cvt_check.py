"""A Triton kernel that compares the quantize kernels' two ways to convert (kernels/quant.py:
the GPU's conversion instructions, CVT, and the integer math) over a range of 32-bit patterns:
fp32 -> e4m3 codes, fp32 -> bf16 bits, e4m3 codes -> fp32. It counts the patterns whose
results differ and finds the first. tests/test_quant_kernels.py runs it over every fp32 on a
GPU, and on a few ranges under the interpreter (where the comparison itself is checked)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fsdp_native import quant as Q

Q._import_triton_kernels()
from fsdp_native.kernels import quant as K  # noqa: E402
from fsdp_native.kernels.quant import _e4m3_value, _fp8_encode, _out_bits  # noqa: E402

ENCODE, BF16, DECODE, PLANTED, ENCODE_OVERFLOW = range(5)
NONE = 1 << 40  # "no difference" as a first index
_NONE = tl.constexpr(NONE)


@triton.jit
def _compare_kernel(start, counts, first, WHAT: tl.constexpr, A: tl.constexpr, B: tl.constexpr, BLOCK: tl.constexpr):
    i = start + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    u = i.to(tl.uint32)
    x = u.to(tl.float32, bitcast=True)
    if WHAT == 0:  # the e4m3 code of x (inverse scale 1: every value the scaled x can take)
        a = _fp8_encode(x, 1.0, A).to(tl.uint32)
        b = _fp8_encode(x, 1.0, B).to(tl.uint32)
    elif WHAT == 1:  # the bf16 bits of x
        a = _out_bits(x, 1, A).to(tl.uint32)
        b = _out_bits(x, 1, B).to(tl.uint32)
    elif WHAT == 2:  # the fp32 value of e4m3 code i % 256 (every NaN as one)
        c = (u & 255).to(tl.uint8)
        a = _out_bits(_e4m3_value(c, A), 0, False)
        b = _out_bits(_e4m3_value(c, B), 0, False)
    elif WHAT == 4:  # the e4m3 code of x scaled by 2^127: finite x whose scaled value is inf
        a = _fp8_encode(x, 1.7014118346046923e38, A).to(tl.uint32)
        b = _fp8_encode(x, 1.7014118346046923e38, B).to(tl.uint32)
    else:  # a planted difference at every 7th pattern: the comparison's own check
        a = u
        b = u ^ ((u % 7) == 0).to(tl.uint32)
    diff = a != b
    tl.atomic_add(counts, tl.sum(diff.to(tl.int64), axis=0))
    tl.atomic_min(first, tl.min(tl.where(diff, i, _NONE), axis=0))


def compare(what: int, a: bool, b: bool, start: int, n: int, device, block: int = 4096) -> tuple[int, int | None]:
    """(how many of patterns [start, start + n) convert differently with CVT=a and CVT=b, the
    first of them or None); n a multiple of `block`."""
    if n % block:
        raise ValueError(f"n: got {n}, expected a multiple of block={block}")
    counts = torch.zeros(1, dtype=torch.int64, device=device)
    first = torch.full((1,), NONE, dtype=torch.int64, device=device)
    _compare_kernel[(n // block,)](start, counts, first, WHAT=what, A=a, B=b, BLOCK=block, **K._OPTS)
    f = int(first.item())
    return int(counts.item()), None if f == NONE else f
