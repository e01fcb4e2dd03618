"""One unit: the parameters of one fully_shard call, all-gathered in one collective and
reduce-scattered in one.

The work is split three ways, each fixed at ``fully_shard``:

* the layout (``_layout.Layout``): per-parameter shapes, padding and dtypes, and the views of
  the flat buffers;
* the all-gather codec (``_codec``): how the shards become this rank's all-gather input (a
  plain or casting copy, torch's tensor-subclass protocol, fp8 or NF4 quantization) and how
  the gathered buffer becomes the unsharded parameters;
* the unit (here): the flat buffers, the streams, the memory accounting, the collective
  calls, the reshard state machine, the gradients and the trace spans.

Memory layout. The sharded parameters are views into one flat padded buffer, so with no dtype
cast that buffer *is* the all-gather input. The unsharded parameters are views into one flat
buffer whose storage is freed (``resize_(0)``) on reshard and re-allocated on unshard, so
autograd's references to them stay valid. The reduce-scatter output, when it needs no cast,
is the flat sharded-gradient buffer itself and the sharded gradients are views into it.

Mixed dtypes (fp32 adapters beside bf16 frozen weights, fp32 norms beside bf16 weights), as
torch FSDP2 allows: the flat buffers are bytes (uint8) and each parameter's region is a view
of its own dtype. With one unsharded dtype (``param_dtype`` set) the all-gather runs in it
and the copy-in casts each shard; with several, the all-gather moves the bytes and the
copy-out copies bytes. Still one collective per unit.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from fsdp_native import _codec, _comm, _compat, _extension, _tp, _trace, ops
from fsdp_native._api import CPUOffloadPolicy, MixedPrecisionPolicy, QuantizedAllGather, resolve_param_dtypes
from fsdp_native._dtensor import ShardedDTensor, make_sharded
from fsdp_native._layout import Layout, itemsize_order
from fsdp_native._mesh import MeshInfo
from fsdp_native._streams import streams_for

_ReduceOp = dist.ReduceOp


class Accounting:
    """Bytes of unsharded parameters (and all-gather buffers in flight) of a set of units."""

    __slots__ = ("current", "peak")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current


class PendingAllGather(NamedTuple):
    """An issued all-gather: its work (None when nothing was sent) and its output buffer (the
    flat shard itself when that stood in for it; None when one rank's cast waits for the
    copy-out)."""

    work: object
    out: torch.Tensor | None


def _converts_dtypes(layout: Layout, fn, device: torch.device) -> bool:
    """Whether ``fn`` (of ``nn.Module._apply``) changes the dtype of any of the layout's plain
    parameters, found on an empty tensor of each of their dtypes."""
    dtypes = {d for d, e in zip(layout.orig_dtypes, layout.ext) if not e}
    with torch.no_grad():
        return any(fn(torch.empty(0, dtype=d, device=device)).dtype != d for d in dtypes)


class Unit:
    def __init__(
        self,
        modules: list[nn.Module],
        params: list[nn.Parameter],
        owners: list[list[tuple[nn.Module, str]]],
        info: MeshInfo,
        mp: MixedPrecisionPolicy,
        offload: CPUOffloadPolicy | None,
        reshard_after_forward: bool | None,
        post_forward: tuple[dist.ProcessGroup, int, int] | None,
        all_gather: QuantizedAllGather | None = None,
        param_dtypes: list[torch.dtype | None] | None = None,
        shard_dims: list[int] | None = None,
        tp_specs: list | None = None,
        spmd: "_tp.Spmd | None" = None,
    ) -> None:
        self.modules = modules
        self.owners = owners
        self.info = info
        self.mp = mp
        self.offload = offload
        self.auto_reshard = reshard_after_forward is None
        self.reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward
        self.post_forward = post_forward  # (group, size, index) for an int reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.unshard_in_backward = True
        self.divide_factor: float | None = None
        self.force_sum = False
        self.all_reduce_hook = None  # (hook, stream) of FSDPModule.set_all_reduce_hook
        # Unsharded gradients accumulated over no-sync micro-batches in the reduce dtype, when
        # that differs from the parameter dtype (bf16 compute, fp32 reduce), as torch does.
        self._accumulated: list[torch.Tensor | None] | None = None
        # torch >= 2.15 (_compat.GRAD_IN_REDUCE_DTYPE): (index, dtype) of the unsharded
        # parameters whose gradient accumulates in a dtype wider than their compute dtype
        self._wide_grads: list[tuple[int, torch.dtype]] = []
        self._grad_dtypes_lifted = False  # defer_grad_upcast lifted some; restore_grad_dtypes undoes it
        self.fqn = ""
        # A fully_shard call whose parameters are on several meshes (shard_placement_fn's
        # ShardPlacementResult, torch 2.13+) makes one unit per mesh: the first (`primary`)
        # is the module's and runs its hooks for all of them, in `group` (itself first).
        self.primary: Unit | None = None
        self.group: tuple[Unit, ...] = (self,)
        # Forward-pass state of the unit as one hook target (several modules may share it).
        self.in_forward = False
        self.modules_to_run: set[nn.Module] = set()
        # Whether the unit's forward inputs are marked for its post-backward in this pass
        # (torch FSDP2's parameter group in its FORWARD state). The full post-forward, the
        # pre-backward and the post-backward clear it: a module of the unit called again after
        # a backward, without the pass completing (the head of torchtitan's chunked loss, once
        # per chunk), marks its inputs again.
        self.inputs_marked = False
        self.ctx = None  # the root context, set at lazy init
        self.acct = Accounting()
        self.total_acct: Accounting | None = None
        self.forward_prefetch: list[Unit] | None = None
        self.backward_prefetch: list[Unit] | None = None
        self.post_optim_event = None

        ws, rank = info.shard_size, info.shard_rank
        self.world_size, self.rank = ws, rank
        self.device = info.device
        self.streams = streams_for(info.device)  # replaced by the root's shared streams at lazy init
        self.shard_device = torch.device("cpu") if offload is not None else info.device
        # Offloaded shards in pinned memory when the policy asks (as torch FSDP2), so their
        # copies to the GPU are asynchronous.
        self._pin = offload is not None and offload.pin_memory and info.device.type == "cuda"
        self.all_gather = all_gather
        self.shard_dims = [0] * len(params) if shard_dims is None else list(shard_dims)  # per parameter, in unit order
        # Per parameter: the DTensor spec tensor parallelism gave it before fully_shard (_tp), or None.
        self.tp_specs = [None] * len(params) if tp_specs is None else list(tp_specs)
        self.spmd = spmd  # dp_mesh_dims: every parameter a DTensor on this full mesh (_tp.Spmd)
        if param_dtypes is None:
            param_dtypes = [mp.param_dtype] * len(params)
        # Each parameter's position in the order fully_shard found them (torch FSDP2's order):
        # a later layout starts again from it (:meth:`_relayout`).
        self.registration = list(range(len(params)))
        order = itemsize_order(params, param_dtypes)
        if order is not None:
            params, param_dtypes = self._reorder(order, params, param_dtypes)
        self._configure(params, param_dtypes)
        self._shard(params)
        self._build_slots()
        self.unsharded_flat: torch.Tensor | None = None
        self.unsharded_params: list[nn.Parameter] = []
        self.is_unsharded = False
        self.pending_ag: PendingAllGather | None = None
        self.pending_rs = None
        self.partial_reduce: torch.Tensor | None = None
        self.needs_post_backward = False
        # set_reduce_scatter_unused_params: gradients of the parameters that require grad but
        # got none are reduced as zeros.
        self.reduce_unused = False
        self.keep_unsharded = False  # set_keep_unsharded_storage: reshard keeps the unsharded storage
        self.manual_finalization = False  # set_manual_backward_finalization before the first forward
        # set_custom_all_gather / set_custom_reduce_scatter: torch's Comm objects (allocate and call)
        self.ag_comm = None
        self.rs_comm = None
        self.shared_comm = None  # share_comm_ctx: a SharedComm that this unit's root uses
        self.rs_group = None  # set_separate_reduce_scatter_group: the reduce-scatters' own group
        self.rs_max_inputs = 1  # set_reduce_scatter_max_input_buffers: reductions kept in flight
        self.pg_alloc = False  # set_allocate_memory_from_process_group_for_comm
        self.backward_reached = False  # pre-backward ran in this backward
        # A backward with create_graph=True reached this unit: the graph it built (a gradient
        # penalty's) holds the unsharded parameters, so they stay unsharded (:meth:`hold`).
        self.held = False
        self._grads_at_hold: list = []
        # A recompute in backward (reentrant activation checkpointing) registered this unit's
        # backward hooks, which its forward without grad did not; cleared by its post-backward.
        self.recompute_hooked = False
        self._t_compute: float | None = None  # start of the unit's running compute (tracing)
        self._pf_shard: torch.Tensor | None = None
        self._pf_shard_in_flight: torch.Tensor | None = None  # input of an in-flight all-gather: kept alive
        self._pf_keep: torch.Tensor | None = None
        # Sharded gradients the in-flight reduce-scatter writes into directly (fresh each step:
        # a user may keep last step's gradients, as with torch).
        self._pending_grads: tuple[torch.Tensor, list[DTensor]] | None = None

    # ----------------------------------------------------------------- sharding
    def _reorder(self, order: list[int], *lists: list) -> list[list]:
        """Puts the unit's parameters in `order` (:func:`itemsize_order`): its owners and shard
        dims, and `lists` (per parameter), returned reordered."""
        self.owners = [self.owners[i] for i in order]
        self.registration = [self.registration[i] for i in order]
        self.shard_dims = [self.shard_dims[i] for i in order]
        self.tp_specs = [self.tp_specs[i] for i in order]
        return [[seq[i] for i in order] for seq in lists]

    def _build_slots(self) -> None:
        """Each registration slot of a parameter (module._parameters, name) and its index."""
        self._slots = [(mod._parameters, name) for owner in self.owners for (mod, name) in owner]
        self._slot_index = [i for i, owner in enumerate(self.owners) for _ in owner]

    def _configure(self, params: list, param_dtypes: list, ext: list[bool] | None = None) -> None:
        """What the parameters' dtypes fix: the layout, the reduce dtype and the codec (at
        ``fully_shard``, and again when a conversion changed the dtypes: :meth:`_relayout`,
        which passes `ext`, the subclass parameters, checked at ``fully_shard``)."""
        owners, mp, post_forward = self.owners, self.mp, self.post_forward
        self.layout = layout = Layout(params, self.world_size, self.rank, param_dtypes, ext, self.shard_dims)
        if layout.has_ext and ext is None:
            _codec.check_extension_params(params, owners, layout.ext, layout.dims, self.world_size, post_forward)
        # The reduce dtype the policy fixes (None: that of the gradients, checked when they are
        # reduced). reduce_dtype=None follows the installed torch (_compat.REDUCE_IN_ORIG_DTYPE).
        self.policy_reduce_dtype = mp.reduce_dtype
        trainable = {d for d, rg in zip(layout.orig_dtypes, layout.requires_grad) if rg}
        if trainable and not any(d.is_floating_point for d in trainable):
            # The policy's dtypes are for floating-point parameters: complex gradients are
            # reduced in their own dtype (a real reduce dtype would drop their imaginary part).
            self.policy_reduce_dtype = trainable.pop() if len(trainable) == 1 else None
        elif mp.reduce_dtype is None and (_compat.REDUCE_IN_ORIG_DTYPE or mp.param_dtype_override_fn is not None):
            if len(trainable) == 1:
                self.policy_reduce_dtype = trainable.pop()
        # One gradient dtype per unit, as torch FSDP2 requires: the reduce dtype, else that of
        # the unsharded parameters with gradients (checked when they are reduced).
        grad_dtypes = {d for d, rg in zip(layout.param_dtypes, layout.requires_grad) if rg}
        self.reduce_dtype = self.policy_reduce_dtype or (
            grad_dtypes.pop() if len(grad_dtypes) == 1 else layout.param_dtypes[0] if params else torch.float32
        )
        self.codec = _codec.choose(
            layout,
            self.all_gather,
            post_forward=post_forward is not None,
            staged=self.shard_device != self.device,
            device=self.device,
            names=[f"parameter '{name}' of {type(mod).__name__}" for (mod, name), *_ in owners],
        )

    def _shard(self, params: list[nn.Parameter]) -> None:
        device = params[0].device if params and params[0].is_meta else self.shard_device
        layout = self.layout
        flat = self._new_flat(device)
        self.sharded_flat = flat
        self.shard_views = layout.shard_views(flat)
        self.sharded_params = []
        with torch.no_grad():
            for i, p in enumerate(params):
                if layout.ext[i]:
                    self._shard_extension(i, p)
                    continue
                view = self.shard_views[i]
                if not p.is_meta and view.numel():
                    view.copy_(layout.local_chunk(i, p.detach()))
                spec = self._sharded_dtensor(i, view, p)._spec
                sp = nn.Parameter(make_sharded(view, spec), requires_grad=p.requires_grad)
                sp._local_tensor = view  # Parameter() detached a copy of the wrapper: point it back at our view
                sp._fsdp_native_unit = self  # who owns it, for the error when it is sharded again
                self.sharded_params.append(sp)
                for mod, name in self.owners[i]:
                    mod._parameters[name] = sp

    def _sharded_dtensor(self, i: int, local: torch.Tensor, p: nn.Parameter) -> DTensor:
        """Sharded parameter `i` over `local` (this rank's shard of `p`, the parameter as
        fully_shard got it: a TP one's local tensor), on the unit's mesh or with the TP dims."""
        spec = self.tp_specs[i]
        shape, stride = self.global_shape(i), spec.stride if spec else p.stride()
        return DTensor.from_local(local, self.mesh(i), self.placements(i), run_check=False, shape=shape, stride=stride)

    def placements(self, i: int) -> tuple:
        """Parameter `i`'s DTensor placements: ``Shard(d)`` on the shard mesh dim (``d`` from
        ``shard_placement_fn``, else 0), ``Replicate()`` on the replicate dim (HSDP), then a
        tensor-parallel parameter's TP placements (:mod:`_tp`)."""
        d, spec = self.shard_dims[i], self.tp_specs[i]
        if spec is not None:
            return _tp.placements(spec, self.info, d, self.spmd)
        placements = self.info.placements
        return placements if d == 0 else (*placements[:-1], Shard(d))

    def mesh(self, i: int):
        """Parameter `i`'s DTensor mesh: the unit's, or it and the TP mesh (:mod:`_tp`)."""
        spec = self.tp_specs[i]
        if spec is None:
            return self.info.mesh
        return self.spmd.mesh if self.spmd is not None else _tp.spmd_mesh(self.info.mesh, spec.mesh)

    def global_shape(self, i: int) -> torch.Size:
        """Parameter `i`'s global shape (the layout's is the TP-local one)."""
        spec = self.tp_specs[i]
        return self.layout.shapes[i] if spec is None else spec.shape

    def _new_flat(self, device: torch.device) -> torch.Tensor:
        """A zeroed flat sharded buffer on `device` (pinned for an offloaded CUDA unit)."""
        pin = self._pin and device.type == "cpu"
        return torch.zeros(sum(self.layout.shard_units), dtype=self.layout.orig_dtype, device=device, pin_memory=pin)

    def _to_shard_device(self, t: torch.Tensor) -> torch.Tensor:
        """`t` on the shard device (pinned for an offloaded CUDA unit); a meta tensor as is."""
        if t.is_meta:
            return t
        t = t.to(self.shard_device)
        return t.pin_memory() if self._pin and not t.is_pinned() else t

    def _shard_extension(self, i: int, p: nn.Parameter) -> None:
        """A subclass parameter keeps its own rank-local shard (its shard dim divides evenly),
        on the CPU with CPU offload (as torch FSDP2: its fsdp_pre_all_gather then runs on a
        copy moved to the device). A chunk still on its device is copied: as a view it would
        keep the whole unsharded tensor's storage alive (torchao's NF4 chunks are views of
        every inner tensor). So is a chunk of a dim other than 0, whose inner tensors must be
        contiguous."""
        d = self.layout.dims[i]
        chunk = torch.chunk(p.detach(), self.world_size, dim=d)[self.rank]
        sd = self.shard_device
        same_device = chunk.device.type == sd.type and sd.index in (None, chunk.device.index)
        if self.world_size > 1 and (same_device or d) and not chunk.is_meta:
            chunk = _extension.own_copy(chunk)
        sp = nn.Parameter(self._sharded_dtensor(i, self._to_shard_device(chunk), p), requires_grad=p.requires_grad)
        self.shard_views[i] = sp._local_tensor
        sp._fsdp_native_unit = self
        self.sharded_params.append(sp)
        for mod, name in self.owners[i]:
            mod._parameters[name] = sp

    def apply_to_flat(self, fn) -> bool:
        """``nn.Module._apply(fn)`` for this unit's plain shards, as one tensor: ``fn`` (a
        device move, ``to_empty``) is applied to the flat buffer and the shards become views of
        the result. It returns True, and the caller must :meth:`hide` them from ``_apply``.
        ``to_empty`` from the meta device so allocates each shard once. Converting every
        parameter and then packing them into a new flat buffer held a unit's shards twice for
        a moment (on an H200, the Llama root unit's 125 MiB at init).

        It returns False, with nothing changed but ``fn``'s call on the flat buffer, when
        ``fn`` changes the dtype or size, with CPU offload, with gradients, or when a parameter
        was replaced: the per-parameter path and :meth:`readopt` then do it all."""
        ext = self.layout.ext
        if self.offload is not None or self.sharded_flat is None or all(ext):
            return False
        for (params, name), i in zip(self._slots, self._slot_index):
            p = params[name]
            if not self._is_ours(i, p) or (not ext[i] and p.grad is not None):
                return False
        flat = self.sharded_flat
        if flat.dtype == torch.uint8 and _converts_dtypes(self.layout, fn, flat.device):
            return False  # a byte buffer hides a conversion of its parameters' dtypes
        with torch.no_grad():
            new = fn(flat)
        if type(new) is not torch.Tensor or new.dtype != flat.dtype or new.shape != flat.shape:
            return False
        if new is not flat:
            if flat.is_meta and not new.is_meta:  # to_empty: zero padding, as _new_flat makes it
                new.zero_()
            views = self.layout.shard_views(new)
            moved = new.device != flat.device
            for i, sp in enumerate(self.sharded_params):
                if ext[i]:
                    continue
                if moved:  # the parameter moves too, as nn.Module._apply moves it
                    dt = make_sharded(views[i], sp._spec)
                    if torch._has_compatible_shallow_copy_type(sp, dt):
                        sp.data = dt
                    else:  # e.g. from the meta device: a new parameter, as _apply makes
                        sp = nn.Parameter(dt, requires_grad=sp.requires_grad)
                        sp._fsdp_native_unit = self
                        self.sharded_params[i] = sp
                sp._local_tensor = self.shard_views[i] = views[i]
            self.sharded_flat = new
            self._pending_grads = None
            if self.unsharded_flat is not None and self.unsharded_flat.device != self.device and new.device.type != "meta":
                self._drop_unsharded()
        return True

    def hide(self, hidden: bool) -> None:
        """Hides the plain sharded parameters from ``nn.Module._apply`` (their slots hold None,
        which it skips, so the parameters' order stays), or shows them again."""
        for (params, name), i in zip(self._slots, self._slot_index):
            if not self.layout.ext[i]:
                params[name] = None if hidden else self.sharded_params[i]

    def readopt(self) -> None:
        """Re-adopts the registered sharded parameters after ``_apply`` / ``to_empty`` /
        ``load_state_dict(assign=True)`` replaced their tensors, re-packing them into a flat
        buffer. Plain DTensors installed by ``load_state_dict(assign=True)`` (Accelerate's
        ``cpu_ram_efficient_loading``) become ShardedDTensors in place, so the parameter
        objects an optimizer may hold stay valid and keep the elementwise fast path."""
        params = []
        for i, owner in enumerate(self.owners):
            mod, name = owner[0]
            params.append(mod._parameters[name])
        ours = [self._is_ours(i, p) for i, p in enumerate(params)]
        if all(ours):
            return
        layout = self.layout
        for i, p in enumerate(params):
            self._check_replacement(i, p)
        ext = [_extension.has_extension(p._local_tensor) for p in params]
        if ext != layout.ext or [p.dtype for p in params] != layout.orig_dtypes:
            params = self._relayout(params, ext)
            layout = self.layout
            ours = [False] * len(params)
        locals_ = [p._local_tensor for p in params]
        device = locals_[0].device if locals_ else self.shard_device
        if not device.type == "meta" and self.offload is not None:
            device = torch.device("cpu")
        # After apply_to_flat only subclass shards changed: the flat buffer stays. A unit of
        # subclass parameters only has an empty one, which follows them (off the meta device).
        repack = not all(o for o, e in zip(ours, layout.ext) if not e)
        flat = self.sharded_flat
        repack = repack or (flat is not None and flat.numel() == 0 and flat.device != device)
        if repack:
            flat = self._new_flat(device)
            views = layout.shard_views(flat)
        else:
            flat, views = self.sharded_flat, list(self.shard_views)
        with torch.no_grad():
            for i, (p, loc, view) in enumerate(zip(params, locals_, views)):
                if layout.ext[i]:  # a subclass shard stays as it is (on the CPU with offload)
                    if self.offload is not None:
                        loc = p._local_tensor = self._to_shard_device(loc)
                    views[i] = loc
                    p._fsdp_native_unit = self
                    continue
                if not repack:
                    continue
                if not loc.is_meta and view.numel():
                    view.copy_(loc.reshape(view.shape))
                if type(p) is not ShardedDTensor:
                    p.__class__ = ShardedDTensor
                p._local_tensor = view
                p._fsdp_native_unit = self
        self.sharded_flat, self.shard_views, self.sharded_params = flat, views, params
        for i, owner in enumerate(self.owners):
            for mod, name in owner:
                mod._parameters[name] = params[i]
        self._pending_grads = None
        if self.unsharded_flat is not None and self.unsharded_flat.device != self.device and not (locals_ and locals_[0].is_meta):
            self._drop_unsharded()

    def _is_ours(self, i: int, p) -> bool:
        """`p` is sharded parameter `i` as this unit registered it."""
        return p is self.sharded_params[i] and p._local_tensor is self.shard_views[i]

    def _check_replacement(self, i: int, p) -> None:
        """A tensor registered in place of sharded parameter `i` must be a DTensor with the
        same global shape and placements, else re-packing it would corrupt the unit. Its dtype
        may differ (a conversion: :meth:`_relayout`) if it stays a floating-point one."""
        mod, name = self.owners[i][0]
        where = f"parameter '{name}' of {type(mod).__name__} (unit '{self.fqn}')"
        # Against the unit's own facts: after nn.Module._apply the registered parameter object
        # is the unit's, with its contents swapped.
        shape, placements = self.global_shape(i), self.placements(i)
        if not isinstance(p, DTensor):
            raise ValueError(
                f"fsdp_native: {where} was replaced by a {type(p).__name__} of shape {tuple(p.shape)}, expected a "
                f"DTensor of shape {tuple(shape)} with placements {placements} (load a sharded state dict, "
                "e.g. from get_model_state_dict, or load without assign=True)"
            )
        if p.shape != shape or tuple(p.placements) != placements or p.device_mesh != self.mesh(i):
            raise ValueError(
                f"fsdp_native: {where} was replaced by a DTensor of shape {tuple(p.shape)}, placements "
                f"{p.placements}, expected shape {tuple(shape)}, placements {placements} on the unit's mesh"
            )
        if p.dtype != self.layout.orig_dtypes[i] and not p.dtype.is_floating_point:
            raise ValueError(
                f"fsdp_native: {where} became a DTensor of dtype {p.dtype}, expected a floating-point dtype "
                f"(it was {self.layout.orig_dtypes[i]})"
            )

    def _relayout(self, params: list, ext: list[bool]) -> list:
        """The parameters' dtypes changed after ``fully_shard`` (``module.to(dtype)``,
        ``.half()``, ``.float()``, or ``load_state_dict(assign=True)`` of other dtypes), or a
        tensor-subclass parameter became a plain one (torchao's NF4 weights dequantize on
        ``.to(dtype)``), which torch FSDP2 allows before its lazy init: the unit is laid out
        again as ``fully_shard`` would lay out such parameters (`ext`: which ones are still
        subclasses), and the mixed precision policy resolved again (``param_dtype`` still
        applies; without it they compute in their new dtype). The caller re-packs the shards.
        Returns the parameters in the new unit order."""
        accumulating = self.partial_reduce is not None or self.has_unreduced_grads()
        if self.is_unsharded or self.pending_ag is not None or self.pending_rs is not None or accumulating:
            raise RuntimeError(
                f"fsdp_native: the dtype of parameters of unit '{self.fqn or 'root'}' changed while the unit was unsharded "
                "or had gradients being reduced or accumulated; change dtypes between optimizer steps"
            )
        self._drop_unsharded()
        # What the layout reads of a parameter (global shape, dtype, requires_grad), without its data.
        specs = [torch.empty(s, dtype=p.dtype, device="meta").requires_grad_(p.requires_grad) for s, p in zip(self.layout.shapes, params)]
        # From fully_shard's order, not the current one: a conversion of one module at a time
        # (``model.to(torch.bfloat16)``) passes through mixed dtypes, whose itemsize order
        # would otherwise stay once the dtypes agree again, and with it another packing of the
        # reduce-scatter than torch FSDP2's (gloo then sums in another order at 4 ranks).
        back = sorted(range(len(params)), key=self.registration.__getitem__)
        params, specs, ext = self._reorder(back, params, specs, ext)
        names = [name for (_, name), *_ in self.owners]
        requested = resolve_param_dtypes(self.mp, params, names)
        order = itemsize_order(specs, requested)
        if order is not None:
            params, specs, ext, requested = self._reorder(order, params, specs, ext, requested)
        self._build_slots()
        self._configure(specs, requested, ext)
        self._accumulated = self._pending_grads = None
        self._pf_shard = self._pf_keep = None
        return params

    def check_registered(self) -> None:
        """Cheap per-step check that nobody swapped the sharded parameters behind our back."""
        for (params, name), i in zip(self._slots, self._slot_index):
            p = params[name]
            if p is not self.sharded_params[i] or p._local_tensor is not self.shard_views[i]:
                if self.is_unsharded and p is self.unsharded_params[i]:
                    continue
                self.readopt()
                return

    # ---------------------------------------------------------------- unsharding
    def _ensure_unsharded_params(self) -> None:
        if self.unsharded_flat is not None:
            return
        layout = self.layout
        flat = torch.empty(layout.unsharded_numel, dtype=layout.param_dtype, device=self.device)
        self.unsharded_flat = flat
        plain, typed = layout.unsharded_views(flat)
        self.unsharded_params = [
            None if t is None else self.new_unsharded_param(i, t, rg) for i, (t, rg) in enumerate(zip(typed, layout.requires_grad))
        ]
        self._init_grad_dtypes()
        self._unsharded_plain = plain  # plain views the copy-out writes (no autograd on them)
        self._unsharded_typed = typed  # the same, typed and shaped (a strided parameter's copy-out target)
        flat.untyped_storage().resize_(0)  # views made; memory comes with the first unshard

    def freed_storage_ptr(self) -> int:
        """The data pointer of the unsharded storage a reshard after forward will free, else 0
        (not allocated, or kept by set_keep_unsharded_storage)."""
        flat = self.unsharded_flat
        if flat is None or self.keep_unsharded or self.held:
            return 0
        storage = flat.untyped_storage()
        return storage.data_ptr() if storage.nbytes() else 0

    def aliased_param_name(self, t: torch.Tensor) -> str:
        """The name of the unsharded parameter whose memory `t` (a view of the unsharded
        storage) starts in."""
        start = t.storage_offset() * t.element_size()
        for i, p in enumerate(self.unsharded_params):
            if p is None or not p.numel():
                continue
            local = p.to_local() if isinstance(p, DTensor) else p
            lo = local.storage_offset() * local.element_size()
            if lo <= start < lo + local.numel() * local.element_size():
                mod, name = self.owners[i][0]
                return f"'{name}' of {type(mod).__name__}"
        return "?"

    def new_unsharded_param(self, i: int, t: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """Parameter `i`'s unsharded parameter over `t`: a DTensor over the TP mesh for a
        tensor-parallel parameter (`t` its TP-local tensor), else `t` itself."""
        spec = self.tp_specs[i]
        return nn.Parameter(t, requires_grad=requires_grad) if spec is None else _tp.unsharded(t, spec, requires_grad)

    # ---------------------------------------------------------------- gradient dtypes (torch >= 2.15)
    # torch 2.15's FSDP2 gives each unsharded parameter the ``grad_dtype`` it accumulates its
    # gradient in: the policy's reduce dtype, else the parameter's original dtype. Where that
    # is wider than the compute dtype (bf16 compute, fp32 reduce), it lifts the dtype during
    # backwards that reduce or add to a gradient already there, so that autograd hands over
    # gradients as the ops made them (bf16 contributions summed in bf16; an op's fp32
    # gradient, such as the CPU LSTM's, kept), and restores it after: a gradient that is kept
    # for accumulation is upcast then, and the first backward without sync accumulates in the
    # wide dtype. fsdp_native does the same, so that its gradients are torch's bit for bit.
    # A tensor-parallel parameter whose gradient may be reduced over TP (a Replicate placement)
    # keeps the wide dtype throughout, as torch keeps it; tensor-subclass parameters (all-gather
    # extensions) keep the dtype their gradients have.
    def _init_grad_dtypes(self) -> None:
        self._wide_grads = []
        # A unit without a reduce dtype has trainable parameters of several original dtypes,
        # which torch FSDP2 refuses at its first forward: no torch behaviour to follow there.
        if not _compat.GRAD_IN_REDUCE_DTYPE or self.policy_reduce_dtype is None:
            return
        layout = self.layout
        for i, (p, orig, spec) in enumerate(zip(self.unsharded_params, layout.orig_dtypes, self.tp_specs)):
            if p is None or layout.ext[i] or not orig.is_floating_point or not p.dtype.is_floating_point:
                continue
            dtype = self.mp.reduce_dtype or orig
            p.grad_dtype = dtype
            if dtype.itemsize > p.dtype.itemsize and (spec is None or not _tp.may_reduce_outside_dp(spec, self.spmd)):
                self._wide_grads.append((i, dtype))

    def defer_grad_upcast(self) -> None:
        """At the unit's pre-backward (torch 2.15's FSDPParamGroup.pre_backward)."""
        for i, _ in self._wide_grads:
            p = self.unsharded_params[i]
            if p.requires_grad and (p.grad is not None or self.requires_gradient_sync):
                p.grad_dtype = None
                self._grad_dtypes_lifted = True

    def restore_grad_dtypes(self) -> None:
        """After the unit's backward: a gradient kept for accumulation is upcast. Where nothing
        was lifted, every wide gradient already came in its wide dtype."""
        if not self._grad_dtypes_lifted:
            return
        self._grad_dtypes_lifted = False
        for i, dtype in self._wide_grads:
            p = self.unsharded_params[i]
            if not p.requires_grad:
                continue
            if p.grad is not None and p.grad.dtype != dtype:
                p.grad = p.grad.to(dtype)
            p.grad_dtype = dtype

    def _alloc_unsharded(self) -> int:
        """Allocates the unsharded storage; returns the bytes newly allocated."""
        self._ensure_unsharded_params()
        storage = self.unsharded_flat.untyped_storage()
        nbytes = self.layout.unsharded_numel * self.unsharded_flat.element_size()
        if storage.nbytes() == 0 and nbytes:
            storage.resize_(nbytes)
            return nbytes
        return 0

    def _free_unsharded(self, force: bool = False) -> None:
        """Frees the unsharded storage (not when kept, unless `force`)."""
        if self.unsharded_flat is None or (self.keep_unsharded and not force):
            return
        storage = self.unsharded_flat.untyped_storage()
        if storage.nbytes():
            self._account(-storage.nbytes())
            storage.resize_(0)
        if self.layout.has_ext:
            self._account(-self.codec.free())

    def _drop_unsharded(self) -> None:
        """Forgets the unsharded parameters (a new layout or device), freeing a kept storage."""
        self._free_unsharded(force=True)
        self.unsharded_flat, self.unsharded_params, self._wide_grads = None, [], []
        self._grad_dtypes_lifted = False

    def _account(self, nbytes: int) -> None:
        self.acct.add(nbytes)
        if self.total_acct is not None:
            self.total_acct.add(nbytes)

    def issue_all_gather(self) -> None:
        """Starts this unit's all-gather (asynchronously) unless it is unsharded or in flight:
        the codec sizes and fills the input, the unit allocates and accounts the output and
        issues the collective."""
        codec = self.codec
        if self.is_unsharded or self.pending_ag is not None:
            return
        if codec.chunk == 0:
            # Only zero-size parameters: nothing to send, but the wait still registers them
            # unsharded (empty plain tensors), as torch FSDP2 does.
            self.pending_ag = PendingAllGather(None, _empty(codec.dtype, self.device))
            return
        if self.sharded_flat.is_meta:
            mod, name = self.owners[0][0] if self.owners else (self.modules[0], "?")
            raise RuntimeError(
                f"fsdp_native: unit '{self.fqn}' has parameters (e.g. '{name}' of {type(mod).__name__}) still on the "
                "meta device; call module.to_empty(device=...) and initialise them before forward"
            )
        ws = self.world_size
        if self._pf_shard is not None:  # backward all-gather within the post-forward group (plain codec)
            group, size, index = self.post_forward
            rec = _trace.active
            t0 = _trace.now_us() if rec is not None else 0.0
            out = self._ag_buffer(ws * codec.chunk, codec.dtype)
            work = self._all_gather(out, self._pf_shard, group, index, size)
            if rec is not None:
                rec.collective("all_gather", "all_gather", self.fqn, work, t0, out.numel() * out.element_size(), group_size=size)
            self._pf_shard_in_flight = self._pf_shard
            self._pf_shard = None
            self._account(out.numel() * out.element_size())
            self.pending_ag = PendingAllGather(work, out)
            return
        if self.post_optim_event is not None:
            torch.get_device_module(self.device.type).current_stream().wait_event(self.post_optim_event)
            self.post_optim_event = None
        chunk = codec.prepare(self)
        rec = _trace.active
        t0 = _trace.now_us() if rec is not None else 0.0
        if codec.in_place:
            # One rank: the flat shard is the gathered data; no buffer, no collective (an
            # all-gather buffer here held one unit more than torch at world size 1).
            if rec is not None:
                rec.collective("all_gather", "all_gather", self.fqn, None, t0, chunk * self.sharded_flat.element_size())
            self.pending_ag = PendingAllGather(None, self.sharded_flat)
            return
        if codec.deferred:
            # One rank with a cast: the copy-out casts at the wait (torch FSDP2 too); an
            # all-gather buffer filled now held one unit more than torch in the backward.
            if rec is not None:
                rec.collective("all_gather", "all_gather", self.fqn, None, t0, chunk * codec.dtype.itemsize)
            self.pending_ag = PendingAllGather(None, None)
            return
        st = self.streams
        st.wait(self.sharded_flat, st.all_gather, st.compute)  # the optimizer wrote the shards on compute
        with st.use(st.all_gather):
            out = self._ag_buffer(ws * chunk, codec.dtype)
            self._account(out.numel() * out.element_size())
            inp = codec.copy_in(self, out, chunk)
            if rec is not None and codec.trace_copy_in and inp is not self.sharded_flat:
                t1 = _trace.now_us()
                rec.span("all_gather_copy_in", "copy", self.fqn, t0, t1)
                t0 = t1
            work = None if ws == 1 else self._all_gather(out, inp, self.info.shard_group, self.rank, ws)
        if rec is not None:
            rec.collective("all_gather", "all_gather", self.fqn, work, t0, out.numel() * out.element_size(), **codec.trace_args)
        self.pending_ag = PendingAllGather(work, out)

    def _ag_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The all-gather output, from :meth:`allocator`."""
        return self.allocator(self.ag_comm, self.info.shard_group)((numel,), dtype=dtype, device=self.device)

    def allocator(self, comm, group):
        """What allocates a collective's buffers, with ``torch.empty``'s (size, *, dtype,
        device): the custom comm's ``allocate`` (`comm`: ``ag_comm`` or ``rs_comm``), the
        process group's (``pg_alloc``), or torch's."""
        if comm is not None:
            return comm.allocate
        if self.pg_alloc:
            return functools.partial(_comm.group_allocate, group)
        return torch.empty

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, group, rank: int, size: int):
        if self.ag_comm is None:
            return _comm.all_gather(out, inp, group, rank, size)
        return self.ag_comm(output_tensor=out, input_tensor=inp, group=group, async_op=True)

    def wait_all_gather(self) -> None:
        """Finishes an issued all-gather: copy-out into the unsharded parameters, which are then
        registered on the modules."""
        if self.pending_ag is None:
            return
        work, out = self.pending_ag  # `out` by this name: _stall reads it from this frame
        self.pending_ag = None
        rec = _trace.active
        st = self.streams
        if work is not None:
            t0 = _trace.now_us() if rec is not None else 0.0
            with st.use(st.all_gather):
                st.wait_work(work)
            if rec is not None:
                rec.waited(work)
                rec.span("wait_all_gather", "stall", self.fqn, t0, _trace.now_us())
        if out is not None:
            st.wait(out, st.compute, st.all_gather)
        self._pf_shard_in_flight = None
        self._ensure_unsharded_params()
        t0 = _trace.now_us() if rec is not None else 0.0
        # The unsharded parameters are reallocated and refilled in place without a version
        # bump (as torch FSDP2 does): autograd may have saved them in forward, and the
        # backward's all-gather refills them. Eager ops here bump nothing, but in a compiled
        # graph's backward (ADInplaceOrView among the thread's dispatch keys) they do.
        with torch.autograd._unsafe_preserve_version_counter(self.unsharded_flat):
            allocated = self._alloc_unsharded()
            allocated += self.codec.copy_out(self, out)
        if rec is not None:
            rec.span("all_gather_copy_out", "copy", self.fqn, t0, _trace.now_us())
        in_backward = self.ctx is not None and self.ctx.in_backward
        if self.post_forward is not None and not in_backward and not self.codec.rebuilds_post_forward:
            # A codec that cannot rebuild its post-forward shard keeps the gathered slice
            # until the forward's reshard (in the backward, nothing needs it).
            _, size, index = self.post_forward
            per = self.world_size // size * self.codec.chunk
            self._pf_keep = out.narrow(0, index * per, per)
        # The unit counts as its all-gather buffer while in flight, then as its parameters.
        self._account(allocated - self._ag_nbytes(out))
        if out is not None:
            st.wait(out, st.all_gather, st.compute)  # `out` came from the all-gather stream: release after the copy-out
        del out
        self._to_unsharded()

    def _ag_nbytes(self, out: torch.Tensor) -> int:
        """Bytes of an all-gather buffer (none when the flat shard stood in for it or the
        cast was deferred to the copy-out)."""
        return 0 if out is None or out is self.sharded_flat else out.numel() * out.element_size()

    def unshard(self) -> None:
        if self.is_unsharded:
            return
        self.issue_all_gather()
        self.wait_all_gather()

    def _to_unsharded(self) -> None:
        ups = self.unsharded_params
        for i, (up, sp) in enumerate(zip(ups, self.sharded_params)):
            if up.requires_grad != sp.requires_grad:
                # As torch FSDP2: requires_grad set on a sharded parameter after fully_shard
                # (freezing or unfreezing it) holds for the unsharded one from its next unshard.
                self.codec.check_requires_grad(self, i, sp.requires_grad)
                up.requires_grad_(sp.requires_grad)
        for (params, name), i in zip(self._slots, self._slot_index):
            params[name] = ups[i]
        self.is_unsharded = True

    def _to_sharded(self) -> None:
        sps = self.sharded_params
        for (params, name), i in zip(self._slots, self._slot_index):
            params[name] = sps[i]
        self.is_unsharded = False

    def hold(self) -> None:
        """A backward with ``create_graph=True`` reached this unit. The graph it builds (the
        double backward of a gradient penalty: ``torch.autograd.grad(out, x, create_graph=True)``)
        saves the unsharded parameters, and a later backward reads them: until :meth:`release`,
        a reshard keeps their storage (as ``set_keep_unsharded_storage`` does). Torch FSDP2
        frees it, and the later backward fails ("setStorage: ... out of bounds").

        The later backward reduces as any does, at the unit's post-backward: autograd runs the
        double backward's nodes, made after the forward, before the forward's nodes that reach
        the unit's inputs (it runs the ready node made last first), so every gradient of the
        unit has arrived by then (``tests/test_higher_order.py`` checks the sums)."""
        if not self.held:
            self.held = True
            self._grads_at_hold = [p.grad for p in self.unsharded_params]

    def accumulated_since_hold(self) -> bool:
        """Whether a backward accumulated parameter gradients since :meth:`hold`: that was
        ``loss.backward(create_graph=True)``, not ``torch.autograd.grad``. (With create_graph,
        autograd accumulates out of place: a new gradient object.)"""
        return any(p.grad is not g for p, g in zip(self.unsharded_params, self._grads_at_hold))

    def release(self) -> None:
        """The end of a :meth:`hold`: the storage is freed now if the unit is resharded, else at
        its next reshard."""
        if self.held:
            self.held = False
            self._grads_at_hold = []
            if not self.is_unsharded:
                self._free_unsharded()

    def hold_unused(self) -> bool:
        """Whether no autograd graph references the held unsharded parameters any more (only
        this unit does): the higher-order graph was freed without a backward through it."""
        return all(p is None or p._use_count() <= 1 for p in self.unsharded_params)

    def reshard(self, after_forward: bool = False) -> None:
        if self.pending_ag is not None:
            self.wait_all_gather()
        if not self.is_unsharded:
            return
        self._to_sharded()
        keep = self._pf_keep
        if after_forward and self.post_forward is not None:
            _, size, index = self.post_forward
            per = self.world_size // size
            if self.codec.rebuilds_post_forward:
                self._pf_shard = self.codec.post_forward_shard(self, index * per, per)
            elif keep is not None:
                self._pf_shard = keep.clone()
        self._pf_keep = None
        if not self.held:
            self._free_unsharded()

    def release_pending(self) -> None:
        """Completes a prefetched all-gather nobody used, keeping collectives matched."""
        if self.pending_ag is not None:
            work, out = self.pending_ag
            self.pending_ag = None
            if work is not None:
                self.streams.wait_work(work)
            self._account(-self._ag_nbytes(out))

    def end_pass(self) -> None:
        """Forgets the forward pass under way (its modules that ran, its marked inputs)."""
        self.in_forward = self.inputs_marked = False
        self.modules_to_run = set()

    def reset_iter(self) -> None:
        """reset_iter_state: back to a resharded unit between iterations, without the failed
        iteration's gradients (the caller has dropped the reductions in flight)."""
        self.release_pending()
        self.pending_rs = None
        self._pending_grads = None
        self.partial_reduce = None
        self._accumulated = None
        self.needs_post_backward = self.recompute_hooked = self.backward_reached = False
        self.release()
        self.end_pass()
        self._t_compute = None
        for p in (*self.unsharded_params, *self.sharded_params):
            if p is not None:  # a subclass parameter's unsharded one exists from its first unshard
                p.grad = None
        self.restore_grad_dtypes()
        self.reshard()
        self._pf_shard = self._pf_shard_in_flight = self._pf_keep = None

    # -------------------------------------------------------------- gradients
    def new_grads(self) -> tuple[torch.Tensor, list[DTensor]]:
        """A fresh flat sharded-gradient buffer and the DTensor gradients viewing it (the
        DTensors reuse the parameters' specs: no sharding propagation per step)."""
        layout = self.layout
        flat = torch.empty(sum(layout.shard_units), dtype=layout.orig_dtype, device=self.sharded_flat.device)
        views = layout.shard_views(flat)
        for i, e in enumerate(layout.ext):
            if e:  # a subclass parameter's gradient is a plain tensor of its shard's shape
                local = self.shard_views[i]
                views[i] = torch.empty(local.shape, dtype=layout.orig_dtypes[i], device=flat.device)
        grads = [make_sharded(v, sp._spec) for v, sp in zip(views, self.sharded_params)]
        return flat, grads

    def reduce_in_place_target(self) -> torch.Tensor:
        """The buffer a reduce-scatter writes straight into; its DTensors become the grads."""
        self._pending_grads = self.new_grads()
        return self._pending_grads[0]

    def _divide_factors(self) -> tuple[float | None, float | None, object, object]:
        """(pre, post, reduce-scatter op, all-reduce op), as torch FSDP2 picks them."""
        dp = self.world_size * self.info.replicate_size
        overflow_risk = self.reduce_dtype not in (torch.float32, torch.bfloat16)
        factor = self.divide_factor
        if not overflow_risk and not self.force_sum:
            if factor is None:
                if dp == 1:
                    return None, None, _ReduceOp.SUM, _ReduceOp.SUM
                return None, None, _ReduceOp.AVG, _ReduceOp.AVG
            if factor == self.world_size:
                return None, None, _ReduceOp.AVG, _ReduceOp.SUM
            return None, factor, _ReduceOp.SUM, _ReduceOp.SUM
        if factor is None:
            factor = float(dp)
        if not overflow_risk:  # sum-only reductions (force_sum) in fp32 / bf16: all after, as torch
            return None, factor, _ReduceOp.SUM, _ReduceOp.SUM
        pre = 1  # fp16: about sqrt(factor) before the sum, the rest after
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return float(pre), factor / pre, _ReduceOp.SUM, _ReduceOp.SUM

    def post_backward(self, force: bool = False) -> None:
        """Hands this unit's unsharded gradients to the reducer (or keeps them when gradient
        sync is off, to accumulate over micro-batches) and reshards the parameters. `force`:
        also when the backward did not reach this unit (gradients that backwards without sync
        left, at finalize_backward; zeros for set_reduce_scatter_unused_params)."""
        if not (self.needs_post_backward or force):
            return
        self.needs_post_backward = self.inputs_marked = False
        self.recompute_hooked = False
        rec = _trace.active
        if rec is not None and self._t_compute is not None:
            rec.span("backward", "compute", self.fqn, self._t_compute, _trace.now_us())
            self._t_compute = None
        if self.pending_rs is not None:
            self.finish_reduce()
        # A unit not unsharded now may still have gradients: set_unshard_in_backward(False)
        # (an embedding's backward needs no weights, so autograd wrote the unsharded
        # parameters' gradients without an all-gather).
        if not (self.is_unsharded or force or self.has_unreduced_grads()):
            return
        ups = self.unsharded_params
        if self.reshard_after_backward:
            # Resharded first, as torch FSDP2 does: the unsharded parameters are freed before
            # the gradients are upcast for accumulation or packed into the reduce-scatter input.
            self.reshard()
        acc = self._accumulated
        if acc is not None:  # add this micro-batch's gradients to the upcast accumulation
            for i, p in enumerate(ups):
                if p.grad is not None and acc[i] is not None:
                    acc[i] += p.grad  # a TP gradient stays a DTensor (Partial ones reduced once, at sync)
                    p.grad = None
        if not self.requires_gradient_sync:
            self.restore_grad_dtypes()
            rd = self.policy_reduce_dtype
            if rd is not None:
                if acc is None:
                    acc = self._accumulated = [None] * len(ups)
                for i, p in enumerate(ups):
                    if p.grad is not None and p.grad.dtype != rd:
                        acc[i] = p.grad.to(rd)
                        p.grad = None
        else:
            grads = [self._local_grad(i, acc[i] if acc is not None and acc[i] is not None else p.grad) for i, p in enumerate(ups)]
            self._accumulated = acc = None  # `grads` holds the accumulations now, and only it
            if self.reduce_unused:
                grads = [
                    torch.zeros(shape, dtype=p.dtype, device=p.device) if g is None and p.requires_grad else g
                    for g, p, shape in zip(grads, ups, self.layout.shapes)
                ]
            has_grad = [g is not None for g in grads]
            if self.policy_reduce_dtype is None and any(has_grad):
                self._check_grad_dtypes(grads)
            for p in ups:
                p.grad = None
            self.restore_grad_dtypes()
            if any(has_grad):
                # `grads` is now the gradients' only owner; the reducer empties it once they
                # are copied into the reduce-scatter input.
                self.ctx.reducer.add(self, grads, has_grad)

    def _local_grad(self, i: int, grad):
        """Unsharded gradient `grad` of parameter `i` as the plain tensor the reducer takes."""
        spec = self.tp_specs[i]
        return grad if grad is None or spec is None else _tp.local_grad(grad, spec, self.spmd)

    def has_unreduced_grads(self) -> bool:
        """Gradients accumulated by backwards without gradient sync, not reduced yet."""
        return any(a is not None for a in self._accumulated or ()) or any(
            p is not None and p.grad is not None for p in self.unsharded_params
        )

    def _check_grad_dtypes(self, grads: list) -> None:
        found = {g.dtype for g in grads if g is not None}
        if len(found) > 1:
            hint = (
                "give the complex parameters units of their own" if any(d.is_complex for d in found)
                else "set mp_policy.param_dtype (one unsharded dtype) or mp_policy.reduce_dtype"
            )
            raise ValueError(
                f"fsdp_native: unit '{self.fqn}' has gradients of dtypes {sorted(map(str, found))}, expected one dtype "
                f"per unit (as torch FSDP2); {hint}"
            )
        dtype = next(g.dtype for g in grads if g is not None)
        if dtype != self.reduce_dtype:
            self.reduce_dtype = dtype

    def reduce_key(self) -> tuple:
        """Units with equal keys can share one reduce-scatter."""
        # A unit with a custom reduce-scatter calls it for its gradients alone, as torch FSDP2 does.
        alone = None if self.rs_comm is None else id(self)
        return (self.reduce_dtype, self.rs_group or self.info.shard_group, self.device, self._divide_factors(), alone, self.pg_alloc)

    def can_reduce_in_place(self, has_grad: list[bool]) -> bool:
        """Whether the reduce-scatter may write straight into the sharded-gradient buffer."""
        return (
            not self.layout.has_ext
            and all(has_grad)  # the reduce-scatter output is then the whole flat gradient buffer
            and self.reduce_dtype == self.layout.orig_dtype
            and self.shard_device == self.device
            and self.partial_reduce is None
            and not any(sp.grad is not None for sp, h in zip(self.sharded_params, has_grad) if h)
        )

    def finish_reduce(self) -> None:
        if self.pending_rs is not None:
            self.ctx.reducer.finish(self.pending_rs)

    def take_reduced(self, out: torch.Tensor, has_grad: list[bool]) -> None:
        """Turns this unit's reduce-scattered flat shard `out` into sharded gradients (HSDP
        all-reduce, division, cast, accumulation), then runs the sharded parameters'
        post-accumulate-grad hooks, as torch FSDP2 does once it has written a sharded gradient
        (optimizer in backward: ``p.register_post_accumulate_grad_hook``, torchtune's
        ``optimizer_in_bwd``)."""
        if not self._write_reduced(out, has_grad):
            return
        for sp, h in zip(self.sharded_params, has_grad):
            hooks = getattr(sp, "_post_accumulate_grad_hooks", None) if h else None
            if hooks:
                for hook in list(hooks.values()):
                    hook(sp)

    def _run_all_reduce_hook(self, out: torch.Tensor) -> None:
        """The all-reduce hook on `out`; on its CUDA stream when it has one, ordered after the
        work queued so far and before what comes next on the current stream."""
        hook, stream = self.all_reduce_hook
        if stream is None or out.device.type != "cuda":
            hook(out)
            return
        current = torch.cuda.current_stream(out.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            hook(out)
        current.wait_stream(stream)

    def _write_reduced(self, out: torch.Tensor, has_grad: list[bool]) -> bool:
        """The sharded gradients from `out`; False when none were written (HSDP without the
        all-reduce: the partial sum is kept for the next backward)."""
        _, post, _, ar_op = self._divide_factors()
        pending, self._pending_grads = self._pending_grads, None
        direct = pending is not None and out is pending[0]
        if self.info.replicate_group is not None:
            if self.partial_reduce is not None:
                out = out + self.partial_reduce if direct else out.add_(self.partial_reduce)
                self.partial_reduce = None
                direct = False
            if not self.requires_all_reduce:
                self.partial_reduce = out.clone() if direct else out
                return False
            rec = _trace.active
            t0 = _trace.now_us() if rec is not None else 0.0
            # Waited like the other collectives, so a stalled replica is reported (_stall).
            work = dist.all_reduce(out, op=ar_op, group=self.info.replicate_group, async_op=True)
            self.streams.wait_work(work)
            if rec is not None:
                rec.span("all_reduce", "all_reduce", self.fqn, t0, _trace.now_us(), out.numel() * out.element_size())
        if self.all_reduce_hook is not None:
            self._run_all_reduce_hook(out)
        sps = self.sharded_params
        if direct:
            if post is not None:
                out.div_(post)
            for sp, g, h in zip(sps, pending[1], has_grad):
                if h:
                    sp.grad = g
            return True
        factor = post if post is not None else 1.0
        if math.frexp(factor)[0] != 0.5:
            # Not a power of two: the copy-out's multiply by 1 / factor rounds differently from
            # torch's division (set_gradient_divide_factor(3.0) with sum-only reductions).
            out.div_(factor)
            factor = 1.0
        device = self.sharded_flat.device
        if out.device != device:
            out = out.to(device)
        accumulate = any(sp.grad is not None for sp, h in zip(sps, has_grad) if h)
        # Fresh gradient buffers only where a parameter gets its first gradient.
        needs_fresh = not accumulate or any(h and sp.grad is None for sp, h in zip(sps, has_grad))
        grad_dtensors = (pending[1] if pending is not None else self.new_grads()[1]) if needs_fresh else None
        if not accumulate:
            ops.reduce_scatter_copy_out(
                out, _with(self.layout.padded, has_grad), _with([g._local_tensor for g in grad_dtensors], has_grad), divide_factor=factor
            )
            for sp, g, h in zip(sps, grad_dtensors, has_grad):
                if h:
                    sp.grad = g
            return True
        targets = []
        for i, (sp, h) in enumerate(zip(sps, has_grad)):
            if not h:
                targets.append(_empty(self.reduce_dtype, device))
            elif sp.grad is None:
                g = grad_dtensors[i]
                g._local_tensor.zero_()
                sp.grad = g
                targets.append(g._local_tensor)
            else:
                targets.append(sp.grad._local_tensor)
        ops.reduce_scatter_copy_out(out, _with(self.layout.padded, has_grad), _with(targets, has_grad), divide_factor=factor, accumulate=True)
        return True


def _with(items: list, has_grad: list[bool]) -> list:
    """The entries of the parameters that have a gradient (the only ones reduced)."""
    return [x for x, h in zip(items, has_grad) if h]


_EMPTIES: dict = {}


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    t = _EMPTIES.get(key)
    if t is None:
        t = _EMPTIES[key] = torch.empty(0, dtype=dtype, device=device)
    return t
