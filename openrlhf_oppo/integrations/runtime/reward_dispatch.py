"""Chunks to the streaming reward and reference actors, their acknowledgements back to the
scheduler in order, and a dead actor's restart and re-scoring (docs/design.md, "Streaming
rewards")."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray

from openrlhf_oppo.core import ChunkReady, OverlapScheduler
from openrlhf_oppo.integrations.runtime import faults
from openrlhf_oppo.integrations.runtime.log import get_logger
from openrlhf_oppo.integrations.runtime.ray_calls import RayCalls
from openrlhf_oppo.integrations.runtime.run_config import SCORER_RESTARTS
from openrlhf_oppo.integrations.runtime.step_meter import StepMeter

logger = get_logger(__name__)

REWARD = "reward"  # the scheduler's names for the streaming reward and reference scorers
REFERENCE = "reference"
SCORER_RESTART_TIMEOUT_S = 300.0  # a restarted actor reloads its model


@dataclass(frozen=True)
class ScoreReply:
    """What one `process` call returns: the results of the samples it finished (a reward, or
    the reference log-prob of every response token), and when it worked."""

    scores: dict[int, Any]
    start_s: float  # time.time() at the call's start and end: the actor's busy interval
    end_s: float
    kv_tokens: int = 0  # tokens the actor holds in KV caches after the call
    kv_budget_tokens: int = 0  # its budget (explicit, or derived from the device's memory)
    # since the actor (re)started, monotone: caches dropped to honour the budget, tokens
    # prefilled again because of it, forwards retried after a device out-of-memory
    evictions: int = 0
    reprefilled_tokens: int = 0
    oom_retries: int = 0


@dataclass(frozen=True)
class RewardCall:
    """One `process` call in flight on a scorer actor."""

    ref: Any  # its Ray object ref
    actor: int  # index of the actor in its group
    chunks: list[ChunkReady]  # what it acknowledges to the scheduler once it returns
    ahead: dict[int, int]  # sample id -> tokens prefilled ahead of the sample's final chunk


class ScorerDispatcher:
    """One streamed scorer's actors (`name`: REWARD or REFERENCE, as the scheduler knows it).
    Sticky routing: sample `sid` always goes to actor `sid % len(actors)`, whose calls
    from this caller run in submission order, so a sample's chunks are prefilled in order.
    With no actors (the scorer not streamed) every method is a no-op."""

    def __init__(self, actors: list, scheduler: OverlapScheduler, meter: StepMeter, strategy: Any,
                 model_path: str | None, calls: RayCalls | None = None, name: str = REWARD) -> None:
        """`strategy`, `model_path`: what a restarted actor reloads its model with, as
        OpenRLHF first loaded it (`init_model_from_pretrained`)."""
        self.name = name
        self.actors = list(actors)
        self.scheduler = scheduler
        self.meter = meter
        self.strategy = strategy
        self.model_path = model_path
        self.calls = calls if calls is not None else RayCalls()
        self.pending: list[RewardCall] = []  # in submission order
        self.opening: dict[int, Any] = {}  # actor index -> its `open_many` call in flight
        self.opened: dict[int, list[int]] = {}  # sample id -> prompt ids, for every sample open on an actor
        self.scores: dict[int, Any] = {}  # sample id -> streamed result (reward; reference log-probs)
        self.step = 0  # the step under way (fault injection, error messages)
        self.restarts_this_step = 0
        self.calls_this_step = 0

    def begin_step(self, step: int) -> None:
        self.step = step
        self.restarts_this_step = self.calls_this_step = 0

    def in_flight(self) -> list:
        """Refs of the calls not yet acknowledged: the driver also wakes on them."""
        return [call.ref for call in self.pending]

    # ------------------------------------------------------------------ opening samples

    def open(self, prompts: dict[int, list[int]]) -> None:
        """Open samples (sample id -> prompt ids) on their actors; `confirm_opened` waits."""
        if not self.actors:
            return
        per_actor: dict[int, dict[int, list[int]]] = {}
        for sid, prompt_ids in prompts.items():
            per_actor.setdefault(sid % len(self.actors), {})[sid] = prompt_ids
        self.opened.update(prompts)
        self.opening = {idx: self.actors[idx].open_many.remote(batch) for idx, batch in per_actor.items()}

    def confirm_opened(self) -> None:
        opening, self.opening = self.opening, {}
        for idx, ref in opening.items():
            try:
                self.calls.get(ref)
            except ray.exceptions.RayActorError:
                pass  # it died: its next `process` call fails and `_restart` reopens what it held
            except ray.exceptions.RayTaskError as exc:
                raise RuntimeError(
                    f"OPPO: {self.name} actor {idx} could not open step {self.step}'s samples: {exc}") from exc

    def forget(self, sample_ids: list[int]) -> None:
        """Trained samples: nothing of them is needed again."""
        for sid in sample_ids:
            self.scores.pop(sid, None)
            self.opened.pop(sid, None)

    def forget_all(self) -> None:
        """After a checkpoint load: the actors restart empty and every held sample is re-scored."""
        self.scores = {}
        self.opened = {}

    # ------------------------------------------------------------------ chunks out, acks back

    def dispatch(self, chunks: list[ChunkReady]) -> None:
        """Send chunks to the actors, one call per actor. A chunk sent with its
        sample's final one is prefilled with it: not overlapped."""
        if not chunks or not self.actors:
            return
        work: dict[int, tuple[dict, dict, list]] = {}
        for ch in chunks:
            idx = ch.sample_id % len(self.actors)
            extends, finishes, sent = work.setdefault(idx, ({}, {}, []))
            toks = list(ch.token_ids)  # the chunk carries its tokens (read-only: copied)
            if ch.final:
                # chunks of one sample arriving together are prefilled as one: same result
                finishes[ch.sample_id] = extends.pop(ch.sample_id, []) + toks
            else:
                extends.setdefault(ch.sample_id, []).extend(toks)
            sent.append(ch)
        for idx, (extends, finishes, sent) in work.items():
            self.meter.on_final_tokens(sum(map(len, finishes.values())))
            ahead = {sid: len(toks) for sid, toks in extends.items()}
            self.pending.append(RewardCall(self.actors[idx].process.remote(extends, finishes), idx, sent, ahead))
            self.calls_this_step += 1
            if faults.due(self.name, self.step, self.calls_this_step):
                self.calls.kill(self.actors[idx], no_restart=False)

    def collect(self) -> None:
        """Acknowledge finished calls, in submission order per actor: a sample's
        chunks must be acknowledged in order (ray.wait reports readiness in any order)."""
        if not self.pending:
            return
        ready = set(self.calls.ready(self.in_flight()))
        blocked: set[int] = set()  # actors with an earlier call still running
        died: set[int] = set()  # actors whose call failed: everything they held is sent again
        still = []
        for call in self.pending:
            if call.actor in died:
                continue
            if call.ref in ready and call.actor not in blocked:
                try:
                    reply = self.calls.get(call.ref)
                except ray.exceptions.RayActorError as exc:
                    died.add(call.actor)
                    logger.warning("OPPO: %s actor %d died in step %d (%s)", self.name, call.actor, self.step,
                                   type(exc).__name__)
                    continue
                self.scores.update(reply.scores)
                self.meter.on_reply(call.actor, reply, call.ahead)
                self.scheduler.on_scored_many(self.name, call.chunks)
            else:
                blocked.add(call.actor)
                still.append(call)
        self.pending = [call for call in still if call.actor not in died]
        for idx in died:
            self._restart(idx)

    # ------------------------------------------------------------------ a dead actor

    def _restart(self, idx: int) -> None:
        """Ray restarts a dead actor empty (its constructor only): reload its model as
        OpenRLHF first loaded it, reopen its held samples and re-send every token the
        scheduler recorded for them; their scores are computed anew."""
        self.restarts_this_step += 1
        if self.restarts_this_step > SCORER_RESTARTS:
            raise RuntimeError(f"OPPO: {self.name} actor {idx} died {self.restarts_this_step} times in step "
                               f"{self.step}; giving up")
        sched = self.scheduler
        held = [sid for gid in sched.in_flight_groups for sid in sched.group_sample_ids(gid)
                if sid % len(self.actors) == idx]
        opens = {sid: self.opened[sid] for sid in held}
        deadline = time.time() + SCORER_RESTART_TIMEOUT_S
        actor = self.actors[idx]
        while True:  # calls made while Ray restarts the actor fail with ActorUnavailableError: wait for it
            try:
                self.calls.get(actor.init_model_from_pretrained.remote(self.strategy, self.model_path))
                self.calls.get(actor.open_many.remote(opens))
                break
            except ray.exceptions.ActorUnavailableError:
                if time.time() > deadline:
                    raise RuntimeError(f"OPPO: {self.name} actor {idx} did not come back within "
                                       f"{SCORER_RESTART_TIMEOUT_S:.0f}s of its death in step {self.step}") from None
                time.sleep(0.5)
        for sid in held:
            self.scores.pop(sid, None)
        chunks = sched.rescore(self.name, held)
        logger.warning("OPPO: %s actor %d restarted; re-prefilling %d held samples (%d tokens) "
                       "from their recorded tokens", self.name, idx, len(held), sum(c.end for c in chunks))
        self.dispatch(chunks)


class Scorers:
    """The streamed scorers' dispatchers as one: every chunk goes to each of them (the scheduler
    waits for every scorer's acknowledgement). `reward` and `reference` are no-ops when not
    streamed."""

    def __init__(self, reward: ScorerDispatcher, reference: ScorerDispatcher) -> None:
        self.reward = reward
        self.reference = reference
        self.all = (reward, reference)

    @property
    def streaming(self) -> bool:
        return any(d.actors for d in self.all)

    @property
    def restarts_this_step(self) -> int:
        return sum(d.restarts_this_step for d in self.all)

    def in_flight(self) -> list:
        return [ref for d in self.all for ref in d.in_flight()]

    def begin_step(self, step: int) -> None:
        for d in self.all:
            d.begin_step(step)

    def open(self, prompts: dict[int, list[int]]) -> None:
        for d in self.all:
            d.open(prompts)

    def confirm_opened(self) -> None:
        for d in self.all:
            d.confirm_opened()

    def dispatch(self, chunks: list[ChunkReady]) -> None:
        for d in self.all:
            d.dispatch(chunks)

    def collect(self) -> None:
        for d in self.all:
            d.collect()

    def forget(self, sample_ids: list[int]) -> None:
        for d in self.all:
            d.forget(sample_ids)

    def forget_all(self) -> None:
        for d in self.all:
            d.forget_all()
