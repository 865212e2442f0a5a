"""OPPO's schedules (`oppo`, `oppo-fixed`, `oppo-intra`, `oppo-inter`) as a driver of the
simulated world. The real `OverlapScheduler` decides; the driver only turns engine and
scorer events into scheduler calls and executes its plans, as the Ray adapter does."""

from __future__ import annotations

from array import array

from openrlhf_oppo import config as oppo_config_module
from openrlhf_oppo.core import OverlapScheduler, StepStats
from openrlhf_oppo.integrations.launch.schedules import oppo_config as schedule_oppo_config
from openrlhf_oppo.sim.costs import CostModel
from openrlhf_oppo.sim.engine import Request
from openrlhf_oppo.sim.presets import SimConfig
from openrlhf_oppo.sim.world import RunResult, StepRecord, World

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
