"""State dicts, distributed checkpointing and meta-device init.

* ``model.state_dict()``: same keys as the unsharded model, fp32 DTensors with
  ``Shard(0)`` (HSDP: ``(Replicate(), Shard(0))``) placement, local shards equal
  to torch FSDP2's, also when taken between forward and backward.
* ``torch.distributed.checkpoint.state_dict``: ``get/set_model_state_dict`` and
  ``get/set_optimizer_state_dict`` with full (``full_state_dict=True,
  cpu_offload=True``) and sharded state dicts and ``broadcast_from_rank0=True``
  into a meta-initialised model; compared with torch FSDP2's output.
* ``dcp.save`` / ``dcp.load`` to a temporary directory, then resume: the losses
  after resuming equal those of an uninterrupted run; checkpoints are
  interchangeable with torch FSDP2 in both directions; ``dcp.async_save`` too.
* A checkpoint saved at world size 2 resumed at 1, 3 and 4 (HSDP 2x2): the states loaded
  exactly, then training on bit for bit as torch FSDP2 resumed from the same checkpoint.

The implementation under test is ``dist_utils.load_impl()`` (``fsdp_native``;
``FSDP_TEST_IMPL=torch`` validates the tests against torch FSDP2 itself).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from dist_utils import assert_close, assert_same_run, ctx, full, load_impl, ref_impl, run_distributed, run_grid
from models import Cfg, Transformer, build_fsdp, make_batches, make_mesh, make_optim, train_fsdp

EXACT = dict(rtol=0, atol=0)
FP32_TOL = dict(rtol=1e-6, atol=1e-6)
BF16_TOL = dict(rtol=1.6e-2, atol=1e-2)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)

STEPS, RESUME_AT = 4, 2


def _cfg(**kw) -> Cfg:
    return Cfg(steps=STEPS, **kw)


def _expected_placements(cfg: Cfg):
    return (Replicate(), Shard(0)) if cfg.mesh == "hsdp" else (Shard(0),)


def _plain_init(cfg: Cfg) -> dict:
    torch.manual_seed(0)
    return Transformer(cfg.model_args).state_dict()


# ---------------------------------------------------------------------------
# model.state_dict()
# ---------------------------------------------------------------------------
def check_state_dict_structure(model: str = "even", mesh: str = "1d", mp: str | None = None, after_forward=False,
                               reshard=True):
    cfg = _cfg(model=model, mesh=mesh, mp=mp, reshard=reshard)
    impl, timpl = load_impl(), ref_impl()
    dmesh = make_mesh(cfg)
    a, b = build_fsdp(impl, cfg, dmesh), build_fsdp(timpl, cfg, dmesh)
    if after_forward:
        # Between forward and backward (unsharded parameters with reshard=False).
        x, _ = make_batches(cfg.model_args, 1, cfg.local_bsz)[0]
        a(x), b(x)
    plain = _plain_init(cfg)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    assert list(sd_a) == list(plain), f"state_dict keys {list(sd_a)} != unsharded model's {list(plain)}"
    assert list(sd_b) == list(plain)
    for k, va in sd_a.items():
        vb = sd_b[k]
        assert isinstance(va, DTensor), f"state_dict()[{k!r}] is {type(va).__name__}, expected DTensor"
        assert tuple(va.placements) == _expected_placements(cfg), f"{k}: placements {va.placements}"
        assert va.device_mesh == dmesh, f"{k}: device_mesh {va.device_mesh} != {dmesh}"
        assert va.dtype == torch.float32, f"{k}: state dict dtype {va.dtype} (mp={mp}), expected the original fp32"
        assert va.shape == plain[k].shape, f"{k}: global shape {tuple(va.shape)} != {tuple(plain[k].shape)}"
        assert va.to_local().shape == vb.to_local().shape, (
            f"{k}: local shard shape {tuple(va.to_local().shape)} != torch's {tuple(vb.to_local().shape)}"
        )
        assert_close(f"{k} local shard vs torch", va.to_local(), vb.to_local(), EXACT)
        assert_close(f"{k} full value vs unsharded init", va.full_tensor(), plain[k], EXACT)
    # The same through the DCP state-dict API (sharded).
    msd = get_model_state_dict(a)
    assert list(msd) == list(plain)
    for k, v in msd.items():
        assert isinstance(v, DTensor) and tuple(v.placements) == _expected_placements(cfg), k
        assert_close(f"get_model_state_dict()[{k!r}]", v.to_local(), sd_b[k].to_local(), EXACT)


# ---------------------------------------------------------------------------
# full / sharded model and optimizer state dicts
# ---------------------------------------------------------------------------
def _train_pair(cfg: Cfg, stop: int):
    impl, timpl = load_impl(), ref_impl()
    dmesh = make_mesh(cfg)
    a, b = build_fsdp(impl, cfg, dmesh), build_fsdp(timpl, cfg, dmesh)
    ra = train_fsdp(impl, a, cfg, stop=stop)
    rb = train_fsdp(timpl, b, cfg, stop=stop)
    return (a, ra), (b, rb), dmesh


def _compare_sd(what, sa, sb, tol):
    """Compare two (possibly nested) state dicts: same structure, types, values."""
    if isinstance(sb, dict):
        assert isinstance(sa, dict), f"{what}: {type(sa).__name__} vs dict"
        assert set(map(str, sa)) == set(map(str, sb)), f"{what}: keys {sorted(map(str, sa))} vs {sorted(map(str, sb))}"
        for k in sb:
            _compare_sd(f"{what}[{k!r}]", sa[k], sb[k], tol)
    elif isinstance(sb, (list, tuple)):
        assert isinstance(sa, (list, tuple)) and len(sa) == len(sb), f"{what}: {sa!r} vs {sb!r}"
        for i, (x, y) in enumerate(zip(sa, sb)):
            _compare_sd(f"{what}[{i}]", x, y, tol)
    elif isinstance(sb, torch.Tensor):
        assert isinstance(sa, torch.Tensor), f"{what}: {type(sa).__name__} vs {type(sb).__name__}"
        assert isinstance(sa, DTensor) == isinstance(sb, DTensor), (
            f"{what}: {type(sa).__name__} vs torch's {type(sb).__name__}"
        )
        if isinstance(sb, DTensor):
            assert sa.placements == sb.placements, f"{what}: placements {sa.placements} vs {sb.placements}"
            assert sa.to_local().shape == sb.to_local().shape, f"{what}: local shape"
        assert sa.device == sb.device, f"{what}: device {sa.device} vs torch's {sb.device}"
        assert sa.dtype == sb.dtype, f"{what}: dtype {sa.dtype} vs {sb.dtype}"
        assert_close(what, full(sa), full(sb), tol)
    else:
        assert sa == sb, f"{what}: {sa!r} vs {sb!r}"


def check_state_dict_api(model: str = "even", mesh: str = "1d", mp: str | None = None, optim: str = "adamw"):
    """get_*_state_dict (full and sharded) of A equal torch's after the same training."""
    cfg = _cfg(model=model, mesh=mesh, mp=mp, optim=optim)
    tol = BF16_TOL if mp else FP32_TOL
    (a, ra), (b, rb), _ = _train_pair(cfg, stop=RESUME_AT)
    rank = dist.get_rank()
    full_a, full_b = get_model_state_dict(a, options=FULL), get_model_state_dict(b, options=FULL)
    if rank == 0:
        assert all(not isinstance(v, DTensor) and v.device.type == "cpu" for v in full_a.values()), (
            "full state dict must hold plain CPU tensors on rank 0"
        )
    _compare_sd("full model state dict", full_a, full_b, tol)
    _compare_sd("sharded model state dict", get_model_state_dict(a), get_model_state_dict(b), tol)
    _compare_sd("sharded optim state dict", get_optimizer_state_dict(a, ra["opt"]),
                get_optimizer_state_dict(b, rb["opt"]), tol)
    _compare_sd("full optim state dict", get_optimizer_state_dict(a, ra["opt"], options=FULL),
                get_optimizer_state_dict(b, rb["opt"], options=FULL), tol)


def _uninterrupted(impl, cfg, dmesh):
    m = build_fsdp(impl, cfg, dmesh)
    return train_fsdp(impl, m, cfg)


def check_resume_broadcast_from_rank0(model: str = "even", mesh: str = "1d", optim: str = "adamw"):
    """Full state dicts from rank 0 into a meta-initialised model, then resume."""
    cfg = _cfg(model=model, mesh=mesh, optim=optim)
    impl = load_impl()
    dmesh = make_mesh(cfg)
    ref = _uninterrupted(impl, cfg, dmesh)

    src = build_fsdp(impl, cfg, dmesh)
    part = train_fsdp(impl, src, cfg, stop=RESUME_AT)
    assert_close("losses before the checkpoint", part["losses"], ref["losses"][: len(part["losses"])], EXACT)
    msd = get_model_state_dict(src, options=FULL)
    osd = get_optimizer_state_dict(src, part["opt"], options=FULL)
    rank = dist.get_rank()
    if rank != 0:
        assert msd == {} or all(isinstance(v, torch.Tensor) for v in msd.values())
        msd, osd = {}, {}

    # Meta-device init, shard, materialise, then load from rank 0.
    dst = build_fsdp(impl, Cfg(**{**cfg.__dict__, "meta": True}), dmesh, seed=99)
    opt = make_optim(cfg, dst.parameters())
    bcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(dst, msd, options=bcast)
    set_optimizer_state_dict(dst, opt, osd, options=bcast)
    for n, p in dst.named_parameters():
        assert isinstance(p, DTensor), f"{n} is {type(p).__name__} after set_model_state_dict"
        assert p.device.type == "cpu", f"{n} on {p.device}"
        assert_close(f"{n} after broadcast_from_rank0 load", full(p), part["params"][n], EXACT)
    rest = train_fsdp(impl, dst, cfg, opt=opt, start=RESUME_AT)
    assert_close("losses after resume (broadcast_from_rank0)", rest["losses"],
                 ref["losses"][len(part["losses"]):], FP32_TOL)
    for n in ref["params"]:
        assert_close(f"final {n} after resume", rest["params"][n], ref["params"][n], FP32_TOL)


def check_resume_sharded_set(model: str = "odd", mesh: str = "1d"):
    """Sharded get/set_state_dict into a fresh model, then resume."""
    cfg = _cfg(model=model, mesh=mesh)
    impl = load_impl()
    dmesh = make_mesh(cfg)
    ref = _uninterrupted(impl, cfg, dmesh)
    src = build_fsdp(impl, cfg, dmesh)
    part = train_fsdp(impl, src, cfg, stop=RESUME_AT)
    msd, osd = get_state_dict(src, part["opt"])
    dst = build_fsdp(impl, cfg, dmesh, seed=99)
    opt = make_optim(cfg, dst.parameters())
    set_state_dict(dst, opt, model_state_dict=msd, optim_state_dict=osd)
    rest = train_fsdp(impl, dst, cfg, opt=opt, start=RESUME_AT)
    assert_close("losses after resume (sharded set_state_dict)", rest["losses"],
                 ref["losses"][len(part["losses"]):], FP32_TOL)


def check_load_state_dict_cross(model: str = "odd", mesh: str = "1d"):
    """model.load_state_dict() of torch FSDP2's sharded state dict (and back)."""
    cfg = _cfg(model=model, mesh=mesh)
    (a, ra), (b, rb), dmesh = _train_pair(cfg, stop=RESUME_AT)
    impl, timpl = load_impl(), ref_impl()
    a2 = build_fsdp(impl, cfg, dmesh, seed=7)
    a2.load_state_dict(b.state_dict())
    b2 = build_fsdp(timpl, cfg, dmesh, seed=7)
    b2.load_state_dict(a.state_dict())
    for n, p in a2.named_parameters():
        assert isinstance(p, DTensor), f"{n} is {type(p).__name__} after load_state_dict"
        assert_close(f"{n} after load_state_dict(torch's)", full(p), rb["params"][n], EXACT)
    for n, p in b2.named_parameters():
        assert_close(f"{n} torch after load_state_dict(impl's)", full(p), ra["params"][n], EXACT)
    # Training continues from the loaded state identically in both.
    ca = train_fsdp(impl, a2, cfg, start=RESUME_AT)
    cb = train_fsdp(timpl, build_with_sd(timpl, cfg, dmesh, b.state_dict()), cfg, start=RESUME_AT)
    assert_close("losses after load_state_dict (fresh optimizer)", ca["losses"], cb["losses"], FP32_TOL)


def build_with_sd(impl, cfg, dmesh, sd):
    m = build_fsdp(impl, cfg, dmesh, seed=7)
    m.load_state_dict(sd)
    return m


# ---------------------------------------------------------------------------
# DCP save / load / resume
# ---------------------------------------------------------------------------
def _ckpt_dir(tag: str) -> str:
    path = os.path.join(ctx().tmpdir, f"ckpt_{tag}")
    return path


def check_dcp_resume(saver: str, loader: str, model: str = "even", mesh: str = "1d", mp: str | None = None,
                     optim: str = "adamw", async_save: bool = False):
    """Save after RESUME_AT steps with ``saver``, load into a fresh ``loader`` model, resume.

    ``saver`` / ``loader``: "impl" (under test) or "torch".  The resumed losses
    must equal the saver's uninterrupted run. ``async_save``: ``dcp.async_save`` (on a
    process group of its own, as DCP asks), with training going on while it writes.
    """
    cfg = _cfg(model=model, mesh=mesh, mp=mp, optim=optim)
    impls = {"impl": load_impl(), "torch": ref_impl()}
    si, li = impls[saver], impls[loader]
    tol = BF16_TOL if mp else FP32_TOL
    dmesh = make_mesh(cfg)
    ref = _uninterrupted(si, cfg, dmesh)

    src = build_fsdp(si, cfg, dmesh)
    part = train_fsdp(si, src, cfg, stop=RESUME_AT)
    path = _ckpt_dir(f"{saver}_{loader}_{model}_{mesh}_{mp}_{optim}_{async_save}")
    msd, osd = get_state_dict(src, part["opt"])
    if async_save:
        fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=dist.new_group(backend="gloo"))
        train_fsdp(si, src, cfg, opt=part["opt"], start=RESUME_AT)  # changes the parameters while the save writes
        fut.result()
    else:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    dist.barrier()

    dst = build_fsdp(li, cfg, dmesh, seed=99)
    opt = make_optim(cfg, dst.parameters())
    msd2, osd2 = get_state_dict(dst, opt)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(dst, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for n, p in dst.named_parameters():
        assert isinstance(p, DTensor), f"{n} is {type(p).__name__} after dcp.load"
        assert_close(f"{n} after dcp.load ({saver} -> {loader})", full(p), part["params"][n], EXACT)
    rest = train_fsdp(li, dst, cfg, opt=opt, start=RESUME_AT)
    n_before = len(part["losses"])
    assert_close(f"losses after dcp resume ({saver} -> {loader})", rest["losses"], ref["losses"][n_before:], tol)
    for n in ref["params"]:
        assert_close(f"final {n} after dcp resume ({saver} -> {loader})", rest["params"][n], ref["params"][n], tol)


def check(kind: str, **kw):
    {
        "structure": check_state_dict_structure,
        "state_dict_api": check_state_dict_api,
        "broadcast_from_rank0": check_resume_broadcast_from_rank0,
        "sharded_set": check_resume_sharded_set,
        "load_state_dict_cross": check_load_state_dict_cross,
        "dcp": check_dcp_resume,
    }[kind](**kw)


def _ws2_grid():
    configs = [
        dict(kind="structure", model="even"),
        dict(kind="structure", model="odd", mp="bf16"),
        dict(kind="structure", model="odd", after_forward=True, reshard=False),
        dict(kind="state_dict_api", model="even"),
        dict(kind="state_dict_api", model="odd", optim="sgd"),
        dict(kind="state_dict_api", model="odd", mp="bf16"),
        dict(kind="broadcast_from_rank0", model="even"),
        dict(kind="broadcast_from_rank0", model="odd", optim="sgd"),
        dict(kind="sharded_set", model="odd"),
        dict(kind="load_state_dict_cross", model="odd"),
        dict(kind="dcp", saver="impl", loader="impl", model="even"),
        dict(kind="dcp", saver="impl", loader="impl", model="odd", mp="bf16"),
        dict(kind="dcp", saver="torch", loader="impl", model="odd"),
        dict(kind="dcp", saver="impl", loader="torch", model="even", optim="sgd"),
        # dcp.async_save (torchtitan's async checkpointing): its staging copies a DTensor by
        # its slots; fsdp_native's once wrote uninitialized memory there.
        dict(kind="dcp", saver="impl", loader="impl", model="odd", async_save=True),
        dict(kind="dcp", saver="impl", loader="torch", model="even", mp="bf16", async_save=True),
    ]
    run_grid(configs, check, name="state-ws2")


def _ws4_grid():
    configs = [
        dict(kind="structure", model="odd", mesh="hsdp"),
        dict(kind="state_dict_api", model="odd", mesh="hsdp"),
        dict(kind="broadcast_from_rank0", model="odd", mesh="hsdp"),
        dict(kind="dcp", saver="torch", loader="impl", model="odd", mesh="hsdp"),
        dict(kind="dcp", saver="impl", loader="impl", model="even", mesh="1d"),
    ]
    run_grid(configs, check, name="state-ws4")


def test_state_dict_and_checkpoint_world_size_2():
    run_distributed(_ws2_grid, 2)


def test_state_dict_and_checkpoint_world_size_4_hsdp():
    run_distributed(_ws4_grid, 4, timeout=300)


# ---------------------------------------------------------------------------
# A checkpoint resumed at another world size (DCP reshards it)
# ---------------------------------------------------------------------------
RESHARD_CFG = dict(model="odd", steps=3)  # dims 0 of 3, 13, 30, 67, 91: uneven shards at 2, 3 and 4 ranks


def _cfg_for_reshard(mesh: str) -> Cfg:
    return Cfg(mesh=mesh, **RESHARD_CFG)


def _save_at_ws2(path: str) -> None:
    impl = load_impl()
    cfg = _cfg_for_reshard("1d")
    model = build_fsdp(impl, cfg, make_mesh(cfg))
    out = train_fsdp(impl, model, cfg, stop=2)
    msd, osd = get_state_dict(model, out["opt"])
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    full_states = (get_model_state_dict(model, options=FULL), get_optimizer_state_dict(model, out["opt"], options=FULL))
    if dist.get_rank() == 0:
        torch.save(full_states, os.path.join(path, "full_states.pt"))
    dist.barrier()


def _load_and_continue(path: str, mesh: str) -> None:
    """Loads the world-size-2 checkpoint at this world size into fsdp_native and into torch
    FSDP2: the model and optimizer states are the saved ones, exactly; then one more step in
    each gives the same losses and parameters, bit for bit."""
    saved_model, saved_optim = torch.load(os.path.join(path, "full_states.pt"), weights_only=False)
    ws = dist.get_world_size()
    runs = {}
    for impl in (load_impl(), ref_impl()):
        cfg = _cfg_for_reshard(mesh)
        model = build_fsdp(impl, cfg, make_mesh(cfg), seed=5)  # other weights than the saved ones
        opt = make_optim(cfg, model.parameters())
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        got_model = get_model_state_dict(model, options=FULL)
        got_optim = get_optimizer_state_dict(model, opt, options=FULL)
        what = f"[{impl.name}, world size {ws}, {mesh}]"
        if dist.get_rank() == 0:  # a full state dict with cpu_offload is rank 0's only
            _compare_sd(f"{what} loaded model state", got_model, saved_model, EXACT)
            _compare_sd(f"{what} loaded optimizer states", got_optim["state"], saved_optim["state"], EXACT)
        runs[impl.name] = train_fsdp(impl, model, cfg, opt=opt, start=2)
    assert_same_run(f"[world size {ws}, {mesh}] after resuming", runs[load_impl().name], runs["torch"])


def test_checkpoint_resumed_at_other_world_sizes(tmp_path):
    """Saved at world size 2 (uneven shards, AdamW states), resumed at 1, 3 and 4 (HSDP 2x2)."""
    path = str(tmp_path)
    run_distributed(_save_at_ws2, 2, path)
    for ws, mesh in ((1, "1d"), (3, "1d"), (4, "hsdp")):
        run_distributed(_load_and_continue, ws, path, mesh)
