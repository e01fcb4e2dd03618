"""fsdp_native: a drop-in replacement for torch.distributed.fsdp.fully_shard (FSDP2)."""
from fsdp_native._load import load_extension as _load_extension

_C = _load_extension()

from fsdp_native import checkpoint, ops  # noqa: E402
from fsdp_native import quant  # noqa: E402,F401  (quantized all-gather formats)
from fsdp_native._api import (  # noqa: E402
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    QuantizedAllGather,
)
from fsdp_native._dtensor import ShardedDTensor  # noqa: E402
from fsdp_native._fully_shard import (  # noqa: E402
    FSDPModule,
    GradientReductionHandle,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from fsdp_native._timeline import plot_timeline  # noqa: E402
from fsdp_native._trace import Recorder, record_trace  # noqa: E402
from fsdp_native._stats import UnitStats, UnshardedStats, reset_unsharded_peak, unsharded_stats  # noqa: E402
from fsdp_native._wrap import shard_model  # noqa: E402

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "QuantizedAllGather",
    "Recorder",
    "ShardedDTensor",
    "UnitStats",
    "UnshardHandle",
    "UnshardedStats",
    "checkpoint",
    "fully_shard",
    "ops",
    "plot_timeline",
    "record_trace",
    "share_comm_ctx",
    "shard_model",
    "register_fsdp_forward_method",
    "reset_unsharded_peak",
    "unsharded_stats",
]
