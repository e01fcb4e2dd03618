"""The tensors of a module's inputs and outputs, as FSDP2 finds them: through torch's pytree
(lists, tuples, dicts, namedtuples and every registered node, Hugging Face's ``ModelOutput``
among them) and also inside what pytree takes for a leaf but torch FSDP2 looks into (from torch
2.12 on; its inputs' casts on every version): dataclass instances, and subclasses of dict, list
and tuple (an ``EasyDict`` of activations, say). A block that takes and returns such states
gets its inputs cast to ``param_dtype``, its post-backward registered on their tensors and its
pre-backward hooked on its outputs' tensors."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree


def _init_names(x: Any) -> list[str]:
    # Only the fields __init__ takes: dataclasses.replace rebuilds from those.
    return [f.name for f in dataclasses.fields(x) if f.init]


def _children(x: Any) -> list | None:
    """The children of a container pytree does not know, None for anything else."""
    if type(x) in pytree.SUPPORTED_NODES or isinstance(x, (torch.Tensor, str, bytes)):
        return None
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [getattr(x, name) for name in _init_names(x)]
    if isinstance(x, dict):
        return list(x.values())
    if isinstance(x, (list, tuple)):
        return list(x)
    return None


def _rebuild(x: Any, old: list, new: list) -> Any:
    """`x` with its children `old` replaced by `new`, of its own type."""
    if all(n is o for n, o in zip(new, old)):
        return x
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{k: n for k, n, o in zip(_init_names(x), new, old) if n is not o})
    if isinstance(x, dict):
        out = copy.copy(x)
        out.update(zip(x.keys(), new))
        return out
    if isinstance(x, list):
        out = copy.copy(x)
        out[:] = new
        return out
    try:  # a tuple subclass
        return type(x)(new)
    except TypeError:
        return tuple(new)


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor of `tree`, in the order :func:`map_tensors` visits them."""
    out: list[torch.Tensor] = []
    _collect(tree, out)
    return out


# The walks are module functions, not closures: a recursive closure is a reference cycle (the
# function holds the cell that holds it), and one that reaches the tensors it visited keeps them
# for the cyclic garbage collector. On torch 2.9 that corrupts a DTensor that only the autograd
# graph still holds (a unit's marked input, saved by the op it feeds): the collector clears the
# wrapper's __slots__ before torch keeps it alive for the graph, and the backward then fails on
# "'DTensor' object has no attribute '_local_tensor'".
def _collect(x: Any, out: list) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
        return
    typ = type(x)
    if typ in _ATOMS:
        return
    if typ is tuple or typ is list:  # the common containers without a pytree call
        for c in x:
            _collect(c, out)
        return
    if typ is dict:
        for c in x.values():
            _collect(c, out)
        return
    # One level of pytree, as map_tensors walks it.
    children = _one_level(x)[0]
    if len(children) == 1 and children[0] is x:
        children = _children(x) or ()
    for c in children:
        _collect(c, out)


def _one_level(x: Any) -> tuple[list, Any]:
    """(x's children, the spec to rebuild it) by one level of pytree: ``[x]`` where pytree takes
    it for a leaf. pytree's ``tree_flatten`` walks by a recursive closure, a cycle that keeps the
    ``is_leaf`` it was given; this one holds `x` in a box emptied afterwards, so that the cycle
    keeps nothing of the tree."""
    box = [x]
    children, spec = pytree.tree_flatten(x, is_leaf=lambda y: y is not box[0])
    box.clear()
    return children, spec


_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device})


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """`tree` with every tensor ``t`` replaced by ``fn(t)``. A container is rebuilt, of its own
    type, only where a child changed (a dataclass by ``dataclasses.replace``, as torch FSDP2
    rebuilds it); one where none changed is kept, the same object, as torch 2.13's FSDP2 keeps
    the containers of a unit's inputs: a block that records statistics in a dict it was passed
    writes to the caller's dict."""
    return _map(fn, tree)


def _map(fn: Callable[[torch.Tensor], torch.Tensor], x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    typ = type(x)
    if typ in _ATOMS:
        return x
    if typ is tuple or typ is list:  # the common containers without a pytree call
        new = [_map(fn, c) for c in x]
        return x if all(n is o for n, o in zip(new, x)) else typ(new)
    if typ is dict:
        new = {k: _map(fn, v) for k, v in x.items()}
        return x if all(new[k] is v for k, v in x.items()) else new
    # One level of pytree: x's own children (x itself where pytree takes it for a leaf).
    children, spec = _one_level(x)
    if len(children) == 1 and children[0] is x:
        kids = _children(x)
        return _rebuild(x, kids, [_map(fn, k) for k in kids]) if kids else x
    new = [_map(fn, c) for c in children]
    if all(n is o for n, o in zip(new, children)):
        return x
    return pytree.tree_unflatten(new, spec)
