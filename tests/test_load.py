"""Importing fsdp_native without a usable compiled extension says how to rebuild it, a build
that cannot import torch says how to build, and the source distribution holds what its build
needs."""
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

import fsdp_native
from fsdp_native._load import load_extension

ROOT = Path(__file__).resolve().parent.parent


def test_extension_records_the_torch_it_was_built_against():
    assert fsdp_native._C.torch_version == torch.__version__


def test_stale_extension_raises_import_error_with_rebuild_command(monkeypatch):
    monkeypatch.setattr(fsdp_native._C, "torch_version", "0.0.0")
    with pytest.raises(ImportError, match=r"built against torch 0\.0\.0, but torch .* is installed\. Rebuild it .*make build"):
        load_extension()


def test_missing_extension_raises_import_error_with_rebuild_command(monkeypatch):
    monkeypatch.delattr(fsdp_native, "_C")
    monkeypatch.setitem(sys.modules, "fsdp_native._C", None)
    with pytest.raises(ImportError, match=r"fsdp_native\._C could not be loaded .*make build"):
        load_extension()


def test_build_without_torch_says_to_turn_off_build_isolation():
    """pip's default isolated build cannot see the installed torch: setup.py stops with a message
    saying how to build instead (ModuleNotFoundError: No module named 'torch' before), and names
    the torch versions pyproject.toml requires."""
    blocked = "import sys, runpy; sys.modules['torch'] = None; sys.argv = ['setup.py', '--name']; runpy.run_path('setup.py')"
    r = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    spec = re.search(r'dependencies = \["torch([^"]*)"\]', (ROOT / "pyproject.toml").read_text()).group(1)
    assert r.stderr.startswith("fsdp_native build: torch cannot be imported here (import of torch halted"), r.stderr
    assert "pip's default build isolation hides it" in r.stderr, r.stderr
    assert "`pip install --no-build-isolation .`" in r.stderr, r.stderr
    assert f"after installing torch{spec} if it is not there." in r.stderr, (spec, r.stderr)


def test_sdist_holds_every_source_the_build_needs(tmp_path):
    """The source distribution (`setup.py sdist`; `python -m build` makes the same) holds every
    C++ / CUDA source and header and every Python file of the packages. Before 2026-12-07 it held
    the .cpp files setup.py lists and nothing else (no header; no .cu, which a CPU torch's build
    does not list), so installing it failed on `checks.h: No such file or directory`."""
    cmd = [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), "sdist", "--dist-dir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (sdist,) = tmp_path.glob("fsdp_native-*.tar.gz")
    with tarfile.open(sdist) as tar:
        held = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    sources = {".h", ".cuh", ".cu", ".cpp", ".py"}
    needed = {
        p.relative_to(ROOT).as_posix()
        for d in ("csrc", "kernels", "fsdp_native")
        for p in (ROOT / d).rglob("*")
        if p.is_file() and p.suffix in sources
    }
    assert {"csrc/checks.h", "csrc/cuda/packing_cuda.cu", "kernels/quant.py", "fsdp_native/_unit.py"} <= needed
    assert needed - held == set(), sorted(needed - held)
    assert {"setup.py", "pyproject.toml", "README.md"} <= held
