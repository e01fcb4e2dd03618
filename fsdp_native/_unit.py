"""One unit: the parameters of one fully_shard call, all-gathered in one collective and
reduce-scattered in one.

Memory layout. The sharded parameters of a unit are views into one flat buffer of
``sum(padded_numels)`` elements (each parameter's rank-local dim-0 shard, zero padded to its
padded shard size), so with no dtype cast that buffer *is* the all-gather input. The unsharded
parameters are views into one flat buffer whose storage is freed (``resize_(0)``) on reshard
and re-allocated on unshard, so autograd's references to them stay valid. The reduce-scatter
output, when it needs no cast, is the flat sharded-gradient buffer itself and the sharded
gradients are views into it.

Mixed dtypes (fp32 adapters beside bf16 frozen weights, fp32 norms beside bf16 weights), as
torch FSDP2 allows: the flat buffers are bytes (uint8) and each parameter's region is a view
of its own dtype. Parameters are ordered by element size, largest first, so every region
starts aligned for its dtype. With one unsharded dtype (``param_dtype`` set) the all-gather
runs in it and the copy-in casts each shard; with several, the all-gather moves the bytes and
the copy-out copies bytes. Still one collective per unit.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_native import _comm, _extension, _trace, ops
from fsdp_native._api import CPUOffloadPolicy, MixedPrecisionPolicy, QuantizedAllGather
from fsdp_native._dtensor import ShardedDTensor, make_sharded
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
        # Unsharded gradients accumulated over no-sync micro-batches in the reduce dtype, when
        # that differs from the parameter dtype (bf16 compute, fp32 reduce), as torch does.
        self._accumulated: list[torch.Tensor | None] | None = None
        self.fqn = ""
        # Forward-pass state of the unit as one hook target (several modules may share it).
        self.in_forward = False
        self.modules_to_run: set[nn.Module] = set()
        self.ctx = None  # the root context, set at lazy init
        self.acct = Accounting()
        self.total_acct: Accounting | None = None
        self.forward_prefetch: list[Unit] | None = None
        self.backward_prefetch: list[Unit] | None = None
        self.post_optim_event = None

        ws, rank = info.shard_size, info.shard_rank
        self.world_size, self.rank = ws, rank
        if len({p.dtype for p in params}) > 1:
            order = sorted(range(len(params)), key=lambda i: -params[i].dtype.itemsize)  # stable
            params, owners = [params[i] for i in order], [owners[i] for i in order]
            self.owners = owners
        # Parameters of torch's all-gather extension protocol (tensor subclasses such as
        # torchao's NF4Tensor) gather what they choose; see _extension.py.
        self.ext = [_extension.has_extension(p) for p in params]
        if any(self.ext):
            _check_extension_params(params, owners, self.ext, ws, offload, post_forward)
        self.has_ext = any(self.ext)
        self._ext_state = [_extension.ExtState() if e else None for e in self.ext]
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.padded = [ops.padded_shard_numel(s, ws) for s in self.shapes]
        self.total_numel = sum(self.numels)
        self.orig_dtypes = [p.dtype for p in params]
        self.param_dtypes = [mp.param_dtype or d for d in self.orig_dtypes]
        mixed = len(set(self.orig_dtypes)) > 1 or self.has_ext
        # Sharded storage: one typed flat buffer, or bytes when the original dtypes differ.
        self.orig_dtype = torch.uint8 if mixed else (self.orig_dtypes[0] if params else torch.float32)
        self.shard_units = [0 if e else n * d.itemsize for n, d, e in zip(self.padded, self.orig_dtypes, self.ext)] if mixed else self.padded
        # All-gather (and unsharded storage): the one unsharded dtype, or bytes.
        self.gather_bytes = len(set(self.param_dtypes)) > 1 or self.has_ext
        self.param_dtype = torch.uint8 if self.gather_bytes else (self.param_dtypes[0] if params else self.orig_dtype)
        self.ag_padded = [n * d.itemsize for n, d in zip(self.padded, self.param_dtypes)] if self.gather_bytes else self.padded
        self.total_padded = sum(self.ag_padded)  # all-gather elements per rank
        self.reduce_total = sum(self.padded)  # reduce-scatter elements per rank
        self.unsharded_numel = (
            sum(0 if e else n * d.itemsize for n, d, e in zip(self.numels, self.param_dtypes, self.ext))
            if self.gather_bytes
            else self.total_numel
        )
        self.needs_cast = self.param_dtypes != self.orig_dtypes
        self.requires_grad = [p.requires_grad for p in params]
        # One gradient dtype per unit, as torch FSDP2 requires: the reduce dtype, else that of
        # the unsharded parameters with gradients (checked when they are reduced).
        grad_dtypes = {d for d, rg in zip(self.param_dtypes, self.requires_grad) if rg}
        self.reduce_dtype = mp.reduce_dtype or (grad_dtypes.pop() if len(grad_dtypes) == 1 else self.param_dtypes[0] if params else torch.float32)
        self.device = info.device
        self.streams = streams_for(info.device)  # replaced by the root's shared streams at lazy init
        self.shard_device = torch.device("cpu") if offload is not None else info.device
        self._shard(params)
        self._qplan = _QuantPlan.make(self, all_gather) if all_gather is not None else None
        if self._qplan is not None:
            self.total_padded = self._qplan.chunk
        # Views and per-parameter registration slots, built once.
        self._slots = [(mod._parameters, name) for owner in owners for (mod, name) in owner]
        self._slot_index = [i for i, owner in enumerate(owners) for _ in owner]
        self.unsharded_flat: torch.Tensor | None = None
        self.unsharded_params: list[nn.Parameter] = []
        self.is_unsharded = False
        self.pending_ag = None  # (work, all-gather output) of an issued all-gather
        self.pending_rs = None
        self.partial_reduce: torch.Tensor | None = None
        self.needs_post_backward = False
        self._t_compute: float | None = None  # start of the unit's running compute (tracing)
        self._pf_shard: torch.Tensor | None = None
        self._pf_shard_in_flight: torch.Tensor | None = None  # input of an in-flight all-gather: kept alive
        self._pf_keep: torch.Tensor | None = None
        # Sharded gradients the in-flight reduce-scatter writes into directly (fresh each step:
        # a user may keep last step's gradients, as with torch).
        self._pending_grads: tuple[torch.Tensor, list[DTensor]] | None = None

    # ----------------------------------------------------------------- sharding
    def _local_rows(self, shape: torch.Size) -> int:
        rows = -(-shape[0] // self.world_size)
        return max(0, min(rows, shape[0] - self.rank * rows))

    def _shard(self, params: list[nn.Parameter]) -> None:
        device = params[0].device if params and params[0].is_meta else self.shard_device
        flat = torch.zeros(sum(self.shard_units), dtype=self.orig_dtype, device=device)
        self.sharded_flat = flat
        self.shard_views = self._views(flat)
        self.sharded_params = []
        with torch.no_grad():
            for i, p in enumerate(params):
                if self.ext[i]:
                    self._shard_extension(i, p)
                    continue
                view = self.shard_views[i]
                if not p.is_meta and view.numel():
                    start = self.rank * self.padded[i]
                    view.copy_(p.detach().reshape(-1)[start : start + view.numel()].view_as(view))
                spec = DTensor.from_local(
                    view, self.info.mesh, self.info.placements, run_check=False, shape=p.shape, stride=p.stride()
                )._spec
                sp = nn.Parameter(make_sharded(view, spec), requires_grad=p.requires_grad)
                sp._local_tensor = view  # Parameter() detached a copy of the wrapper: point it back at our view
                sp._fsdp_native_unit = self  # who owns it, for the error when it is sharded again
                self.sharded_params.append(sp)
                for mod, name in self.owners[i]:
                    mod._parameters[name] = sp

    def _shard_extension(self, i: int, p: nn.Parameter) -> None:
        """A subclass parameter keeps its own rank-local shard (dim 0 divides evenly)."""
        local = torch.chunk(p.detach(), self.world_size, dim=0)[self.rank]
        dt = DTensor.from_local(local, self.info.mesh, self.info.placements, run_check=False, shape=p.shape, stride=p.stride())
        sp = nn.Parameter(dt, requires_grad=p.requires_grad)
        self.shard_views[i] = sp._local_tensor
        sp._fsdp_native_unit = self
        self.sharded_params.append(sp)
        for mod, name in self.owners[i]:
            mod._parameters[name] = sp

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """This rank's shard of every parameter, as views into a flat padded buffer (typed
        views into a byte buffer when the dtypes differ)."""
        views, offset = [], 0
        by_bytes = flat.dtype == torch.uint8 and self.orig_dtype == torch.uint8
        for shape, units, dtype in zip(self.shapes, self.shard_units, self.orig_dtypes):
            n = self._local_rows(shape) * math.prod(shape[1:])
            if by_bytes:
                views.append(flat[offset : offset + n * dtype.itemsize].view(dtype).view((-1, *shape[1:])))
            else:
                views.append(flat[offset : offset + n].view((-1, *shape[1:])))
            offset += units
        return views

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
        same = all(p is sp for p, sp in zip(params, self.sharded_params)) and all(
            p._local_tensor is v for p, v in zip(params, self.shard_views)
        )
        if same:
            return
        for i, p in enumerate(params):
            self._check_replacement(i, p)
        locals_ = [p._local_tensor for p in params]
        device = locals_[0].device if locals_ else self.shard_device
        if not device.type == "meta" and self.offload is not None:
            device = torch.device("cpu")
        flat = torch.zeros(sum(self.shard_units), dtype=self.orig_dtype, device=device)
        views = self._views(flat)
        with torch.no_grad():
            for i, (p, loc, view) in enumerate(zip(params, locals_, views)):
                if self.ext[i]:  # a subclass shard stays as it is
                    views[i] = loc
                    p._fsdp_native_unit = self
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
        if self.unsharded_flat is not None and self.unsharded_flat.device != self.device and device.type != "meta":
            self.unsharded_flat = None
            self.unsharded_params = []

    def _check_replacement(self, i: int, p) -> None:
        """A tensor registered in place of sharded parameter `i` must be a DTensor with the
        same global shape, dtype and placements, else re-packing it would corrupt the unit."""
        mod, name = self.owners[i][0]
        where = f"parameter '{name}' of {type(mod).__name__} (unit '{self.fqn}')"
        ref = self.sharded_params[i]
        if not isinstance(p, DTensor):
            raise ValueError(
                f"fsdp_native: {where} was replaced by a {type(p).__name__} of shape {tuple(p.shape)}, expected a "
                f"DTensor of shape {tuple(ref.shape)} with placements {ref.placements} (load a sharded state dict, "
                "e.g. from get_model_state_dict, or load without assign=True)"
            )
        if p.shape != ref.shape or p.dtype != ref.dtype or tuple(p.placements) != tuple(ref.placements) or p.device_mesh != ref.device_mesh:
            raise ValueError(
                f"fsdp_native: {where} was replaced by a DTensor of shape {tuple(p.shape)}, dtype {p.dtype}, placements "
                f"{p.placements}, expected shape {tuple(ref.shape)}, dtype {ref.dtype}, placements {ref.placements} "
                "on the unit's mesh"
            )

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
        flat = torch.empty(self.unsharded_numel, dtype=self.param_dtype, device=self.device)
        self.unsharded_flat = flat
        params, plain, offset = [], [], 0
        for shape, numel, rg, dtype, ext in zip(self.shapes, self.numels, self.requires_grad, self.param_dtypes, self.ext):
            n = 0 if ext else numel * dtype.itemsize if self.gather_bytes else numel
            plain.append(flat[offset : offset + n])  # bytes, when the all-gather moves bytes
            typed = plain[-1].view(dtype) if self.gather_bytes else plain[-1]
            # A subclass parameter's unsharded tensor comes from its first fsdp_post_all_gather.
            params.append(None if ext else nn.Parameter(typed.view(shape), requires_grad=rg))
            offset += n
        self.unsharded_params = params
        self._unsharded_plain = plain  # plain views the copy-out writes (no autograd on them)
        flat.untyped_storage().resize_(0)  # views made; memory comes with the first unshard

    def _alloc_unsharded(self) -> int:
        """Allocates the unsharded storage; returns the bytes newly allocated."""
        self._ensure_unsharded_params()
        storage = self.unsharded_flat.untyped_storage()
        nbytes = self.unsharded_numel * self.unsharded_flat.element_size()
        if storage.nbytes() == 0 and nbytes:
            storage.resize_(nbytes)
            return nbytes
        return 0

    def _free_unsharded(self) -> None:
        if self.unsharded_flat is None:
            return
        storage = self.unsharded_flat.untyped_storage()
        if storage.nbytes():
            self._account(-storage.nbytes())
            storage.resize_(0)
        if self.has_ext:
            self._account(-sum(st.free() for st in self._ext_state if st is not None))

    def _account(self, nbytes: int) -> None:
        self.acct.add(nbytes)
        if self.total_acct is not None:
            self.total_acct.add(nbytes)

    def issue_all_gather(self) -> None:
        """Starts this unit's all-gather (asynchronously) unless it is unsharded or in flight."""
        if self.is_unsharded or self.pending_ag is not None or self.total_padded == 0:
            return
        if self.sharded_flat.is_meta:
            mod, name = self.owners[0][0] if self.owners else (self.modules[0], "?")
            raise RuntimeError(
                f"fsdp_native: unit '{self.fqn}' has parameters (e.g. '{name}' of {type(mod).__name__}) still on the "
                "meta device; call module.to_empty(device=...) and initialise them before forward"
            )
        ws, S = self.world_size, self.total_padded
        if self._pf_shard is not None:  # backward all-gather within the post-forward group
            group, size, index = self.post_forward
            rec = _trace.active
            t0 = _trace.now_us() if rec is not None else 0.0
            out = torch.empty(ws * S, dtype=self.param_dtype, device=self.device)
            work = _comm.all_gather(out, self._pf_shard, group, index, size)
            if rec is not None:
                rec.collective("all_gather", "all_gather", self.fqn, work, t0, out.numel() * out.element_size(), group_size=size)
            self._pf_shard_in_flight = self._pf_shard
            self._pf_shard = None
            self._account(out.numel() * out.element_size())
            self.pending_ag = (work, out)
            return
        if self.post_optim_event is not None:
            torch.get_device_module(self.device.type).current_stream().wait_event(self.post_optim_event)
            self.post_optim_event = None
        if self.has_ext:
            self._issue_extension_all_gather()
            return
        if self._qplan is not None:
            self._issue_quantized_all_gather()
            return
        rec = _trace.active
        t0 = _trace.now_us() if rec is not None else 0.0
        if ws == 1 and not self.needs_cast and self.shard_device == self.device:
            # One rank: the flat shard is the gathered data; no buffer, no collective (an
            # all-gather buffer here held one unit more than torch at world size 1).
            if rec is not None:
                rec.collective("all_gather", "all_gather", self.fqn, None, t0, S * self.sharded_flat.element_size())
            self.pending_ag = (None, self.sharded_flat)
            return
        st = self.streams
        st.wait(self.sharded_flat, st.all_gather, st.compute)  # the optimizer wrote the shards on compute
        with st.use(st.all_gather):
            out = torch.empty(ws * S, dtype=self.param_dtype, device=self.device)
            self._account(out.numel() * out.element_size())
            if not self.needs_cast and self.shard_device == self.device:
                inp = self.sharded_flat  # padding is kept zero: the flat shard is the input as is
            elif self.shard_device != self.device:
                staged = self.sharded_flat.to(self.device, non_blocking=True)
                inp = out.narrow(0, self.rank * S, S)
                if self.needs_cast:
                    ops.all_gather_copy_in(self._views(staged), self.padded, inp)
                else:
                    ops.all_gather_copy_in([staged], [S], inp)
            else:
                inp = out.narrow(0, self.rank * S, S)
                ops.all_gather_copy_in(self.shard_views, self.padded, inp)
            if rec is not None:
                t1 = _trace.now_us()
                if inp is not self.sharded_flat:
                    rec.span("all_gather_copy_in", "copy", self.fqn, t0, t1)
                t0 = t1
            if ws == 1:
                if inp is not out:
                    out.copy_(inp)
                work = None
            else:
                work = _comm.all_gather(out, inp, self.info.shard_group, self.rank, ws)
        if rec is not None:
            rec.collective("all_gather", "all_gather", self.fqn, work, t0, out.numel() * out.element_size())
        self.pending_ag = (work, out)

    def wait_all_gather(self) -> None:
        """Finishes an issued all-gather: copy-out into the unsharded parameters, which are then
        registered on the modules."""
        if self.pending_ag is None:
            return
        work, out = self.pending_ag
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
        st.wait(out, st.compute, st.all_gather)
        self._pf_shard_in_flight = None
        allocated = self._alloc_unsharded()
        t0 = _trace.now_us() if rec is not None else 0.0
        if self.has_ext:
            allocated += self._extension_copy_out(out)
        elif self._qplan is not None:
            self._qplan.copy_out(self, out)
        else:
            ops.all_gather_copy_out(out, self.ag_padded, self.world_size, self._unsharded_plain)
        if rec is not None:
            rec.span("all_gather_copy_out", "copy", self.fqn, t0, _trace.now_us())
        if self.post_forward is not None:
            _, size, index = self.post_forward
            per = self.world_size // size * self.total_padded
            self._pf_keep = out.narrow(0, index * per, per)
        # The unit counts as its all-gather buffer while in flight, then as its parameters.
        self._account(allocated - self._ag_nbytes(out))
        st.wait(out, st.all_gather, st.compute)  # `out` came from the all-gather stream: release after the copy-out
        del out
        self._to_unsharded()

    def _issue_quantized_all_gather(self) -> None:
        """fsdp_native's quantized all-gather: each rank's chunk is the quantized parameters'
        codes and scales (one kernel for the unit), then the other parameters' padded shards
        in the unsharded dtype; one collective."""
        plan, ws = self._qplan, self.world_size
        rec = _trace.active
        t0 = _trace.now_us() if rec is not None else 0.0
        st = self.streams
        st.wait(self.sharded_flat, st.all_gather, st.compute)
        with st.use(st.all_gather):
            out = torch.empty(ws * plan.chunk, dtype=torch.uint8, device=self.device)
            self._account(out.numel())
            inp = out.narrow(0, self.rank * plan.chunk, plan.chunk)
            plan.copy_in(self, inp)
            if rec is not None:
                t1 = _trace.now_us()
                rec.span("all_gather_copy_in", "copy", self.fqn, t0, t1)
                t0 = t1
            work = None if ws == 1 else _comm.all_gather(out, inp, self.info.shard_group, self.rank, ws)
        if rec is not None:
            rec.collective("all_gather", "all_gather", self.fqn, work, t0, out.numel(), format=plan.policy.format)
        self.pending_ag = (work, out)

    def _issue_extension_all_gather(self) -> None:
        """One all-gather of bytes: every subclass parameter's inner tensors and every plain
        parameter's padded shard in its unsharded dtype (see _extension.py)."""
        ws, info = self.world_size, self.info
        mesh = info.mesh if info.mesh.ndim == 1 else info.mesh[info.mesh.mesh_dim_names[-1]]
        inputs, seg = [], []
        for i, local in enumerate(self.shard_views):
            if self.ext[i]:
                mod = self.owners[i][0][0]
                inners, meta = _extension.pre_all_gather(local, mesh, self.shapes[i], mod, self.mp)
                state = self._ext_state[i]
                state.sizes, state.meta = [t.shape for t in inners], meta
                state.ensure_outputs(inners, ws)  # made (or checked) now, allocated at the copy-out
                inputs += inners
            else:
                padded = torch.zeros(self.padded[i], dtype=self.param_dtypes[i], device=self.device)
                padded[: local.numel()].copy_(local.reshape(-1))
                inputs.append(padded)
        seg = [t.numel() * t.element_size() for t in inputs]
        self._ext_segments = seg
        total = sum(seg)
        rec = _trace.active
        t0 = _trace.now_us() if rec is not None else 0.0
        st = self.streams
        st.wait(self.sharded_flat, st.all_gather, st.compute)
        with st.use(st.all_gather):
            out = torch.empty(ws * total, dtype=torch.uint8, device=self.device)
            self._account(out.numel())
            inp = out.narrow(0, self.rank * total, total)
            ops.all_gather_copy_in([t.reshape(-1).view(torch.uint8) for t in inputs], seg, inp)
            work = None if ws == 1 else _comm.all_gather(out, inp, info.shard_group, self.rank, ws)
        if rec is not None:
            rec.collective("all_gather", "all_gather", self.fqn, work, t0, out.numel())
        self.pending_ag = (work, out)

    def _extension_copy_out(self, out: torch.Tensor) -> int:
        """Copies the gathered bytes into the plain parameters and into each subclass
        parameter's persistent outputs, then runs its fsdp_post_all_gather. Returns the bytes
        of outputs allocated."""
        outs, allocated = [], 0
        plain = iter(self._unsharded_plain)
        for i in range(len(self.shapes)):
            view = next(plain)
            if self.ext[i]:
                state = self._ext_state[i]
                allocated += state.alloc()
                outs += [o.view(torch.uint8) for o in state.outputs]
            else:
                outs.append(view)
        ops.all_gather_copy_out(out, self._ext_segments, self.world_size, outs)
        for i, local in enumerate(self.shard_views):
            if self.ext[i]:
                self.unsharded_params[i] = _extension.post_all_gather(
                    local, self._ext_state[i], self.param_dtypes[i], self.unsharded_params[i], self.requires_grad[i]
                )
        return allocated

    def _ag_nbytes(self, out: torch.Tensor) -> int:
        """Bytes of an all-gather buffer (none when the flat shard stood in for it)."""
        return 0 if out is self.sharded_flat else out.numel() * out.element_size()

    def unshard(self) -> None:
        if self.is_unsharded:
            return
        self.issue_all_gather()
        self.wait_all_gather()

    def _to_unsharded(self) -> None:
        ups = self.unsharded_params
        for (params, name), i in zip(self._slots, self._slot_index):
            params[name] = ups[i]
        self.is_unsharded = True

    def _to_sharded(self) -> None:
        sps = self.sharded_params
        for (params, name), i in zip(self._slots, self._slot_index):
            params[name] = sps[i]
        self.is_unsharded = False

    def reshard(self, after_forward: bool = False) -> None:
        if self.pending_ag is not None:
            self.wait_all_gather()
        if not self.is_unsharded:
            return
        self._to_sharded()
        keep = self._pf_keep
        if after_forward and self.post_forward is not None and keep is not None:
            self._pf_shard = keep.clone()
        self._pf_keep = None
        self._free_unsharded()

    def release_pending(self) -> None:
        """Completes a prefetched all-gather nobody used, keeping collectives matched."""
        if self.pending_ag is not None:
            work, out = self.pending_ag
            self.pending_ag = None
            if work is not None:
                work.wait()
            self._account(-self._ag_nbytes(out))

    # -------------------------------------------------------------- gradients
    def new_grads(self) -> tuple[torch.Tensor, list[DTensor]]:
        """A fresh flat sharded-gradient buffer and the DTensor gradients viewing it (the
        DTensors reuse the parameters' specs: no sharding propagation per step)."""
        flat = torch.empty(sum(self.shard_units), dtype=self.orig_dtype, device=self.sharded_flat.device)
        views = self._views(flat)
        for i, e in enumerate(self.ext):
            if e:  # a subclass parameter's gradient is a plain tensor of its shard's shape
                local = self.shard_views[i]
                views[i] = torch.empty(local.shape, dtype=self.orig_dtypes[i], device=flat.device)
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
        pre = 1
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return float(pre), factor / pre, _ReduceOp.SUM, _ReduceOp.SUM

    def post_backward(self) -> None:
        """Hands this unit's unsharded gradients to the reducer (or keeps them when gradient
        sync is off, to accumulate over micro-batches) and reshards the parameters."""
        if not self.needs_post_backward:
            return
        self.needs_post_backward = False
        rec = _trace.active
        if rec is not None and self._t_compute is not None:
            rec.span("backward", "compute", self.fqn, self._t_compute, _trace.now_us())
            self._t_compute = None
        if self.pending_rs is not None:
            self.finish_reduce()
        if not self.is_unsharded:
            return
        ups = self.unsharded_params
        acc = self._accumulated
        if acc is not None:  # add this micro-batch's gradients to the upcast accumulation
            for i, p in enumerate(ups):
                if p.grad is not None and acc[i] is not None:
                    acc[i] += p.grad
                    p.grad = None
        if not self.requires_gradient_sync:
            rd = self.mp.reduce_dtype
            if rd is not None:
                if acc is None:
                    acc = self._accumulated = [None] * len(ups)
                for i, p in enumerate(ups):
                    if p.grad is not None and p.grad.dtype != rd:
                        acc[i] = p.grad.to(rd)
                        p.grad = None
        else:
            grads = [acc[i] if acc is not None and acc[i] is not None else p.grad for i, p in enumerate(ups)]
            self._accumulated = None
            has_grad = [g is not None for g in grads]
            if self.mp.reduce_dtype is None and any(has_grad):
                self._check_grad_dtypes(grads)
            if any(has_grad):
                self.ctx.reducer.add(self, grads, has_grad)
            for p in ups:
                p.grad = None
        if self.reshard_after_backward:
            self.reshard()

    def _check_grad_dtypes(self, grads: list) -> None:
        dtypes = sorted({str(g.dtype) for g in grads if g is not None})
        if len(dtypes) > 1:
            raise ValueError(
                f"fsdp_native: unit '{self.fqn}' has gradients of dtypes {dtypes}, expected one dtype per unit (as torch "
                "FSDP2); set mp_policy.param_dtype (one unsharded dtype) or mp_policy.reduce_dtype"
            )
        dtype = next(g.dtype for g in grads if g is not None)
        if dtype != self.reduce_dtype:
            self.reduce_dtype = dtype

    def reduce_key(self) -> tuple:
        """Units with equal keys can share one reduce-scatter."""
        return (self.reduce_dtype, self.info.shard_group, self.device, self._divide_factors())

    def can_reduce_in_place(self, has_grad: list[bool]) -> bool:
        """Whether the reduce-scatter may write straight into the sharded-gradient buffer."""
        return (
            not self.has_ext
            and all(has_grad)  # the reduce-scatter output is then the whole flat gradient buffer
            and self.reduce_dtype == self.orig_dtype
            and self.shard_device == self.device
            and self.partial_reduce is None
            and not any(sp.grad is not None for sp, h in zip(self.sharded_params, has_grad) if h)
        )

    def finish_reduce(self) -> None:
        if self.pending_rs is not None:
            self.ctx.reducer.finish(self.pending_rs)

    def take_reduced(self, out: torch.Tensor, has_grad: list[bool]) -> None:
        """Turns this unit's reduce-scattered flat shard `out` into sharded gradients: HSDP
        all-reduce, division, cast, accumulation."""
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
                return
            rec = _trace.active
            t0 = _trace.now_us() if rec is not None else 0.0
            dist.all_reduce(out, op=ar_op, group=self.info.replicate_group)
            if rec is not None:
                rec.span("all_reduce", "all_reduce", self.fqn, t0, _trace.now_us(), out.numel() * out.element_size())
        sps = self.sharded_params
        if direct:
            if post is not None:
                out.div_(post)
            for sp, g, h in zip(sps, pending[1], has_grad):
                if h:
                    sp.grad = g
            return
        device = self.sharded_flat.device
        if out.device != device:
            out = out.to(device)
        factor = post if post is not None else 1.0
        accumulate = any(sp.grad is not None for sp, h in zip(sps, has_grad) if h)
        # Fresh gradient buffers only where a parameter gets its first gradient.
        needs_fresh = not accumulate or any(h and sp.grad is None for sp, h in zip(sps, has_grad))
        grad_dtensors = (pending[1] if pending is not None else self.new_grads()[1]) if needs_fresh else None
        if not accumulate:
            ops.reduce_scatter_copy_out(
                out, _with(self.padded, has_grad), _with([g._local_tensor for g in grad_dtensors], has_grad), divide_factor=factor
            )
            for sp, g, h in zip(sps, grad_dtensors, has_grad):
                if h:
                    sp.grad = g
            return
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
        ops.reduce_scatter_copy_out(out, _with(self.padded, has_grad), _with(targets, has_grad), divide_factor=factor, accumulate=True)


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


def _check_extension_params(params, owners, ext, world_size: int, offload, post_forward) -> None:
    """What fsdp_native supports of torch's all-gather extension protocol, checked at
    fully_shard: dim 0 divisible by the shard world size (each rank's inner tensors must have
    equal sizes), no CPU offload, no int reshard_after_forward."""
    for p, owner, e in zip(params, owners, ext):
        if not e:
            continue
        mod, name = owner[0]
        where = f"parameter '{name}' of {type(mod).__name__} ({type(p).__name__})"
        if p.dim() == 0 or p.shape[0] % world_size:
            raise ValueError(
                f"fully_shard: {where} has shape {tuple(p.shape)}; a tensor-subclass parameter with "
                f"fsdp_pre_all_gather needs dim 0 divisible by the shard world size {world_size}"
            )
        if offload is not None:
            raise NotImplementedError(f"fully_shard: {where} uses the all-gather extension protocol, which fsdp_native does not support with CPU offload")
        if post_forward is not None:
            raise NotImplementedError(
                f"fully_shard: {where} uses the all-gather extension protocol, which fsdp_native does not support with "
                "an int reshard_after_forward"
            )


class _QuantPlan:
    """Which parameters of a unit the quantized all-gather quantizes, and the byte layout of
    one rank's chunk: ``[quantized codes and scales (quant.unit_layout)][the other
    parameters' padded shards in the unsharded dtype]``."""

    def __init__(self, policy: QuantizedAllGather, q: list[int], plain: list[int], rows: list[int], layout, itemsize: int, unit) -> None:
        self.policy, self.q, self.plain, self.rows = policy, q, plain, rows
        self.q_bytes = layout.rank_nbytes
        self.chunk = self.q_bytes + sum(unit.padded[i] for i in plain) * itemsize
        self.itemsize = itemsize
        self.q_padded = [unit.padded[i] for i in q]
        self.plain_padded = [self.q_bytes // itemsize] + [unit.padded[i] for i in plain]
        self.empty = torch.empty(0, dtype=unit.param_dtype, device=unit.device)

    @staticmethod
    def make(unit, policy: QuantizedAllGather) -> "_QuantPlan | None":
        from fsdp_native import quant

        where = f"fully_shard: argument 'all_gather' ({policy.format})"
        if unit.has_ext:
            raise NotImplementedError(f"{where} cannot be combined with tensor-subclass parameters (torch's all-gather extensions)")
        if unit.offload is not None or unit.post_forward is not None:
            raise NotImplementedError(f"{where} is not supported with CPU offload or an int reshard_after_forward")
        if unit.gather_bytes:
            raise NotImplementedError(
                f"{where} needs one unsharded dtype per unit, got {sorted({str(d) for d in unit.param_dtypes})}; set "
                "mp_policy.param_dtype"
            )
        q = [
            i
            for i, shape in enumerate(unit.shapes)
            if len(shape) >= 2
            and unit.numels[i] >= policy.min_numel
            and (policy.format != quant.NF4 or not unit.requires_grad[i])
        ]
        if not q:
            return None
        plain = [i for i in range(len(unit.shapes)) if i not in q]
        rows = [math.prod(unit.shapes[i][1:]) for i in q]
        layout = quant.unit_layout([unit.padded[i] for i in q], rows, policy.format, block_size=policy.block_size)
        return _QuantPlan(policy, q, plain, rows, layout, unit.param_dtype.itemsize, unit)

    def copy_in(self, unit, inp: torch.Tensor) -> None:
        from fsdp_native import quant

        if self.plain:  # zeroes the quantized region first (an empty source), then the shards
            views = [self.empty] + [unit.shard_views[i] for i in self.plain]
            ops.all_gather_copy_in(views, self.plain_padded, inp.view(unit.param_dtype))
        quant.quantize_copy_in(
            [unit.shard_views[i] for i in self.q],
            self.q_padded,
            self.rows,
            inp.narrow(0, 0, self.q_bytes),
            format=self.policy.format,
            block_size=self.policy.block_size,
        )

    def copy_out(self, unit, out: torch.Tensor) -> None:
        from fsdp_native import quant

        ws = unit.world_size
        gathered = out.view(ws, self.chunk)[:, : self.q_bytes]
        outs = unit._unsharded_plain
        quant.dequantize_copy_out(
            gathered, self.q_padded, self.rows, ws, [outs[i] for i in self.q], format=self.policy.format, block_size=self.policy.block_size
        )
        if self.plain:
            ops.all_gather_copy_out(out.view(unit.param_dtype), self.plain_padded, ws, [self.empty] + [outs[i] for i in self.plain])
