"""A faster TRITON_INTERPRET=1 for the tests: Triton's interpreter re-patches the whole
``triton.language`` namespace (``inspect.getmembers`` over tl, tl.tensor, tl.math, ...) at every
call of a ``@triton.jit`` helper from a kernel, though the kernel's launch has already patched
it with the same (global, stateless) builder. kernels/quant.py calls a dozen helpers a program,
so that re-patching was about a third of the interpreted Triton-vs-C++ run (93 -> 63 s).

``install()`` makes a helper's call skip the re-patch when the same modules were already
patched in the current launch; the launch itself patches and restores as before. What the
kernels compute is unchanged (the interpreted runs compare every op bit for bit with the C++
kernels). On a Triton whose interpreter lacks these internals it does nothing (the runs are
slower, not different). ``skipped`` counts the re-patches skipped, so a test can tell that it
took effect.
"""
from __future__ import annotations

skipped = 0
_installed = False


class _NoRestore:
    def restore(self) -> None:
        pass


def install() -> bool:
    """Installs the shim (once); whether this Triton's interpreter has what it patches."""
    global _installed
    if _installed:
        return True
    try:
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    patch_lang = getattr(interp, "_patch_lang", None)
    executor = getattr(interp, "GridExecutor", None)
    if patch_lang is None or executor is None:
        return False
    langs = (interp.tl, interp.tl.core)
    launch_call = executor.__call__
    patched: set[tuple[int, ...]] = set()  # the language modules patched in the current launch
    depth = [0]

    def _patch_lang(fn):
        global skipped
        key = tuple(sorted(id(v) for v in fn.__globals__.values() if interp.inspect.ismodule(v) and v in langs))
        if depth[0] and key in patched:
            skipped += 1
            return _NoRestore()
        patched.add(key)
        return patch_lang(fn)

    def _launch(self, *args, **kwargs):
        if depth[0] == 0:
            patched.clear()
        depth[0] += 1
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                patched.clear()

    interp._patch_lang = _patch_lang
    executor.__call__ = _launch
    _installed = True
    return True


def command(script: str, *args: str) -> list[str]:
    """The command line that runs ``python script args...`` with the shim installed first (run
    it with TRITON_INTERPRET=1; the script sees the same sys.argv and sys.path[0])."""
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        "import runpy, sys; "
        f"sys.path.insert(0, {here!r}); import triton_interpreter; triton_interpreter.install(); "
        f"script = {str(script)!r}; sys.argv = [script, *sys.argv[1:]]; sys.path[0] = __import__('os').path.dirname(script); "
        "runpy.run_path(script, run_name='__main__')"
    )
    return [sys.executable, "-c", code, *args]
