"""Build of fsdp_native and its extension fsdp_native._C.

Switches (environment): FORCE_CUDA=1 builds the CUDA kernels even when torch or nvcc
look CPU-only; TORCH_CUDA_ARCH_LIST (default "8.0;9.0"); MAX_JOBS (ninja's parallelism,
left alone when set); DEBUG=1 builds with -O0 -g. Build with --no-build-isolation: the
extension is compiled against the torch already installed.
"""
import glob
import os
import shutil
import site
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))


def log(msg: str) -> None:
    print(f"fsdp_native build: {msg}", file=sys.stderr)


def cuda_decision() -> tuple[bool, str]:
    if os.environ.get("FORCE_CUDA", "0") == "1":
        return True, "FORCE_CUDA=1"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU build"
    if CUDA_HOME is None or shutil.which("nvcc") is None and not os.path.exists(
        os.path.join(CUDA_HOME, "bin", "nvcc")
    ):
        return False, "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"
    return True, f"torch {torch.__version__} is a CUDA {torch.version.cuda} build and nvcc is at {CUDA_HOME}"


def wheel_cuda_dirs() -> tuple[list[str], list[str]]:
    """Headers and libraries shipped in torch's nvidia-* wheels (e.g. cusparse.h), which a
    bare nvcc toolkit may lack."""
    incs, libs = [], []
    for root in site.getsitepackages() + [site.getusersitepackages()]:
        for inc in glob.glob(os.path.join(root, "nvidia", "*", "include")):
            incs.append(inc)
        for lib in glob.glob(os.path.join(root, "nvidia", "*", "lib")):
            libs.append(lib)
    return sorted(set(incs)), sorted(set(libs))


def extension():
    with_cuda, why = cuda_decision()
    debug = os.environ.get("DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    macros = [("FSDPN_TORCH_VERSION", f'"{torch.__version__}"')]
    # No -std: torch's cpp_extension adds the standard its headers need (C++17 for torch 2.13,
    # C++20 for 2.14, whose headers use std::strong_ordering), for c++ and nvcc alike.
    cxx = opt + ["-fopenmp"]
    kwargs: dict = dict(define_macros=macros, extra_link_args=["-fopenmp"])
    if not with_cuda:
        log(f"building CPU kernels only; CUDA skipped because {why}")
        return CppExtension("fsdp_native._C", sources, extra_compile_args={"cxx": cxx}, **kwargs)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    incs, libs = wheel_cuda_dirs()
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    macros.append(("FSDPN_WITH_CUDA", "1"))
    log(
        f"building CPU and CUDA kernels ({why}); TORCH_CUDA_ARCH_LIST="
        f"{os.environ['TORCH_CUDA_ARCH_LIST']}; extra CUDA include dirs: {incs or 'none'}"
    )
    return CUDAExtension(
        "fsdp_native._C",
        sources,
        include_dirs=incs,
        library_dirs=libs,
        extra_compile_args={"cxx": cxx, "nvcc": opt},
        **kwargs,
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
