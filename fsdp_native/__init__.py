"""fsdp_native: a drop-in replacement for torch.distributed.fsdp.fully_shard (FSDP2)."""
from fsdp_native._load import load_extension as _load_extension

_C = _load_extension()

from fsdp_native import ops  # noqa: E402

__all__ = ["ops"]
