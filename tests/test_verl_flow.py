"""veRL's FSDP2 setup (its ``fsdp_workers`` and ``fsdp_utils``), with fsdp_native in place of
torch FSDP2, against torch FSDP2 on 2 gloo ranks:

* the model built on rank 0 only, on the meta device elsewhere, and its full state dict taken
  before sharding;
* ``fully_shard`` of each block and the root with veRL's ``fsdp_kwargs``: ``offload_policy`` None
  (the roles it does not offload) or ``CPUOffloadPolicy``, bf16 compute with fp32 reduction
  and ``cast_forward_inputs``, and its ``shard_placement_fn`` (the first dim that divides by
  the shard size: dim 1 for the 63-row embedding and output);
* ``fsdp2_load_full_state_dict``: ``model.to(device)`` on rank 0, ``to_empty`` elsewhere,
  ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``, buffers
  broadcast;
* its gradient clipping (``_get_total_norm`` + ``_clip_grads_with_norm_``), and the model moved
  off and back between steps (``model.cpu()``, ``model.to(device)``).

Losses, gradient norms, placements and the full state dict after 3 steps: bit for bit.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.utils.clip_grad import _clip_grads_with_norm_, _get_total_norm

from dist_utils import assert_close, load_impl, ref_impl, run_distributed, run_grid
from models import ModelArgs, Transformer

EXACT = dict(rtol=0, atol=0)
ARGS = ModelArgs(n_layers=2, dim=32, vocab_size=63, max_seq_len=16, n_heads=4)


def _shard_placement_fn(fsdp_size: int):
    def fn(param):
        for i, s in enumerate(param.shape):
            if s % fsdp_size == 0:
                return Shard(i)
        return Shard(0)

    return fn


def _train(impl, offload: bool) -> dict:
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("fsdp",))
    torch.manual_seed(0)
    if dist.get_rank() == 0:
        model = Transformer(ARGS)
    else:
        with torch.device("meta"):
            model = Transformer(ARGS)
    full_state = model.state_dict()
    mp = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    fsdp_kwargs = {
        "mesh": mesh,
        "mp_policy": mp,
        "offload_policy": impl.CPUOffloadPolicy(pin_memory=False) if offload else None,
        "reshard_after_forward": True,
        "shard_placement_fn": _shard_placement_fn(ws),
    }
    for layer in model.layers:
        impl.fully_shard(layer, **fsdp_kwargs)
    impl.fully_shard(model, **fsdp_kwargs)
    if dist.get_rank() == 0:
        model = model.to(device="cpu", non_blocking=True)
    else:
        model = model.to_empty(device="cpu")
    opts = StateDictOptions(full_state_dict=True, cpu_offload=offload, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state, options=opts)
    for buf in model.buffers():
        dist.broadcast(buf, src=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses, norms = [], []
    for _ in range(3):
        x = torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), generator=gen)
        loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        total = _get_total_norm([p.grad for p in model.parameters() if p.grad is not None], 2.0, False, None)
        _clip_grads_with_norm_(list(model.parameters()), 1.0, total, None)
        opt.step()
        opt.zero_grad()
        model.cpu()  # veRL's offload_fsdp2_model_to_cpu, then load_fsdp2_model_to_gpu
        model.to("cpu")
        losses.append(loss.item())
        norms.append(float(total.full_tensor() if isinstance(total, DTensor) else total))
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
    return dict(losses=losses, norms=norms, state=state, placements=placements)


def _check(offload: bool) -> None:
    impl = load_impl()
    ref, got = _train(ref_impl(), offload), _train(impl, offload)
    tag = f"[{impl.name} vs torch, veRL flow, offload={offload}]"
    assert_close(f"{tag} losses", got["losses"], ref["losses"], EXACT)
    assert_close(f"{tag} grad norms", got["norms"], ref["norms"], EXACT)
    assert got["placements"] == ref["placements"], (got["placements"], ref["placements"])
    assert ref["placements"]["tok_embeddings.weight"] == (Shard(1),), ref["placements"]
    for k, v in ref["state"].items():
        assert_close(f"{tag} {k}", got["state"][k], v, EXACT)


def _grid() -> None:
    run_grid([dict(offload=False), dict(offload=True)], _check, name="verl")


def test_verl_fsdp2_flow_matches_torch():
    run_distributed(_grid, 2)
