"""The data-parallel mesh of a unit: shard group, optional replicate group (HSDP), device."""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard


@dataclass
class MeshInfo:
    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    device: torch.device

    @property
    def placements(self) -> tuple:
        return (Shard(0),) if self.replicate_group is None else (Replicate(), Shard(0))


def default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard: torch.distributed is not initialized; call init_process_group first or pass 'mesh'")
    device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() != "gloo" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def mesh_info(mesh: DeviceMesh) -> MeshInfo:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: argument 'mesh' must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard: argument 'mesh' must be a 1-D (FSDP) or 2-D (HSDP: replicate, shard) DeviceMesh, "
            f"got a {mesh.ndim}-D mesh"
        )
    if mesh.device_type == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
    shard_group = mesh.get_group(mesh.ndim - 1)
    replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
    return MeshInfo(
        mesh=mesh,
        shard_group=shard_group,
        shard_size=mesh.size(mesh.ndim - 1),
        shard_rank=mesh.get_local_rank(mesh.ndim - 1),
        replicate_group=replicate_group,
        replicate_size=mesh.size(0) if mesh.ndim == 2 else 1,
        device=device,
    )


def post_forward_group(info: MeshInfo, size: int) -> tuple[dist.ProcessGroup, int]:
    """The group of `size` consecutive shard ranks this rank reshards to after forward (an int
    `reshard_after_forward`), and this rank's index in it. Every rank creates every group."""
    table = info.mesh.mesh.reshape(-1, size).tolist()
    mine = None
    me = dist.get_rank()
    for ranks in table:
        group = dist.new_group(ranks)
        if me in ranks:
            mine = (group, ranks.index(me))
    assert mine is not None
    return mine
