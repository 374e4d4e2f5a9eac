"""Output trees: flatten a forward output into tensor leaves and rebuild it.

Supported nodes: tensors, ``None`` and other plain values (compared by equality), tuples,
lists, named tuples, dicts (any ``dict`` subclass), dataclasses, and objects that hold their
tensors in a ``tensors`` dict (SGLang's ``PPProxyTensors``).

Why not ``torch.utils._pytree``: it only walks dataclasses after a process-wide
``register_dataclass`` call. Registering SGLang's own output classes from a plugin would change
how dynamo and every other pytree user in the serving process sees them, so we walk
dataclasses here, without global registration, and rebuild them with a shallow copy (which keeps
non-field attributes and works for frozen and slotted classes).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, eq=False, slots=True)
class Node:
    """One node of a flattened output."""

    kind: str  # "tensor" | "value" | "seq" | "map" | "attrs" | "holder"
    type: type
    keys: tuple[Any, ...] = ()
    children: tuple[Node, ...] = ()
    value: Any = None
    template: Any = None


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _holds_tensors(obj: object) -> bool:
    found = False
    for v in getattr(obj, "__dict__", {}).values():
        found = found or isinstance(v, torch.Tensor)
    return found


def flatten(obj: object, path: str = "output") -> tuple[Node, list[tuple[str, torch.Tensor]]]:
    """Flatten ``obj`` into a structure node and its tensor leaves ``(path, tensor)``.

    :raises TypeError: an object holds tensors but is none of the supported node types (its
        tensors could not be tracked, so replay could return stale values).
    """
    leaves: list[tuple[str, torch.Tensor]] = []
    node = _flatten(obj, path, leaves)
    return node, leaves


def _flatten(obj: object, path: str, leaves: list[tuple[str, torch.Tensor]]) -> Node:
    if isinstance(obj, torch.Tensor):
        leaves.append((path, obj))
        return Node("tensor", type(obj))
    if _is_namedtuple(obj) or isinstance(obj, (tuple, list)):
        seq = list(obj)  # type: ignore[call-overload]
        kids = tuple(_flatten(v, f"{path}[{i}]", leaves) for i, v in enumerate(seq))
        return Node("seq", type(obj), tuple(range(len(seq))), kids)
    if isinstance(obj, dict):
        keys = tuple(obj)
        kids = tuple(_flatten(obj[k], f"{path}[{k!r}]", leaves) for k in keys)
        return Node("map", type(obj), keys, kids, template=obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj))
        kids = tuple(_flatten(getattr(obj, n), f"{path}.{n}", leaves) for n in names)
        return Node("attrs", type(obj), names, kids, template=obj)
    tensors = getattr(obj, "tensors", None)
    if isinstance(tensors, dict):
        kid = _flatten(tensors, f"{path}.tensors", leaves)
        return Node("holder", type(obj), ("tensors",), (kid,), template=obj)
    if _holds_tensors(obj):
        msg = (
            f"unsupported output type {type(obj).__qualname__} at {path}: it holds tensors but is "
            "not a tuple, list, dict, dataclass, named tuple or object with a 'tensors' dict; "
            "return one of those so every tensor can be tracked"
        )
        raise TypeError(msg)
    return Node("value", type(obj), value=obj)


def unflatten(node: Node, tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> Any:
    """Rebuild an output shaped like ``node`` with the given tensors as leaves, in order."""
    it = iter(tensors)
    return _unflatten(node, it)


def _unflatten(node: Node, it: Iterator[torch.Tensor]) -> Any:
    if node.kind == "tensor":
        return next(it)
    if node.kind == "value":
        return node.value
    kids = [_unflatten(k, it) for k in node.children]
    if node.kind == "seq":
        if issubclass(node.type, tuple) and hasattr(node.type, "_fields"):
            return node.type(*kids)
        return node.type(kids)
    new = copy.copy(node.template)
    if node.kind == "map":
        for k, v in zip(node.keys, kids, strict=True):
            new[k] = v
        return new
    for name, v in zip(node.keys, kids, strict=True):
        object.__setattr__(new, name, v)
    return new


def _values_equal(a: object, b: object) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. numpy arrays: ambiguous truth value
        return False


def describe(node: Node) -> str:
    """Short human description of a node for error messages."""
    if node.kind == "tensor":
        return "a tensor"
    if node.kind == "value":
        return "None" if node.value is None else f"{type(node.value).__name__} {node.value!r}"
    return node.type.__qualname__


def diff(a: Node, b: Node, path: str = "output") -> tuple[str, str] | None:
    """First structural difference between two trees as ``(path, reason)``, or ``None``."""
    if a.kind != b.kind or a.type is not b.type:
        if a.kind == "tensor" or b.kind == "tensor":
            return path, f"expected {describe(a)}, got {describe(b)}"
        return path, f"type changed: expected {describe(a)}, got {describe(b)}"
    if a.kind == "value":
        if not _values_equal(a.value, b.value):
            return path, f"non-tensor leaf value changed: expected {a.value!r}, got {b.value!r}"
        return None
    if a.kind == "tensor":
        return None
    if a.keys != b.keys:
        if a.kind == "seq":
            return path, f"sequence length changed: expected {len(a.keys)}, got {len(b.keys)}"
        if a.kind == "map":
            return path, f"dict keys changed: expected {list(a.keys)}, got {list(b.keys)}"
        return path, f"fields changed: expected {list(a.keys)}, got {list(b.keys)}"  # pragma: no cover - same type implies same fields
    for key, ka, kb in zip(a.keys, a.children, b.children, strict=True):
        if a.kind == "seq":
            sub = f"{path}[{key}]"
        elif a.kind == "map":
            sub = f"{path}[{key!r}]"
        else:
            sub = f"{path}.{key}"
        found = diff(ka, kb, sub)
        if found is not None:
            return found
    return None


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of a tensor's storage (device, base address)."""
    return (str(t.device), t.untyped_storage().data_ptr())


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's own elements (what a consumer reads)."""
    return t.numel() * t.element_size()


def collect_tensors(obj: object, limit: int = 10_000) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj`` through containers, dataclasses and ``__dict__``.

    Lenient (never raises, cycle-safe, bounded): used for ``capture_inputs``, which may be any
    object (SGLang passes its forward batch), to know which storages are static inputs.
    """
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [obj]
    while stack and len(seen) < limit:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, torch.Tensor):
            found.append(cur)
        elif isinstance(cur, (list, tuple, set, frozenset)):
            stack.extend(cur)
        elif isinstance(cur, dict):
            stack.extend(cur.values())
        elif hasattr(cur, "__dict__") and not isinstance(cur, type):
            stack.extend(vars(cur).values())
    return found
