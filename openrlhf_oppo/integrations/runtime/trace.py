"""OPPO's per-step trace (OPPO_TRACE_JSONL): one JSON line per step with what was
admitted, trained (tokens, per-token policy versions, rewards) and carried. For small
runs: `openrlhf-oppo train` writes it and the tests read it."""

from __future__ import annotations

import json

from openrlhf_oppo.core import OverlapScheduler, TrainBatch


def write_trace(path: str, scheduler: OverlapScheduler, batch: TrainBatch, report,
                prompts: dict[int, tuple[str, str, list[int]]], scores: dict[int, float]) -> None:
    """Append step `report.step`: `prompts` is group id -> (prompt, label, prompt ids),
    `scores` sample id -> streamed or rule-based reward (absent: OpenRLHF's reward forward)."""
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
