"""Output trees: flatten a forward output into tensor leaves and rebuild it, without global
registration (docs/index.md#output-sharing, lists the supported nodes and what is refused)."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .scan import attributes, cut, short_repr, tensor_inside, walk_tensors


@dataclass(frozen=True, eq=False, slots=True)
class Node:
    """One node of a flattened output."""

    kind: str  # "tensor" | "value" | "seq" | "map" | "attrs" | "holder"
    type: type
    keys: tuple[Any, ...] = ()
    children: tuple[Node, ...] = ()
    value: Any = None
    template: Any = None


#: A flattened output's tensor leaves, ``(path, tensor)`` in order.
Leaves = list[tuple[str, torch.Tensor]]

#: Storage identities (:func:`storage_key`).
Storages = frozenset[tuple[str, int]]

#: Deepest output nesting :func:`flatten` walks (a 100-deep output is a bug, not a model).
MAX_DEPTH = 100

#: What every "unsupported output" error lists.
SUPPORTED_TEXT = ("tensors, None and plain values, tuples, lists, named tuples, dicts, dataclasses, "
                  "and objects holding a 'tensors' dict")


def flatten(obj: object, path: str = "output") -> tuple[Node, Leaves]:
    """Flatten ``obj`` into a structure node and its tensor leaves ``(path, tensor)``.

    :raises TypeError: a tensor replay could not track (inside a plain value, on an attribute
        the walk does not follow, not strided), or nesting deeper than :data:`MAX_DEPTH`."""
    leaves: Leaves = []
    return _flatten(obj, path, leaves, 0), leaves


def _flatten(obj: object, path: str, leaves: Leaves, depth: int) -> Node:
    if depth > MAX_DEPTH:
        raise TypeError(f"output nested deeper than {MAX_DEPTH} levels at {cut(path)}: outputs are walked level by "
                        "level; return a flatter structure (a list of tensors, not a list inside a list ...)")
    if isinstance(obj, torch.Tensor):
        leaves.append((path, _strided(obj, path)))
        # a Parameter is its values here: a shared buffer or a replay hands them out as a plain tensor
        return Node("tensor", torch.Tensor if isinstance(obj, torch.nn.Parameter) else type(obj))
    keys: tuple[Any, ...]  # indices, a dict's keys or field names
    if isinstance(obj, (tuple, list)):  # named tuples too
        kind, values, walked = "seq", list(obj), "one of its items"
        keys, known = tuple(range(len(values))), lambda name, value: False
    elif isinstance(obj, dict):  # a ModelOutput keeps its fields as attributes too: the very values of its keys
        kind, keys, walked = "map", tuple(obj), "one of its keys"
        values, known = [obj[k] for k in keys], lambda name, value: name in obj and obj[name] is value
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        kind, keys, walked = "attrs", tuple(f.name for f in dataclasses.fields(obj)), "one of its fields"
        values, known = [getattr(obj, n) for n in keys], lambda name, value: name in keys
    elif isinstance(tensors := getattr(obj, "tensors", None), dict):
        kind, keys, walked = "holder", ("tensors",), "its 'tensors' dict"
        values, known = [tensors], lambda name, value: name == "tensors"
    else:
        inside = tensor_inside(obj, path)
        if inside is not None:
            msg = (f"unsupported output type {type(obj).__qualname__} at {path}: it holds a tensor (at {cut(inside)}) "
                   f"that cannot be tracked, so replay would return it stale; supported: {SUPPORTED_TEXT}; return one "
                   "of those (a set or an object with tensors in attributes, __slots__ or a list attribute is not)")
            raise TypeError(msg)
        return Node("value", type(obj), value=obj)
    kids = tuple(_flatten(v, _child(kind, path, k), leaves, depth + 1) for k, v in zip(keys, values, strict=True))
    _refuse_attributes(obj, path, walked, known)
    return Node(kind, type(obj), keys, kids, template=None if kind == "seq" else obj)


def _strided(t: torch.Tensor, path: str) -> torch.Tensor:
    """:raises TypeError: ``t`` is not strided (sparse, nested, ...)."""
    if t.layout != torch.strided or t.is_nested:
        kind = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        raise TypeError(f"unsupported output tensor at {path}: layout {kind}; only strided (dense) tensors can be "
                        "captured and shared (sparse and other non-strided layouts are not supported); return a dense "
                        "tensor (.to_dense()) or its parts (indices and values)")
    return t


def _child(kind: str, path: str, key: Any) -> str:
    """The path of a node's child: ``output[0]``, ``output['x']``, ``output.x``."""
    return f"{path}[{key}]" if kind == "seq" else f"{path}[{key!r}]" if kind == "map" else f"{path}.{key}"


def _refuse_attributes(obj: object, path: str, walked: str, known: Callable[[str, object], bool]) -> None:
    """:raises TypeError: an attribute the walk does not follow holds a tensor."""
    if type(obj) in (tuple, list, dict):  # built-in containers: no instance attributes
        return
    for name, value in attributes(obj):
        if known(name, value):
            continue
        inside = tensor_inside(value, f"{path}.{name}")
        if inside is not None:
            raise TypeError(f"unsupported output {type(obj).__qualname__} at {path}: its attribute {name!r} is not "
                            f"{walked} and holds a tensor (at {cut(inside)}) that cannot be tracked, so replay would "
                            f"return it stale; put the tensor in {walked} or return it beside the object (plain values "
                            f"on such attributes are fine); supported: {SUPPORTED_TEXT}")


def unflatten(node: Node, tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> Any:
    """Rebuild an output shaped like ``node`` with the given tensors as leaves, in order."""
    it = iter(tensors)  # the children share it: ``iter`` of an iterator is itself
    if node.kind == "tensor":
        return next(it)
    if node.kind == "value":
        return node.value
    kids = [unflatten(k, it) for k in node.children]
    if node.kind == "seq":  # a named tuple takes its fields one by one
        return node.type(*kids) if issubclass(node.type, tuple) and hasattr(node.type, "_fields") else node.type(kids)
    new = copy.copy(node.template)
    if node.kind == "map":
        for k, v in zip(node.keys, kids, strict=True):
            new[k] = v
        return new
    for name, v in zip(node.keys, kids, strict=True):
        object.__setattr__(new, name, v)
    return new


def skeleton(node: Node) -> Node:
    """``node`` without its containers' templates: what :func:`diff` compares, holding none of an output's
    tensors (a template is the output's own dict or dataclass, its tensors included)."""
    return Node(node.kind, node.type, node.keys, tuple(skeleton(k) for k in node.children), node.value)


def _is_nan(v: object) -> bool:
    return (isinstance(v, float) and math.isnan(v)) or (isinstance(v, complex) and math.isnan(abs(v)))


def _values_equal(a: object, b: object) -> bool:
    """Equality of two non-tensor leaf values; NaN equals NaN."""
    if a is b or (_is_nan(a) and _is_nan(b)):
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. numpy arrays: ambiguous truth value
        return False


def _tensor_type(kind: type) -> str:
    return "a tensor" if kind is torch.Tensor else f"a {kind.__module__}.{kind.__qualname__} tensor"


def describe(node: Node) -> str:
    """Short human description of a node for error messages."""
    if node.kind == "tensor":
        return _tensor_type(node.type)
    if node.kind == "value":
        return "None" if node.value is None else f"{type(node.value).__name__} {short_repr(node.value)}"
    return node.type.__qualname__


def diff(a: Node, b: Node, path: str = "output") -> tuple[str, str] | None:
    """First structural difference between two trees as ``(path, reason)``, or ``None``."""
    if a.kind != b.kind or a.type is not b.type:
        if a.kind == b.kind == "tensor":
            return path, f"tensor type changed: expected {_tensor_type(a.type)}, got {_tensor_type(b.type)}"
        if a.kind == "tensor" or b.kind == "tensor":
            return path, f"expected {describe(a)}, got {describe(b)}"
        return path, f"type changed: expected {describe(a)}, got {describe(b)}"
    if a.kind == "value":
        if not _values_equal(a.value, b.value):
            return path, f"non-tensor leaf value changed: expected {short_repr(a.value)}, got {short_repr(b.value)}"
        return None
    if a.kind == "tensor":
        return None
    if a.keys != b.keys:
        if a.kind == "seq":
            return path, f"sequence length changed: expected {len(a.keys)}, got {len(b.keys)}"
        return path, f"dict keys changed: expected {list(a.keys)}, got {list(b.keys)}"  # same type: same fields
    for key, ka, kb in zip(a.keys, a.children, b.children, strict=True):
        found = diff(ka, kb, _child(a.kind, path, key))
        if found is not None:
            return found
    return None


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of a tensor's storage (device, base address)."""
    return (str(t.device), t.untyped_storage().data_ptr())


def collect_tensors(obj: object) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj``; lenient (never raises, cycle-safe, bounded)."""
    return [t for _, t in walk_tensors(obj)]
