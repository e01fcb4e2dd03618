"""Transformers 5's own FSDP2 path on fsdp_native: ``from_pretrained(path,
distributed_config=DistributedConfig(fsdp_size=...))`` shards the model while it loads (the
model's ``_fsdp_plan``: decoder layers, the embedding / final norm / output layer tail, the
root). A tiny Llama saved locally (no Hub) is loaded and trained on 2 CPU ranks once with
torch's ``fully_shard`` and once under ``fsdp_native.integrations.use_with_accelerate``, in
the same spawn: the loaded parameters, the losses and the trained parameters are bitwise
equal, with and without ``fsdp_mixed_precision``, with HSDP (``dp_replicate_size=2``) and
with tensor parallelism (``tp_size=2``, Transformers' own TP plan, with and without sequence
parallelism) on 4 ranks, and a tiny Qwen3-MoE with expert parallelism (``ep_size=2``) on 4.
``fsdp_cpu_offload=True`` (``CPUOffloadPolicy()``, whose pinned memory torch FSDP2 cannot
allocate without an accelerator) trains with torch FSDP2's numbers without offload. With a quantized all-gather the decoder layers gather fp8 and the other units full
precision."""
from __future__ import annotations

import contextlib
import os

import pytest

from dist_utils import _clear_dtensor_caches, ctx, full_params, run_distributed, run_grid
from test_hf_common import HF_PRELOAD, VOCAB, assert_same, check_impl, set_launcher_env, tiny_llama, token_batches, train_steps

pytest.importorskip("transformers.distributed.fsdp", reason="a Transformers with its own FSDP2 path (5.x)")


def _tiny_moe():
    """A Qwen3-MoE of the tiny Llama's size: 4 experts of which 2 per token, in both layers."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64, tie_word_embeddings=False,
        use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    return Qwen3MoeForCausalLM(cfg)


def _saved_model(kind: str = "llama") -> str:
    import torch.distributed as dist

    path = os.path.join(ctx().tmpdir, f"tiny-{kind}")
    if dist.get_rank() == 0 and not os.path.exists(path):
        (tiny_llama(0) if kind == "llama" else _tiny_moe()).save_pretrained(path)
    dist.barrier()
    return path


def _run(impl: str, mp: bool, steps: int = 3, all_gather=None, on_loaded=None, replicas: int = 1, tp: int = 1, **dc):
    """Load with distributed_config (``dc``: more of its fields), train ``steps`` AdamW steps;
    (loaded params, losses, params)."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    import fsdp_native.integrations as fi

    world = dist.get_world_size()
    path = _saved_model()
    # Each library's run from empty DTensor caches: on torch 2.9 and 2.10 the vocabulary-parallel
    # embedding's mask placement cached by the other library's run broke this one's (dist_utils).
    _clear_dtensor_caches()
    handle = fi.use_with_accelerate(cpu=True, all_gather=all_gather) if impl == "native" else contextlib.nullcontext()
    with handle:
        if tp > 1:
            dc.update(tp_size=tp)
        cfg = DistributedConfig(fsdp_size=world // replicas // tp, dp_replicate_size=replicas, fsdp_mixed_precision=mp, **dc)
        model = LlamaForCausalLM.from_pretrained(path, distributed_config=cfg)
        check_impl(model, impl)
        loaded = full_params(model)
        if on_loaded is not None:
            on_loaded(model)
        losses, params = train_steps(model, steps)
    return loaded, losses, params


def _parity(mp: bool, replicas: int = 1, tp: int = 1, offload: bool = False, **dc) -> None:
    """``offload``: fsdp_native with fsdp_cpu_offload=True against torch FSDP2 without."""
    import torch.distributed as dist

    meshes = []
    record = lambda model: meshes.append(  # noqa: E731
        [(n, tuple(p.device_mesh.shape), tuple(p.placements)) for n, p in model.named_parameters()]
    )
    ref = _run("torch", mp, replicas=replicas, tp=tp, on_loaded=record, **dc)
    got = _run("native", mp, replicas=replicas, tp=tp, on_loaded=record, fsdp_cpu_offload=offload, **dc)
    world = dist.get_world_size()
    want = (replicas, world // replicas) if replicas > 1 else (world // tp, tp) if tp > 1 else (world,)
    # TP: the Linears and embeddings on the 2-D mesh, the norms (no TP plan) on FSDP's dim only
    assert {m for _, m, _ in meshes[0]} == ({want, want[:1]} if tp > 1 else {want}), meshes[0]
    assert meshes[1] == meshes[0], (meshes[1], meshes[0])  # meshes and placements, parameter by parameter
    assert_same("loaded parameters", got[0], ref[0])
    assert_same("losses", got[1], ref[1])
    assert_same("trained parameters", got[2], ref[2])
    if not mp:  # the checkpoint's weights, as saved
        want = {k: v for k, v in tiny_llama(0).state_dict().items() if k in got[0]}
        assert_same("loaded vs saved", got[0], want)


def _expert_parallel() -> None:
    """Transformers' expert parallelism next to FSDP, 4 ranks: ``fsdp_size=4, ep_size=2`` with
    all-to-all token dispatch. The experts are sharded on the (ep 2, efsdp 2) mesh, with
    ``set_gradient_divide_factor(4)`` and ``set_force_sum_reduction_for_comms(True)``; the
    dense modules on FSDP's 4 ranks. Meshes and placements, loaded parameters, losses and
    trained parameters: torch FSDP2's, bit for bit."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import fsdp_native.integrations as fi

    path = _saved_model("moe")
    runs = []
    for impl in ("torch", "native"):
        handle = fi.use_with_accelerate(cpu=True) if impl == "native" else contextlib.nullcontext()
        with handle:
            cfg = DistributedConfig(fsdp_size=4, ep_size=2, ep_implementation="all_to_all")
            model = AutoModelForCausalLM.from_pretrained(path, distributed_config=cfg)
            check_impl(model, impl)
            layout = [(n, tuple(p.device_mesh.shape), tuple(p.placements)) for n, p in model.named_parameters()]
            loaded = full_params(model)
            runs.append((layout, loaded, *train_steps(model, 3)))
    (layout, *ref), (got_layout, *got) = runs
    assert {m for _, m, _ in layout} == {(2, 2), (4,)}, layout
    assert got_layout == layout, (got_layout, layout)
    for what, a, b in zip(("loaded parameters", "losses", "trained parameters"), got, ref):
        assert_same(what, a, b)


def _quantized() -> None:
    import torch

    import fsdp_native

    formats = {}

    def gathers(model):
        x = token_batches(1, bsz=2)[0]
        with torch.no_grad(), fsdp_native.record_trace() as rec:
            model(input_ids=x)
        formats.update({s.unit: s.args.get("format") for s in rec.spans if s.lane == "all_gather"})

    _, losses, _ = _run("native", False, all_gather=fsdp_native.QuantizedAllGather("fp8_rowwise", min_numel=256), on_loaded=gathers)
    layers = {u: f for u, f in formats.items() if ".layers." in u}
    assert layers and set(layers.values()) == {"fp8_rowwise"}, formats
    assert all(f is None for u, f in formats.items() if u not in layers), formats
    ref = _run("torch", False)[1]
    worst = max(abs(a.item() - b.item()) for a, b in zip(losses, ref))
    assert worst < 0.05, f"fp8 all-gather losses differ from torch's by {worst:.4f}"


def _grid():
    set_launcher_env()
    run_grid([dict(mp=False), dict(mp=True), dict(mp=True, offload=True)], _parity, name="from_pretrained(distributed_config)")
    run_grid([{}], _quantized, name="from_pretrained quantized all-gather")


def test_from_pretrained_distributed_config_parity_ws2():
    run_distributed(_grid, 2, timeout=400, preload=HF_PRELOAD)


def _grid_4_ranks():
    set_launcher_env()
    run_grid([dict(mp=True, replicas=2)], _parity, name="from_pretrained(distributed_config) HSDP 2x2")
    run_grid([dict(mp=True, tp=2), dict(mp=False, tp=2, enable_sequence_parallel=True)], _parity,
             name="from_pretrained(distributed_config) FSDP 2 x TP 2")  # fmt: skip
    run_grid([{}], _expert_parallel, name="from_pretrained(distributed_config) MoE, FSDP 4, EP 2")


def test_from_pretrained_distributed_config_4_ranks():
    """dp_replicate_size=2, fsdp_size=2: a 2-D mesh, reduce-scatter then all-reduce. tp_size=2,
    fsdp_size=2: Transformers' TP plan on the "tp" dim, FSDP on the other. A MoE with expert
    parallelism (ep_size=2)."""
    run_distributed(_grid_4_ranks, 4, timeout=400, preload=HF_PRELOAD)
