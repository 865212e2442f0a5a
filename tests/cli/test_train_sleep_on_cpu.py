"""OpenRLHF's hybrid engine under OPPO, end to end on CPU: `openrlhf-oppo train --schedule oppo
--config configs/tiny-cpu.yaml -- --train.colocate_all --vllm.enable_sleep --ds.enable_sleep`
with the reward model streamed (4 steps; the session's `oppo_run`, which the OPPO, timeline and
compat-matrix tests read too). vLLM's CPU build has no sleep mode; the compat layer's stand-in
drops the engine's KV cache at sleep (`compat.patches.vllm_sleep_standin`), the part a carried
sample must survive. At each batch the carried requests stop with their tokens, the engines
sleep through the update, and after the wake each decodes on from its tokens, prompt + partial
response re-prefilled."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from openrlhf_oppo import timeline
from openrlhf_oppo.core import ledger

pytestmark = pytest.mark.e2e  # real Ray, vLLM (CPU build), DeepSpeed and OpenRLHF processes

STEPS = 4  # the oppo_run fixture: 16 prompts, 4 a step


def _rows(run, name: str) -> list[dict]:
    return [json.loads(line) for line in (run.root / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def sleep_run(oppo_run):
    return oppo_run


@pytest.fixture(scope="module")
def decodes(sleep_run) -> dict[int, list[dict]]:
    """sample id -> its engine requests in start order (timeline `sample` records: tokens
    decoded, finish reason, tokens `held` when it started)."""
    out: dict[int, list[dict]] = defaultdict(list)
    for r in sorted(timeline.read(sleep_run.root / "timeline"), key=lambda r: r["t0"]):
        if r["role"] == "rollout" and r["kind"] == "sample" and r.get("sample") is not None:
            out[r["sample"]].append(r)
    return out


def test_the_hybrid_engine_trains_every_group_once(sleep_run):
    trace = _rows(sleep_run, "oppo_trace.jsonl")
    assert [row["step"] for row in trace] == list(range(STEPS))
    trained = [g["group_id"] for row in trace for g in row["trained"]]
    assert sorted(trained) == list(range(4 * STEPS))
    assert ledger.check_run(sleep_run.root).ok


def test_carried_samples_stop_at_the_batch_keep_their_tokens_and_are_reprefilled(sleep_run, decodes):
    trace = _rows(sleep_run, "oppo_trace.jsonl")
    trained = {s["sample_id"]: (g, s) for row in trace for g in row["trained"] for s in g["samples"]}
    stopped = {sid for sid, reqs in decodes.items() if any(r["finish"] == "abort" for r in reqs)}
    assert stopped, "no request was decoding at a batch: nothing was carried through a sleep"
    expected_reprefill = defaultdict(int)  # step -> prompt + held tokens of the requests it resumed
    step_of = {}  # (sample id, tokens held at the start) -> the step that started the request
    for row in trace:  # what each step's end held, carried into the next step
        for sid, held in row["carried_tokens"].items():
            step_of[(int(sid), len(held))] = row["step"] + 1
    for sid in stopped:
        group, sample = trained[sid]
        reqs = decodes[sid]
        for before, after in zip(reqs, reqs[1:]):
            assert before["finish"] == "abort"  # stopped at a batch, and only then started again
            assert after["held"] == before["held"] + before["tokens"]  # every token kept, none twice
            expected_reprefill[step_of[(sid, after["held"])]] += len(group["prompt_ids"]) + after["held"]
        assert reqs[-1]["finish"] in ("stop", "length")
        assert len(sample["tokens"]) == reqs[-1]["held"] + reqs[-1]["tokens"]
    for row in trace:  # the tokens a sample held at a step's end open its trained response
        for sid, held in row["carried_tokens"].items():
            assert trained[int(sid)][1]["tokens"][: len(held)] == held
    metrics = _rows(sleep_run, "oppo_metrics.jsonl")
    assert [m["oppo/reprefilled_tokens"] for m in metrics] == [float(expected_reprefill[s]) for s in range(STEPS)]


def test_the_engines_sleep_through_every_update(sleep_run, decodes):
    records = timeline.read(sleep_run.root / "timeline")
    driver = defaultdict(list)
    for r in records:
        if r["role"] == "driver" and r["kind"] == "span":
            driver[r["stage"]].append((r["t0"], r["t1"]))
    assert len(driver["wake"]) == len(driver["sleep"]) == len(driver["train"]) == STEPS
    for t0, t1 in driver["train"]:
        for reqs in decodes.values():
            for r in reqs:
                assert r["t1"] <= t0 or r["t0"] >= t1, "a request decoded while the models trained"
    metrics = _rows(sleep_run, "oppo_metrics.jsonl")
    assert all(m["oppo/stale_kv_token_fraction"] == 0.0 for m in metrics)  # asleep, the KV cache is dropped
