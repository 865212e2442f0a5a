"""The scheduler's checkpoint: written between steps, read back whole or not at all.

A checkpoint holds the carried groups (tokens, logprobs, policy versions, finish
reasons), the Δ and C controllers, the prompt-stream position, the counters and the
*ledger*: one row per trained group (group id, prompt position, admission step,
training step, deferrals). Held groups plus ledger rows account for every group ever
admitted, which `openrlhf_oppo.core.ledger.check_state` verifies.

The scheduler hands its in-flight record (`openrlhf_oppo.core.records.InFlight`) and its
controllers to `dump`; `load` parses and validates a checkpoint into new objects, which
the scheduler then installs whole, and reconciles it with the new run's settings: a Δ or
C the new flags forbid is clamped with a logged notice (never silently kept). Loading
what `dump` wrote and dumping again gives the same dict.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass
from typing import Any

from openrlhf_oppo.config import OppoConfig
from openrlhf_oppo.core import ledger
from openrlhf_oppo.core.controllers import ChunkSizeController, DeltaController
from openrlhf_oppo.core.records import Group, InFlight, Sample
from openrlhf_oppo.core.types import DEFERRAL_BUCKETS, FINISH_REASONS
from openrlhf_oppo.core.validate import check_int as _int
from openrlhf_oppo.core.validate import check_ints as _ints

log = logging.getLogger(__name__)

STATE_VERSION = 2  # 2: + ledger
LEDGER_FIELDS = ledger.LEDGER_FIELDS


@dataclass(frozen=True)
class Setup:
    """What a checkpoint is written with and must be loaded with (the scheduler's shape)."""

    batch_groups: int  # B, prompt groups per batch
    samples_per_group: int  # n
    scorers: tuple[str, ...]


def dump(flight: InFlight, delta: DeltaController, chunk: ChunkSizeController, setup: Setup) -> dict[str, Any]:
    """The checkpoint dict (JSON-serialisable) of a scheduler between steps."""
    samples = flight.samples
    return {
        "version": STATE_VERSION,
        "batch_groups": setup.batch_groups,
        "samples_per_group": setup.samples_per_group,
        "scorers": list(setup.scorers),
        "next_group_id": flight.next_group_id,
        "next_prompt_index": flight.next_prompt_index,
        "last_step": flight.last_step,
        "delta": delta.state_dict(),
        "chunk": chunk.state_dict(),
        "complete_order": flight.complete_order(),
        "groups": [
            {
                "group_id": g.group_id,
                "prompt_index": g.prompt_index,
                "admitted_step": g.admitted_step,
                "deferrals": g.deferrals,
                "samples": [_dump_sample(s) for s in map(samples.__getitem__, g.sample_ids)],
            }
            for g in flight.groups.values()
        ],
        "ledger": list(flight.ledger),  # LEDGER_FIELDS per trained group, flat
        "totals": {
            "admitted_groups": flight.admitted_groups_total,
            "trained_groups": flight.trained_groups_total,
            "trained_tokens": flight.trained_tokens_total,
            "offpolicy_tokens": flight.offpolicy_tokens_total,
            "deferral_hist": dict(flight.deferral_hist_total),
        },
    }


def _dump_sample(s: Sample) -> dict[str, Any]:
    return {
        "sample_id": s.sample_id,
        "tokens": [list(c) for c in s.token_chunks],
        "logprobs": _dump_logprobs(s),
        "version_runs": [list(r) for r in s.version_runs],
        "finish_reason": s.finish_reason,
    }


def _dump_logprobs(s: Sample) -> list[list[float]]:
    """One list per token chunk, empty where no logprobs were recorded."""
    if s.logprob_chunks is None:
        return [[] for _ in s.token_chunks]
    return [list(c) for c in s.logprob_chunks]


def check_header(state: Any, setup: Setup) -> None:
    """Refuse a checkpoint of another version or written with another B, n or scorer set."""
    if not isinstance(state, dict) or state.get("version") not in (1, STATE_VERSION):
        found = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"scheduler checkpoint version {found!r}, expected {STATE_VERSION}")
    for key, mine in (
        ("batch_groups", setup.batch_groups),
        ("samples_per_group", setup.samples_per_group),
        ("scorers", list(setup.scorers)),
    ):
        if state.get(key) != mine:
            raise ValueError(f"checkpoint was written with {key}={state.get(key)!r}, this run has {mine!r}")


def load(
    state: dict[str, Any], setup: Setup, config: OppoConfig
) -> tuple[InFlight, DeltaController, ChunkSizeController]:
    """New in-flight record and controllers from a checkpoint that passed `check_header`;
    raises ``ValueError`` for a malformed one. Scorer caches do not survive a restart:
    with scorers, held samples are not complete and a restream is due."""
    try:
        flight, totals = _parse(state, setup)
        delta = _delta(config, state["delta"], len(flight.groups), setup.batch_groups)
        chunk = _chunk(config, state["chunk"])
    except (KeyError, IndexError, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"scheduler checkpoint is malformed: {exc!r}") from exc
    problems = ledger.check_state(state)
    if problems:
        raise ValueError("scheduler checkpoint's ledger does not account for its groups: " + "; ".join(problems[:5]))
    (flight.admitted_groups_total, flight.trained_groups_total, flight.trained_tokens_total,
     flight.offpolicy_tokens_total, flight.deferral_hist_total) = totals
    order = _ints(state.get("complete_order", []), "complete_order")
    if setup.scorers:
        flight.needs_restream = bool(flight.groups)
        flight.restored_complete_order = order if flight.needs_restream else []
    else:  # complete once finished: keep the completion order the run had
        for s in flight.samples.values():
            if s.finish_reason is not None:
                flight.sample_complete(s)
        kept = [gid for gid in order if gid in flight.complete]
        flight.complete = dict.fromkeys(kept + [gid for gid in flight.complete if gid not in kept])
    return flight, delta, chunk


def _parse(state: dict[str, Any], setup: Setup) -> tuple[InFlight, tuple]:
    n = setup.samples_per_group
    flight = InFlight(len(setup.scorers))
    flight.next_group_id = next_group_id = _int(state["next_group_id"], "next_group_id")
    flight.next_prompt_index = _int(state["next_prompt_index"], "next_prompt_index")
    flight.last_step = _int(state["last_step"], "last_step", low=-1)
    for gs in state["groups"]:
        gid = _int(gs["group_id"], "group_id")
        sids = tuple(_int(ss["sample_id"], "sample_id") for ss in gs["samples"])
        if gid >= next_group_id or sids != tuple(range(gid * n, gid * n + n)):
            raise ValueError(
                f"group {gid}: sample ids {sids} do not belong to it (n={n}, next_group_id={next_group_id})"
            )
        if gid in flight.groups:
            raise ValueError(f"a group is held twice: {sorted([g['group_id'] for g in state['groups']])}")
        g = Group(gid, _int(gs["prompt_index"], "prompt_index"), _int(gs["admitted_step"], "admitted_step"), sids)
        g.deferrals = _int(gs["deferrals"], "deferrals")
        for ss in gs["samples"]:
            flight.add_sample(_parse_sample(ss, g))
        flight.groups[gid] = g
    flight.ledger = array("q", _ints(state.get("ledger", []), "ledger"))
    if len(flight.ledger) % len(LEDGER_FIELDS):
        raise ValueError(f"ledger length {len(flight.ledger)} is not a multiple of {len(LEDGER_FIELDS)}")
    if state["version"] == 1:
        log.warning("scheduler checkpoint of version 1 has no ledger: groups trained before it are not listed")
    totals = state["totals"]
    hist = {b: _int(totals["deferral_hist"][b], "deferral_hist") for b in DEFERRAL_BUCKETS}
    return flight, (
        _int(totals["admitted_groups"], "admitted_groups"), _int(totals["trained_groups"], "trained_groups"),
        _int(totals["trained_tokens"], "trained_tokens"), _int(totals["offpolicy_tokens"], "offpolicy_tokens"), hist,
    )


def _parse_sample(ss: dict[str, Any], g: Group) -> Sample:
    s = Sample(ss["sample_id"], g)
    s.token_chunks = [array("i", _ints(c, "tokens")) for c in ss["tokens"]]
    s.logprob_chunks = [array("d", c) for c in ss["logprobs"]]
    if len(s.logprob_chunks) != len(s.token_chunks) or any(
        len(lp) not in (0, len(t)) for lp, t in zip(s.logprob_chunks, s.token_chunks, strict=True)
    ):
        raise ValueError(f"sample {s.sample_id}: logprobs do not match its token chunks")
    s.num_tokens = sum(map(len, s.token_chunks))
    s.version_runs = tuple((_int(a, "version offset"), _int(b, "policy version")) for a, b in ss["version_runs"])
    offsets = [a for a, _ in s.version_runs]
    versions = [b for _, b in s.version_runs]
    if s.num_tokens and (
        not offsets or offsets[0] != 0 or offsets != sorted(set(offsets)) or offsets[-1] >= s.num_tokens
        or versions != sorted(versions)
    ):
        raise ValueError(f"sample {s.sample_id}: version runs {s.version_runs} do not fit {s.num_tokens} tokens")
    s.version = versions[-1] if versions else None
    s.finish_reason = ss["finish_reason"]
    if s.finish_reason not in (None, *FINISH_REASONS):
        raise ValueError(f"sample {s.sample_id}: finish reason {s.finish_reason!r}")
    return s


def _delta(config: OppoConfig, state: dict[str, Any], carried: int, batch_groups: int) -> DeltaController:
    """The checkpoint's Δ controller under this run's --oppo.delta.* (clamped, with a notice)."""
    cfg = config.delta
    ctl = DeltaController(cfg, batch_groups)
    ctl.load_state_dict(state)
    was = ctl.value
    if not cfg.enable:
        ctl.value = 0
        why = "--oppo.delta.enable is false"
    elif not cfg.adaptive:
        ctl.value = cfg.init
        why = "--oppo.delta.adaptive is false: Δ is --oppo.delta.init"
    else:
        ctl.value = min(cfg.max, max(cfg.min, was))
        why = f"--oppo.delta.min/max allow [{cfg.min}, {cfg.max}]"
    if ctl.value != was:
        log.warning("OPPO resume: the checkpoint's Δ=%d becomes Δ=%d (%s); %d carried group(s) are trained first",
                    was, ctl.value, why, carried)
    return ctl


def _chunk(config: OppoConfig, state: dict[str, Any]) -> ChunkSizeController:
    """The checkpoint's C controller under this run's --oppo.chunk.* (a new trial round
    when the checkpoint's sizes are not candidates any more)."""
    cfg = config.chunk
    ctl = ChunkSizeController(cfg)
    if not cfg.adaptive:
        if int(state["best"]) != cfg.size_tokens:
            log.warning("OPPO resume: the checkpoint's C=%s becomes C=%d (--oppo.chunk.size_tokens; "
                        "--oppo.chunk.adaptive is false)", state["best"], cfg.size_tokens)
        return ctl
    loaded = ChunkSizeController(cfg)
    loaded.load_state_dict(state)
    # Before its first round of trials ends, C is the start value, a candidate or not
    if not loaded.trial_sizes() <= set(cfg.candidates) or loaded.best not in (*cfg.candidates, cfg.size_tokens):
        sizes = {loaded.best, *loaded.trial_sizes()}
        log.warning("OPPO resume: the checkpoint's chunk sizes %s are not all in --oppo.chunk.candidates %s; "
                    "a new round of trials starts", sorted(sizes), list(cfg.candidates))
        return ctl
    return loaded
