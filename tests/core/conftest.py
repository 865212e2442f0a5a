"""Shared helpers of the core tests: `make_scheduler`, the one factory every core test
builds its scheduler with (as vLLM's ``tests/v1/core/utils.py``), and `frozen`: a
scheduler's whole internal state as nested tuples, to assert that a rejected call
changed nothing (``state_dict`` exists only between steps)."""

from __future__ import annotations

from array import array
from collections import deque

import pytest

from openrlhf_oppo.config import ChunkConfig, DeltaConfig, OppoConfig, StalenessConfig, StreamingConfig
from openrlhf_oppo.core import OverlapScheduler

SCORERS = ("reward", "reference")


def build_scheduler(
    batch_groups: int = 1,
    samples_per_group: int = 1,
    scorers: tuple[str, ...] = SCORERS,
    *,
    delta: int | DeltaConfig = 0,
    max_delta: int | None = None,
    chunk: int | ChunkConfig = 4,
    stream: bool = True,
    max_deferral: int = 3,
    max_lag: int = 0,
    keep_kv: bool = True,
) -> OverlapScheduler:
    """A scheduler of B=``batch_groups`` groups of n=``samples_per_group``; config overrides:

    delta: a fixed Δ (bounds [0, ``max_delta`` or Δ]), or a whole `DeltaConfig`;
    chunk: a fixed C in tokens, or a whole `ChunkConfig` (adaptive C);
    stream: stream chunks into the scorers; max_deferral: ``staleness.max_deferral_steps``;
    max_lag: ``staleness.max_policy_lag`` (async admission); keep_kv: ``staleness.keep_kv_cache``.
    """
    if not isinstance(delta, DeltaConfig):
        top = delta if max_delta is None else max_delta
        delta = DeltaConfig(enable=True, init=delta, min=0, max=top, adaptive=False)
    cfg = OppoConfig(
        delta=delta,
        chunk=chunk if isinstance(chunk, ChunkConfig) else ChunkConfig(size_tokens=chunk),
        staleness=StalenessConfig(max_deferral_steps=max_deferral, max_policy_lag=max_lag, keep_kv_cache=keep_kv),
        streaming=StreamingConfig(enable=stream),
    )
    return OverlapScheduler(cfg, batch_groups=batch_groups, samples_per_group=samples_per_group, scorers=scorers)


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


@pytest.fixture(scope="session")
def make_scheduler():
    """The scheduler factory (`build_scheduler`); session-scoped, so hypothesis tests take it too."""
    return build_scheduler
