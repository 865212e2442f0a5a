"""The schedules, each a driver of the simulated cluster.

OpenRLHF's own modes (`sync`, `async`, `partial`, `oversample`) are modelled after
OpenRLHF 0.11.2's control flow. OPPO's (`oppo`, `oppo-fixed`, `oppo-intra`,
`oppo-inter`) are driven by the real `OverlapScheduler`: the driver only turns engine
and scorer events into scheduler calls and executes its plans, as the Ray adapter does.

A step, after its batch is ready (every schedule)::

    make_experience   reward forward (unless streamed) on the reward servers, in parallel with
                      old-logprob, reference and critic forwards on the training devices
    train             actor + critic forward/backward on the training devices
    weight_sync       the actor's weights to the engines (engines pause)

With `split.colocate` the engines pause while the training devices work (they are the
same devices). Step latency is the gap between consecutive trainings' ends.
"""

from __future__ import annotations

import math
import random
import statistics
from array import array
from dataclasses import dataclass, field

from openrlhf_oppo import config as oppo_config_module
from openrlhf_oppo.core import OverlapScheduler, StepStats
from openrlhf_oppo.integrations.launch.schedules import oppo_config as schedule_oppo_config
from openrlhf_oppo.sim.costs import CostModel
from openrlhf_oppo.sim.engine import EventLoop, Recorder, Request, Rollout, Scorer
from openrlhf_oppo.sim.lengths import LengthSampler
from openrlhf_oppo.sim.presets import SimConfig

BASELINES = ("sync", "async", "partial", "oversample")
OPPO_SCHEDULES = ("oppo-fixed", "oppo-intra", "oppo-inter", "oppo")
SCHEDULE_NAMES = BASELINES + OPPO_SCHEDULES
TRAIN_WORKER = 0  # the training devices draw as one worker per role


@dataclass(frozen=True)
class StepRecord:
    """One trained batch."""

    step: int
    generate_start_s: float  # the driver starts waiting for this batch
    batch_ready_s: float
    train_end_s: float
    sync_end_s: float
    prompt_indices: tuple[int, ...]  # trained groups' prompts, sorted
    tokens: int  # response tokens trained
    deferred_fraction: float = 0.0
    delta: int = 0
    chunk_size_tokens: int = 0


@dataclass
class RunResult:
    """What one simulated run produced."""

    schedule: str
    seed: int
    steps: list[StepRecord]
    rows: list[dict]
    decoded_tokens_at: list[tuple[float, int]]  # (time, cumulative decoded tokens) at each train end
    busy: dict[str, list[tuple[float, float]]]  # role -> busy intervals (all its devices)
    devices: dict[str, int]
    admitted_groups: int = 0
    held_groups: tuple[int, ...] = ()
    trained_group_ids: list[int] = field(default_factory=list)


class World:
    """Resources and shared phases of one run: lengths, engines, reward servers, training devices."""

    def __init__(self, cfg: SimConfig, costs: CostModel, seed: int) -> None:
        self.cfg = cfg
        self.costs = costs
        self.seed = seed
        self.loop = EventLoop()
        self.recorder = Recorder()
        self.rollout = Rollout(self.loop, costs, self.recorder, self.on_progress)
        self.scorer = Scorer(self.loop, costs, self.recorder, self.rollout, self.on_scored,
                             max_call_chunks=cfg.workload.score_chunks_per_call)
        self.sampler = LengthSampler(cfg.lengths, random.Random(seed))
        self._lengths: list[int] = []  # response length by sample index (prompt index * n + j): common random numbers
        self.train_busy: list[tuple[float, float]] = []
        self.records: list[StepRecord] = []
        self.decoded_at: list[tuple[float, int]] = []
        self.version = 0  # weight syncs so far

    # ----------------------------------------------------------------- hooks (drivers override)

    def on_progress(self, engine: int, crossed: list[Request], finished: list[Request], now_s: float) -> None:
        raise NotImplementedError

    def on_scored(self, items: list[tuple], now_s: float) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------------- shared

    def requests(self, prompt_index: int, sample_ids: tuple[int, ...]) -> list[Request]:
        n = self.cfg.workload.samples_per_group
        need = (prompt_index + 1) * n
        while len(self._lengths) < need:
            self._lengths.append(self.sampler.sample())
        ln = self.cfg.lengths
        return [Request(sid, ln.prompt_tokens, self._lengths[prompt_index * n + j], ln.cap_tokens)
                for j, sid in enumerate(sample_ids)]

    def train_tokens(self, lengths: list[int]) -> int:
        """Tokens the training devices process for these responses (padded per micro-batch without packing)."""
        p, w = self.cfg.lengths.prompt_tokens, self.cfg.workload
        if w.packing:
            return sum(p + n for n in lengths)
        mb = w.micro_batch_size
        return sum(len(lengths[i:i + mb]) * (p + max(lengths[i:i + mb])) for i in range(0, len(lengths), mb))

    def experience_and_train(self, now_s: float, lengths: list[int], sample_ids: list[int],
                             score_in_experience: bool) -> float:
        """make_experience and train from `now_s`; the end of training. Records the spans."""
        c, w = self.costs, self.cfg.workload
        tokens = self.train_tokens(lengths)
        slow = c.train_slowdown_shared if self.rollout.decoding() else 1.0
        self._hold_engines(now_s)
        t = now_s
        for stage, dt in c.make_experience_s(tokens, w.reference, w.critic).items():
            role = {"old_logprobs": "actor", "ref_logprobs": "ref", "values": "critic"}[stage]
            self.recorder.span(role, TRAIN_WORKER, stage, t, t + dt * slow)
            t += dt * slow
        if score_in_experience:
            t = max(t, self.score_whole(now_s, lengths, sample_ids))
        t += c.phase_overhead_s
        self.recorder.span("driver", 0, "make_experience", now_s, t)
        train_s = c.train_s(tokens) * slow + c.phase_overhead_s
        actor_share = 1.0 / (2.0 if w.critic else 1.0)  # the actor and critic fits draw as two spans
        self.recorder.span("actor", TRAIN_WORKER, "train", t, t + train_s * actor_share)
        if w.critic:
            self.recorder.span("critic", TRAIN_WORKER, "train", t + train_s * actor_share, t + train_s)
        self.recorder.span("driver", 0, "train", t, t + train_s)
        end = t + train_s
        self.train_busy.append((now_s, end))
        self.loop.at(end, self._release_engines, end)
        return end

    def score_whole(self, now_s: float, lengths: list[int], sample_ids: list[int]) -> float:
        """The reward forward of make_experience over whole sequences, batched per server; its end."""
        n = len(self.scorer.queues)
        per_server: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for sid, length in zip(sample_ids, lengths):
            per_server[sid % n].append((0, self.cfg.lengths.prompt_tokens + length))
        end = now_s
        for q, chunks in enumerate(per_server):
            if chunks:
                dt = self.costs.prefill_s(chunks)
                self.recorder.span("reward", q, "score", now_s, now_s + dt, tokens=sum(x for _, x in chunks))
                self.scorer.busy[q].append((now_s, now_s + dt))
                end = max(end, now_s + dt)
        return end

    def weight_sync(self, now_s: float) -> float:
        """Broadcast the new weights; engines pause for it. Returns its end."""
        c = self.costs
        end = now_s + c.weight_sync_s + c.phase_overhead_s
        self.rollout.pause(now_s)
        for e in range(len(self.rollout.engines)):
            self.recorder.span("rollout", e, "load_weights", now_s, end)
        self.recorder.span("driver", 0, "weight_sync", now_s, end)
        self.loop.at(end, self._synced, end)
        return end

    def _synced(self, now_s: float) -> None:
        self.version += 1
        self.rollout.resume(now_s)

    def _hold_engines(self, now_s: float) -> None:
        """Training starts: colocated engines pause; on a shared host they slow down."""
        if self.cfg.split.colocate:
            self.rollout.pause(now_s)
        else:
            self.rollout.set_factor(self.costs.decode_slowdown_shared, now_s)

    def _release_engines(self, now_s: float) -> None:
        if self.cfg.split.colocate:
            self.rollout.resume(now_s)
        else:
            self.rollout.set_factor(1.0, now_s)

    def record(self, rec: StepRecord) -> None:
        self.records.append(rec)
        self.decoded_at.append((rec.train_end_s, self.rollout.decoded_tokens))

    def mean_reward(self, step: int) -> float:
        """Synthetic reward curve: rises as 1 - exp(-step/tau), with seeded noise (drives the adaptive Δ)."""
        w = self.cfg.workload
        noise = random.Random(self.seed * 1_000_003 + step).gauss(0.0, w.reward_noise)
        return 1.0 - math.exp(-step / w.reward_tau_steps) + noise

    def result(self, schedule: str) -> RunResult:
        busy = {"rollout": [iv for e in self.rollout.engines for iv in e.busy],
                "reward": [iv for q in self.scorer.busy for iv in q], "train": self.train_busy}
        devices = {"rollout": len(self.rollout.engines), "reward": len(self.scorer.busy), "train": 1}
        return RunResult(schedule, self.seed, self.records, self.recorder.rows, self.decoded_at, busy, devices)


# ------------------------------------------------------------------------- OpenRLHF: sync


class SyncDriver(World):
    """OpenRLHF synchronous PPO: generate B groups to completion, score, train, sync."""

    def __init__(self, cfg: SimConfig, costs: CostModel, seed: int) -> None:
        super().__init__(cfg, costs, seed)
        self.step = 0
        self.next_prompt = 0
        self.pending = 0
        self.batch: list[Request] = []
        self.step_start_s = 0.0

    def run(self) -> RunResult:
        self.loop.at(0.0, self.begin)
        self.loop.run(lambda: len(self.records) >= self.cfg.workload.steps)
        return self.result("sync")

    def begin(self) -> None:
        now = self.loop.now_s
        self.step_start_s = now
        w = self.cfg.workload
        groups = [self.requests(p, tuple(range(p * w.samples_per_group, (p + 1) * w.samples_per_group)))
                  for p in range(self.next_prompt, self.next_prompt + w.batch_groups)]
        self.next_prompt += w.batch_groups
        self.batch = [r for g in groups for r in g]
        self.pending = len(self.batch)
        start = now + self.costs.generate_overhead_s
        self.loop.at(start, self.rollout.admit, groups, start)

    def on_progress(self, engine: int, crossed: list[Request], finished: list[Request], now_s: float) -> None:
        self.pending -= len(finished)
        if self.pending == 0:
            self.batch_ready(now_s)

    def batch_ready(self, now_s: float) -> None:
        self.recorder.span("driver", 0, "generate", self.step_start_s, now_s)
        lengths = [r.done for r in self.batch]
        train_end = self.experience_and_train(now_s, lengths, [r.sample_id for r in self.batch], True)
        self.loop.at(train_end, self.after_train, now_s, lengths)

    def after_train(self, ready_s: float, lengths: list[int]) -> None:
        now = self.loop.now_s
        sync_end = self.weight_sync(now)
        n = self.cfg.workload.samples_per_group
        prompts = tuple(sorted({r.sample_id // n for r in self.batch}))
        self.record(StepRecord(self.step, self.step_start_s, ready_s, now, sync_end, prompts, sum(lengths)))
        self.step += 1
        self.loop.at(sync_end, self.begin)

    def on_scored(self, items: list[tuple], now_s: float) -> None:
        pass  # make_experience scores whole sequences (score_whole)


# ------------------------------------------------------------- OpenRLHF: async family


class AsyncDriver(World):
    """OpenRLHF --train.async_enable: a rollout loop one call ahead of the trainer.

    A generate call takes `batches_per_call` x B groups to completion (over-sampling: 2)
    and queues them as batches of B. Call c starts when call c-1 is done and the trainer
    has started on a batch of call c-1 (one step off-policy). After training, the
    weight sync waits for the call in flight to end; with partial rollout it pauses the
    engines instead (requests keep their tokens) and generation goes on afterwards.
    """

    def __init__(self, cfg: SimConfig, costs: CostModel, seed: int, partial: bool, batches_per_call: int,
                 name: str) -> None:
        super().__init__(cfg, costs, seed)
        self.partial = partial
        self.batches_per_call = batches_per_call
        self.name = name
        self.next_prompt = 0
        self.calls_started = 0
        self.call_of_trained = -1  # the call whose batch the trainer last started
        self.generating = False
        self.pending = 0
        self.call_reqs: list[Request] = []
        self.queue: list[tuple[int, list[Request]]] = []  # (call, requests of a batch)
        self.trainer_idle = True
        self.sync_pending = False
        self.wait_start_s = 0.0
        self.trained = 0

    def run(self) -> RunResult:
        self.loop.at(0.0, self.maybe_start_call)
        self.loop.run(lambda: len(self.records) >= self.cfg.workload.steps)
        return self.result(self.name)

    def maybe_start_call(self) -> None:
        now = self.loop.now_s
        c = self.calls_started
        if self.generating or self.sync_pending or (c > 0 and self.call_of_trained < c - 1):
            return
        w = self.cfg.workload
        count = w.batch_groups * self.batches_per_call
        groups = [self.requests(p, tuple(range(p * w.samples_per_group, (p + 1) * w.samples_per_group)))
                  for p in range(self.next_prompt, self.next_prompt + count)]
        self.next_prompt += count
        self.call_reqs = [r for g in groups for r in g]
        self.pending = len(self.call_reqs)
        self.generating = True
        self.calls_started += 1
        start = now + self.costs.generate_overhead_s
        self.loop.at(start, self.rollout.admit, groups, start)

    def on_progress(self, engine: int, crossed: list[Request], finished: list[Request], now_s: float) -> None:
        self.pending -= len(finished)
        if self.pending == 0 and self.generating:
            self.generating = False
            reqs, per = self.call_reqs, len(self.call_reqs) // self.batches_per_call
            for b in range(self.batches_per_call):
                self.queue.append((self.calls_started - 1, reqs[b * per:(b + 1) * per]))
            if self.sync_pending:
                self.sync_pending = False
                self.do_sync(now_s)
            else:
                self.maybe_start_call()
            self.trainer_try()

    def trainer_try(self) -> None:
        now = self.loop.now_s
        if not self.trainer_idle or not self.queue:
            return
        call, batch = self.queue.pop(0)
        self.trainer_idle = False
        self.call_of_trained = call
        self.recorder.span("driver", 0, "generate", self.wait_start_s, now)
        lengths = [r.done for r in batch]
        end = self.experience_and_train(now, lengths, [r.sample_id for r in batch], True)
        n = self.cfg.workload.samples_per_group
        prompts = tuple(sorted({r.sample_id // n for r in batch}))
        rec = StepRecord(self.trained, self.wait_start_s, now, end, end, prompts, sum(lengths))
        self.trained += 1
        self.loop.at(end, self.after_train, rec)
        self.maybe_start_call()  # the trainer took a batch of the last call: the next call may start

    def after_train(self, rec: StepRecord) -> None:
        now = self.loop.now_s
        self.record(rec)
        if self.generating and not self.partial:
            self.sync_pending = True  # the sync waits for the call in flight
        else:
            self.do_sync(now)

    def do_sync(self, now_s: float) -> None:
        end = self.weight_sync(now_s)
        self.loop.at(end, self.after_sync)

    def after_sync(self) -> None:
        self.trainer_idle = True
        self.wait_start_s = self.loop.now_s
        self.maybe_start_call()
        self.trainer_try()

    def on_scored(self, items: list[tuple], now_s: float) -> None:
        pass


# ------------------------------------------------------------------------------- OPPO


_ZEROS = array("i", bytes(4 * 4096))  # token ids do not matter to the scheduler


def _tokens(count: int) -> array:
    if count <= len(_ZEROS):
        return _ZEROS[:count]  # a fresh array each time (a slice copies)
    return array("i", bytes(4 * count))


class OppoDriver(World):
    """OPPO: the real OverlapScheduler decides admission, chunks, the batch, carry-over, Δ and C."""

    def __init__(self, cfg: SimConfig, costs: CostModel, seed: int, name: str) -> None:
        super().__init__(cfg, costs, seed)
        self.name = name
        oppo = schedule_oppo_config(name, oppo_config_module.to_dict(cfg.oppo))
        extra = [s for s in oppo.streaming.scorers() if s != "reward"]
        if extra:
            raise ValueError(f"--set streaming.{extra[0]}: only the reward model's streaming is simulated")
        w = cfg.workload
        self.sched = OverlapScheduler(oppo, batch_groups=w.batch_groups, samples_per_group=w.samples_per_group)
        self.streaming = bool(self.sched.scorers)
        self.reqs: dict[int, Request] = {}
        self.step = 0
        self.generating = False
        self.step_start_s = 0.0
        self.decoded_at_start = 0

    def run(self) -> RunResult:
        self.loop.at(0.0, self.begin)
        self.loop.run(lambda: len(self.records) >= self.cfg.workload.steps)
        res = self.result(self.name)
        res.admitted_groups = self.sched.admitted_groups_total
        res.held_groups = self.sched.in_flight_groups
        res.trained_group_ids = [row[0] for row in self.sched.ledger]
        return res

    # a step's phases: admit, generate + stream, batch, train, sync, adapt

    def begin(self) -> None:
        now = self.loop.now_s
        plan = self.sched.begin_step(self.step)
        self.step_start_s = now
        self.decoded_at_start = self.rollout.decoded_tokens
        self.rollout.chunk_tokens = plan.chunk_size_tokens if self.streaming else 0
        self.flush(now)  # carried tokens meet this step's C
        groups = [self.requests(g.prompt_index, g.sample_ids) for g in plan.admit]
        for g in groups:
            for r in g:
                self.reqs[r.sample_id] = r
        self.generating = True
        self.rollout.replan(now)
        start = now + self.costs.generate_overhead_s
        self.loop.at(start, self.rollout.admit, groups, start)
        self.check_batch(now)

    def on_progress(self, engine: int, crossed: list[Request], finished: list[Request], now_s: float) -> None:
        chunks = self.report(crossed + finished, finished)
        self.send(chunks, now_s)
        self.check_batch(now_s)

    def report(self, reqs: list[Request], finished: list[Request]) -> list:
        outputs = [(r.sample_id, _tokens(r.done - r.reported), None) for r in reqs if r.done > r.reported]
        for r in reqs:
            r.reported = r.done
        chunks = self.sched.on_tokens_many(outputs, self.version) if outputs else []
        for r in finished:
            chunks += self.sched.on_finished(r.sample_id, r.finish_reason)
        for ch in chunks:
            if not ch.final:
                self.reqs[ch.sample_id].cut = ch.end
        return chunks

    def send(self, chunks: list, now_s: float) -> None:
        if chunks and self.streaming:
            p = self.cfg.lengths.prompt_tokens
            self.scorer.submit([(ch.sample_id, ch.start, ch.end, ch.final, p) for ch in chunks], now_s)

    def flush(self, now_s: float) -> None:
        """Hand every decoded token to the scheduler (before a version change or a new C)."""
        running = [r for r in self.rollout.running() if r.done > r.reported]
        self.send(self.report(running, []), now_s)

    def on_scored(self, items: list[tuple], now_s: float) -> None:
        for name in self.sched.scorers:
            self.sched.on_scored_many(name, [(it[0], it[1], it[2], it[3]) for it in items])
        self.check_batch(now_s)

    def check_batch(self, now_s: float) -> None:
        if not self.generating:
            return
        batch = self.sched.take_batch()
        if batch is not None:
            self.generating = False
            self.batch_ready(now_s, batch)

    def batch_ready(self, now_s: float, batch) -> None:
        self.recorder.span("driver", 0, "generate", self.step_start_s, now_s)
        generated = self.rollout.decoded_tokens - self.decoded_at_start
        gen_s = now_s - self.step_start_s
        samples = [s for g in batch.groups for s in g.samples]
        lengths = [s.num_tokens for s in samples]
        for s in samples:
            del self.reqs[s.sample_id]
        self.flush(now_s)
        train_end = self.experience_and_train(now_s, lengths, [s.sample_id for s in samples], not self.streaming)
        self.loop.at(train_end, self.sync_and_adapt, batch, generated, gen_s, now_s, train_end)

    def sync_and_adapt(self, batch, generated: int, gen_s: float, ready_s: float, train_end: float) -> None:
        now = self.loop.now_s
        self.flush(now)  # tokens decoded before the sync belong to the old policy version
        sync_end = self.weight_sync(now)
        report = self.sched.end_step(StepStats(self.mean_reward(self.step), int(generated), gen_s))
        prompts = tuple(sorted(g.prompt_index for g in batch.groups))
        tokens = sum(s.num_tokens for g in batch.groups for s in g.samples)
        self.record(StepRecord(self.step, self.step_start_s, ready_s, train_end, sync_end, prompts, tokens,
                               report.deferred_fraction, report.delta, report.chunk_size_tokens))
        self.step += 1
        self.loop.at(sync_end, self.begin)


def simulate(cfg: SimConfig, costs: CostModel, schedule: str, seed: int) -> RunResult:
    """One run of `schedule` with `seed`."""
    if schedule == "sync":
        return SyncDriver(cfg, costs, seed).run()
    if schedule in ("async", "partial", "oversample"):
        return AsyncDriver(cfg, costs, seed, partial=schedule == "partial",
                           batches_per_call=2 if schedule == "oversample" else 1, name=schedule).run()
    if schedule in OPPO_SCHEDULES:
        return OppoDriver(cfg, costs, seed, schedule).run()
    raise ValueError(f"--schedules: unknown schedule '{schedule}'; allowed: {', '.join(SCHEDULE_NAMES)}")


def step_latencies_s(result: RunResult, warmup_steps: int) -> list[float]:
    ends = [r.train_end_s for r in result.steps][max(0, warmup_steps - 1):]
    return [b - a for a, b in zip(ends, ends[1:])]


def summarize(result: RunResult, warmup_steps: int) -> dict:
    """Per-run figures: step latency (median, mean), tokens/s and utilisation over the measured window."""
    lat = step_latencies_s(result, warmup_steps)
    (t0, n0), (t1, n1) = result.decoded_tokens_at[max(0, warmup_steps - 1)], result.decoded_tokens_at[-1]
    util = {role: _covered(ivs, t0, t1) / (max(t1 - t0, 1e-12) * result.devices[role])
            for role, ivs in result.busy.items()}
    deferred = [r.deferred_fraction for r in result.steps[warmup_steps:]]
    return {"median_step_s": statistics.median(lat), "mean_step_s": statistics.fmean(lat),
            "tokens_per_s": (n1 - n0) / max(t1 - t0, 1e-12), "util": util,
            "deferred": statistics.fmean(deferred) if deferred else 0.0}


def _covered(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Device-seconds busy within [t0, t1] (intervals of different devices add up)."""
    return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in intervals)
