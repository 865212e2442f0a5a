"""OppoRolloutActor's outbox without vLLM: a step of the tiny task replayed through the real
`_push` / `next_outputs`, one single-token delta per sample per engine step, as vLLM's
DELTA stream yields them."""

from __future__ import annotations

import asyncio
import random
from array import array

from openrlhf_oppo.integrations.runtime.deltas import Outbox, SampleDelta
from openrlhf_oppo.integrations.runtime.rollout import OppoRolloutActor


def make_outbox() -> OppoRolloutActor:
    """The actor's outbox state as its `__init__` sets it (its base would start vLLM)."""
    actor = object.__new__(OppoRolloutActor)
    actor._outbox = Outbox()
    return actor


async def replay(lengths: list[int], chunk: int) -> tuple[int, list[SampleDelta]]:
    """Decode every sample in lockstep (one token each per engine step); the driver drains the
    outbox whenever it would wake. Returns the deltas pushed and the deltas handed over."""
    actor, pushed, sent = make_outbox(), 0, []
    for step in range(max(lengths)):
        for sid, n in enumerate(lengths):
            if step < n:
                actor._push(SampleDelta(sid, array("i", [step]), None, 0, "stop" if step == n - 1 else None, 0.0))
                pushed += 1
        if actor._outbox.ready.is_set() or step == max(lengths) - 1:
            sent += await actor.next_outputs(0.0, chunk)
    return pushed, sent


def test_a_tiny_task_step_crosses_ray_in_about_c_times_fewer_deltas_with_every_token_in_order():
    # configs/tiny-cpu.yaml: B 4 x n 2 plus Δ 2 groups = 12 samples, up to 192 tokens, EOS p ~0.015, C = 8
    rng = random.Random(0)
    lengths = [min(192, 1 + int(rng.expovariate(0.015))) for _ in range(12)]
    pushed, sent = asyncio.run(replay(lengths, chunk=8))
    assert pushed == sum(lengths)
    for sid, n in enumerate(lengths):
        mine = [d for d in sent if d.sample_id == sid]
        assert [t for d in mine for t in d.token_ids] == list(range(n))
        assert [d.finish_reason for d in mine][-1] == "stop" and all(d.finish_reason is None for d in mine[:-1])
    assert len(sent) * 4 < pushed  # C = 8: about one delta per sample per chunk
