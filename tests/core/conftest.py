"""`frozen`: a scheduler's whole internal state as nested tuples, to assert that a
rejected call changed nothing (``state_dict`` exists only between steps)."""

from __future__ import annotations

from array import array
from collections import deque

import pytest


def freeze(obj):
    if isinstance(obj, dict):
        return tuple((k, freeze(v)) for k, v in obj.items())  # insertion order matters (completion order)
    if isinstance(obj, (list, tuple, deque)):
        return tuple(freeze(v) for v in obj)
    if isinstance(obj, array):
        return (obj.typecode, tuple(obj))
    if isinstance(obj, (set, frozenset)):
        return tuple(sorted(obj))
    if hasattr(obj, "__slots__") and not hasattr(obj, "__dataclass_fields__"):
        return (type(obj).__name__, tuple(freeze(getattr(obj, a, None)) for a in obj.__slots__))
    if hasattr(obj, "__dict__") and not hasattr(obj, "__dataclass_fields__"):
        return (type(obj).__name__, freeze(vars(obj)))
    return obj


@pytest.fixture(scope="session")
def frozen():
    return freeze
