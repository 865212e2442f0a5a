"""OpenRLHF's own schedules (`sync`, `async`, `partial`, `oversample` and its 3B / 4B variants) as
drivers of the simulated world, modelled after OpenRLHF 0.11.2's control flow.

Each driver also records, per trained step, its response tokens by policy lag: how many versions
older than the weights that train them were the weights that decoded them (`OpenRLHFRunResult`,
the measured side of `drivers.version_budget`). The versions count weight syncs: the trainer's
j-th batch trains from version j; a token decoded after the k-th sync's end and before the next
sync's start is version k (the engines are paused during a sync).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from openrlhf_oppo.sim.costs import CostModel
from openrlhf_oppo.sim.engine import Request
from openrlhf_oppo.sim.presets import SimConfig
from openrlhf_oppo.sim.world import RunResult, StepRecord, World


@dataclass
class OpenRLHFRunResult(RunResult):
    """A run of an OpenRLHF mode, with each trained step's response tokens by policy lag."""

    lag_tokens: list[dict[int, int]] = field(default_factory=list)  # per trained step: lag -> tokens


def released_s(costs: CostModel, now_s: float, end_s: float, background: bool) -> float:
    """When the trainer goes on after a weight sync that started at `now_s` and ends at `end_s`:
    in the background (`staleness.background_sync`, OPPO's or OpenRLHF's with OPPO's transport) once
    the weights are gathered (`sync_gather_s`), else after the broadcast."""
    return min(end_s, now_s + costs.sync_gather_s) if background else end_s

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
        self.lag_tokens: list[dict[int, int]] = []

    def run(self) -> OpenRLHFRunResult:
        self.loop.at(0.0, self.begin)
        self.loop.run(lambda: len(self.records) >= self.cfg.workload.steps)
        return OpenRLHFRunResult(**vars(self.result("sync")), lag_tokens=self.lag_tokens)

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
        self.lag_tokens.append({0: sum(lengths)})  # generated from the weights it trains from
        self.step += 1
        self.loop.at(sync_end, self.begin)

    def on_scored(self, items: list[tuple], now_s: float) -> None:
        pass  # make_experience scores whole sequences (score_whole)


# ------------------------------------------------------------- OpenRLHF: async family
# Mirrors OpenRLHF 0.11.2's trainer/ppo_trainer_async.py and ppo_utils/samples_generator.py
# (upstream control flow, not an algorithm of ours); with the bench harness's seeded rollouts
# (integrations/runtime/seeding.py) a vLLM call's batch is trained in dispatch order.


class AsyncDriver(World):
    """OpenRLHF --train.async_enable: a generator actor and a trainer actor around a queue.

        generator (GenerateSamplesActor.fit)          trainer (TrainingActor.fit)
          take a slot (rollout_slots: 1)                take a batch (rollout_queue: 1)
          [lock] generate_samples():                    give a slot back -> the generator goes on
            buffer < B groups: one vLLM call of           make_experience, train
            `prompts_per_call` prompts, buffered in       broadcast: [lock] (partial: pause the
            the order their groups finish                   engines) weight sync [unlock]
            hand over the first B                         log the step (the bench's step event)
          [unlock] put it on the queue

    Without partial rollout the generator holds the lock for the whole call, so the weight
    sync waits for the call in flight; with it, the sync pauses the engines and requests keep
    their tokens. Over-sampling (`prompts_per_call` = kB, `--rollout.vllm_generate_batch_size`;
    OpenRLHF's `oversample` is k = 2): batches 2..k of a call come from the buffer, and the next
    call starts only when the trainer takes the last of them. With `workload.dataset_steps` the
    dataset ends with the run: the last batch trains with nothing generating.

    Policy lag (no partial rollout): a call starts as the trainer takes the last batch of the
    call before, whose weights are the engines' (version v); its k batches train from versions
    v+1 .. v+k (the sync after the taken batch waits for the call): lags 1 .. k. Partial rollout
    (one batch a call): a call spans at most one sync, lags 0 and 1.

    `background_sync` (not OpenRLHF's shipped code: its async trainer with OPPO's transport,
    `staleness.background_sync` and `staleness.background_sync_buffer`): the trainer takes the
    next batch once the weights are gathered (`released_s`); the broadcast holds the vLLM lock,
    and the engines stay paused, until it ends.
    """

    def __init__(self, cfg: SimConfig, costs: CostModel, seed: int, partial: bool, prompts_per_call: int,
                 name: str, background_sync: bool = False) -> None:
        super().__init__(cfg, costs, seed)
        self.partial = partial
        self.prompts_per_call = prompts_per_call
        self.name = name
        self.background_sync = background_sync
        self.syncs_started = 0  # weight syncs begun (each ends before any engine decodes again)
        self.versions: dict[int, list[tuple[int, int]]] = {}  # sample -> (version, tokens decoded up to then)
        self.version_at_start: dict[int, int] = {}  # sample -> the version its first tokens are decoded by
        self.lag_tokens: list[dict[int, int]] = []
        w = cfg.workload
        self.prompts_left = w.steps * w.batch_groups if w.dataset_steps else 1 << 62  # the dataloader
        self.next_prompt = 0
        self.slots = 1  # rollout_slots (async_queue_size 1)
        self.queue: list[list[list[Request]]] = []  # rollout_queue: batches of groups
        self.buffer: list[list[Request]] = []  # SamplesGenerator._sample_buffer: finished groups
        self.lock_holder: str | None = None  # VLLMLock
        self.lock_waiters: list[tuple[str, Callable[[], None]]] = []  # FIFO, as asyncio.Lock
        self.generator_busy = False  # between taking a slot and putting a batch on the queue
        self.call_groups: dict[int, list[Request]] = {}  # the vLLM call in flight: prompt -> group
        self.call_left: dict[int, int] = {}  # prompt -> responses still decoding
        self.call_done: list[int] = []  # prompts whose groups finished, in order
        self.call_start_s = 0.0
        self.trainer_idle = True
        self.wait_start_s = 0.0
        self.trained = 0

    def run(self) -> OpenRLHFRunResult:
        self.loop.at(0.0, self.generator_next)
        self.loop.run(lambda: len(self.records) >= self.cfg.workload.steps)
        return OpenRLHFRunResult(**vars(self.result(self.name)), lag_tokens=self.lag_tokens)

    # ------------------------------------------------------------------ the lock

    def acquire(self, who: str, then: Callable[[], None]) -> None:
        if self.lock_holder is None:
            self.lock_holder = who
            then()
        else:
            self.lock_waiters.append((who, then))

    def release(self) -> None:
        self.lock_holder = None
        if self.lock_waiters:
            who, then = self.lock_waiters.pop(0)
            self.lock_holder = who
            self.loop.at(self.loop.now_s, then)

    # ------------------------------------------------------------------ the generator

    def generator_next(self) -> None:
        if self.generator_busy or self.slots == 0 or (self.prompts_left == 0 and not self.buffer):
            return  # a batch in hand, no slot, or the dataset is done
        self.slots -= 1
        self.generator_busy = True
        if self.partial:
            self.generate_samples()
        else:
            self.acquire("generator", self.generate_samples)

    def generate_samples(self) -> None:
        now = self.loop.now_s
        w = self.cfg.workload
        if len(self.buffer) >= w.batch_groups or self.prompts_left == 0:
            self.hand_over(from_call=False)
            return
        count = min(self.prompts_per_call, self.prompts_left)
        n = w.samples_per_group
        groups = [self.requests(p, tuple(range(p * n, (p + 1) * n)))
                  for p in range(self.next_prompt, self.next_prompt + count)]
        self.next_prompt += count
        self.prompts_left -= count
        self.call_groups = {g[0].sample_id // n: g for g in groups}
        for g in groups:  # a sync begun before the call ends before the engines decode it
            for r in g:
                self.versions[r.sample_id] = []
                self.version_at_start[r.sample_id] = self.syncs_started
        self.call_left = {p: n for p in self.call_groups}
        self.call_done = []
        self.call_start_s = now
        start = now + self.costs.generate_overhead_s
        self.loop.at(start, self.rollout.admit, groups, start)

    def on_progress(self, engine: int, crossed: list[Request], finished: list[Request], now_s: float) -> None:
        n = self.cfg.workload.samples_per_group
        for r in finished:
            p = r.sample_id // n
            self.call_left[p] -= 1
            if self.call_left[p] == 0:
                self.call_done.append(p)
        if self.call_groups and len(self.call_done) == len(self.call_groups):
            self.recorder.span("driver", 1, "generate", self.call_start_s, now_s)
            self.buffer += [self.call_groups[p] for p in self.call_done]
            self.call_groups = {}
            self.call_left = {}
            self.hand_over(from_call=True)

    def hand_over(self, from_call: bool) -> None:
        """The first B buffered groups go on the queue (a call's own batch in dispatch order)."""
        b = self.cfg.workload.batch_groups
        batch, self.buffer = self.buffer[:b], self.buffer[b:]
        if from_call:
            batch = sorted(batch, key=lambda g: g[0].sample_id)
        if not self.partial:
            self.release()
        self.generator_busy = False
        if batch:
            self.queue.append(batch)
        self.loop.at(self.loop.now_s, self.trainer_next)
        self.loop.at(self.loop.now_s, self.generator_next)

    def generating(self) -> bool:
        return bool(self.call_groups)

    # ------------------------------------------------------------------ the trainer

    def trainer_next(self) -> None:
        if not self.trainer_idle or not self.queue:
            return
        now = self.loop.now_s
        batch = self.queue.pop(0)
        self.trainer_idle = False
        self.slots += 1
        self.generator_next()  # the slot wakes the generator first: its call decodes beside training
        reqs = [r for g in batch for r in g]
        lengths = [r.done for r in reqs]
        self.lag_tokens.append(self.lags(reqs, self.trained))
        end = self.experience_and_train(now, lengths, [r.sample_id for r in reqs], True)
        n = self.cfg.workload.samples_per_group
        prompts = tuple(sorted({r.sample_id // n for r in reqs}))
        self.loop.at(end, self.acquire, "trainer",
                     lambda: self.broadcast(StepRecord(self.trained, self.wait_start_s, now, end, end, prompts,
                                                       sum(lengths))))

    def lags(self, reqs: list[Request], trained_version: int) -> dict[int, int]:
        """The batch's response tokens by lag behind `trained_version` (see the class doc)."""
        out: dict[int, int] = {}
        for r in reqs:
            marks = self.versions.pop(r.sample_id, [])
            start = self.version_at_start.pop(r.sample_id, 0)
            upto = 0
            for version, done in marks:
                if done > upto:
                    out[trained_version - version] = out.get(trained_version - version, 0) + done - upto
                    upto = done
            last = marks[-1][0] + 1 if marks else start
            if r.done > upto:
                out[trained_version - last] = out.get(trained_version - last, 0) + r.done - upto
        return out

    def mark_versions(self) -> None:
        """A sync begins: the tokens decoded so far by the call in flight are the engines' version."""
        for g in self.call_groups.values():
            for r in g:
                self.versions[r.sample_id].append((self.syncs_started, r.done))
        self.syncs_started += 1

    def broadcast(self, rec: StepRecord) -> None:
        now = self.loop.now_s
        end = self.weight_sync(now, self.background_sync)  # pauses the engines (partial: requests keep their tokens)
        self.mark_versions()
        released = released_s(self.costs, now, end, self.background_sync)
        if released < end:  # the trainer goes on; the broadcast holds the lock to its end
            self.loop.at(end, self.release)
        self.loop.at(released, self.after_sync, StepRecord(rec.step, rec.generate_start_s, rec.batch_ready_s,
                                                           rec.train_end_s, released, rec.prompt_indices, rec.tokens),
                     released < end)

    def after_sync(self, rec: StepRecord, broadcasting: bool = False) -> None:
        if not broadcasting:
            self.release()
        self.record(rec)
        self.trained += 1
        self.trainer_idle = True
        self.wait_start_s = self.loop.now_s
        self.trainer_next()

    def on_scored(self, items: list[tuple], now_s: float) -> None:
        pass
