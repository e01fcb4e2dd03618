"""Accelerate's FSDP2 path on fsdp_native vs on torch FSDP2: a tiny Llama (built from a
LlamaConfig, no Hub) trained through ``Accelerator.prepare`` on 2 CPU ranks (and HSDP 2x2 on 4),
once with torch's fully_shard and once with fsdp_native's (fsdp_native.integrations), in the
same spawn; losses and parameters must be bitwise equal. Checkpoints (save_state/load_state,
sharded and full) move between the two libraries both ways, and the exports a script ends with
are torch's bit for bit: ``get_state_dict``, ``save_model`` (safetensors) and
``merge_fsdp_weights`` of a sharded checkpoint. With ``mixed_precision="fp8"`` (torchao Float8
through ``AORecipeKwargs``, fp8 all-gathers) the runs match too."""
from __future__ import annotations

import os
import re

from dist_utils import ctx, full_params, grid, run_distributed, run_grid
from test_hf_common import (
    HF_PRELOAD,
    assert_same,
    check_impl,
    impl_handle,
    reset_accelerate,
    set_launcher_env,
    tiny_llama,
    token_batches,
)

LR = 1e-2


def accelerate_run(
    impl,
    *,
    mp="no",
    ga=1,
    ac=False,
    cpu_ram=False,
    steps=3,
    start=0,
    state_dict_type="SHARDED_STATE_DICT",
    save_after=None,
    save_dir=None,
    load_dir=None,
    hsdp=False,
    all_gather=None,
    on_prepared=None,
    on_trained=None,
    model_dtype=None,
):
    """Train ``steps`` optimizer steps (from step ``start``); returns (losses, full params).
    ``on_prepared(model, batch)`` runs right after ``Accelerator.prepare``, ``on_trained(acc,
    model)`` after the last step."""
    import torch
    import torch.distributed as dist

    reset_accelerate()
    rank, world = dist.get_rank(), dist.get_world_size()
    with impl_handle(impl, all_gather):
        from accelerate import Accelerator, FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            reshard_after_forward=True,
            state_dict_type=state_dict_type,
            activation_checkpointing=ac,
            cpu_ram_efficient_loading=cpu_ram,
        )
        kwargs = {}
        if hsdp:
            from accelerate import ParallelismConfig

            kwargs["parallelism_config"] = ParallelismConfig(dp_replicate_size=2, dp_shard_size=world // 2)
        if mp == "fp8":  # torchao Float8 training with fp8 all-gathers (Accelerate converts the Linears)
            from accelerate.utils import AORecipeKwargs
            from torchao.float8 import Float8LinearConfig

            kwargs["kwargs_handlers"] = [AORecipeKwargs(config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))]
        acc = Accelerator(fsdp_plugin=plugin, mixed_precision=mp, gradient_accumulation_steps=ga, **kwargs)
        assert acc.is_fsdp2 and acc.device.type == "cpu", (acc.distributed_type, acc.device)
        # With cpu_ram_efficient_loading only rank 0's weights count: the others start different.
        model = tiny_llama(seed=rank if cpu_ram else 0)
        if model_dtype is not None:  # loaded in bf16 (torch_dtype=torch.bfloat16): Accelerate upcasts it
            model.to(getattr(torch, model_dtype))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        model, opt = acc.prepare(model, opt)
        check_impl(model, impl)
        if mp == "fp8":
            # Accelerate leaves the first and last Linear in high precision: layer 0's unit holds
            # a plain q_proj before its Float8 weights and norms after them.
            kinds = [type(p.to_local()).__name__ for p in model.model.layers[0].parameters()]
            assert kinds[:2] == ["Tensor", "WeightWithDynamicFloat8CastTensor"] and kinds[-1] == "Tensor", kinds
        if on_prepared is not None:
            on_prepared(model, token_batches(1, bsz=2)[0])
        if hsdp:
            mesh = next(model.parameters()).device_mesh
            assert mesh.ndim == 2 and tuple(mesh.shape) == (2, world // 2), mesh
        if load_dir is not None:
            acc.load_state(load_dir)
        data = token_batches((start + steps) * ga, bsz=2 * world)
        losses = []
        for i in range(start * ga, (start + steps) * ga):
            x = data[i][2 * rank : 2 * rank + 2]
            with acc.accumulate(model):
                out = model(input_ids=x, labels=x)
                acc.backward(out.loss)
                opt.step()
                opt.zero_grad()
            losses.append(out.loss.detach().float().clone())
            if save_dir is not None and i + 1 == save_after * ga:
                acc.save_state(save_dir)
        if on_trained is not None:
            on_trained(acc, model)
        params = full_params(model)
        acc.free_memory()
    return losses, params


def _parity(**cfg):
    ref = accelerate_run("torch", **cfg)
    got = accelerate_run("native", **cfg)
    assert_same("losses", got[0], ref[0])
    assert_same("parameters", got[1], ref[1])
    if cfg.get("cpu_ram"):
        # Rank 0's initial weights were used everywhere: rank 1 started from another seed.
        import torch.distributed as dist

        init = accelerate_run("torch", steps=0, cpu_ram=True)[1]
        if dist.get_rank() == 0:
            assert_same("initial parameters", init, {k: v for k, v in tiny_llama(0).state_dict().items() if k in init})


def _train_grid():
    set_launcher_env()
    configs = [
        dict(mp="no"),
        dict(mp="bf16"),
        dict(mp="bf16", ga=2),
        dict(mp="bf16", model_dtype="bfloat16"),
        dict(mp="no", ac=True),
        dict(mp="no", cpu_ram=True),
        dict(mp="fp8"),
    ]
    run_grid(configs, _parity, name="accelerate")




def _gathers(model, x) -> dict:
    """{unit: (quantized format or None, bytes)} of the all-gathers of one no-grad forward."""
    import torch

    import fsdp_native

    with torch.no_grad(), fsdp_native.record_trace() as rec:
        model(input_ids=x)
    return {s.unit: (s.args.get("format"), s.nbytes) for s in rec.spans if s.lane == "all_gather"}


def _quantized(fmt: str) -> None:
    """use_with_accelerate(all_gather=QuantizedAllGather(fmt)): the decoder layers' units gather
    quantized bytes (at most 0.32x their fp32 bytes: fp8 codes are 0.25x, one fp32 scale per
    32-element row 0.03x, the norms travel in fp32), the embedding and tail (final norm, output
    layer) units full precision; training follows the unquantized run's losses."""
    import fsdp_native

    seen = {}
    ref = accelerate_run("native", steps=4, on_prepared=lambda m, x: seen.update(plain=_gathers(m, x)))
    got = accelerate_run(
        "native", steps=4, all_gather=fsdp_native.QuantizedAllGather(fmt, min_numel=256), on_prepared=lambda m, x: seen.update(q=_gathers(m, x))
    )
    layers = {u: v for u, v in seen["q"].items() if ".layers." in u}
    assert layers and all(f == fmt for f, _ in layers.values()), seen["q"]
    assert all(f is None for u, (f, _) in seen["q"].items() if u not in layers), seen["q"]
    for u, (_, nbytes) in layers.items():
        assert nbytes <= 0.32 * seen["plain"][u][1], (u, nbytes, seen["plain"][u][1])
    worst = max(abs(a.item() - b.item()) for a, b in zip(got[0], ref[0]))
    assert worst < 0.05, f"{fmt}: losses differ from the unquantized run's by {worst:.4f}: {got[0]} vs {ref[0]}"


def _exporter(into: dict, out_dir: str):
    """on_trained for accelerate_run: the trained model as a script exports it at the end,
    ``Accelerator.get_state_dict`` (rank 0's full state dict) and ``Accelerator.save_model``
    (safetensors, read back on rank 0), into ``into``."""

    def export(acc, model):
        import torch.distributed as dist
        from safetensors.torch import load_file

        state = acc.get_state_dict(model)
        acc.save_model(model, out_dir)
        acc.wait_for_everyone()
        if dist.get_rank() == 0:
            into["get_state_dict"] = {k: v.clone() for k, v in state.items()}
            into["save_model"] = load_file(os.path.join(out_dir, "model.safetensors"))
            assert into["get_state_dict"].keys() == into["save_model"].keys() and len(state) == 21, sorted(state)

    return export


def _merge_fsdp_weights(checkpoints: dict[str, str]) -> dict:
    """Accelerate's ``merge_fsdp_weights`` (``accelerate merge-weights``) of each sharded model
    checkpoint, run as that CLI runs: a process of its own, no process group. {impl: merged
    safetensors, read back}."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    code = "from accelerate.utils import merge_fsdp_weights\n" + "".join(
        f"merge_fsdp_weights({src!r}, {src + '-merged'!r}, safe_serialization=True)\n" for src in checkpoints.values()
    )
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return {impl: load_file(os.path.join(src + "-merged", "model.safetensors")) for impl, src in checkpoints.items()}


def _checkpoint(state_dict_type):
    """Save with one library after 2 steps, load with the other, train 2 more: both resumed runs
    match the uninterrupted runs bit for bit. The uninterrupted runs' exports are equal too, and
    so are the merged sharded checkpoints."""
    import torch.distributed as dist

    c = ctx()
    base = os.path.join(c.tmpdir, state_dict_type)
    dirs = {impl: f"{base}-{impl}" for impl in ("torch", "native")}
    exports: dict[str, dict] = {"torch": {}, "native": {}}
    whole = {
        impl: accelerate_run(impl, steps=4, state_dict_type=state_dict_type, save_after=2, save_dir=dirs[impl],
                             on_trained=_exporter(exports[impl], f"{dirs[impl]}-export"))  # fmt: skip
        for impl in ("torch", "native")
    }
    assert_same("uninterrupted losses", whole["native"][0], whole["torch"][0])
    assert_same("uninterrupted parameters", whole["native"][1], whole["torch"][1])
    failure = [None]
    if dist.get_rank() == 0:  # the exports exist there; its verdict goes to every rank (no hang)
        try:
            for what in ("get_state_dict", "save_model"):
                assert_same(what, exports["native"][what], exports["torch"][what])
            if state_dict_type == "SHARDED_STATE_DICT":
                merged = _merge_fsdp_weights({impl: os.path.join(d, "pytorch_model_fsdp_0") for impl, d in dirs.items()})
                assert len(merged["torch"]) == 21, sorted(merged["torch"])
                assert_same("merge_fsdp_weights", merged["native"], merged["torch"])
        except AssertionError as e:
            failure[0] = f"rank 0: {e}"
    dist.broadcast_object_list(failure, src=0)
    assert failure[0] is None, failure[0]
    for saver, loader in (("torch", "native"), ("native", "torch")):
        losses, params = accelerate_run(
            loader, steps=2, start=2, state_dict_type=state_dict_type, load_dir=dirs[saver]
        )
        assert_same(f"losses after {saver} -> {loader}", losses, whole[saver][0][2:])
        assert_same(f"parameters after {saver} -> {loader}", params, whole[saver][1])


def _checkpoint_grid():
    set_launcher_env()
    run_grid(grid(state_dict_type=["SHARDED_STATE_DICT", "FULL_STATE_DICT"]), _checkpoint, name="save/load")


def _ws2():
    _train_grid()
    _checkpoint_grid()
    run_grid([dict(fmt="fp8_rowwise")], _quantized, name="accelerate quantized all-gather")


def test_accelerate_parity_and_checkpoints_across_libraries_ws2():
    """One spawn (start-up dominates): the training grid, then save/load both ways."""
    run_distributed(_ws2, 2, timeout=400, preload=HF_PRELOAD)


def _hsdp_grid():
    import test_shard_model

    set_launcher_env()
    run_grid([dict(mp="no", hsdp=True), dict(mp="bf16", ga=2, hsdp=True)], _parity, name="accelerate HSDP")
    test_shard_model.hsdp_grid()


def test_hybrid_shard_2x2_accelerate_and_shard_model():
    """HYBRID_SHARD on 4 ranks, one spawn (4 start-ups on 2 cores are the cost): Accelerate
    with ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), then shard_model's HSDP grid."""
    run_distributed(_hsdp_grid, 4, timeout=400, preload=HF_PRELOAD)


LAUNCH_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
use_cpu: true
"""

LAUNCH_SCRIPT = """\
import sys
sys.path.insert(0, {tests!r})
import torch
import fsdp_native
import fsdp_native.integrations as fi
handle = fi.use_with_accelerate(cpu=True)
from accelerate import Accelerator
from test_hf_common import tiny_llama, token_batches
acc = Accelerator()
model = tiny_llama()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, opt = acc.prepare(model, opt)
units = sorted(n or "<root>" for n, m in model.named_modules() if isinstance(m, fsdp_native.FSDPModule))
losses = []
for batch in token_batches(2, bsz=4):
    x = batch[2 * acc.process_index : 2 * acc.process_index + 2]
    loss = model(input_ids=x, labels=x).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
print(f"RESULT rank={{acc.process_index}} type={{acc.distributed_type}} device={{acc.device}} units={{units}}", flush=True)
handle.restore()
"""


def test_accelerate_launch_cpu_fsdp2_config(tmp_path):
    """`accelerate launch` with an FSDP2 config file and use_cpu: true: the script's
    Accelerator() runs FSDP with fsdp_native units on 2 CPU processes."""
    import socket
    import subprocess
    import sys

    (tmp_path / "cfg.yaml").write_text(LAUNCH_CONFIG)
    (tmp_path / "train.py").write_text(LAUNCH_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "cfg.yaml")]
    cmd += ["--main_process_port", str(port), str(tmp_path / "train.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # The two ranks print concurrently: their lines may run together.
    results = sorted(re.findall(r"RESULT rank=\d+ type=\S+ device=\S+ units=\[[^\]]*\]", out))
    units = "['<root>', 'lm_head', 'model.embed_tokens', 'model.layers.0', 'model.layers.1', 'model.norm']"
    assert results == [
        f"RESULT rank={r} type=DistributedType.FSDP device=cpu:0 units={units}" for r in (0, 1)
    ], out[-4000:]
