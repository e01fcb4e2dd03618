"""Triton kernels of fsdp_native (installed as ``fsdp_native.kernels``)."""

if __name__ == "kernels":
    # Imported under the top-level name ``kernels``: a source checkout's root is on sys.path
    # (``python -m pytest`` or ``python -c`` run there), and this folder would hide Hugging
    # Face's ``kernels`` package, which transformers 5.25 requires and imports
    # (``transformers.trainer`` then failed on "cannot import name 'CUDAProperties' from
    # 'kernels'"). The name belongs to that package: load whatever the rest of sys.path
    # provides under it in this module's place, or fail as if the checkout were not there.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    def _other_kernels() -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
        spec = importlib.machinery.PathFinder.find_spec("kernels", path)
        if spec is None or spec.loader is None:
            raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
        module = importlib.util.module_from_spec(spec)
        # The import statement returns what sys.modules holds after this file ran (and drops
        # the name if this raises).
        sys.modules["kernels"] = module
        spec.loader.exec_module(module)

    _other_kernels()
