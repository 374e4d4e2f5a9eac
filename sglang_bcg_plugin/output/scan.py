"""A bounded search for tensors inside any object (lists, tuples, sets, dict values, ``__dict__``
and ``__slots__``; iterative, cycle-safe, never raises), and short reprs for messages."""

from __future__ import annotations

import itertools
import reprlib
from collections.abc import Iterator

import torch

#: Objects one scan visits (and members it reads per container) before it gives up.
SCAN_LIMIT = 10_000

_ATOMS = (str, bytes, int, float, complex, bool, type(None), type)
_BUILTIN_CONTAINERS = (list, tuple, set, frozenset, dict)
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 200


def cut(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters, ``...`` marking the cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_repr(value: object, limit: int = 200) -> str:
    """``repr(value)`` cut to ``limit`` characters; never raises."""
    return cut(_repr.repr(value), limit)


def attributes(obj: object) -> list[tuple[str, object]]:
    """``obj``'s instance attributes ``(name, value)``: ``__dict__`` (bounded) and set ``__slots__``."""
    found = list(itertools.islice(getattr(obj, "__dict__", {}).items(), SCAN_LIMIT))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            try:
                found.append((name, getattr(obj, name)))
            except Exception:  # noqa: BLE001, S112 - an unset slot holds nothing
                continue
    return found


def _members(obj: object) -> list[tuple[str, object]]:
    """The ``(sub-path, value)`` pairs a scan looks into."""
    if isinstance(obj, (list, tuple)):
        found = [(f"[{i}]", v) for i, v in enumerate(itertools.islice(obj, SCAN_LIMIT))]
    elif isinstance(obj, (set, frozenset)):
        found = [("{...}", v) for v in itertools.islice(obj, SCAN_LIMIT)]
    elif isinstance(obj, dict):
        found = [(f"[{short_repr(k, 40)}]", v) for k, v in itertools.islice(obj.items(), SCAN_LIMIT)]
    else:
        return [(f".{k}", v) for k, v in attributes(obj)]
    if type(obj) not in _BUILTIN_CONTAINERS:  # a subclass may carry attributes too
        found += [(f".{k}", v) for k, v in attributes(obj)]
    return found


def walk_tensors(obj: object, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``obj`` with its path, depth first, each object visited once,
    at most :data:`SCAN_LIMIT` objects."""
    seen: set[int] = set()
    stack: list[tuple[str, object]] = [(path, obj)]
    while stack and len(seen) < SCAN_LIMIT:
        where, cur = stack.pop()
        if id(cur) in seen or isinstance(cur, _ATOMS):
            continue
        seen.add(id(cur))
        if isinstance(cur, torch.Tensor):
            yield where, cur
            continue
        stack.extend((where + sub, v) for sub, v in reversed(_members(cur)))


def tensor_inside(obj: object, path: str) -> str | None:
    """The path of the first tensor held anywhere inside ``obj``, else ``None``."""
    return next((where for where, _ in walk_tensors(obj, path)), None)
