"""Forming a training batch: which groups it must hold, and complete groups leaving the
in-flight record as `TrainGroup` messages.

Sample token and logprob lists are handed over, not copied: the samples leave the
scheduler here. Each trained group adds a ledger row (`openrlhf_oppo.core.ledger`).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from functools import lru_cache
from itertools import islice

from openrlhf_oppo.config import StalenessConfig
from openrlhf_oppo.core.records import InFlight, Sample
from openrlhf_oppo.core.types import (
    DEFERRAL_BUCKETS,
    LAG_BUCKETS,
    TrainBatch,
    TrainGroup,
    TrainSample,
    deferral_bucket,
    lag_bucket,
)

# Builds a NamedTuple message from a tuple without the Python-level ``__new__`` frame;
# thousands are made per step.
_new_tuple = tuple.__new__


def batch_members(flight: InFlight, forced: Set[int], size: int) -> list[int]:
    """The complete groups a batch of `size` groups holds: every complete `forced` group, then the
    first others in completion order. Once the batch can be taken, exactly its groups; before,
    groups it will hold whatever completes later (completion order only appends)."""
    complete = flight.complete
    chosen = [g for g in complete if g in forced] if forced else []
    return chosen + list(islice((g for g in complete if g not in forced), max(0, size - len(forced))))


def held_by_forced(flight: InFlight, forced: Set[int], size: int) -> bool:
    """A batch of `size` groups could be taken but for an incomplete `forced` group: without the
    staleness bounds that force it in, the batch would be taken now."""
    complete = flight.complete
    return len(complete) >= size and any(g not in complete for g in forced)


def take_groups(flight: InFlight, group_ids: Sequence[int], step: int, kept_kv: bool = True) -> TrainBatch:
    """Remove ``group_ids`` (complete) from ``flight`` and return them as the batch of ``step``.
    ``kept_kv``: the engines kept a paused sample's KV cache across weight syncs, so its
    tokens after its first version run were decoded on keys/values of older weights."""
    samples = flight.samples
    scored = flight.scored
    groups = []
    tokens = stale_kv = max_lag = 0
    lag_tokens = dict.fromkeys(LAG_BUCKETS, 0)
    for gid in group_ids:
        g = flight.groups.pop(gid)
        del flight.complete[gid]
        trained = []
        for sid in g.sample_ids:
            s = samples.pop(sid)
            for acked in scored:
                del acked[sid]
            n = s.num_tokens
            runs = s.version_runs
            tokens += n
            if runs:  # the oldest run is the first: a sample's versions never go back
                max_lag = max(max_lag, step - runs[0][1])
            if len(runs) == 1:
                lag_tokens[lag_bucket(step - runs[0][1])] += n
            elif runs:
                if kept_kv:
                    stale_kv += n - runs[1][0]
                ends = [start for start, _ in runs[1:]] + [n]  # a run ends where the next starts
                for (start, v), end in zip(runs, ends, strict=True):
                    lag_tokens[lag_bucket(step - v)] += end - start
            lps = s.logprob_chunks
            if lps is None:
                lps = _no_logprobs(len(s.token_chunks))
            trained.append(_new_tuple(TrainSample, (sid, gid, s.finish_reason, s.token_chunks, lps, runs)))
        groups.append(_new_tuple(TrainGroup, (gid, g.prompt_index, g.admitted_step, g.deferrals, tuple(trained))))
        flight.ledger.extend((gid, g.prompt_index, g.admitted_step, step, g.deferrals))
    flight.trained_groups_total += len(groups)
    flight.trained_tokens_total += tokens
    offpolicy = tokens - lag_tokens["0"]  # decoded by a version below the step's
    flight.offpolicy_tokens_total += offpolicy
    return TrainBatch(step, tuple(groups), offpolicy / tokens if tokens else 0.0, lag_tokens, stale_kv, tokens,
                      max_lag)


def forced_groups(flight: InFlight, step: int, staleness: StalenessConfig) -> frozenset[int]:
    """Groups the batch of ``step`` must train: carried ``max_deferral_steps`` times, or
    (``max_policy_lag`` N >= 1) holding a token that would be more than N versions old at
    step + 1. A sample's first recorded token gives its oldest version; one with none
    recorded may still have tokens on their way (decoded, not yet polled), as old as the
    engines' version when its group was admitted: under async admission
    ``begin_step(a)`` runs before the weight sync that makes version ``a``, so ``a - 1``."""
    lag = staleness.max_policy_lag
    forced = [g.group_id for g in flight.groups.values() if g.deferrals >= staleness.max_deferral_steps]
    if lag:
        for g in flight.groups.values():
            floor = max(0, g.admitted_step - 1)
            oldest = min(_first_version(flight.samples[sid], floor) for sid in g.sample_ids)
            if step + 1 - oldest > lag:
                forced.append(g.group_id)
    return frozenset(forced)


def _first_version(s: Sample, floor: int) -> int:
    """Policy version of the sample's first token (``floor`` while none is recorded)."""
    return s.version_runs[0][1] if s.version_runs else floor


def deferral_histogram(batch: TrainBatch) -> dict[str, int]:
    """Trained groups of ``batch`` per deferral bucket ("0", "1", "2", "3+")."""
    hist = {b: 0 for b in DEFERRAL_BUCKETS}
    for tg in batch.groups:
        hist[deferral_bucket(tg.deferrals)] += 1
    return hist


@lru_cache(maxsize=256)
def _no_logprobs(num_chunks: int) -> tuple[tuple[()], ...]:
    """Logprob chunks of a sample that recorded none: one empty entry per token chunk,
    shared between samples (immutable) rather than a list per sample."""
    return ((),) * num_chunks
