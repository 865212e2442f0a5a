"""What the driver and a rollout engine hand each other: `SampleRequest` (a sample to decode),
`SampleDelta` (its new tokens), and `merge_deltas`, which joins a drained outbox's deltas per
sample and policy version before they cross Ray.

vLLM's `RequestOutputKind.DELTA` stream yields about one token per engine step per
request; the engine's outbox is drained once a chunk is due (`OppoRolloutActor.next_outputs`),
so a reply held ~C single-token deltas per sample. One merged delta per sample and
version is ~C times fewer Python objects to pickle, send and feed to the scheduler core.
`Outbox` holds an engine's deltas until the driver drains them. Pure
Python: imports neither Ray nor vLLM (the lab's synthetic engine, `python -m oppo_lab control-plane`, uses it too).
"""

from __future__ import annotations

import asyncio
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


@dataclass(frozen=True)
class SampleRequest:
    """Start (or resume, after a restart) decoding one sample."""

    sample_id: int
    prompt_ids: list[int]
    held_ids: list[int]  # response tokens generated before a restart; decoding continues after them
    max_tokens: int  # response budget, held tokens included
    seed: int | None = None  # vLLM per-request seed (integrations.runtime.seeding); None: the engine's RNG
    # (prompt text, label) when the engine scores the finished sample with --reward.remote_url
    reward_query: tuple[str, str] | None = None
    exact: bool = False  # decode exactly `max_tokens` (task.fixed_lengths): no EOS or stop token before


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


class Outbox:
    """A rollout engine's deltas not yet handed to the driver, and the rule that wakes it:
    what `OppoRolloutActor.next_outputs` drains. Lives in the engine's event loop."""

    def __init__(self) -> None:
        self.deltas: list[SampleDelta] = []
        self.ready = asyncio.Event()
        self.decoded: dict[int, int] = {}  # sample id -> response tokens pushed so far
        self.drained: dict[int, int] = {}  # sample id -> of those, handed to the caller
        self.wake_tokens = 1  # set by drain: a sample crossing a multiple of it wakes the caller

    def begin(self, sample_id: int, held_tokens: int) -> None:
        """A sample starts decoding after `held_tokens` response tokens (0 for a new one)."""
        self.decoded[sample_id] = self.drained[sample_id] = held_tokens

    def push(self, delta: SampleDelta) -> None:
        self.deltas.append(delta)
        sid = delta.sample_id
        self.decoded[sid] = self.decoded.get(sid, 0) + len(delta.token_ids)
        if delta.finish_reason is not None or self._chunk_ready(sid):
            self.ready.set()

    def _chunk_ready(self, sid: int) -> bool:
        # the scheduler cuts chunks at multiples of C from the response start: wake at those
        return self.decoded[sid] // self.wake_tokens > self.drained.get(sid, 0) // self.wake_tokens

    def _take(self) -> list[SampleDelta]:
        """The deltas a drain hands over: every one pushed."""
        out, self.deltas = self.deltas, []
        return out

    async def drain(self, timeout_s: float, wake_tokens: int = 1) -> list[SampleDelta]:
        """Every delta pushed (`_take`), once something is worth a round trip: a sample finished or
        has `wake_tokens` unsent tokens, or `timeout_s` passed; merged per sample and policy
        version (`merge_deltas`)."""
        self.wake_tokens = wake_tokens
        if any(self._chunk_ready(sid) for sid in self.decoded):
            self.ready.set()
        try:
            await asyncio.wait_for(self.ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        out = self._take()
        for d in out:
            if d.finish_reason is None:
                self.drained[d.sample_id] = self.decoded[d.sample_id]
            else:  # the sample is done on this engine
                self.decoded.pop(d.sample_id, None)
                self.drained.pop(d.sample_id, None)
        self.ready.clear()
        return merge_deltas(out)  # one delta per sample and policy version, not one per vLLM step
