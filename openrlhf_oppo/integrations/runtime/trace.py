"""OPPO's per-step records: the trace (OPPO_TRACE_JSONL), one JSON line per step with what
was admitted, trained (tokens, per-token policy versions, rewards) and carried, for small
runs (`openrlhf-oppo train` writes it and the tests read it); and the ledger
(OPPO_LEDGER_JSONL, `core.ledger`) of every group admitted, trained and held, across restarts."""

from __future__ import annotations

import json
from typing import Any

from openrlhf_oppo import run_env
from openrlhf_oppo.core import OverlapScheduler, TrainBatch, ledger


def write_trace(path: str, scheduler: OverlapScheduler, batch: TrainBatch, report,
                prompts: dict[int, tuple[str, str, list[int]]], scores: dict[int, float],
                reference: dict[int, list[float]] | None = None) -> None:
    """Append step `report.step`: `prompts` is group id -> (prompt, label, prompt ids),
    `scores` sample id -> streamed or rule-based reward (absent: OpenRLHF's reward forward),
    `reference` sample id -> streamed reference log-probs of its response tokens (absent: not
    streamed)."""
    reference = reference or {}
    carried = {}
    for gid in report.carried_groups:
        for sid in scheduler.group_sample_ids(gid):
            carried[str(sid)] = scheduler.held_tokens(sid)
    row = {
        "step": report.step,
        "admitted_groups": report.admitted_groups,
        "next_prompt_index": scheduler.next_prompt_index,
        "trained": [
            {
                "group_id": g.group_id,
                "prompt_index": g.prompt_index,
                "prompt_ids": prompts[g.group_id][2],
                "deferrals": g.deferrals,
                "samples": [
                    {
                        "sample_id": s.sample_id,
                        "tokens": s.token_ids,
                        "versions": s.token_versions,
                        "finish_reason": s.finish_reason,
                        "reward": scores.get(s.sample_id),
                        "reference_logprobs": reference.get(s.sample_id),
                    }
                    for s in g.samples
                ],
            }
            for g in batch.groups
        ],
        "carried_groups": list(report.carried_groups),
        "carried_tokens": carried,
    }
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


class RunLedger:
    """The ledger's events as the samples generator writes them; nothing when OPPO_LEDGER_JSONL is unset."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path if path is not None else run_env.path(run_env.LEDGER_JSONL)
        self.started = False  # the run's (re)start is recorded once per process, before its first step

    def start(self, last_step: int, held: list[int], next_group_id: int, per_pass: int) -> None:
        self.event("start", last_step=last_step, held=held, next_group_id=next_group_id, per_pass=per_pass)
        self.started = True

    def event(self, event: str, **fields: Any) -> None:
        if self.path:
            ledger.append_event(self.path, {"event": event, **fields})
