"""The simulated cluster's resources: an event loop, rollout engines with continuous
batching, reward servers, and a recorder writing the timeline format of real runs.

Engines advance in *segments*: between two events (a sequence finishes, or crosses a
chunk boundary while streaming) the batch is fixed, so the segment's duration is the
closed-form sum of its iterations (`CostModel.decode_run_s`). A pause (weight sync,
training on shared devices, a prefill on the same device) cuts a segment at the
iterations done by then. With the hybrid engine (`split.sleep`) the driver stops every request
at the batch (`Rollout.stop`: tokens kept, KV cache dropped) and starts them again after the
wake (`Rollout.restart`): each pays a prefill of prompt + held tokens on its engine when it next
enters the running batch. Time only moves forward; a test checks it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable

from openrlhf_oppo.sim.costs import CostModel

HOST = "sim"


class EventLoop:
    """Simulated time: callbacks run in time order (ties: in the order they were scheduled)."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self._heap: list = []
        self._seq = itertools.count()

    def at(self, t_s: float, fn: Callable, *args) -> None:
        if t_s < self.now_s - 1e-9:
            raise RuntimeError(f"event scheduled in the past: {t_s} < {self.now_s}")
        heapq.heappush(self._heap, (max(t_s, self.now_s), next(self._seq), fn, args))

    def run(self, done: Callable[[], bool]) -> None:
        while self._heap and not done():
            t_s, _, fn, args = heapq.heappop(self._heap)
            if t_s < self.now_s:
                raise RuntimeError(f"simulated time went back: {t_s} < {self.now_s}")
            self.now_s = t_s
            fn(*args)
        if not done():
            raise RuntimeError("the simulation ran out of events before it was done (a schedule deadlocked)")


class Recorder:
    """Timeline rows in `openrlhf_oppo.timeline`'s format (role, host, pid = worker index)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self._keys = itertools.count()

    def span(self, role: str, worker: int, stage: str, t0_s: float, t1_s: float, **attrs) -> None:
        if t1_s >= t0_s:
            self.rows.append({"kind": "span", "role": role, "host": HOST, "pid": worker, "stage": stage,
                              "t0": t0_s, "t1": t1_s, **attrs})

    def sample(self, worker: int, t0_s: float, t1_s: float, tokens: int, finish: str, sample_id: int) -> None:
        self.rows.append({"kind": "sample", "role": "rollout", "host": HOST, "pid": worker, "key": next(self._keys),
                          "t0": t0_s, "t1": t1_s, "tokens": tokens, "finish": finish, "sample": sample_id})


class Request:
    """One response being decoded."""

    __slots__ = ("sample_id", "prompt_tokens", "target_tokens", "cap_tokens", "done", "reported", "cut", "start_s",
                 "engine", "reprefill")

    def __init__(self, sample_id: int, prompt_tokens: int, target_tokens: int, cap_tokens: int) -> None:
        self.sample_id = sample_id
        self.prompt_tokens = prompt_tokens
        self.target_tokens = target_tokens  # the length it will reach (the engine does not "know" it: it stops there)
        self.cap_tokens = cap_tokens
        self.done = 0  # tokens decoded
        self.reported = 0  # tokens handed to the driver
        self.cut = 0  # tokens already cut into chunks (streaming)
        self.start_s: float | None = None
        self.engine = -1
        self.reprefill = 0  # tokens to prefill again when it next runs (a stopped request: prompt + held)

    @property
    def finish_reason(self) -> str:
        return "length" if self.target_tokens >= self.cap_tokens else "stop"


class _Engine:
    __slots__ = ("index", "running", "waiting", "pauses", "epoch", "seg_start_s", "seg_steps", "seg_factor",
                 "busy", "beside")

    def __init__(self, index: int) -> None:
        self.index = index
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.pauses = 0  # reasons to stay paused (sync, training on its devices, a prefill on its device)
        self.epoch = 0  # bumps when a planned segment is cut: its event is stale
        self.seg_start_s: float | None = None  # a segment is in progress
        self.seg_steps = 0
        self.seg_factor = 1.0
        self.busy: list[tuple[float, float]] = []  # decoding intervals (utilisation)
        self.beside = 1.0  # decode slowdown from a scorer prefilling on the same host (`Rollout.slow`)


Listener = Callable[[int, list, list, float], None]  # (engine, crossed chunk boundary, finished, now)


class Rollout:
    """Every rollout engine; groups go whole to the least-loaded engine, as the real adapter sends them."""

    def __init__(self, loop: EventLoop, costs: CostModel, recorder: Recorder, listener: Listener) -> None:
        self.loop = loop
        self.costs = costs
        self.recorder = recorder
        self.listener = listener
        self.engines = [_Engine(i) for i in range(costs.engines)]
        self.chunk_tokens = 0  # streaming: also stop at chunk boundaries (0: only at finishes)
        self.factor = 1.0  # decode slowdown (shared host)
        self.decoded_tokens = 0
        self.decode_iterations = 0  # engine iterations (each gives every running sequence a token)
        self.prefill_costs = costs  # the engines' own prefill (`costs.engine_prefill`), for stopped requests
        self.reprefilled_tokens = 0  # prompt + held tokens prefilled again (the metric oppo/reprefilled_tokens)

    # ------------------------------------------------------------------ driver calls

    def admit(self, groups: list[list[Request]], now_s: float) -> None:
        for group in groups:
            eng = min(self.engines, key=lambda e: (len(e.running) + len(e.waiting), e.index))
            for r in group:
                r.engine = eng.index
                eng.waiting.append(r)
        for eng in self.engines:
            if eng.waiting:
                self._cut(eng, now_s)
                self._fill(eng, now_s)
                self._plan(eng, now_s)

    def stop(self, now_s: float) -> list[Request]:
        """Every request leaves its engine where it is, its tokens kept and its KV cache dropped
        (the hybrid engine's sleep); returns them."""
        out = []
        for eng in self.engines:
            self._cut(eng, now_s)
            out += eng.running + list(eng.waiting)
            eng.running = []
            eng.waiting = deque()
        return out

    def restart(self, reqs: list[Request], now_s: float) -> None:
        """Stopped requests back on their engines, each to prefill its `reprefill` tokens again."""
        touched = sorted({r.engine for r in reqs})
        for r in reqs:
            self.engines[r.engine].waiting.append(r)
        for i in touched:
            eng = self.engines[i]
            self._cut(eng, now_s)
            self._fill(eng, now_s)
            self._plan(eng, now_s)

    def pause(self, now_s: float, engines: list[int] | None = None) -> None:
        for i in self._which(engines):
            eng = self.engines[i]
            self._cut(eng, now_s)
            eng.pauses += 1

    def resume(self, now_s: float, engines: list[int] | None = None) -> None:
        for i in self._which(engines):
            eng = self.engines[i]
            eng.pauses -= 1
            assert eng.pauses >= 0, "resume without pause"
            self._plan(eng, now_s)

    def slow(self, engine: int, factor: float, now_s: float) -> None:
        """A scorer on engine `engine`'s host starts (factor > 1) or stops (1) a prefill. The engine
        decodes on at the larger of this and the trainer's factor (the lab's calibration measures the
        scorer's while the trainer is idle; beside the trainer its factor stands for both)."""
        eng = self.engines[engine]
        if factor != eng.beside:
            self._cut(eng, now_s)
            eng.beside = factor
            self._plan(eng, now_s)

    def set_factor(self, factor: float, now_s: float) -> None:
        if factor == self.factor:
            return
        for eng in self.engines:
            self._cut(eng, now_s)
        self.factor = factor
        for eng in self.engines:
            self._plan(eng, now_s)

    def replan(self, now_s: float) -> None:
        """After the chunk size changed: cut and plan every engine again."""
        for eng in self.engines:
            self._cut(eng, now_s)
            self._plan(eng, now_s)

    def running(self) -> list[Request]:
        return [r for e in self.engines for r in e.running] + [r for e in self.engines for r in e.waiting]

    def decoding(self) -> bool:
        return any(e.running and not e.pauses for e in self.engines)

    def drain_s(self, incoming: list[Request]) -> float:
        """Seconds until every engine has decoded what it holds and `incoming` (requests about to
        be admitted, least-loaded first as `admit` sends them), at the current factor with no
        pause and nothing else admitted: when the host stops decoding, if nothing changes."""
        queues = [list(e.running) + list(e.waiting) for e in self.engines]
        for r in incoming:
            min(queues, key=len).append(r)
        return max((self._drain_one([(r.target_tokens - r.done, r.prompt_tokens + r.done) for r in q])
                    for q in queues if q), default=0.0)

    def _drain_one(self, todo: list[tuple[int, int]]) -> float:
        """One engine's decode of responses given as (tokens to go, context tokens), in closed form
        between finishes, at most `seqs_per_engine` at once (the rest wait, in order)."""
        cap = self.costs.seqs_per_engine
        running, waiting = todo[:cap], todo[cap:]
        t = 0.0
        while running:
            k = max(1, min(left for left, _ in running))
            t += self.costs.decode_run_s(len(running), sum(ctx for _, ctx in running), k) * self.factor
            running = [(left - k, ctx + k) for left, ctx in running if left > k]
            while waiting and len(running) < cap:
                running.append(waiting.pop(0))
        return t

    # -------------------------------------------------------------------- internals

    def _which(self, engines: list[int] | None) -> range | list[int]:
        return range(len(self.engines)) if engines is None else engines

    def _fill(self, eng: _Engine, now_s: float) -> None:
        resumed = []
        while eng.waiting and len(eng.running) < self.costs.seqs_per_engine:
            r = eng.waiting.popleft()
            if r.start_s is None:
                r.start_s = now_s
            if r.reprefill:
                resumed.append(r)
            eng.running.append(r)
        if resumed:
            self._reprefill(eng, resumed, now_s)

    def _reprefill(self, eng: _Engine, resumed: list[Request], now_s: float) -> None:
        """Stopped requests entering the batch: one prefill call over their prompt + held tokens;
        the engine decodes nothing meanwhile."""
        chunks = [(0, r.reprefill) for r in resumed]
        tokens = sum(n for _, n in chunks)
        for r in resumed:
            r.reprefill = 0
        self.reprefilled_tokens += tokens
        self.pause(now_s, [eng.index])
        self.loop.at(now_s + self.prefill_costs.prefill_s(chunks), self._reprefilled, eng, now_s, tokens)

    def _reprefilled(self, eng: _Engine, t0_s: float, tokens: int) -> None:
        now_s = self.loop.now_s
        eng.busy.append((t0_s, now_s))
        self.recorder.span("rollout", eng.index, "reprefill", t0_s, now_s, tokens=tokens)
        self.resume(now_s, [eng.index])

    def _steps_to_event(self, eng: _Engine) -> int:
        k = min(r.target_tokens - r.done for r in eng.running)
        c = self.chunk_tokens
        if c:
            k = min(k, min(r.cut + c - r.done for r in eng.running))
        return max(1, k)

    def _plan(self, eng: _Engine, now_s: float) -> None:
        if eng.pauses or not eng.running or eng.seg_start_s is not None:
            return
        k = self._steps_to_event(eng)
        ctx = sum(r.prompt_tokens + r.done for r in eng.running)
        factor = max(self.factor, eng.beside)
        dt = self.costs.decode_run_s(len(eng.running), ctx, k) * factor
        eng.seg_start_s = now_s
        eng.seg_steps = k
        eng.seg_factor = factor
        self.loop.at(now_s + dt, self._segment_done, eng, eng.epoch)

    def _advance(self, eng: _Engine, steps: int, now_s: float) -> None:
        for r in eng.running:
            r.done += steps
        self.decoded_tokens += steps * len(eng.running)
        self.decode_iterations += steps
        if now_s > eng.seg_start_s:
            eng.busy.append((eng.seg_start_s, now_s))
        eng.seg_start_s = None

    def _cut(self, eng: _Engine, now_s: float) -> None:
        """Stop the segment in progress at the iterations done by `now_s` (never its last one:
        the segment's own event delivers finishes and boundaries)."""
        if eng.seg_start_s is None:
            return
        ctx = sum(r.prompt_tokens + r.done for r in eng.running)
        budget = (now_s - eng.seg_start_s) / eng.seg_factor
        steps = self.costs.decode_steps_within(len(eng.running), ctx, eng.seg_steps - 1, budget)
        self._advance(eng, steps, now_s)
        eng.epoch += 1

    def _segment_done(self, eng: _Engine, epoch: int) -> None:
        if epoch != eng.epoch:
            return  # cut by a pause or a re-plan
        now_s = self.loop.now_s
        self._advance(eng, eng.seg_steps, now_s)
        eng.epoch += 1
        finished = [r for r in eng.running if r.done >= r.target_tokens]
        c = self.chunk_tokens
        crossed = [r for r in eng.running if c and r.done < r.target_tokens and r.done - r.cut >= c]
        if finished:
            eng.running = [r for r in eng.running if r.done < r.target_tokens]
            for r in finished:
                self.recorder.sample(eng.index, r.start_s, now_s, r.done, r.finish_reason, r.sample_id)
            self._fill(eng, now_s)
        self.listener(eng.index, crossed, finished, now_s)
        self._plan(eng, now_s)


class Scorer:
    """Reward servers; a sample's chunks always go to the same server (its KV cache lives there).

    A server that is idle takes every chunk queued for it (up to `max_call_tokens`) as one
    batched forward. `on_done(items, now)` is called when a call ends. With
    `scorer_on_engines`, server i shares engine i's devices: the engine pauses while it prefills,
    or, on a CPU host's shared cores (`decode_slowdown_scoring` > 0), decodes on that much slower.
    """

    def __init__(self, loop: EventLoop, costs: CostModel, recorder: Recorder, rollout: Rollout,
                 on_done: Callable[[list, float], None], max_call_tokens: int = 65536,
                 max_call_chunks: int = 0, role: str = "reward") -> None:
        self.loop = loop
        self.role = role  # the timeline's role: "reward", or "ref" for OPPO's streaming reference actors
        self.costs = costs
        self.recorder = recorder
        self.rollout = rollout
        self.on_done = on_done
        self.max_call_tokens = max_call_tokens
        self.max_call_chunks = max_call_chunks or 1 << 30
        n = max(1, costs.scorers)
        self.queues: list[list[tuple]] = [[] for _ in range(n)]
        self.busy_until = [0.0] * n
        self.active = [False] * n
        self.busy: list[list[tuple[float, float]]] = [[] for _ in range(n)]

    def submit(self, items: list[tuple], now_s: float) -> None:
        """items: (sample_id, start, end, final, prefix_tokens)."""
        n = len(self.queues)
        touched = set()
        for item in items:
            q = item[0] % n
            self.queues[q].append(item)
            touched.add(q)
        for q in sorted(touched):
            if not self.active[q]:
                self._start(q, now_s)

    def _start(self, q: int, now_s: float) -> None:
        queue = self.queues[q]
        if not queue:
            return
        take = 0  # chunks in this call
        tokens = 0  # their new tokens
        while take < min(len(queue), self.max_call_chunks) and (
                take == 0 or tokens + queue[take][2] - queue[take][1] <= self.max_call_tokens):
            tokens += queue[take][2] - queue[take][1]
            take += 1
        items, self.queues[q] = queue[:take], queue[take:]
        chunks = []  # (cached prefix, new tokens): a sample's first chunk prefills its prompt too
        for _, start, end, _, prefix_tokens in items:
            if start:
                chunks.append((prefix_tokens + start, end - start))
            else:
                chunks.append((0, prefix_tokens + end))
        dt = self.costs.prefill_s(chunks)
        if self.costs.scorer_on_engines:
            self._beside(q, now_s, start=True)
        self.active[q] = True
        self.loop.at(now_s + dt, self._done, q, items, now_s)

    def _beside(self, q: int, now_s: float, start: bool) -> None:
        """A prefill on engine q's devices starts or ends: the engine stops, or decodes on slower."""
        engine = q % len(self.rollout.engines)
        slowdown = self.costs.decode_slowdown_scoring
        if slowdown:
            self.rollout.slow(engine, slowdown if start else 1.0, now_s)
        elif start:
            self.rollout.pause(now_s, [engine])
        else:
            self.rollout.resume(now_s, [engine])

    def _done(self, q: int, items: list[tuple], t0_s: float) -> None:
        now_s = self.loop.now_s
        self.active[q] = False
        self.busy[q].append((t0_s, now_s))
        stage = "score" if all(it[3] for it in items) else "prefill"
        self.recorder.span(self.role, q, stage, t0_s, now_s, tokens=sum(it[2] - it[1] for it in items))
        if self.costs.scorer_on_engines:
            self._beside(q, now_s, start=False)
        self.on_done(items, now_s)
        self._start(q, now_s)
