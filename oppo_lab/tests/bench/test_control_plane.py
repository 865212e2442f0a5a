"""`bench control-plane`'s pieces without Ray: the synthetic engine's clock, pause and outbox,
the synthetic scorer's checks, and the lag arithmetic on hand-built logs."""

from __future__ import annotations

import asyncio
from array import array

from openrlhf_oppo.integrations.runtime.deltas import SampleRequest
from oppo_lab.control_plane.actors import SyntheticEngine, SyntheticScorer
from oppo_lab.control_plane.figures import token_lags
from oppo_lab.synthetic import LengthModel

FIXED = LengthModel(median_tokens=6, sigma=0.0, min_tokens=6, max_tokens=6)  # every response: 6 tokens


def make_engine(max_seqs: int = 1, tokens_per_s: float = 1000.0) -> SyntheticEngine:
    return SyntheticEngine(max_seqs, tokens_per_s, FIXED, seed=0, tick_s=0.001)


def request(sid: int) -> SampleRequest:
    return SampleRequest(sid, [1, 2], [], max_tokens=100)


def test_engine_decodes_at_most_max_seqs_at_once_and_hands_every_token_in_order():
    async def run():
        engine = make_engine(max_seqs=1)
        await engine.start_samples([request(0), request(1)], None)
        assert list(engine.decoding) == [0] and [r.sample_id for r in engine.waiting] == [1]
        got: dict[int, list[int]] = {0: [], 1: []}
        finished = []
        while len(finished) < 2:
            for d in await engine.next_outputs(1.0, wake_tokens=4):
                got[d.sample_id] += list(d.token_ids)
                if d.finish_reason:
                    finished.append(d.sample_id)
        return engine, got, finished

    engine, got, finished = asyncio.run(run())
    assert got == {0: list(range(6)), 1: list(range(6))} and finished == [0, 1]
    assert engine.full_until_s is not None  # sample 1 decoded alone, nothing waiting
    times, ends = engine.pushes[0]
    assert list(ends)[-1] == 6 and list(times) == sorted(times)
    assert engine.calls["start_samples"] == 1 and engine.calls["next_outputs"] >= 2


def test_a_paused_engine_emits_nothing_and_resumes_where_it_stopped():
    async def run():
        engine = make_engine(tokens_per_s=200.0)  # 6 tokens in 30 ms
        await engine.start_samples([request(0)], None)
        await engine.pause_generation(True)
        await asyncio.sleep(0.05)
        during = engine.decoding[0].emitted
        await engine.resume_generation()
        engine.set_policy_version(3)
        deltas = []
        while not deltas or deltas[-1].finish_reason is None:
            deltas += await engine.next_outputs(1.0, wake_tokens=100)
        return during, deltas

    during, deltas = asyncio.run(run())
    assert during == 0
    assert [t for d in deltas for t in d.token_ids] == list(range(6)) and deltas[-1].policy_version == 3


def test_scorer_flags_a_chunk_out_of_order_and_a_chunk_after_the_final_one():
    scorer = SyntheticScorer()
    scorer.open_many({7: [1, 2], 8: [1, 2]})
    reply = scorer.process({7: [0, 1], 8: [0, 1]}, {})
    assert reply.scores == {} and scorer.error_count == 0
    scorer.process({7: [3]}, {})  # token 2 skipped
    assert scorer.error_count == 1 and "where 2.. was due" in scorer.errors[-1]
    reply = scorer.process({}, {8: [2]})
    assert reply.scores == {8: 3.0} and scorer.error_count == 1
    scorer.process({8: [3]}, {})  # after its final chunk
    assert scorer.error_count == 2 and "not open" in scorer.errors[-1]


def test_lag_is_each_tokens_chunk_arrival_less_its_push_time():
    # sample 0: tokens 0-1 pushed at t=1, 2-3 at t=2; chunks [0,2) arrive at 1.5, [2,4) at 2.25
    engine_logs = [{"pushes": {0: (array("d", [1.0, 2.0]), array("i", [2, 4]))}}]
    scorer_logs = [{"sids": array("q", [0, 0]), "starts": array("q", [0, 2]), "ends": array("q", [2, 4]),
                    "arrival_s": array("d", [1.5, 2.25]), "finished": {0: 4}, "error_count": 0, "errors": []}]
    lags, chunk_lags, checks = token_lags(engine_logs, scorer_logs, {0: 4})
    assert list(lags) == [0.5, 0.5, 0.25, 0.25] and list(chunk_lags) == [0.5, 0.25]
    assert checks["samples_exact"] == 1 and checks["emitted_tokens"] == checks["scored_tokens"] == 4


def test_a_sample_whose_chunks_leave_a_gap_is_not_exact():
    engine_logs = [{"pushes": {0: (array("d", [1.0]), array("i", [4]))}}]
    scorer_logs = [{"sids": array("q", [0, 0]), "starts": array("q", [0, 3]), "ends": array("q", [2, 4]),
                    "arrival_s": array("d", [1.5, 2.0]), "finished": {0: 4}, "error_count": 0, "errors": []}]
    _, _, checks = token_lags(engine_logs, scorer_logs, {0: 4, 1: 5})
    assert checks["samples_exact"] == 0 and checks["bad_samples"] == [0] and checks["missing_samples"] == [1]


def test_due_only_drain_leaves_a_sample_without_a_chunk_due_in_the_outbox():
    from openrlhf_oppo.integrations.runtime.deltas import SampleDelta
    from oppo_lab.control_plane.actors import DueOnlyOutbox

    async def run():
        box = DueOnlyOutbox()
        box.begin(0, 0)
        box.begin(1, 0)
        box.push(SampleDelta(0, array("i", [0, 1, 2, 3]), None, 0, None, 1.0))  # a chunk of 4 due
        box.push(SampleDelta(1, array("i", [0]), None, 0, None, 1.0))
        first = await box.drain(0.0, wake_tokens=4)
        box.push(SampleDelta(1, array("i", [1]), None, 0, "stop", 2.0))
        return first, await box.drain(0.0, wake_tokens=4)

    first, second = asyncio.run(run())
    assert [(d.sample_id, list(d.token_ids)) for d in first] == [(0, [0, 1, 2, 3])]
    assert [(d.sample_id, list(d.token_ids), d.finish_reason) for d in second] == [(1, [0, 1], "stop")]
