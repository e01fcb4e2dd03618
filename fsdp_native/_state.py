"""Hooks and the per-root context: lazy init, prefetch order, end-of-backward work."""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.autograd import forward_ad as _forward_ad

from fsdp_native import _agreement, _trace, _tree
from fsdp_native._reduce import Reducer
from fsdp_native._streams import Streams
from fsdp_native._unit import Accounting, Unit


def _eager(fn):
    """`fn` run with dynamo off: the backward's hooks and callbacks (pre-backward, post-backward,
    end of backward), like the forward hooks (``_fully_shard._eager_hooks``). A compiled
    function that calls ``loss.backward()`` breaks its graph there, and dynamo would otherwise
    trace the frames the backward runs (torch 2.11 did, and failed in the reduction)."""
    return torch.compiler.disable(fn, recursive=True)


def _run_post_backward(unit: Unit) -> None:
    for u in unit.group:
        if not u.needs_post_backward:
            # No pre-backward hook ran for this forward: a module of a several-module unit
            # called on its own hooks no outputs (torchtitan's chunked loss calls the head of
            # the [norm, head] unit once per sequence chunk, each with its own backward). As in
            # torch FSDP2, the backward reaching the forward's inputs still runs the unit's
            # post-backward: its gradients are accumulated in the reduce dtype or reduced.
            u.needs_post_backward = u.backward_reached = True
        if u.held and torch.is_grad_enabled() and not u.accumulated_since_hold():
            continue  # torch.autograd.grad(..., create_graph=True): nothing to reduce (Unit.hold)
        u.post_backward()


def _functorch_off(fn):
    """`fn` run outside torch.func's transforms when one is active (``torch.func.jvp``, where
    every tensor a factory makes is a wrapper without storage): the all-gathers and the
    unsharded parameters are the unit's own plain tensors, constants to the transform (as
    torch FSDP2's are)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch._C._functorch.peek_interpreter_stack() is None:
            return fn(*args, **kwargs)
        with torch._C._DisableFuncTorch():
            return fn(*args, **kwargs)

    return run


@_functorch_off
def _unshard(unit: Unit, backward: bool = False) -> None:
    """Unshards `unit` and the units of its call on other meshes (:attr:`Unit.group`; in
    `backward`, those that unshard in backward): every all-gather is issued before the first
    is waited on."""
    group = [u for u in unit.group if u.unshard_in_backward] if backward else unit.group
    if len(group) > 1:
        for u in group:
            u.issue_all_gather()
    for u in group:
        u.unshard()


@functools.cache
def _eager_backward_hooks():
    """(pre-backward, post-backward) run eagerly; made at the first lazy init, when
    fully_shard has imported torch._dynamo."""
    return _eager(pre_backward), _eager(_run_post_backward)


ABORTED_BACKWARD_WARNING = (
    "fsdp_native: a forward began while the last backward had not completed (it raised?). Its "
    "iteration state is reset as reset_iter_state() resets it: its gradients, reduced or not, "
    "and those accumulated without sync are discarded. Call reset_iter_state() on the root module "
    "after catching the error to do this explicitly."
)


class RootContext:
    """Shared by every unit under one root module for the duration of training."""

    def __init__(self, root: nn.Module, units: list[Unit]) -> None:
        self.root = root
        self.units = units
        self.acct = Accounting()
        self.reducer = Reducer()
        self._eager_end_backward = _eager(self.end_backward)
        self.in_backward = False
        self.callback_queued = False
        self.manual_active: bool | None = None  # the mode of the backward iteration under way
        self.pending_finalize: GradientReductionHandle | None = None  # finalize_backward(async_op=True)
        self.forward_order: list[Unit] = []
        self.next_forward: dict[Unit, Unit] = {}
        self.prev_forward: dict[Unit, Unit] = {}
        self._set_order([u for u in units if u.primary is None])
        streams = units[0].streams if units else None
        if streams is not None and streams.cuda:
            shared = root._fsdp_native_unit.shared_comm  # share_comm_ctx: the roots' one set of streams
            if shared is None:
                streams = Streams(units[0].device)
            else:
                if shared.streams is None:
                    shared.streams = Streams(units[0].device)
                streams = shared.streams
        for u in units:
            u.ctx = self
            if streams is not None:
                u.streams = streams
            u.pre_backward_hook = lambda grad, u=u, pre=_eager_backward_hooks()[0]: pre(u)
            u.total_acct = self.acct
            self.acct.current += u.acct.current
        self.acct.peak = max(self.acct.current, max((u.acct.peak for u in units), default=0))

    @property
    def manual(self) -> bool:
        """set_manual_backward_finalization (on the root): backwards finish nothing;
        finalize_backward does it."""
        return self.root._fsdp_native_unit.manual_finalization

    def _set_order(self, order: list[Unit]) -> None:
        seen = list(dict.fromkeys(order))  # first occurrences, in order
        self.next_forward = {a: b for a, b in zip(seen, seen[1:])}
        self.prev_forward = {b: a for a, b in zip(seen, seen[1:])}

    def begin_forward(self) -> None:
        if self.pending_finalize is not None:  # an asynchronous finalization nobody waited on
            self.pending_finalize.wait()
        self.forward_order = []
        root_unit = self.root._fsdp_native_unit
        for u in self.units:
            if u is not root_unit and u.in_forward:  # a pass some module of it never completed
                u.end_pass()  # (a no-grad chunked loss, torchtitan's validation): a new one begins
            if u.held and u.hold_unused():  # the graph of a create_graph=True backward was freed
                u.release()
        if _trace.active is not None:
            _trace.active.begin_step()
        for u in self.units:
            u.check_registered()

    def end_forward(self) -> None:
        if self.forward_order:
            self._set_order(self.forward_order)
        for u in self.units:  # prefetched all-gathers that no forward used
            u.release_pending()

    def begin_backward(self) -> None:
        if self.in_backward:
            return
        self.in_backward = True
        if self.manual_active is None:
            self.manual_active = self.manual
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self._eager_end_backward)

    def end_backward(self) -> None:
        """Runs once autograd finished: post-backward for units autograd did not reach through
        their inputs (the root, most often), then every pending reduction completes."""
        # A backward with create_graph=True runs in grad mode. torch.autograd.grad(...,
        # create_graph=True) accumulates no parameter gradient: nothing is reduced.
        if torch.is_grad_enabled() and not any(u.held and u.accumulated_since_hold() for u in self.units):
            self._end_higher_order()
            return
        # An ordinary backward has now run through (and freed) every graph a backward with
        # create_graph=True built: the units it held free their storage at their reshard. So
        # does loss.backward(create_graph=True), which accumulated gradients: it ends as an
        # ordinary backward, as in torch FSDP2, the gradients reduced as plain values (their
        # graph ends there); a further backward through it is not supported.
        for u in self.units:
            u.release()
        with torch.no_grad():
            self._end_backward()

    def _end_backward(self) -> None:
        self.callback_queued = False
        for u in self.units:  # as torch FSDP2's final callback: the next forward starts a new pass
            u.end_pass()
        if self.manual_active:
            # Manual finalization: units whose gradients are not synced this backward take
            # them unreduced now; the others wait for finalize_backward.
            for u in self._order():
                if u.needs_post_backward and not u.requires_gradient_sync:
                    u.post_backward()
            for u in self.units:
                u.release_pending()
            self.in_backward = False
            return
        # With set_reduce_scatter_unused_params, a unit that the backward did not reach reduces
        # zeros, as in torch FSDP2, if it was ever unsharded.
        for u in self._order():
            if self._unreached(u):
                u.post_backward(force=True)
            elif not u.backward_reached and u.has_unreduced_grads():
                # Gradients that no pre- or post-backward hook saw: as torch FSDP2's final
                # callback, which runs every unit's post-backward, they are reduced now. The
                # pre-backward hook on an output is lost when the caller modifies that output
                # in place while it is a view (`_hook_outputs`), and a unit whose inputs need no
                # gradient (the first block) has no post-backward of its own.
                u.post_backward(force=True)
            else:
                u.post_backward()
        self._complete()
        self.in_backward = False

    def _end_higher_order(self) -> None:
        """The end of ``torch.autograd.grad(..., create_graph=True)``: no parameter gradient
        came, so nothing is reduced (the gradients that backwards without sync accumulated wait
        for the next backward). The units it reached reshard, keeping their storage for the
        graph it built (Unit.hold), and the next backward starts as after a forward."""
        self.callback_queued = False
        for u in self.units:
            u.end_pass()
            if u.held:
                u.needs_post_backward = u.backward_reached = u.recompute_hooked = False
                u.release_pending()
                if u.reshard_after_backward:
                    u.reshard()
        if not self.manual_active:
            self.manual_active = None
        self.in_backward = False

    def _order(self) -> list[Unit]:
        """Reverse forward order first (the order the backward would have reached them), then
        any other unit. Every rank runs the same order, so the reductions it issues match."""
        return list(dict.fromkeys([*(g for u in reversed(self.forward_order) for g in u.group), *self.units]))

    @staticmethod
    def _unreached(u: Unit) -> bool:
        """Whether `u` reduces zeros for a backward that did not reach it (set_reduce_scatter_unused_params)."""
        if u.reduce_unused and not u.backward_reached and u.unsharded_params:
            u.backward_reached = True
            return True
        return False

    def _complete(self) -> None:
        """Every pending reduction completes; prefetched all-gathers nobody used are released;
        the units that reshard after backward reshard."""
        self.reducer.finish_all()
        for u in self.units:
            u.backward_reached = False
            u.recompute_hooked = False
            u.restore_grad_dtypes()
            u.release_pending()
            if u.reshard_after_backward:
                u.reshard()
        self.manual_active = None
        self.pending_finalize = None

    def finish_unit(self, u: Unit) -> None:
        """A finalization's work for one unit: the post-backward the last backward left, or the
        reduction of what backwards without sync accumulated, or the reshard after backward."""
        if u.needs_post_backward:  # reached by the last backward but not done (the root, often)
            u.post_backward()
        elif u.requires_gradient_sync and (u.has_unreduced_grads() or self._unreached(u)):
            u.post_backward(force=True)  # gradients accumulated by backwards without sync
        elif u.reshard_after_backward:
            u.reshard()

    def recover_aborted_backward(self) -> None:
        """A forward outside autograd's engine while a backward is still under way: that
        backward raised, and the caller went on without reset_iter_state(). Its hooks left
        the units mid-backward (unsharded, gradients partly accumulated or reduced), and as
        its end-of-backward callback never ran, none would be queued again: every later
        forward would run as a recompute, and later gradients be wrong (torch FSDP2 2.13
        trains on from such a state, its losses drifting from those of a run that skipped the
        step). The state is reset as reset_iter_state() resets it."""
        warnings.warn(ABORTED_BACKWARD_WARNING, UserWarning, stacklevel=4)
        self.reset_iter_state()

    def reset_iter_state(self) -> None:
        """FSDPModule.reset_iter_state: after a forward or backward raised, the in-flight
        collectives complete with their results dropped, every unit reshards and loses the
        iteration's gradients, and no backward or finalization is under way any more."""
        handle, self.pending_finalize = self.pending_finalize, None
        if handle is not None:
            handle._ctx, handle._invalid = None, True
        self.reducer.discard()
        for u in self.units:
            u.reset_iter()
        self.in_backward = False
        self.callback_queued = False
        self.manual_active = None
        self.forward_order = []

    def finish_all(self) -> None:
        """Every unit's :meth:`finish_unit`, then every reduction completes (a pipeline stage's
        gradient reduction before torch 2.15, ``fsdp_native._torch_state``)."""
        if self.in_backward:
            raise RuntimeError("fsdp_native: gradients can be reduced only after backward completes")
        for u in self._order():
            self.finish_unit(u)
        self._complete()

    def finalize(self, async_op: bool) -> GradientReductionHandle | None:
        """FSDPModule.finalize_backward: what the backwards left (manual finalization)."""
        if self.pending_finalize is not None:
            raise RuntimeError("finalize_backward: the previous gradient reduction must be waited on before finalizing backward again")
        manual = self.manual_active if self.manual_active is not None else self.manual
        if not manual:
            raise RuntimeError(
                "finalize_backward requires manual backward finalization; call set_manual_backward_finalization(True) "
                "on the root module before forward"
            )
        if self.in_backward:
            raise RuntimeError("finalize_backward must be called after backward completes")
        partial = next((u for u in self.units if u.info.replicate_group is not None and not u.requires_all_reduce and (
            u.partial_reduce is not None or u.pending_rs is not None or u.needs_post_backward or u.has_unreduced_grads()
        )), None)  # fmt: skip
        if partial is not None:
            raise RuntimeError(
                f"finalize_backward: manual backward finalization does not support partial gradient reductions "
                f"(unit '{partial.fqn or 'root'}' has gradients and set_requires_all_reduce(False)); call "
                "set_requires_all_reduce(True) before finalizing, or use automatic finalization"
            )
        for u in self._order():
            self.finish_unit(u)
        handle = GradientReductionHandle(self)
        if async_op:
            self.pending_finalize = handle
            return handle
        handle.wait()
        return None


class GradientReductionHandle:
    """Handle of ``FSDPModule.finalize_backward(async_op=True)``: the reductions are issued;
    ``wait()`` completes them and reshards, before the gradients are used (the next forward
    waits for it if nobody did). ``reset_iter_state`` invalidates it."""

    def __init__(self, ctx: RootContext | None) -> None:
        self._ctx = ctx
        self._invalid = False

    def wait(self) -> None:
        if self._invalid:
            raise RuntimeError("This gradient reduction handle was invalidated")
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx._complete()


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs whose backward marks the unit's gradients done."""

    # torch.func's transforms (grad, jacrev, hessian, vmap) take only Functions whose forward
    # has no ctx; the identity's batching rule is generated.
    generate_vmap_rule = True

    @staticmethod
    def forward(unit: Unit, *inputs: torch.Tensor):
        return inputs

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.unit = inputs[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        _eager_backward_hooks()[1](ctx.unit)
        return (None, *grads)

    @staticmethod
    def jvp(ctx, _unit, *tangents: torch.Tensor):
        """Forward-mode AD (dual tensors through a training forward): the identity's tangents,
        as views, since the forward returns its inputs as they are."""
        return tuple(t if t is None else t.view_as(t) for t in tangents)


# As torch FSDP2 (and DDP), the root moves its forward inputs to its accelerator: a batch left
# on the CPU works with a model sharded on CUDA.
_INPUTS_TO_DEVICE = ("cuda", "hpu", "xpu", "mtia", torch._C._get_privateuse1_backend_name())


def _inputs_to_device(args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
    from torch.distributed.utils import _to_kwargs

    moved_args, moved_kwargs = _to_kwargs(args, kwargs, device, False)
    return moved_args[0], moved_kwargs[0]


def _cast_floats(tree, dtype: torch.dtype):
    return _tree.map_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, tree)


@_functorch_off
def _prefetch(explicit: list[Unit] | None, neighbour: Unit | None, backward: bool = False) -> None:
    """Issues the all-gathers of the units to prefetch: the explicit list if one was set, else
    the neighbour in the recorded forward order (implicit prefetch, depth 1)."""
    if explicit is None:
        explicit = (neighbour,) if neighbour is not None and not neighbour.is_unsharded else ()
    for other in explicit:
        for u in other.group:
            if not backward or u.unshard_in_backward:
                u.issue_all_gather()


def _mark_inputs(unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs that require grad, passed through _PostBackward: the unit's post-backward
    runs once the backward has reached them."""
    if not kwargs and all(type(a) is torch.Tensor for a in args):  # block(x): no pytree walk
        idx = [i for i, t in enumerate(args) if t.requires_grad]
        if idx:
            flat = list(args)
            for i, t in zip(idx, _PostBackward.apply(unit, *[flat[i] for i in idx])):
                flat[i] = t
            args = tuple(flat)
        return args, kwargs
    marked = [t for t in _tree.tensors((args, kwargs)) if t.requires_grad]
    if marked:
        outs = iter(_PostBackward.apply(unit, *marked))
        args, kwargs = _tree.map_tensors(lambda t: next(outs) if t.requires_grad else t, (args, kwargs))
    return args, kwargs


def pre_forward(unit: Unit, module: nn.Module, args: tuple, kwargs: dict):
    """Before `module`'s forward. A unit of several modules (``fully_shard([a, b])``) is one
    unit for the hooks, as in torch FSDP2: the first of its modules to run in a forward pass
    unshards it, records it in the forward order, prefetches and marks its inputs for the
    post-backward; the others only cast their inputs."""
    ctx: RootContext | None = unit.ctx
    if ctx is None:
        ctx = lazy_init(module)
    mp = unit.mp
    cast = mp.cast_forward_inputs and mp.param_dtype is not None
    if ctx.in_backward and torch._C._current_graph_task_id() < 0:
        ctx.recover_aborted_backward()
    if ctx.in_backward:
        # An activation-checkpoint recompute. Where the unit's pre-backward already ran
        # (checkpointing by saved-tensor hooks: use_reentrant=False), the parameters only need
        # to be there. Where it did not (use_reentrant=True: the forward ran without grad and
        # registered no hooks; the backward runs the recompute's own backward), the recompute
        # registers them as a forward does, or the unit's gradients would never be reduced.
        _unshard(unit)
        if cast:
            args, kwargs = _cast_floats((args, kwargs), mp.param_dtype)
        if torch.is_grad_enabled() and not unit.needs_post_backward and not unit.recompute_hooked:
            unit.recompute_hooked = True
            args, kwargs = _mark_inputs(unit, args, kwargs)
        return args, kwargs
    first = not unit.in_forward
    if first:
        unit.in_forward = True
        if len(unit.modules) > 1:
            unit.modules_to_run = set(unit.modules)
        if ctx.root is module:
            ctx.begin_forward()
            if (args or kwargs) and unit.device.type in _INPUTS_TO_DEVICE:
                args, kwargs = _inputs_to_device(args, kwargs, unit.device)
        ctx.forward_order.append(unit)
        _unshard(unit)
        _prefetch(unit.forward_prefetch, ctx.next_forward.get(unit))
    else:
        _unshard(unit)  # a no-op unless a module of the unit resharded it
    if cast:
        args, kwargs = _cast_floats((args, kwargs), mp.param_dtype)
    if not unit.inputs_marked:
        unit.inputs_marked = True
        if torch.is_grad_enabled():
            args, kwargs = _mark_inputs(unit, args, kwargs)
    if first and _trace.active is not None:
        unit._t_compute = _trace.now_us()
    return args, kwargs


def post_forward(unit: Unit, module: nn.Module, args, output):
    """After `module`'s forward. For a unit of several modules, the full post-forward (reshard,
    pre-backward hooks on the output) runs once, after the last of its modules that had not run
    yet in this pass; the others only cast their outputs. Units whose group did not complete
    (a module of it skipped) are completed by the root's post-forward."""
    ctx: RootContext = unit.ctx
    out_dtype = unit.mp.output_dtype
    if ctx.in_backward:  # a recompute: no reshard; pre-backward hooks on its outputs if pre_forward marked its inputs
        if out_dtype is not None:
            output = _cast_floats(output, out_dtype)
        if unit.recompute_hooked and torch.is_grad_enabled():
            _hook_outputs(unit, output)
        return output
    if len(unit.modules) > 1 and unit.in_forward:
        unit.modules_to_run.discard(module)
        if unit.modules_to_run:
            return None if out_dtype is None else _cast_floats(output, out_dtype)
    output = _complete_forward(unit, output)
    if ctx.root is module:
        for other in ctx.units:
            if other.in_forward and other is not unit:
                output = _complete_forward(other, output)
        ctx.end_forward()
    return output


def _complete_forward(unit: Unit, output):
    unit.in_forward = unit.inputs_marked = False
    unit.modules_to_run = set()
    rec = _trace.active
    if rec is not None and unit._t_compute is not None:
        rec.span("forward", "compute", unit.fqn, unit._t_compute, _trace.now_us())
        unit._t_compute = None
    # Also the forward's last unit, which the backward gathers again at once: keeping its
    # data would hold it through the loss, often the step's peak (tests/test_memory.py).
    resharding = [u for u in unit.group if u.reshard_after_forward]
    freed = {ptr: u for u in resharding if (ptr := u.freed_storage_ptr())}
    if freed:
        _check_output_storage(unit, freed, output)
    for u in resharding:
        u.reshard(after_forward=True)
    if unit.mp.output_dtype is not None:
        output = _cast_floats(output, unit.mp.output_dtype)
    if torch.is_grad_enabled():
        _hook_outputs(unit, output)
    return output


def _check_output_storage(unit: Unit, freed: dict, output) -> None:
    """No output may be a view of the unsharded parameters the reshard after forward is about
    to free (a unit returning its parameter, a slice of it or an ``expand``): read after the
    reshard it points at freed memory; torch FSDP2 then fails at the next op reading it, or
    crashes (a segfault, with ``expand``). `freed`: the storages' data pointers, by unit."""
    functorch = torch._C._functorch.peek_interpreter_stack() is not None
    for t in (output,) if type(output) is torch.Tensor else _tree.tensors(output):
        if functorch:  # under torch.func's transforms: the plain tensor inside the wrappers
            while torch._C._functorch.is_functorch_wrapped_tensor(t):
                t = torch._C._functorch.get_unwrapped(t)
        if type(t) not in _PLAIN or not t.numel():
            continue
        u = freed.get(t.untyped_storage().data_ptr())
        if u is not None:
            raise ValueError(
                f"fully_shard: the forward of unit '{unit.fqn or 'root'}' returned a tensor (shape {tuple(t.shape)}) "
                f"that shares memory with the unsharded parameter {u.aliased_param_name(t)} in unit "
                f"'{u.fqn or 'root'}': resharding after forward frees that memory, so the output would point at "
                "freed memory. Return a copy (`.clone()`), or pass reshard_after_forward=False to that unit's "
                "fully_shard."
            )


_PLAIN = (torch.Tensor, nn.Parameter)


def _hook_outputs(unit: Unit, output) -> None:
    """The unit's pre-backward hook on every output that requires grad, and under forward-mode
    AD on their tangents too: a loss of the tangents (``forward_ad.unpack_dual(out).tangent``)
    reaches the unit's weights through the tangents' own graph."""
    hook = unit.pre_backward_hook
    dual = _forward_ad._current_level >= 0
    for t in (output,) if type(output) is torch.Tensor else _tree.tensors(output):
        if t.requires_grad:
            if t._base is not None:
                _warn_view_output(unit)
            t.register_hook(hook)
        if dual:
            tangent = _forward_ad.unpack_dual(t).tangent
            if tangent is not None and tangent.requires_grad:
                tangent.register_hook(hook)


def _warn_view_output(unit: Unit) -> None:
    """An in-place op on a view gives the view a new autograd node: the hook registered on the
    old one never runs, so the unit's backward starts without its all-gather (torch FSDP2 warns
    of the same since torch 2.13). The text names no shape, so that Python's default filter shows
    it once per unit however the batch shapes vary, and it holds torch's "returned a view tensor",
    so that a filter written for torch's warning covers it too."""
    names = ", ".join(type(m).__name__ for m in unit.modules) or "?"
    warnings.warn(
        f"fully_shard: the forward of unit '{unit.fqn or 'root'}' ({names}) returned a view "
        "tensor that requires grad. An in-place op on it (`out += y`) drops the "
        "unit's pre-backward hook, so the unit's backward runs without its all-gather: with "
        "reshard_after_forward it fails. Use an out-of-place op (`out = out + y`) or return a "
        "`.clone()`.",
        UserWarning,
        stacklevel=4,
    )


def pre_backward(unit: Unit) -> None:
    ctx: RootContext = unit.ctx
    ctx.begin_backward()
    higher_order = torch.is_grad_enabled()  # create_graph=True: grad mode is on in the backward
    for u in unit.group:
        u.needs_post_backward = True
        u.backward_reached = True
        u.inputs_marked = False
        if higher_order:
            u.hold()
    _unshard(unit, backward=True)
    for u in unit.group:
        u.defer_grad_upcast()
    _prefetch(unit.backward_prefetch, ctx.prev_forward.get(unit), backward=True)
    if _trace.active is not None:
        unit._t_compute = _trace.now_us()


@_functorch_off
def lazy_init(module: nn.Module) -> RootContext:
    """The first forward of an unsharded-context unit makes its module the root of every unit
    below it, as FSDP2 does. Outside torch.func's transforms: on torch 2.9 the structure check's
    all-gather under ``torch.func.jvp`` made its table a wrapper without storage, which
    ``.tolist()`` cannot read."""
    units: list[Unit] = []
    for name, sub in module.named_modules():
        unit = getattr(sub, "_fsdp_native_unit", None)
        if unit is not None and unit not in units:
            if unit.ctx is not None:
                raise RuntimeError(
                    f"fully_shard: module '{name}' already belongs to the root of another forward; "
                    "run the root module's forward first"
                )
            for u in unit.group:
                u.fqn = name
                units.append(u)
    root_unit = module._fsdp_native_unit
    for u in units:
        if u is not root_unit and u.manual_finalization:
            raise RuntimeError("set_manual_backward_finalization must be called on the root module (the first one forwarded)")
    if root_unit.auto_reshard:
        for u in root_unit.group:
            u.reshard_after_forward = False
    _agreement.first_forward(module, units)  # same units on every rank, before any collective
    return RootContext(module, units)
