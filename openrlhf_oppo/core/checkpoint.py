"""The scheduler's checkpoint: written between steps, read back whole or not at all.

A checkpoint holds the carried groups (tokens, logprobs, policy versions, finish
reasons), the Δ and C controllers, the prompt-stream position, the counters and the
*ledger*: one row per trained group (group id, prompt position, admission step,
training step, deferrals). Held groups plus ledger rows account for every group ever
admitted, which `openrlhf_oppo.core.ledger.check_state` verifies.

`restore` parses and validates everything into new objects before it touches the
scheduler, then reconciles the checkpoint with the new run's settings: a Δ or C
the new flags forbid is clamped with a logged notice (never silently kept).
"""

from __future__ import annotations

import logging
from array import array
from typing import TYPE_CHECKING, Any

from openrlhf_oppo.core import ledger
from openrlhf_oppo.core.controllers import ChunkSizeController, DeltaController
from openrlhf_oppo.core.types import DEFERRAL_BUCKETS, FINISH_REASONS

if TYPE_CHECKING:
    from openrlhf_oppo.core.scheduler import OverlapScheduler

log = logging.getLogger(__name__)

STATE_VERSION = 2  # 2: + ledger
LEDGER_FIELDS = ledger.LEDGER_FIELDS


def dump(sched: "OverlapScheduler") -> dict[str, Any]:
    samples = sched._samples
    return {
        "version": STATE_VERSION,
        "batch_groups": sched.batch_groups,
        "samples_per_group": sched.samples_per_group,
        "scorers": list(sched.scorers),
        "next_group_id": sched._next_group_id,
        "next_prompt_index": sched._next_prompt_index,
        "last_step": sched._last_step,
        "delta": sched.delta.state_dict(),
        "chunk": sched.chunk.state_dict(),
        "complete_order": list(sched._complete),
        "groups": [
            {
                "group_id": g.group_id,
                "prompt_index": g.prompt_index,
                "admitted_step": g.admitted_step,
                "deferrals": g.deferrals,
                "samples": [
                    {
                        "sample_id": s.sample_id,
                        "tokens": [list(c) for c in s.token_chunks],
                        "logprobs": [list(c) for c in s.logprob_chunks]
                        if s.logprob_chunks is not None
                        else [[] for _ in s.token_chunks],
                        "version_runs": [list(r) for r in s.version_runs],
                        "finish_reason": s.finish_reason,
                    }
                    for s in map(samples.__getitem__, g.sample_ids)
                ],
            }
            for g in sched._groups.values()
        ],
        "ledger": list(sched._ledger),  # LEDGER_FIELDS per trained group, flat
        "totals": {
            "admitted_groups": sched.admitted_groups_total,
            "trained_groups": sched.trained_groups_total,
            "trained_tokens": sched.trained_tokens_total,
            "offpolicy_tokens": sched.offpolicy_tokens_total,
            "deferral_hist": dict(sched.deferral_hist_total),
        },
    }


def restore(sched: "OverlapScheduler", state: dict[str, Any]) -> None:
    if not isinstance(state, dict) or state.get("version") not in (1, STATE_VERSION):
        found = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"scheduler checkpoint version {found!r}, expected {STATE_VERSION}")
    for key, mine in (
        ("batch_groups", sched.batch_groups),
        ("samples_per_group", sched.samples_per_group),
        ("scorers", list(sched.scorers)),
    ):
        if state.get(key) != mine:
            raise ValueError(f"checkpoint was written with {key}={state.get(key)!r}, this run has {mine!r}")
    if sched._step is not None or sched._groups or sched._last_step >= 0:
        raise RuntimeError("load_state_dict on a scheduler that already ran; build a fresh one")
    try:
        parsed = _parse(sched, state)
    except (KeyError, IndexError, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"scheduler checkpoint is malformed: {exc!r}") from exc
    problems = ledger.check_state(state)
    if problems:
        raise ValueError("scheduler checkpoint's ledger does not account for its groups: " + "; ".join(problems[:5]))
    # nothing below raises: the scheduler changes only now, and entirely
    (sched._next_group_id, sched._next_prompt_index, sched._last_step, sched.delta, sched.chunk,
     groups, sample_list, sched._ledger, totals) = parsed
    sched._chunk_size = sched.chunk.value
    sched._step_delta = sched.delta.value
    for g in groups:
        sched._groups[g.group_id] = g
    for s in sample_list:
        sched._samples[s.sample_id] = s
        for acked in sched._scored:
            acked[s.sample_id] = 0
        if not sched.scorers and s.finish_reason is not None:
            sched._sample_complete(s)
    if not sched.scorers:  # keep the completion order the run had
        order = [gid for gid in state["complete_order"] if gid in sched._complete]
        sched._complete = dict.fromkeys(order + [gid for gid in sched._complete if gid not in order])
    sched._needs_restream = bool(sched._groups) and bool(sched.scorers)
    (sched.admitted_groups_total, sched.trained_groups_total, sched.trained_tokens_total,
     sched.offpolicy_tokens_total, sched.deferral_hist_total) = totals


def _parse(sched: "OverlapScheduler", state: dict[str, Any]) -> tuple:
    from openrlhf_oppo.core.scheduler import _Group, _Sample  # the scheduler's own records

    n = sched.samples_per_group
    next_group_id = _int(state["next_group_id"], "next_group_id")
    next_prompt_index = _int(state["next_prompt_index"], "next_prompt_index")
    last_step = _int(state["last_step"], "last_step", low=-1)
    groups, samples = [], []
    for gs in state["groups"]:
        gid = _int(gs["group_id"], "group_id")
        sids = tuple(_int(ss["sample_id"], "sample_id") for ss in gs["samples"])
        if gid >= next_group_id or sids != tuple(range(gid * n, gid * n + n)):
            raise ValueError(f"group {gid}: sample ids {sids} do not belong to it (n={n}, next_group_id={next_group_id})")
        g = _Group(gid, _int(gs["prompt_index"], "prompt_index"), _int(gs["admitted_step"], "admitted_step"), sids)
        g.deferrals = _int(gs["deferrals"], "deferrals")
        for ss in gs["samples"]:
            s = _Sample(ss["sample_id"], g)
            s.token_chunks = [array("i", _ints(c, "tokens")) for c in ss["tokens"]]
            s.logprob_chunks = [array("d", c) for c in ss["logprobs"]]
            if len(s.logprob_chunks) != len(s.token_chunks) or any(
                len(lp) not in (0, len(t)) for lp, t in zip(s.logprob_chunks, s.token_chunks)
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
            samples.append(s)
        groups.append(g)
    held = [g.group_id for g in groups]
    if len(set(held)) != len(held):
        raise ValueError(f"a group is held twice: {sorted(held)}")
    ledger = array("q", _ints(state.get("ledger", []), "ledger"))
    if len(ledger) % len(LEDGER_FIELDS):
        raise ValueError(f"ledger length {len(ledger)} is not a multiple of {len(LEDGER_FIELDS)}")
    if state["version"] == 1:
        log.warning("scheduler checkpoint of version 1 has no ledger: groups trained before it are not listed")
    totals = state["totals"]
    hist = {b: _int(totals["deferral_hist"][b], "deferral_hist") for b in DEFERRAL_BUCKETS}
    return (
        next_group_id, next_prompt_index, last_step,
        _delta(sched, state["delta"], len(groups)), _chunk(sched, state["chunk"]),
        groups, samples, ledger,
        (_int(totals["admitted_groups"], "admitted_groups"), _int(totals["trained_groups"], "trained_groups"),
         _int(totals["trained_tokens"], "trained_tokens"), _int(totals["offpolicy_tokens"], "offpolicy_tokens"), hist),
    )


def _delta(sched: "OverlapScheduler", state: dict[str, Any], carried: int) -> DeltaController:
    """The checkpoint's Δ controller under this run's --oppo.delta.* (clamped, with a notice)."""
    cfg = sched.config.delta
    ctl = DeltaController(cfg)
    ctl.load_state_dict(state)
    was = ctl.value
    if not cfg.enable:
        ctl.value, why = 0, "--oppo.delta.enable is false"
    elif not cfg.adaptive:
        ctl.value, why = cfg.init, "--oppo.delta.adaptive is false: Δ is --oppo.delta.init"
    else:
        ctl.value = min(cfg.max, max(cfg.min, was))
        why = f"--oppo.delta.min/max allow [{cfg.min}, {cfg.max}]"
    if ctl.value != was:
        log.warning("OPPO resume: the checkpoint's Δ=%d becomes Δ=%d (%s); %d carried group(s) are trained first",
                    was, ctl.value, why, carried)
    return ctl


def _chunk(sched: "OverlapScheduler", state: dict[str, Any]) -> ChunkSizeController:
    """The checkpoint's C controller under this run's --oppo.chunk.* (a new trial round
    when the checkpoint's sizes are not candidates any more)."""
    cfg = sched.config.chunk
    ctl = ChunkSizeController(cfg)
    if not cfg.adaptive:
        if int(state["best"]) != cfg.size_tokens:
            log.warning("OPPO resume: the checkpoint's C=%s becomes C=%d (--oppo.chunk.size_tokens; "
                        "--oppo.chunk.adaptive is false)", state["best"], cfg.size_tokens)
        return ctl
    loaded = ChunkSizeController(cfg)
    loaded.load_state_dict(state)
    sizes = {loaded._best, *loaded._trial_queue, *loaded._tokens}
    if not sizes <= set(cfg.candidates):
        log.warning("OPPO resume: the checkpoint's chunk sizes %s are not all in --oppo.chunk.candidates %s; "
                    "a new round of trials starts", sorted(sizes), list(cfg.candidates))
        return ctl
    return loaded


def _int(value: Any, what: str, low: int = 0) -> int:
    if type(value) is not int or value < low:
        raise ValueError(f"{what} must be an int >= {low}, got {value!r}")
    return value


def _ints(values: Any, what: str) -> list[int]:
    values = list(values)
    if not all(type(v) is int for v in values):
        raise ValueError(f"{what} must be ints, got {[v for v in values if type(v) is not int][:4]!r}")
    return values
