"""The two synthetic actors of `bench control-plane`: a rollout engine that emits tokens on a
clock at GPU rates, and a reward actor that acknowledges chunks at once (or at a fixed cost
per token). Neither imports vLLM or torch: 8 engines and their scorers start in seconds.

`SyntheticEngine` has `OppoRolloutActor`'s interface (`start_samples`, `next_outputs`,
`pause_generation`, `resume_generation`, `set_policy_version`) and its outbox
(`deltas.Outbox`: the same wake rule and the same per-sample merge), so the driver receives
exactly what it would from vLLM. Like vLLM with `max_num_seqs`, it decodes at most
`max_seqs` samples at once, the rest waiting in order; each decodes `tokens_per_s` tokens a
second. Token ids are the token's position in its response, so the scorer checks order.

`SyntheticScorer` has the streaming reward actor's `open_many` / `process` and replies with
the real `ScoreReply`. Both log what they did (emissions, chunk arrivals) for the lag figures;
those logs are read after the run with `emission_log` / `chunk_log`, calls the generator
never makes (not counted as its messages).
"""

from __future__ import annotations

import asyncio
import random
import time
from array import array
from collections import Counter, deque

import ray

from openrlhf_oppo.integrations.runtime.deltas import Outbox, SampleDelta, SampleRequest
from openrlhf_oppo.integrations.runtime.reward_dispatch import ScoreReply
from oppo_lab.synthetic import LengthModel

TICK_S = 0.05  # the engine emits every 50 ms: 2 tokens per sequence at 40 tokens/s (vLLM: 1 per ~25 ms step)


def sample_length(lengths: LengthModel, seed: int, sample_id: int, max_tokens: int) -> int:
    """A sample's response length: drawn from `lengths` by its id alone, so the driver knows
    every length the engines will decode (progress, checks) without asking them."""
    return min(max_tokens, lengths.sample(random.Random(seed * 1_000_003 + sample_id)))


class DueOnlyOutbox(Outbox):
    """An experiment, not the product's rule (`--drain due`): a drain hands over only the samples
    with a chunk due or finished; the others' tokens wait in the outbox for their own chunk. The
    driver's cost is mostly per delta, and the product's drain hands over every sample that
    decoded anything, a few tokens each at small C."""

    def _take(self) -> list[SampleDelta]:
        due = {sid for sid in self.decoded if self._chunk_ready(sid)}
        due.update(d.sample_id for d in self.deltas if d.finish_reason is not None)
        out = [d for d in self.deltas if d.sample_id in due]
        self.deltas = [d for d in self.deltas if d.sample_id not in due]
        return out


class _Sequence:
    """A sample decoding on the engine (`__slots__`: 128 of them are touched every tick)."""

    __slots__ = ("start_s", "emitted", "length")

    def __init__(self, start_s: float, emitted: int, length: int) -> None:
        self.start_s = start_s  # when it started decoding (shifted by pauses)
        self.emitted = emitted  # response tokens pushed so far (held ones included)
        self.length = length  # response tokens it ends at


class SyntheticEngine:
    """A rollout engine without a model: `OppoRolloutActor`'s interface and outbox."""

    def __init__(self, max_seqs: int, tokens_per_s: float, lengths: LengthModel, seed: int,
                 tick_s: float = TICK_S, drain: str = "all") -> None:
        """`drain`: "all", the product's outbox (`deltas.Outbox`); "due", `DueOnlyOutbox`."""
        self.max_seqs = max_seqs
        self.tokens_per_s = tokens_per_s
        self.lengths = lengths
        self.seed = seed
        self.tick_s = tick_s
        self.outbox = {"all": Outbox, "due": DueOnlyOutbox}[drain]()
        self.waiting: deque[SampleRequest] = deque()  # started, not yet decoding (max_seqs reached)
        self.decoding: dict[int, _Sequence] = {}
        self.policy_version = 0
        self.paused_s: float | None = None  # time.time() of the pause under way
        self.ticker: asyncio.Task | None = None  # the emission loop while anything is started
        self.calls: Counter[str] = Counter()  # the generator's calls, by method
        # sample id -> (time.time() of each push, response tokens emitted after it)
        self.pushes: dict[int, tuple[array, array]] = {}
        self.full_until_s: float | None = None  # when fewer than max_seqs first decoded with none waiting

    # ------------------------------------------------------------------ OppoRolloutActor's interface

    async def start_samples(self, requests: list[SampleRequest], sampling_params) -> None:
        """`sampling_params` is unused: each request carries its budget (`max_tokens`)."""
        self.calls["start_samples"] += 1
        for req in requests:
            if req.sample_id in self.decoding or any(w.sample_id == req.sample_id for w in self.waiting):
                raise ValueError(f"sample {req.sample_id} is already decoding on this engine")
            self.waiting.append(req)
        self._admit(time.time())
        if self.ticker is None:
            self.ticker = asyncio.create_task(self._run())

    async def next_outputs(self, timeout_s: float, wake_tokens: int = 1) -> list[SampleDelta]:
        self.calls["next_outputs"] += 1
        return await self.outbox.drain(timeout_s, wake_tokens)

    async def pause_generation(self, keep_kv_cache: bool = False) -> None:
        self.calls["pause_generation"] += 1
        if self.paused_s is None:
            self.paused_s = time.time()

    async def resume_generation(self) -> None:
        self.calls["resume_generation"] += 1
        if self.paused_s is not None:
            gap = time.time() - self.paused_s
            for seq in self.decoding.values():  # the pause emitted nothing: the clock of each moves on
                seq.start_s += gap
            self.paused_s = None

    def set_policy_version(self, version: int) -> None:
        self.calls["set_policy_version"] += 1
        self.policy_version = version

    # ------------------------------------------------------------------ emission

    async def _run(self) -> None:
        while self.decoding or self.waiting:
            await asyncio.sleep(self.tick_s)
            if self.paused_s is None:
                self._tick(time.time())
        self.ticker = None

    def _tick(self, now: float) -> None:
        """Push every sequence's tokens due by `now`; a finished one frees its slot."""
        rate, finished = self.tokens_per_s, []
        for sid, seq in self.decoding.items():
            due = min(seq.length, int((now - seq.start_s) * rate))
            if due <= seq.emitted:
                continue
            done = due == seq.length
            self.outbox.push(SampleDelta(sid, array("i", range(seq.emitted, due)), None, self.policy_version,
                                         "stop" if done else None, now))
            times, ends = self.pushes[sid]
            times.append(now)
            ends.append(due)
            seq.emitted = due
            if done:
                finished.append(sid)
        for sid in finished:
            del self.decoding[sid]
        if finished:
            self._admit(now)

    def _admit(self, now: float) -> None:
        while self.waiting and len(self.decoding) < self.max_seqs:
            req = self.waiting.popleft()
            held = len(req.held_ids)
            length = max(held, sample_length(self.lengths, self.seed, req.sample_id, req.max_tokens))
            self.decoding[req.sample_id] = _Sequence(now - held / self.tokens_per_s, held, length)
            self.pushes[req.sample_id] = (array("d"), array("i"))
            self.outbox.begin(req.sample_id, held)
        if self.full_until_s is None and len(self.decoding) < self.max_seqs:  # a slot free, nothing waiting
            self.full_until_s = now

    # ------------------------------------------------------------------ read by the bench after the run

    def emission_log(self) -> dict:
        """calls (by method), when the engine stopped being full, and per sample its pushes'
        times and the response tokens emitted after each."""
        return {"calls": dict(self.calls), "full_until_s": self.full_until_s,
                "cpu_s": time.process_time(), "pushes": self.pushes}


class SyntheticScorer:
    """A streaming reward actor without a model: `open_many` / `process`, each chunk checked
    (open, in order, once) and logged with its arrival time."""

    def __init__(self, s_per_token: float = 0.0) -> None:
        self.s_per_token = s_per_token  # fixed cost of a chunk token (slept: a GPU's time, not this CPU's)
        self.received: dict[int, int] = {}  # open sample id -> response tokens received so far
        self.finished: dict[int, int] = {}  # finished sample id -> its response tokens
        self.errors: list[str] = []  # what broke an invariant (first 20)
        self.error_count = 0
        self.calls: Counter[str] = Counter()
        # one entry per chunk: sample id, first and end token, time.time() it reached the actor
        self.chunk_sids, self.chunk_starts, self.chunk_ends = array("q"), array("q"), array("q")
        self.chunk_arrival_s = array("d")

    def open_many(self, prompts: dict[int, list[int]]) -> None:
        self.calls["open_many"] += 1
        for sid in prompts:
            if sid in self.received or sid in self.finished:
                self._error(f"sample {sid} opened twice")
            self.received[sid] = 0

    def process(self, extends: dict[int, list[int]], finishes: dict[int, list[int]]) -> ScoreReply:
        start_s = time.time()
        self.calls["process"] += 1
        tokens = 0
        for sid, toks in extends.items():
            tokens += self._take(sid, toks, start_s)
        scores = {}
        for sid, toks in finishes.items():
            tokens += self._take(sid, toks, start_s)
            n = self.received.pop(sid, 0)
            self.finished[sid] = n
            scores[sid] = float(n)  # a reward the test can check: the response's length
        if self.s_per_token:
            time.sleep(tokens * self.s_per_token)
        return ScoreReply(scores, start_s, time.time())

    def _take(self, sid: int, toks: list[int], now: float) -> int:
        got = self.received.get(sid)
        if got is None:
            self._error(f"sample {sid}: a chunk while not open ({'finished' if sid in self.finished else 'never'})")
            return len(toks)
        end = got + len(toks)
        if toks != list(range(got, end)):
            self._error(f"sample {sid}: tokens {toks[:3]}... where {got}.. was due")
        self.chunk_sids.append(sid)
        self.chunk_starts.append(got)
        self.chunk_ends.append(end)
        self.chunk_arrival_s.append(now)
        self.received[sid] = end
        return len(toks)

    def _error(self, what: str) -> None:
        self.error_count += 1
        if len(self.errors) < 20:
            self.errors.append(what)

    def chunk_log(self) -> dict:
        return {"calls": dict(self.calls), "cpu_s": time.process_time(), "finished": self.finished,
                "open": dict(self.received), "errors": self.errors, "error_count": self.error_count,
                "sids": self.chunk_sids, "starts": self.chunk_starts, "ends": self.chunk_ends,
                "arrival_s": self.chunk_arrival_s}


SyntheticEngineActor = ray.remote(num_cpus=0)(SyntheticEngine)
SyntheticScorerActor = ray.remote(num_cpus=0)(SyntheticScorer)
