"""What a rollout engine hands the driver: `SampleDelta`, and `merge_deltas`, which joins a
drained outbox's deltas per sample and policy version before they cross Ray.

vLLM's `RequestOutputKind.DELTA` stream yields about one token per engine step per
request; the engine's outbox is drained once a chunk is due (`OppoRolloutActor.next_outputs`),
so a reply held ~C single-token deltas per sample. One merged delta per sample and
version is ~C times fewer Python objects to pickle, send and feed to the scheduler core
(issue 26, item 9). Pure Python: imports neither Ray nor vLLM.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass


@dataclass(frozen=True)
class SampleDelta:
    """New tokens of one sample, all from one policy version.

    Attributes:
        token_ids: array("i") of the new response token ids. Arrays, not lists: the
            driver's scheduler holds millions of these ids between steps, and arrays are
            invisible to the cyclic GC (lists are walked on every pass).
        logprobs: array("d") of their rollout log-probs (one per token), or None when not requested.
        policy_version: the weights that decoded them (weight syncs done before).
        finish_reason: "stop" | "length" | "abort" on the last delta of a sample, else None.
        time_s: when the engine produced it (time.time()): a finished sample's end.
        reward: on a finished sample's last delta with --reward.remote_url: reward, scores, extra_logs.
        error: why the sample was aborted, or its reward could not be had.
    """

    sample_id: int
    token_ids: array
    logprobs: array | None
    policy_version: int
    finish_reason: str | None
    time_s: float
    reward: dict | None = None
    error: str | None = None


def merge_deltas(deltas: list[SampleDelta]) -> list[SampleDelta]:
    """Join consecutive deltas of one sample decoded by one policy version into one.

    A run ends at a finished delta (nothing of a sample follows it) or where the version
    changes (a weight sync in between: the core stamps tokens per version run). The merged
    delta takes the place of its run's *last* delta, so finished samples keep their order
    relative to each other and to other samples' tokens, and its time, finish reason,
    reward and error are the last delta's. Deltas with tokens but without log-probs never
    join ones with log-probs (an empty delta joins either).
    """
    run_of: list[int] = []  # delta index -> its run
    runs: list[list[SampleDelta]] = []
    last_of_run: list[int] = []  # run -> index of its last delta
    with_logprobs: list[bool | None] = []  # run -> whether its tokens carry log-probs (None: no tokens yet)
    open_run: dict[int, int] = {}  # sample id -> its run that may still grow
    for i, d in enumerate(deltas):
        r = open_run.get(d.sample_id)
        if r is None or not _joins(runs[r][-1], with_logprobs[r], d):
            r = len(runs)
            runs.append([])
            last_of_run.append(i)
            with_logprobs.append(None)
        runs[r].append(d)
        if d.token_ids:
            with_logprobs[r] = d.logprobs is not None
        run_of.append(r)
        last_of_run[r] = i
        if d.finish_reason is None:
            open_run[d.sample_id] = r
        else:
            open_run.pop(d.sample_id, None)
    return [_join(runs[r]) for i, r in enumerate(run_of) if last_of_run[r] == i]


def _joins(last: SampleDelta, with_logprobs: bool | None, d: SampleDelta) -> bool:
    if last.policy_version != d.policy_version:
        return False
    return not d.token_ids or with_logprobs is None or with_logprobs == (d.logprobs is not None)


def _join(run: list[SampleDelta]) -> SampleDelta:
    last = run[-1]
    if len(run) == 1:
        return last
    tokens = array("i")
    parts = [d for d in run if d.token_ids]
    for d in parts:
        tokens.extend(d.token_ids)
    if not parts or parts[0].logprobs is None:
        logprobs = last.logprobs if not parts else None
    else:
        logprobs = array("d")
        for d in parts:
            logprobs.extend(d.logprobs)
    return SampleDelta(last.sample_id, tokens, logprobs, last.policy_version, last.finish_reason, last.time_s,
                       last.reward, last.error)
