"""What the Triton quantize kernels (kernels/quant.py) compile to on a GPU, without a GPU.

    .venv/bin/python benchmarks/triton_sass.py                   # sm_90 (H100 / H200)
    .venv/bin/python benchmarks/triton_sass.py --arch 100 --kernels /tmp/old/kernels/quant.py

The ops are called on CPU tensors as `bench_gpu.py` calls them on the GPU (rank 3's bf16 shards
of one Llama-3-8B layer over 8 ranks, and of the overhead model's block), under
``TRITON_INTERPRET=1`` with every launch recorded instead of run (so no kernel runs here). Each recorded launch is then
compiled for the target by Triton's own compiler and ptxas (bundled with triton), with the
specialisations a launch would get (16-byte aligned pointers and integers). Per launch:
programs, elements per program, SASS instructions of one thread (static), the instructions
per element of a program whose tiles are all whole (the masked path of a tensor's last tile
left out; where the kernel loops over tiles, ``loop``, per element of one tile with the loop's
body counted once), registers, and the global loads and stores by width (with the local ones:
register spills).

A static view, not a timing: on a bandwidth-bound kernel the instructions per element and the
width of its memory operations are what its speed is made of (an H100 issues about 27 thread
instructions per element of a bf16 -> fp8 quantize in the time HBM moves its bytes), but only
a GPU run (``bench_gpu.py``) says how fast a kernel is.
"""
from __future__ import annotations

import ast
import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))

WORLD_SIZE, RANK = 8, 3
LLAMA_LAYER = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (4096, 14336), (14336, 4096)]
OVERHEAD_BLOCK = [(256, 128), (128, 256)]
_TYPES = {torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def load_kernels(path: str, interpret: bool | None, name: str | None = None):
    """kernels/quant.py (or another version of it) as a module of its own (its own plans and
    launch tables); jitted for the GPU when not `interpret`, as TRITON_INTERPRET says when
    `interpret` is None."""
    import triton.compiler.code_generator  # noqa: F401 - triton's own jitted library, jitted for the GPU
    import triton.language  # noqa: F401

    if interpret is not None:
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    name = name or f"_triton_sass_kernels_{int(bool(interpret))}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        if interpret is not None:
            os.environ.pop("TRITON_INTERPRET")
    return mod


def record_launches(mod, work: list[tuple[int, ...]]) -> list[tuple[str, str, dict]]:
    """(op, kernel name, launch) of every launch of the ops on `work`; none is run."""
    from triton.runtime.interpreter import InterpretedFunction

    from fsdp_native import ops
    from fsdp_native import quant as Q

    launches: list = []
    current = [""]
    orig = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        launches.append((current[0], self.fn.__name__, {"grid": grid, "args": dict(zip(names, args)), "kwargs": kwargs}))

    InterpretedFunction.run = run
    try:
        padded = [ops.padded_shard_numel(s, WORLD_SIZE) for s in work]
        rows = [s[1] for s in work]
        shards = [torch.zeros(padded[i] if (RANK + 1) * padded[i] <= s[0] * s[1] else 0, dtype=torch.bfloat16) for i, s in enumerate(work)]
        for fmt in Q.FORMATS:
            out = torch.empty(Q.unit_layout(padded, rows, fmt).rank_nbytes, dtype=torch.uint8)
            current[0] = f"quantize {fmt}"
            mod.quantize_copy_in_eager(shards, padded, rows, fmt, 64, None, out)
            if fmt == Q.FP8_TENSORWISE:
                current[0] = "quantize fp8_tensorwise, amax given"
                mod.quantize_copy_in_eager(shards, padded, rows, fmt, 64, torch.ones(len(shards)), out)
                current[0] = "quantize_amax"
                mod.quantize_amax_eager(shards, torch.empty(len(shards)))
            gathered = out.repeat(WORLD_SIZE)
            outs = [torch.empty(s[0] * s[1], dtype=torch.bfloat16) for s in work]
            current[0] = f"dequantize {fmt}"
            mod.dequantize_copy_out_eager(gathered, padded, rows, WORLD_SIZE, fmt, 64, outs)
    finally:
        InterpretedFunction.run = orig
    # the elements of each launch's own parameters (column 1 of its table: the shards', or
    # the unsharded parameters' for a dequantize); a call may make a launch per group of them
    return [(op, name, dict(launch, numel=int(launch["args"]["meta"].view(-1, mod._COLS)[:, 1].sum()))) for op, name, launch in launches]


def _signature(fn, launch) -> tuple[dict, dict, dict]:
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in launch["kwargs"] and name not in launch["args"]:
            v = launch["kwargs"][name]
        else:
            v = launch["args"][name]
        if name in launch["kwargs"] or (fn.params[i].is_constexpr):
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return sig, consts, attrs


def sass_stats(cubin: bytes) -> dict:
    """Instruction count, registers, global loads/stores by width, whether there is a loop,
    and ``fast``: the instructions outside the basic blocks with an 8- or 16-bit global
    access, i.e. without the masked path of a tile at a tensor's end, in a kernel whose whole
    tiles have 128-bit accesses (the launch told the compiler their alignment); all of them in
    a kernel without (every tile runs the same code)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:  # cuobjdump reads a file
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    instr = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    instr = [(a, t) for a, t in instr if not t.startswith("NOP")]
    mem = Counter()
    loop = False
    starts = {instr[0][0]} if instr else set()
    for i, (addr, text) in enumerate(instr):
        m = re.search(r"\b(LDG|STG|LDL|STL)(\.E)?(\.[A-Z0-9.]+)?", text)  # LDL / STL: register spills
        if m:
            width = re.search(r"\.(128|64|U8|S8|U16|S16)\b", m.group(0))
            mem[f"{m.group(1)}.{width.group(1) if width else '32'}"] += 1
        b = re.search(r"\bBRA\s+(0x[0-9a-f]+)", text)
        if b:
            target = int(b.group(1), 16)
            loop |= target < addr
            starts.add(target)
        if (b or re.search(r"\bEXIT\b", text)) and i + 1 < len(instr):
            starts.add(instr[i + 1][0])
    masked, block = 0, []
    for addr, text in instr + [(-1, "")]:
        if addr in starts or addr == -1:
            if any(re.search(r"\b(LDG|STG)\.E\.(U8|S8|U16|S16)\b", t) for t in block):
                masked += len(block)
            block = []
        block.append(text)
    # a kernel without wide accesses has no separate whole-tile path: all of it runs per tile
    wide = any(re.search(r"\b(LDG|STG)\.E\.128\b", t) for _, t in instr)
    fast = len(instr) - (masked if wide else 0)
    return {"instr": len(instr), "fast": fast, "mem": dict(sorted(mem.items())), "loop": loop, "regs": int(regs.group(1)) if regs else -1}


def compile_launch(gpu_mod, name: str, launch: dict, arch: int, cvt: bool | None = None) -> dict:
    """SASS statistics of one recorded launch compiled for sm_`arch`; `cvt`: the CVT constexpr
    (the conversion instructions) where the kernel has one, by default as a GPU of `arch` gets
    it (the recording ran on CPU tensors, which never get it)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(gpu_mod, name)
    if "CVT" in launch["kwargs"]:
        launch = dict(launch, kwargs=dict(launch["kwargs"], CVT=arch >= 89 if cvt is None else cvt))
    if "ASM" in launch["kwargs"]:  # inline PTX, as on an NVIDIA GPU (the recording ran on CPU tensors)
        launch = dict(launch, kwargs=dict(launch["kwargs"], ASM=2 if getattr(gpu_mod, "NF4_CODE_ASM", False) else 1))
    sig, consts, attrs = _signature(fn, launch)
    opts = {k: v for k, v in launch["kwargs"].items() if k in ("enable_fp_fusion", "enable_reflect_ftz", "num_warps", "maxnreg")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    stats = sass_stats(k.asm["cubin"])
    programs = launch["grid"][0]
    threads = k.metadata.num_warps * 32
    per_prog = launch["numel"] / max(programs, 1)
    kw = launch["kwargs"]
    # per element of a program, or of a tile where the kernel loops over tiles (the loop's body
    # counted once, the program's fixed start with it)
    unit = (kw["BS"] * kw["NB"] if "NB" in kw else kw["BLOCK"]) if stats["loop"] else per_prog
    stats.update(programs=programs, per_program=per_prog, threads=threads, fast_per_element=stats["fast"] * threads / max(unit, 1))
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    ap.add_argument("--kernels", default=os.path.join(_ROOT, "kernels", "quant.py"), help="a kernels/quant.py to compile")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--work", choices=("all", "llama"), default="all")
    ap.add_argument("--cvt", choices=("auto", "on", "off"), default="auto",
                    help="the kernels' GPU conversion instructions (auto: as a GPU of --arch gets them, 8.9 and up)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a module constant of the kernels set first, e.g. NF4_CODE_ASM=True (a Python literal; repeatable)")
    ap.add_argument("--ops", nargs="*", metavar="OP", help="compile these ops' launches only (e.g. 'quantize nf4')")
    a = ap.parse_args()
    interp = load_kernels(a.kernels, interpret=True)
    gpu = load_kernels(a.kernels, interpret=False)
    for item in a.set:
        name, _, value = item.partition("=")
        if not hasattr(gpu, name):
            ap.error(f"argument --set: the kernels have no constant {name!r}")
        for mod in (interp, gpu):
            setattr(mod, name, ast.literal_eval(value))
    cvt = {"auto": None, "on": True, "off": False}[a.cvt]
    print(f"{a.kernels}: sm_{a.arch}, world size {WORLD_SIZE}, rank {RANK}, bf16 shards, conversion instructions {a.cvt}")
    out = []
    works = (("Llama-3-8B layer", LLAMA_LAYER), ("overhead block", OVERHEAD_BLOCK))
    for work_name, work in works[:1] if a.work == "llama" else works:
        print(f"\n{work_name}")
        print(f"{'op':38} {'kernel':20} {'programs':>8} {'elem/prog':>9} {'SASS':>5} {'whole tiles /elem':>17} {'regs':>4}  loop  loads / stores (LDG / STG global, LDL / STL spills)")
        for op, name, launch in record_launches(interp, work):
            if a.ops is not None and op not in a.ops:
                continue
            s = compile_launch(gpu, name, launch, a.arch, cvt)
            out.append(dict(s, work=work_name, op=op, kernel=name))
            fast = f"{s['fast_per_element']:.1f}" if s["fast"] else "-"
            print(f"{op:38} {name:20} {s['programs']:>8} {s['per_program']:>9.0f} {s['instr']:>5} {fast:>17} "
                  f"{s['regs']:>4}  {'yes' if s['loop'] else 'no ':4}  {s['mem']}")  # fmt: skip
    if a.json:
        import json

        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
