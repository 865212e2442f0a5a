"""Streamed make_experience forwards: OPPO's `streaming.reference` (the reference model's
log-probs) and `streaming.critic` (the critic's values and the actor's old log-probs, the forwards
of the weights being trained) on the training devices (`TrainStreamer`), or the reference on
streaming reference actors of its own (`ReferenceActors`, `projections.reference_actors`); or
make_experience's forwards of whole groups ahead of the batch (`ExperienceAhead`,
`projections.experience_ahead`).

The training devices hold the reference, critic and actor. While they neither make experience
nor train (in a disaggregated layout: while the engines generate) they prefill chunks as the
reward servers do: every queued chunk in one call, costing the streamed models' per-token
forwards plus, per call, a ZeRO-3 gather of each streamed model's weights (`stream_call_s`).
Colocated, the devices are the engines': a call pauses every engine.

The reference is frozen: a chunk prefilled once is final. Values and old log-probs must come from
the weights the step trains from, so a sample any of whose chunks were prefilled under an older
version (a carried sample, after an update) is recomputed whole in make_experience, never mixed
across versions (`recomputed_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim.engine import Scorer

TRAIN_STREAMED = ("reference", "critic")  # the scorer names the training devices stream


def _new_tokens(item: tuple) -> int:
    """Tokens a chunk forwards: its own, and the prompt with a sample's first chunk."""
    return item[2] - item[1] + (item[4] if item[1] == 0 else 0)


class TrainStreamer:
    """The training devices as a scorer of `names` (a subset of TRAIN_STREAMED)."""

    def __init__(self, world, names: tuple[str, ...], on_done: Callable[[list, float], None]) -> None:
        self.world = world
        self.names = names
        self.on_done = on_done
        c = world.costs
        w = world.cfg.workload
        self.per_token_s = 0.0
        models = 0  # forwards a streamed chunk costs
        if "reference" in names:
            self.per_token_s += c.forward_per_token_s
            models += 1
        if "critic" in names:  # the actor's old log-probs, and the critic's values with a critic
            self.per_token_s += c.forward_per_token_s + (c.critic_forward_per_token_s if w.critic else 0.0)
            models += 2 if w.critic else 1
        self.call_s = c.stream_call_s * models
        self.queue: list[tuple] = []
        self.active = False
        self.busy_until_s = 0.0  # the call in progress ends
        self.free_at_s = 0.0  # the devices make experience / train until then
        self.version_of: dict[int, int] = {}  # sample -> oldest weights version its chunks were prefilled under
        self.recomputed_tokens = 0

    def submit(self, items: list[tuple], now_s: float) -> None:
        """items: (sample_id, start, end, final, prefix_tokens), as the reward servers get them."""
        self.queue.extend(items)
        self.kick(now_s)

    def hold(self, until_s: float) -> None:
        """The devices make experience and train until `until_s`; calls wait for it."""
        self.free_at_s = until_s
        self.world.loop.at(until_s, self.kick, until_s)

    def kick(self, now_s: float) -> None:
        if self.active or not self.queue or now_s < self.free_at_s:
            return
        items, self.queue = self.queue, []
        dt = self.call_seconds(items)
        if self.world.cfg.split.colocate:
            self.world.rollout.pause(now_s)
        self.active = True
        self.busy_until_s = now_s + dt
        self.world.loop.at(now_s + dt, self._done, items, now_s)

    def call_seconds(self, items: list[tuple]) -> float:
        return self.call_s + self.per_token_s * sum(_new_tokens(it) for it in items)

    def _done(self, items: list[tuple], t0_s: float) -> None:
        now_s = self.world.loop.now_s
        self.active = False
        self.world.train_busy.append((t0_s, now_s))
        self.world.recorder.span("actor", 0, "stream_forward", t0_s, now_s, tokens=sum(_new_tokens(it) for it in items))
        if self.world.cfg.split.colocate:
            self.world.rollout.resume(now_s)
        if "critic" in self.names:  # (ExperienceAhead forwards after the last update: nothing to recompute)
            for it in items:
                self.version_of.setdefault(it[0], self.world.version)
        self.on_done(items, now_s)
        self.kick(now_s)

    def recompute(self, sample_ids: list[int], lengths: list[int]) -> int:
        """Tokens make_experience forwards again for the values and old log-probs: every sample of
        the batch with a chunk prefilled under older weights than the current ones, whole."""
        if "critic" not in self.names:
            return 0
        p = self.world.cfg.lengths.prompt_tokens
        now = self.world.version
        tokens = sum(p + n for sid, n in zip(sample_ids, lengths, strict=True)
                     if self.version_of.pop(sid, now) < now)
        self.recomputed_tokens += tokens
        return tokens


class ExperienceAhead(TrainStreamer):
    """`projections.experience_ahead`: each group certain to be in the step's batch (the core's
    `committed_groups`) is forwarded whole through make_experience's `stages` (old log-probs;
    values with a critic; the reference unless it is streamed) on the training devices, while
    they wait for the batch and after the update the step trains from (`hold`), so nothing is
    recomputed. Samples go in whole forward rounds (`unit`: a micro-batch on every training
    device, as make_experience forwards them), every queued round in one call, costed as
    make_experience costs its forwards (`costs.make_experience_s` over the padded micro-batches,
    fixed costs included, the critic's group beside the actor's) plus a round trip per model
    (`ahead_call_s`): a round's forwards are the micro-batches make_experience would run, with
    the same ZeRO-3 gathers, which the cost model leaves inside `forward_mfu` there too.
    make_experience then forwards the batch's samples not forwarded ahead (`left`). Colocated,
    a call pauses every engine."""

    def __init__(self, world, stages: tuple[str, ...]) -> None:
        super().__init__(world, (), lambda items, now_s: None)
        self.stages = stages
        self.call_s = world.costs.ahead_call_s * len(stages)
        split = world.cfg.split
        self.unit = world.cfg.workload.micro_batch_size * split.train_gpus * split.pattern_nodes
        self.pending: list[tuple] = []  # committed samples short of a round
        self.forwarded: set[int] = set()  # samples in a call begun (make_experience waits for its end)

    def kick(self, now_s: float) -> None:
        if not self.active and self.queue and now_s >= self.free_at_s:
            self.forwarded.update(it[0] for it in self.queue)
        super().kick(now_s)

    def call_seconds(self, items: list[tuple]) -> float:
        w = self.world.cfg.workload
        stages = self.world.costs.make_experience_s(self.world.train_tokens([it[2] for it in items]),
                                                    w.reference, w.critic)
        return self.call_s + self.world._forwards_s({k: v for k, v in stages.items() if k in self.stages})

    def forward(self, samples: list[tuple[int, int]], now_s: float) -> None:
        """samples: (sample_id, response tokens) of groups newly committed to the batch."""
        p = self.world.cfg.lengths.prompt_tokens
        self.pending += [(sid, 0, n, True, p) for sid, n in samples]
        rounds = len(self.pending) // self.unit * self.unit
        if rounds:
            items, self.pending = self.pending[:rounds], self.pending[rounds:]
            self.submit(items, now_s)

    def left(self, sample_ids: list[int], lengths: list[int]) -> dict[str, int]:
        """make_experience's stages -> tokens still to forward: the batch's samples in no call
        begun (a call in progress ends first: `World.experience_and_train`); queued ones leave
        the queue."""
        rest = [n for sid, n in zip(sample_ids, lengths, strict=True) if sid not in self.forwarded]
        self.forwarded.difference_update(sample_ids)
        batch = set(sample_ids)
        self.queue = [it for it in self.queue if it[0] not in batch]
        self.pending = [it for it in self.pending if it[0] not in batch]
        return dict.fromkeys(self.stages, self.world.train_tokens(rest))


class ReferenceActors:
    """OPPO's streaming reference actors (`projections.reference_actors`): the reference held whole,
    on `split.reference_gpus` devices or beside the engines, as the streaming reward actors hold the
    reward model, and costed as they are (a `Scorer` with the reference's shape:
    `costs.reference_actors`). A sample's chunks go to one actor, each chunk prefilled once on the
    KV cached before it; the reference is frozen, so a carried sample's cache stays valid across
    weight syncs and nothing is recomputed. make_experience then forwards the reference only over
    the samples not streamed whole (`left`)."""

    def __init__(self, world, on_done: Callable[[list, float], None]) -> None:
        self.world = world
        self.on_done = on_done
        costs = cost_model.reference_actors(world.cfg, world.costs)
        self.scorer = Scorer(world.loop, costs, world.recorder, world.rollout, self._done,
                             max_call_chunks=world.cfg.workload.score_chunks_per_call, role="ref")
        self.streamed: set[int] = set()  # samples whose every token the reference actors have prefilled
        self.prefilled_tokens: dict[int, int] = {}  # sample -> tokens prefilled (its prompt with its first chunk)

    def submit(self, items: list[tuple], now_s: float) -> None:
        """items: (sample_id, start, end, final, prefix_tokens), as the reward servers get them."""
        self.scorer.submit(items, now_s)

    def _done(self, items: list[tuple], now_s: float) -> None:
        for it in items:
            self.prefilled_tokens[it[0]] = self.prefilled_tokens.get(it[0], 0) + _new_tokens(it)
            if it[3]:
                self.streamed.add(it[0])
        self.on_done(items, now_s)

    def left(self, sample_ids: list[int], lengths: list[int]) -> int:
        """Tokens make_experience's one-shot reference forward still takes for this batch: the
        samples not streamed whole, prompt and response."""
        p = self.world.cfg.lengths.prompt_tokens
        tokens = sum(p + n for sid, n in zip(sample_ids, lengths, strict=True) if sid not in self.streamed)
        self.streamed.difference_update(sample_ids)
        return tokens
