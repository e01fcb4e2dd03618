"""Loading of the compiled extension, with a clear message when it is missing or stale."""
import torch

_REBUILD = (
    "Rebuild it against the installed torch with `make build` "
    "(or `pip install --no-build-isolation -e .`) from the repository root."
)


def load_extension():
    try:
        from fsdp_native import _C
    except ImportError as e:
        raise ImportError(f"fsdp_native's compiled extension fsdp_native._C could not be loaded ({e}). {_REBUILD}") from e
    if _C.torch_version != torch.__version__:
        raise ImportError(
            f"fsdp_native._C was built against torch {_C.torch_version}, but torch "
            f"{torch.__version__} is installed. {_REBUILD}"
        )
    return _C
