"""fsdp_native.shard_model: which modules become units for each policy, Hugging Face fsdp_config
parsing and its errors (single process), and bitwise parity with hand-written fully_shard calls
on 2 CPU ranks and HSDP 2x2 (a tiny Llama built from a LlamaConfig, no Hub; the HSDP grid runs
in test_hf_accelerate.py's 4-rank spawn)."""
from __future__ import annotations

import os

import pytest

from dist_utils import run_distributed, run_grid
from test_hf_common import assert_same, tiny_llama, train_steps

os.environ["HF_HUB_OFFLINE"] = "1"

LAYERS = {"model.layers.0", "model.layers.1"}
SIZE_ORDER = [
    "model.embed_tokens",
    "model.layers.0.self_attn",
    "model.layers.0.mlp",
    "model.layers.1.self_attn",
    "model.layers.1.mlp",
    "lm_head",
]
SIZE_3000 = set(SIZE_ORDER)


def _selected(model, policy=None, fsdp_config=None):
    from fsdp_native._wrap import FSDPConfig, _make_policy, parse_fsdp_config, select_units

    cfg = parse_fsdp_config(fsdp_config) if fsdp_config is not None else FSDPConfig()
    units = select_units(model, _make_policy(model, policy, cfg))
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(m)] for m in units]


# ---------------------------------------------------------------------------
# Which modules become units (no process group needed)
# ---------------------------------------------------------------------------
def test_transformer_layer_policies():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = tiny_llama()
    for policy in (LlamaDecoderLayer, "LlamaDecoderLayer", [LlamaDecoderLayer], ("LlamaDecoderLayer", LlamaDecoderLayer)):
        assert _selected(model, policy) == ["model.layers.0", "model.layers.1"], policy
    # None: the model's _no_split_modules (Hugging Face's default), as does TRANSFORMER_BASED_WRAP.
    assert _selected(model) == ["model.layers.0", "model.layers.1"]
    assert _selected(model, "TRANSFORMER_BASED_WRAP") == ["model.layers.0", "model.layers.1"]
    assert _selected(model, ["LlamaDecoderLayer", "LlamaRMSNorm"]) == [
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.0",
        "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm",
        "model.layers.1",
        "model.norm",
    ]


def test_size_policy_counts_params_not_in_a_unit_below():
    import torch.nn as nn

    model = tiny_llama()
    # Attention 3072 and MLP 6144 parameters per layer, 64 in its norms: a layer itself stays
    # below 3000 once its attention and MLP are units; LlamaModel keeps 160; ModuleList never.
    assert _selected(model, 3000) == SIZE_ORDER  # bottom-up, in registration order
    assert _selected(model, fsdp_config={"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 3000}) == _selected(
        model, 3000
    )
    # 100: every projection; the norms (32) are not, but LlamaModel's 160 left-over norm
    # parameters are: it becomes a unit, its already-wrapped children not counted again.
    sel = _selected(model, 100)
    assert "model" in sel and "model.layers" not in sel and "model.layers.0" not in sel
    assert "model.layers.0.self_attn.q_proj" in sel and "model.layers.0.input_layernorm" not in sel
    assert sel.index("model.layers.0.self_attn.q_proj") < sel.index("model")
    # Everything in one leaf: never the root, never a container, never a module without params.
    seq = nn.Sequential(nn.ModuleList([nn.Linear(4, 4), nn.ReLU()]), nn.ModuleDict({"a": nn.Linear(4, 4)}))
    assert _selected(seq, 1) == ["0.0", "1.a"]
    big = nn.Sequential(nn.Sequential(nn.Linear(10, 10)), nn.Linear(2, 2))
    assert _selected(big, 100) == ["0.0"]  # the inner Sequential has nothing left over
    # A parameter shared by two modules counts once, in the first unit that takes it.
    shared = nn.Linear(10, 10)
    tied = nn.Sequential(nn.Sequential(shared), nn.Sequential(shared))
    assert _selected(tied, 100) == ["0.0"]


def test_no_wrap_and_callable_policies():
    model = tiny_llama()
    assert _selected(model, "NO_WRAP") == []
    assert _selected(model, "no_wrap") == []
    assert _selected(model, fsdp_config={"auto_wrap_policy": "NO_WRAP"}) == []
    assert _selected(model, lambda m: type(m).__name__ == "LlamaMLP") == ["model.layers.0.mlp", "model.layers.1.mlp"]
    # A model without _no_split_modules and no policy is one unit.
    import torch.nn as nn

    assert _selected(nn.Sequential(nn.Linear(2, 2))) == []


def test_policy_errors():
    from fsdp_native import shard_model

    model = tiny_llama()
    with pytest.raises(ValueError, match=r"argument 'policy' names \['GPT2Block'\], which are not classes of modules in the model"):
        shard_model(model, "GPT2Block")
    with pytest.raises(TypeError, match=r"argument 'policy' is 2\.5 \(float\), expected None, 'NO_WRAP'"):
        shard_model(model, 2.5)
    with pytest.raises(ValueError, match=r"argument 'policy' is -1 \(min_num_params\), expected an int >= 0"):
        shard_model(model, -1)
    with pytest.raises(ValueError, match=r"argument 'policy' and fsdp_config's auto_wrap_policy"):
        shard_model(model, "LlamaDecoderLayer", fsdp_config={"auto_wrap_policy": "NO_WRAP"})
    with pytest.raises(ValueError, match=r"argument 'reshard_after_forward' \(False\) and fsdp_config\['reshard_after_forward'\] both given"):
        shard_model(model, reshard_after_forward=False, fsdp_config={"reshard_after_forward": True})
    with pytest.raises(ValueError, match=r"argument 'mp_policy' .* and fsdp_config's mixed precision both given"):
        shard_model(model, mp_policy=None, fsdp_config={"mixed_precision": "bf16"})
    with pytest.raises(TypeError, match="argument 'model' is a str, expected an nn.Module"):
        shard_model("model")
    import torch.nn as nn

    with pytest.raises(ValueError, match=r"TRANSFORMER_BASED_WRAP' without transformer_layer_cls_to_wrap, and the model \(Sequential\) has no _no_split_modules"):
        shard_model(nn.Sequential(nn.Linear(2, 2)), fsdp_config={"auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
    # Nothing was changed by the failed calls.
    assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())


# ---------------------------------------------------------------------------
# fsdp_config parsing
# ---------------------------------------------------------------------------
# The fsdp_config of the Hugging Face FSDP2 docs (hf-transformers-fsdp2.md).
HF_DOCS_CONFIG = {
    "version": 2,
    "reshard_after_forward": True,
    "cpu_offload": False,
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
    "state_dict_type": "FULL_STATE_DICT",
    "cpu_ram_efficient_loading": True,
    "activation_checkpointing": True,
}


def test_parse_hf_docs_config():
    from fsdp_native._wrap import FSDPConfig, parse_fsdp_config

    assert parse_fsdp_config(HF_DOCS_CONFIG) == FSDPConfig(
        auto_wrap_policy="TRANSFORMER_BASED_WRAP",
        transformer_layer_cls_to_wrap=("LlamaDecoderLayer",),
        reshard_after_forward=True,
        offload_params=False,
        activation_checkpointing=True,
        cpu_ram_efficient_loading=True,
        state_dict_type="FULL_STATE_DICT",
    )
    # Accelerate's spellings (its config file), strings for booleans, a comma-separated list.
    acc = {
        "fsdp_version": "2",
        "fsdp_auto_wrap_policy": "transformer_based_wrap",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer,LlamaRMSNorm",
        "fsdp_reshard_after_forward": "false",
        "fsdp_offload_params": "true",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": "false",
        "fsdp_activation_checkpointing": "no",
        "fsdp_min_num_params": 0,
        "mixed_precision": "bf16",
        "xla": False,
    }
    import torch

    from fsdp_native import MixedPrecisionPolicy

    assert parse_fsdp_config(acc) == FSDPConfig(
        auto_wrap_policy="TRANSFORMER_BASED_WRAP",
        transformer_layer_cls_to_wrap=("LlamaDecoderLayer", "LlamaRMSNorm"),
        min_num_params=0,
        reshard_after_forward=False,
        offload_params=True,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16),
        mixed_precision_given=True,
        activation_checkpointing=False,
        cpu_ram_efficient_loading=False,
        state_dict_type="SHARDED_STATE_DICT",
    )
    p = parse_fsdp_config({"mixed_precision_policy": {"param_dtype": "bfloat16", "reduce_dtype": torch.float32}})
    assert p.mp_policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert parse_fsdp_config({"mixed_precision": "no"}).mp_policy is None


def test_unknown_key_error_text():
    from fsdp_native._wrap import parse_fsdp_config

    with pytest.raises(ValueError) as e:
        parse_fsdp_config({"reshard_after_forward": True, "fsdp_sharding_strategy": 1, "wrap_layers": "x"})
    assert str(e.value) == (
        "shard_model: fsdp_config has unknown key(s) ['sharding_strategy', 'wrap_layers']; "
        "['sharding_strategy'] are FSDP1 options that FSDP2 does not have. Known keys (each may also be "
        "spelled with the 'fsdp_' prefix): activation_checkpointing, auto_wrap_policy, cpu_offload, "
        "cpu_ram_efficient_loading, min_num_params, mixed_precision, mixed_precision_policy, offload_params, "
        "reshard_after_forward, state_dict_type, transformer_layer_cls_to_wrap, version, xla, "
        "xla_fsdp_grad_ckpt, xla_fsdp_v2"
    )
    with pytest.raises(ValueError) as e:
        parse_fsdp_config({"foo": 1})
    assert str(e.value).startswith("shard_model: fsdp_config has unknown key(s) ['foo']. Known keys")


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"auto_wrap_policy": "LAYER_WRAP"}, "fsdp_config['auto_wrap_policy'] is 'LAYER_WRAP', expected one of ['TRANSFORMER_BASED_WRAP', 'SIZE_BASED_WRAP', 'NO_WRAP']"),
        ({"reshard_after_forward": "maybe"}, "fsdp_config['reshard_after_forward'] is 'maybe', expected a bool or one of 'true' / 'false'"),
        ({"min_num_params": -5}, "fsdp_config['min_num_params'] is -5, expected an int >= 0"),
        ({"min_num_params": "1e6"}, "fsdp_config['min_num_params'] is '1e6', expected an int >= 0"),
        ({"version": 1}, "fsdp_config['version'] is 1, expected 2 (fsdp_native implements FSDP2)"),
        ({"state_dict_type": "LOCAL_STATE_DICT"}, "fsdp_config['state_dict_type'] is 'LOCAL_STATE_DICT', expected one of ['FULL_STATE_DICT', 'SHARDED_STATE_DICT']"),
        ({"mixed_precision": "int8"}, "fsdp_config['mixed_precision'] is 'int8', expected one of ['no', 'fp32', 'bf16', 'fp16']"),
        ({"mixed_precision_policy": {"param_dtype": "half-ish"}}, "fsdp_config['mixed_precision_policy']['param_dtype'] is 'half-ish', expected a torch.dtype, None or one of"),
        ({"mixed_precision_policy": {"buffer_dtype": "bf16"}}, "fsdp_config['mixed_precision_policy'] has unknown key(s) ['buffer_dtype']"),
        ({"transformer_layer_cls_to_wrap": []}, "fsdp_config['transformer_layer_cls_to_wrap'] is [], expected a class name"),
        ({"cpu_offload": True, "fsdp_offload_params": False}, "fsdp_config gives cpu_offload and offload_params different values"),
        ({"activation_checkpointing": True, "fsdp_activation_checkpointing": True}, "fsdp_config gives 'activation_checkpointing' twice"),
        ({"xla": True}, "fsdp_config['xla'] is True, expected false"),
        ({"mixed_precision": "bf16", "mixed_precision_policy": "bf16"}, "gives both 'mixed_precision' and 'mixed_precision_policy'"),
    ],
)
def test_config_value_errors(cfg, message):
    from fsdp_native._wrap import parse_fsdp_config

    with pytest.raises(ValueError) as e:
        parse_fsdp_config(cfg)
    assert message in str(e.value)
    assert str(e.value).startswith("shard_model: ")


# ---------------------------------------------------------------------------
# Sharding: bitwise parity with hand-written fully_shard calls
# ---------------------------------------------------------------------------
def _units(model):
    import fsdp_native

    return {n for n, m in model.named_modules() if isinstance(m, fsdp_native.FSDPModule)}


def _by_hand(model, fqns, *, mesh=None, raf=None, mp=None, offload=None, ac=False):
    """fully_shard on ``fqns`` in that order, then the root: what shard_model should do."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fsdp_native import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kw = dict(mesh=mesh, mp_policy=mp or MixedPrecisionPolicy(), offload_policy=offload or OffloadPolicy())
    for fqn in fqns:
        m = model.get_submodule(fqn)
        if ac:
            m = checkpoint_wrapper(m)
            model.set_submodule(fqn, m)
        fully_shard(m, reshard_after_forward=raf, **kw)
    fully_shard(model, **kw)
    return model


def _mesh(hsdp):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:
        return init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _parity(case, hsdp=False):
    import torch
    import torch.distributed as dist

    from fsdp_native import CPUOffloadPolicy, MixedPrecisionPolicy, shard_model

    mesh = _mesh(hsdp)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16)
    layers = ["model.layers.0", "model.layers.1"]
    if case == "classes":
        got = shard_model(tiny_llama(), "LlamaDecoderLayer", mesh=mesh)
        ref, units = _by_hand(tiny_llama(), layers, mesh=mesh), LAYERS
    elif case == "size":
        got = shard_model(tiny_llama(), 3000, mesh=mesh, reshard_after_forward=False)
        ref, units = _by_hand(tiny_llama(), SIZE_ORDER, mesh=mesh, raf=False), SIZE_3000
    elif case == "no_wrap":
        got = shard_model(tiny_llama(), "NO_WRAP", mesh=mesh)
        ref, units = _by_hand(tiny_llama(), [], mesh=mesh), set()
    elif case == "hf_config_bf16":
        cfg = {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}
        got = shard_model(tiny_llama(), mesh=mesh, fsdp_config={**cfg, "mixed_precision": "bf16", "fsdp_reshard_after_forward": "false"})
        ref, units = _by_hand(tiny_llama(), layers, mesh=mesh, mp=bf16, raf=False), LAYERS
    elif case == "hf_docs_config":  # activation checkpointing and cpu_ram_efficient_loading
        got = shard_model(tiny_llama(seed=dist.get_rank()), mesh=mesh, fsdp_config=HF_DOCS_CONFIG)
        ref = _by_hand(tiny_llama(), layers, mesh=mesh, raf=True, ac=True)
        units = LAYERS  # the checkpoint wrappers, which took the layers' places
    elif case == "offload":
        got = shard_model(tiny_llama(), mesh=mesh, fsdp_config={"cpu_offload": True, "min_num_params": 3000})
        ref = _by_hand(tiny_llama(), SIZE_ORDER, mesh=mesh, offload=CPUOffloadPolicy())
        units = SIZE_3000
    elif case == "already_sharded":  # a unit made by hand first is kept, not sharded again
        from fsdp_native import fully_shard

        model = tiny_llama()
        fully_shard(model.model.layers[1], mesh=mesh)
        got = shard_model(model, "LlamaDecoderLayer", mesh=mesh)
        ref, units = _by_hand(tiny_llama(), ["model.layers.1", "model.layers.0"], mesh=mesh), LAYERS
    else:
        raise AssertionError(case)
    assert _units(got) == units | {""}, f"units {sorted(_units(got))}, expected {sorted(units | {''})}"
    assert _units(ref) == _units(got)
    if hsdp:
        p = next(got.parameters())
        assert p.device_mesh.ndim == 2, p.device_mesh
    got_losses, got_params = train_steps(got)
    ref_losses, ref_params = train_steps(ref)
    assert_same("losses", got_losses, ref_losses)
    assert_same("parameters", got_params, ref_params)
    if case == "hf_docs_config":
        # Rank 0's weights everywhere (rank 1 built its model from another seed), buffers too.
        for (n, b), (_, rb) in zip(got.named_buffers(), ref.named_buffers()):
            assert torch.equal(b, rb), n


def _grid_ws2():
    cases = ["classes", "size", "no_wrap", "hf_config_bf16", "hf_docs_config", "offload", "already_sharded"]
    run_grid([dict(case=c) for c in cases], _parity, name="shard_model")


def test_shard_model_parity_ws2():
    run_distributed(_grid_ws2, 2, timeout=300)


def hsdp_grid():
    """Run by tests/test_hf_accelerate.py's 4-rank spawn (one spawn for all HSDP 2x2 checks)."""
    run_grid([dict(case="classes", hsdp=True), dict(case="hf_docs_config", hsdp=True)], _parity, name="shard_model HSDP")
