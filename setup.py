"""Build of fsdp_native and its extension fsdp_native._C.

Switches (environment): FORCE_CUDA=1 builds the CUDA kernels even when torch or nvcc
look CPU-only, FORCE_CUDA=0 the CPU kernels only; CUDA_HOME (default: the toolkit of the nvcc
on PATH, as nvcc reports it); TORCH_CUDA_ARCH_LIST (default "8.0;9.0"); MAX_JOBS (ninja's
parallelism, left alone when set); DEBUG=1 builds with -O0 -g. Build with --no-build-isolation: the
extension is compiled against the torch already installed.
"""
import glob
import os
import site
import subprocess
import sys

from setuptools import setup

try:
    import torch
except ModuleNotFoundError as e:
    # pip's default isolated build environment has the build requirements only, and torch is
    # deliberately not one (pyproject.toml): fetching a torch there would build the extension
    # against a torch other than the one it will run with.
    raise SystemExit(
        f"fsdp_native build: torch cannot be imported here ({e}). fsdp_native's extension is compiled "
        "against the torch already installed, and pip's default build isolation hides it (its build "
        "environment holds only the build requirements; torch is deliberately not one). Build in your "
        "environment instead: `pip install --no-build-isolation .` (editable: `pip install "
        "--no-build-isolation -e .`; uv: `uv pip install --no-build-isolation .`), after installing "
        "torch>=2.9,<2.16 if it is not there."
    ) from e

HERE = os.path.dirname(os.path.abspath(__file__))


def nvcc_toolkit() -> str | None:
    """The toolkit of the nvcc on PATH: the parent of the bin directory nvcc itself reports
    (`#$ _HERE_=...` in --dryrun). torch guesses nvcc's grandparent, wrong for a wrapper script
    such as /usr/local/bin/nvcc."""
    try:
        out = subprocess.run(["nvcc", "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    here = [l.split("=", 1)[1].strip() for l in (out.stdout + out.stderr).splitlines() if l.startswith("#$ _HERE_=")]
    return os.path.dirname(os.path.realpath(here[0])) if here else None


# torch.utils.cpp_extension reads CUDA_HOME when imported: settle it first.
if (torch.version.cuda or os.environ.get("FORCE_CUDA") == "1") and not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
    if home := nvcc_toolkit():
        os.environ["CUDA_HOME"] = home
import torch.utils.cpp_extension as cpp_ext  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

if os.environ.get("CUDA_HOME"):
    cpp_ext.CUDA_HOME = os.environ["CUDA_HOME"]  # in case torch imported it already
CUDA_HOME = cpp_ext.CUDA_HOME


def log(msg: str) -> None:
    print(f"fsdp_native build: {msg}", file=sys.stderr)


def cuda_decision() -> tuple[bool, str]:
    force = os.environ.get("FORCE_CUDA", "")
    if force in ("0", "1"):
        return force == "1", f"FORCE_CUDA={force}"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU build"
    if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return False, f"nvcc was not found (CUDA_HOME={CUDA_HOME}; set CUDA_HOME or put nvcc on PATH)"
    return True, f"torch {torch.__version__} is a CUDA {torch.version.cuda} build and nvcc is at {CUDA_HOME}"


def wheel_cuda_dirs() -> tuple[list[str], list[str]]:
    """Headers and libraries shipped in torch's nvidia-* wheels (e.g. cusparse.h), which a
    bare nvcc toolkit may lack. The headers are searched after the toolkit's own (-idirafter):
    the wheels' CUDA can be newer than nvcc's (torch 2.15: 13.2, nvcc 13.0), and nvcc refuses
    runtime headers of another version."""
    incs, libs = [], []
    for root in site.getsitepackages() + [site.getusersitepackages()]:
        incs += glob.glob(os.path.join(root, "nvidia", "*", "include"))
        libs += glob.glob(os.path.join(root, "nvidia", "*", "lib"))
    return sorted(set(incs)), sorted(set(libs))


def cudart_dir(wheel_libs: list[str]) -> list[str]:
    """torch links -lcudart from CUDA_HOME/lib64 (or lib). A toolkit without libcudart.so gets
    a directory linking it to the versioned libcudart.so.N of torch's nvidia wheels, which
    torch loads at run time anyway."""
    if CUDA_HOME and any(os.path.exists(os.path.join(CUDA_HOME, d, "libcudart.so")) for d in ("lib64", "lib")):
        return []
    found = sorted(f for d in wheel_libs for f in glob.glob(os.path.join(d, "libcudart.so.[0-9]*")))
    if not found:
        return []
    link_dir = os.path.join(HERE, "build", "cudart")
    os.makedirs(link_dir, exist_ok=True)
    link = os.path.join(link_dir, "libcudart.so")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(found[-1], link)
    return [link_dir]


def torch_libstdcxx() -> list[str]:
    """The shared libstdc++ this process runs torch with, as a link input of the extension.
    A compiler that links libstdc++ statically (seen on a GPU image whose CXX is a GCC of its
    own that has only libstdc++.a) puts a second libstdc++ in the process, whose locale is
    never set up: every number in an error message came out empty, or crashed the process
    with a segmentation fault. Listed ahead of the compiler's own libstdc++, the shared
    one defines every symbol the extension needs, so nothing comes from a static copy."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libstdc++.so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.isfile(p))[:1]


def extension():
    with_cuda, why = cuda_decision()
    debug = os.environ.get("DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    macros = [("FSDPN_TORCH_VERSION", f'"{torch.__version__}"')]
    # No -std: torch's cpp_extension adds the standard its headers need (C++17 for torch 2.13,
    # C++20 for 2.14, whose headers use std::strong_ordering), for c++ and nvcc alike.
    cxx = opt + ["-fopenmp"]
    kwargs: dict = dict(define_macros=macros, extra_link_args=["-fopenmp"] + torch_libstdcxx())
    if not with_cuda:
        log(f"building CPU kernels only; CUDA skipped because {why}")
        return CppExtension("fsdp_native._C", sources, extra_compile_args={"cxx": cxx}, **kwargs)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    incs, libs = wheel_cuda_dirs()
    libs = cudart_dir(libs) + libs
    after = [f"-idirafter{d}" for d in incs]
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    macros.append(("FSDPN_WITH_CUDA", "1"))
    log(
        f"building CPU and CUDA kernels ({why}); TORCH_CUDA_ARCH_LIST="
        f"{os.environ['TORCH_CUDA_ARCH_LIST']}; fallback CUDA include dirs: {incs or 'none'}"
    )
    return CUDAExtension(
        "fsdp_native._C",
        sources,
        library_dirs=libs,
        extra_compile_args={"cxx": cxx + after, "nvcc": opt + [f"-Xcompiler={a}" for a in after]},
        **kwargs,
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
