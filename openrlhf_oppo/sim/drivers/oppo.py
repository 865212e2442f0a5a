"""OPPO's schedules (`oppo`, `oppo-async`, `oppo-async-inter`, `oppo-async-bg`, `oppo-eq4`, `oppo-fixed`,
`oppo-intra`, `oppo-inter`) as a driver of the simulated world. The real `OverlapScheduler` decides; the
driver only turns engine and scorer events into scheduler calls and executes its plans, as the Ray adapter does.

Async admission (`staleness.max_policy_lag` N >= 1, the `oppo-async` schedule)::

    sync admission   engines  ==== step t ====|           (carried only) |== step t+1 ==
                     train                    [exp][train][sync]
    async admission  engines  ==== step t ====|== step t+1 (version t) ==|== (version t+1)
                     train                    [exp][train][sync]
                                              ^ take_batch(t), end_step(t), begin_step(t+1)

Tokens decoded before the weight sync after training step t are stamped version t (one
version behind step t+1's weights); the core forces into a batch any group that would
exceed N, and the driver follows its plan. Where the engines and the trainer share devices
(`split.colocate`) the world pauses the engines while the trainer works and during the sync,
so the groups admitted early wait: they start decoding after the sync, with the new weights,
and async admission changes when groups are admitted (and bounds their lag), not the
timeline. On a shared host (`cpu-longtail`, not colocated) they decode during training, both
slowed by the `*_slowdown_shared` factors.

With `staleness.background_sync` (a projection, async admission only) the trainer waits for
a sync only while the actor's weights are gathered (`sync_gather_s`); the engines stay paused
for the whole broadcast, their version changes at its end, and the next sync waits for it::

    engines  == step t+1 (version t) ==|  (paused: broadcast) |== (version t+1)
    train                 [exp][train][g][exp][train] ...
                                       ^ g: the gather; the next step's experience starts here

The hybrid engine (`split.sleep`, sync admission only: the layout rules refuse async)::

    engines  ==== step t ====|stop| asleep .................................|wake|pre|== step t+1
    train                         [off][exp][train]         [sync]
                                  ^ batch: every carried request stops, its tokens fed and kept

At the batch every request still decoding stops where it is (`Rollout.stop`, as the integration's
park: vLLM's KV cache is dropped while it sleeps); nothing decodes until the wake. The sleep and
wake moves are the world's (`offload` before make_experience, the wake inside the sync). When the
next step begins the stopped samples go back to their engines and each pays a prefill of its
prompt + the tokens the scheduler holds for it (`pre`; `reprefilled_tokens`). Streaming actors
keep their caches.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from openrlhf_oppo.core import OverlapScheduler, StepStats
from openrlhf_oppo.core.types import StepPlan, StepReport, TrainBatch
from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim.costs import CostModel
from openrlhf_oppo.sim.drivers.openrlhf import released_s
from openrlhf_oppo.sim.engine import Request
from openrlhf_oppo.sim.presets import SimConfig, schedule_oppo
from openrlhf_oppo.sim.streamer import TRAIN_STREAMED, ExperienceAhead, ReferenceActors, TrainStreamer
from openrlhf_oppo.sim.world import RunResult, StepRecord, World

_ZEROS = array("i", bytes(4 * 4096))  # token ids do not matter to the scheduler


def _tokens(count: int) -> array:
    if count <= len(_ZEROS):
        return _ZEROS[:count]  # a fresh array each time (a slice copies)
    return array("i", bytes(4 * count))


@dataclass
class OppoRunResult(RunResult):
    """A run of an OPPO schedule, with what the scheduler reported for each trained step."""

    reports: list[StepReport] = field(default_factory=list)  # end_step's report, one per trained step
    reprefilled_tokens: int = 0  # sleep mode: prompt + held tokens the engines prefilled again


class OppoDriver(World):
    """OPPO: the real OverlapScheduler decides admission, chunks, the batch, carry-over, Δ and C."""

    def __init__(self, cfg: SimConfig, costs: CostModel, seed: int, name: str) -> None:
        super().__init__(cfg, costs, seed)
        self.name = name
        oppo = schedule_oppo(cfg, name)
        w = cfg.workload
        self.sched = OverlapScheduler(oppo, batch_groups=w.batch_groups, samples_per_group=w.samples_per_group)
        self.streaming = bool(self.sched.scorers)
        self.length_buckets = oppo.train.length_buckets
        self.vectorized_advantages = oppo.train.vectorized_advantages
        self.rollout_old_logprobs = oppo.train.old_logprobs == "rollout"
        self.reward_streamed = "reward" in self.sched.scorers
        self.ref_actors = None  # OPPO's streaming reference actors (sim.streamer), if the reference streams there
        if "reference" in self.sched.scorers and cfg.projections.reference_actors:
            self.ref_actors = ReferenceActors(self, self.on_ref_streamed)
        on_train = tuple(n for n in self.sched.scorers
                         if n in TRAIN_STREAMED and not (n == "reference" and self.ref_actors is not None))
        if on_train:
            self.streamer = TrainStreamer(self, on_train, self.on_streamed)
        self.ahead: ExperienceAhead | None = None  # projections.experience_ahead
        self.ahead_groups: set[int] = set()  # groups handed to it, not yet trained
        if cfg.projections.experience_ahead:
            if on_train:
                raise ValueError(f"projections.experience_ahead: schedule {name} streams into the training devices' "
                                 "models already")
            if cfg.split.sleep:
                raise ValueError(f"projections.experience_ahead: schedule {name} with split.sleep, whose models are "
                                 "offloaded while the engines generate")
            stages = ["old_logprobs"]
            if w.critic:
                stages.append("values")
            if w.reference and "reference" not in self.sched.scorers:
                stages.append("ref_logprobs")
            self.ahead = ExperienceAhead(self, tuple(stages))
            self.streamer = self.ahead
        self.async_admission = oppo.staleness.max_policy_lag >= 1
        self.background_sync = oppo.staleness.background_sync and self.async_admission
        self.sync_end_s = 0.0  # the last weight sync's end (the engines resume then)
        if cfg.split.sleep and self.async_admission:
            raise ValueError(f"split.sleep: schedule {name} admits asynchronously (staleness.max_policy_lag "
                             f"{oppo.staleness.max_policy_lag}); asleep, the engines decode nothing while the "
                             "models train: use a schedule without async admission or no sleep")
        self.stopped: list[Request] = []  # sleep mode: requests stopped at the batch, to decode on after the wake
        if cfg.split.sleep:
            self.rollout.prefill_costs = cost_model.engine_prefill(cfg, costs)
        self.reqs: dict[int, Request] = {}
        self.step = 0  # the open step (under async admission: begun while the trainer trains the one before)
        self.waiting = False  # the trainer waits for the open step's batch (take_batch may run)
        self.admit_s = 0.0  # the open step began: its groups were admitted (the C controller's window)
        self.wait_start_s = 0.0  # the trainer began waiting for the open step's batch
        self.forced_since_s: float | None = None  # ... and its batch began to wait only for forced groups
        self.decoded_at_admit = 0
        self.reports: list[StepReport] = []

    def run(self) -> OppoRunResult:
        self.loop.at(0.0, self.first_step)
        self.loop.run(lambda: len(self.records) >= self.cfg.workload.steps)
        result = self.result(self.name)
        if self.ref_actors is not None:
            result.busy["ref"] = [iv for q in self.ref_actors.scorer.busy for iv in q]
            result.devices["ref"] = len(self.ref_actors.scorer.busy)
        fields = {**vars(result), "admitted_groups": self.sched.admitted_groups_total,
                  "held_groups": self.sched.in_flight_groups,
                  "trained_group_ids": [row[0] for row in self.sched.ledger]}
        return OppoRunResult(**fields, reports=self.reports, reprefilled_tokens=self.rollout.reprefilled_tokens)

    # a step's phases: admit, generate + stream, batch, (async: admit the next) train, sync, adapt

    def first_step(self) -> None:
        self.admit(self.loop.now_s)
        self.wait_for_batch()

    def admit(self, now_s: float) -> StepPlan:
        """begin_step: C for the step, the new groups start on the engines."""
        plan = self.sched.begin_step(self.step)
        self.admit_s = now_s
        self.decoded_at_admit = self.rollout.decoded_tokens
        self.rollout.chunk_tokens = plan.chunk_size_tokens if self.streaming else 0
        self.flush(now_s)  # carried tokens meet this step's C
        groups = [self.requests(g.prompt_index, g.sample_ids) for g in plan.admit]
        for g in groups:
            for r in g:
                self.reqs[r.sample_id] = r
        self.rollout.replan(now_s)
        start = now_s + self.costs.generate_overhead_s
        if self.stopped:  # before the new groups, so that placement counts them (as the pool's does)
            for r in self.stopped:
                r.reprefill = r.prompt_tokens + len(self.sched.held_tokens(r.sample_id))
            self.loop.at(start, self.rollout.restart, self.stopped, start)
            self.stopped = []
        self.loop.at(start, self.rollout.admit, groups, start)
        return plan

    def wait_for_batch(self) -> None:
        """The trainer is free: the open step's batch may be taken (now, or at a later event)."""
        self.waiting = True
        self.wait_start_s = self.loop.now_s
        self.check_batch(self.loop.now_s)

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
            items = [(ch.sample_id, ch.start, ch.end, ch.final, p) for ch in chunks]
            if self.reward_streamed:
                self.scorer.submit(items, now_s)
            if self.streamer is not None and self.ahead is None:
                self.streamer.submit(items, now_s)
            if self.ref_actors is not None:
                self.ref_actors.submit(items, now_s)

    def flush(self, now_s: float) -> None:
        """Hand every decoded token to the scheduler (before a version change or a new C)."""
        running = [r for r in self.rollout.running() if r.done > r.reported]
        self.send(self.report(running, []), now_s)

    def on_scored(self, items: list[tuple], now_s: float) -> None:
        self._ack(("reward",), items, now_s)

    def on_streamed(self, items: list[tuple], now_s: float) -> None:
        self._ack(self.streamer.names, items, now_s)

    def on_ref_streamed(self, items: list[tuple], now_s: float) -> None:
        self._ack(("reference",), items, now_s)

    def _ack(self, names: tuple[str, ...], items: list[tuple], now_s: float) -> None:
        for name in names:
            self.sched.on_scored_many(name, [(it[0], it[1], it[2], it[3]) for it in items])
        self.check_batch(now_s)

    def check_batch(self, now_s: float) -> None:
        batch = self.sched.take_batch() if self.waiting else None
        if batch is not None:
            self.waiting = False
            self.batch_ready(now_s, batch)
            return
        if self.waiting and self.forced_since_s is None and self.sched.waiting_on_forced:
            self.forced_since_s = now_s  # B groups are complete: from here only the staleness bounds hold the batch
        if self.ahead is not None:  # the groups that complete the batch are make_experience's
            self.forward_ahead(now_s)

    def forward_ahead(self, now_s: float) -> None:
        """Groups newly certain to be in the open step's batch go to `ExperienceAhead` whole."""
        new = [g for g in self.sched.committed_groups() if g not in self.ahead_groups]
        if new:
            self.ahead_groups.update(new)
            sids = [sid for g in new for sid in self.sched.group_sample_ids(g)]
            self.ahead.forward([(sid, self.reqs[sid].done) for sid in sids], now_s)

    def batch_ready(self, now_s: float, batch: TrainBatch) -> None:
        self.recorder.span("driver", 0, "generate", self.wait_start_s, now_s)
        samples = [s for g in batch.groups for s in g.samples]
        self.ahead_groups.difference_update(g.group_id for g in batch.groups)
        for s in samples:
            del self.reqs[s.sample_id]
        if self.cfg.split.sleep:  # the engines sleep next: every carried request stops, its tokens fed
            self.stopped = self.rollout.stop(now_s)
            self.send(self.report(self.stopped, []), now_s)
        self.flush(now_s)
        forced_wait = 0.0 if self.forced_since_s is None else now_s - self.forced_since_s
        self.forced_since_s = None
        stats = StepStats(self.mean_reward(self.step), self.rollout.decoded_tokens - self.decoded_at_admit,
                          now_s - self.admit_s, forced_wait)
        step = self.step  # the step trained now (async admission opens the next one below)
        wait_start_s = self.wait_start_s
        report = None
        if self.async_admission:  # close step t and open t+1 now: its groups decode while t trains
            report = self.sched.end_step(stats)
            self.step += 1
            self.admit(now_s)
        lengths = [s.num_tokens for s in samples]
        ids = [s.sample_id for s in samples]
        # the batch of step t trains from the weights of t updates: a sample whose every token that version
        # decoded takes its rollout log-probs (train.old_logprobs 'rollout')
        cut = self.old_logprobs_left(lengths, [all(v == step for _, v in s.version_runs) for s in samples])
        left = self._left(ids, lengths)
        if cut:
            left = {**(left or {}), **cut}
        train_end = self.experience_and_train(now_s, lengths, ids, not self.reward_streamed, left)
        self.loop.at(train_end, self.sync_and_adapt, step, batch, stats, report, wait_start_s, now_s)

    def _left(self, ids: list[int], lengths: list[int]) -> dict[str, int] | None:
        """Streamed make_experience stages -> tokens still to forward (a carried sample's
        values and old log-probs again, whole, under the weights the step trains from; the
        reference over the samples its actors did not stream whole)."""
        w = self.cfg.workload
        left = {}
        if self.ref_actors and w.reference:
            left["ref_logprobs"] = self.ref_actors.left(ids, lengths)
        if self.ahead is not None:
            return {**self.ahead.left(ids, lengths), **left}
        if self.streamer is None:
            return left or None
        names = self.streamer.names
        if "reference" in names and w.reference:
            left["ref_logprobs"] = 0
        if "critic" in names:
            again = self.streamer.recompute(ids, lengths)
            left["old_logprobs"] = again
            if w.critic:
                left["values"] = again
        return left

    def sync_and_adapt(self, step: int, batch: TrainBatch, stats: StepStats, report: StepReport | None,
                       wait_start_s: float, ready_s: float) -> None:
        now = self.loop.now_s
        if now < self.sync_end_s:  # background sync: the last one is still broadcasting; this one waits for it
            self.loop.at(self.sync_end_s, self.sync_and_adapt, step, batch, stats, report, wait_start_s, ready_s)
            return
        self.sync_end_s = self.weight_sync(now, self.background_sync)  # pauses the engines: their segments end now
        # the trainer goes on once the weights are gathered (background sync), else after the broadcast
        released = released_s(self.costs, now, self.sync_end_s, self.background_sync)
        self.flush(now)  # tokens decoded before the sync belong to the old policy version
        if report is None:
            report = self.sched.end_step(stats)
            self.step += 1
        self.reports.append(report)
        prompts = tuple(sorted(g.prompt_index for g in batch.groups))
        self.record(StepRecord(step, wait_start_s, ready_s, now, released, prompts, batch.tokens,
                               report.deferred_fraction, report.delta, report.chunk_size_tokens))
        self.loop.at(released, self.after_sync)

    def after_sync(self) -> None:
        if not self.async_admission:
            self.admit(self.loop.now_s)
        self.wait_for_batch()
