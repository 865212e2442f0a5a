"""OpenRLHF's own schedules (`sync`, `async`, `partial`, `oversample`) as drivers of the
simulated world, modelled after OpenRLHF 0.11.2's control flow."""

from __future__ import annotations

from openrlhf_oppo.sim.costs import CostModel
from openrlhf_oppo.sim.engine import Request
from openrlhf_oppo.sim.presets import SimConfig
from openrlhf_oppo.sim.world import RunResult, StepRecord, World

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
