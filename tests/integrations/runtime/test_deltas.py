"""merge_deltas: an engine's drained outbox, joined per sample and policy version before it
crosses Ray."""

from __future__ import annotations

import random
from array import array

from openrlhf_oppo.integrations.runtime.deltas import SampleDelta, merge_deltas


def make_delta(sid: int, tokens: list[int], version: int = 0, finish: str | None = None, time_s: float = 0.0,
               logprobs: list[float] | None = None, reward: dict | None = None) -> SampleDelta:
    lp = None if logprobs is None else array("d", logprobs)
    return SampleDelta(sid, array("i", tokens), lp, version, finish, time_s, reward)


def per_sample(deltas: list[SampleDelta]) -> dict[int, list[tuple]]:
    """sample id -> its (token, logprob, version) in order, and its finish reason last."""
    out: dict[int, list[tuple]] = {}
    for d in deltas:
        lps = list(d.logprobs) if d.logprobs is not None else [None] * len(d.token_ids)
        out.setdefault(d.sample_id, []).extend((t, lp, d.policy_version) for t, lp in zip(d.token_ids, lps))
        if d.finish_reason is not None:
            out[d.sample_id].append(("finished", d.finish_reason))
    return out


def test_single_token_deltas_of_two_samples_become_one_delta_each_with_their_tokens_and_logprobs():
    outbox = [make_delta(0, [5], logprobs=[-0.5], time_s=1.0), make_delta(1, [7], logprobs=[-0.7], time_s=1.0),
              make_delta(0, [6], logprobs=[-0.6], time_s=2.0), make_delta(1, [8], logprobs=[-0.8], time_s=2.0)]
    merged = merge_deltas(outbox)
    assert [(d.sample_id, list(d.token_ids), list(d.logprobs), d.time_s) for d in merged] == [
        (0, [5, 6], [-0.5, -0.6], 2.0), (1, [7, 8], [-0.7, -0.8], 2.0)]
    assert all(d.token_ids.typecode == "i" and d.logprobs.typecode == "d" for d in merged)


def test_a_version_change_splits_a_merge():
    outbox = [make_delta(0, [1], version=3), make_delta(0, [2], version=3), make_delta(0, [3], version=4),
              make_delta(0, [4], version=4)]
    merged = merge_deltas(outbox)
    assert [(list(d.token_ids), d.policy_version) for d in merged] == [([1, 2], 3), ([3, 4], 4)]


def test_finished_samples_keep_their_order_and_their_reward():
    # sample 1 finishes before sample 0: the merged deltas keep that order
    reward = {"reward": 1.0, "scores": 1.0, "extra_logs": {}}
    outbox = [make_delta(0, [1]), make_delta(1, [9], finish="stop", time_s=5.0, reward=reward),
              make_delta(0, [2], finish="length", time_s=6.0)]
    merged = merge_deltas(outbox)
    assert [(d.sample_id, list(d.token_ids), d.finish_reason, d.time_s) for d in merged] == [
        (1, [9], "stop", 5.0), (0, [1, 2], "length", 6.0)]
    assert merged[0].reward is reward


def test_an_empty_abort_joins_the_tokens_before_it_and_keeps_their_logprobs():
    outbox = [make_delta(0, [1], logprobs=[-1.0]), make_delta(0, [], finish="abort")]
    (merged,) = merge_deltas(outbox)
    assert (list(merged.token_ids), list(merged.logprobs), merged.finish_reason) == ([1], [-1.0], "abort")


def test_tokens_with_and_without_logprobs_never_join():
    outbox = [make_delta(0, [1], logprobs=[-1.0]), make_delta(0, [2])]
    assert merge_deltas(outbox) == outbox


def test_a_lone_delta_is_handed_on_as_it_is():
    d = make_delta(0, [1])
    assert merge_deltas([d])[0] is d and merge_deltas([]) == []


def test_many_random_single_token_deltas_keep_every_samples_tokens_logprobs_versions_and_order():
    rng = random.Random(0)
    outbox, version = [], 0
    for step in range(400):
        if step % 97 == 0:
            version += 1  # a weight sync
        sid = rng.randrange(6)
        outbox.append(make_delta(sid, [step], version=version, logprobs=[-step / 100]))
    merged = merge_deltas(outbox)
    assert per_sample(merged) == per_sample(outbox)
    assert len(merged) < len(outbox) / 10
