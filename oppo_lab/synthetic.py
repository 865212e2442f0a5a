"""A synthetic rollout engine: long-tail response lengths, decoded chunk by chunk.

It drives the real :class:`~openrlhf_oppo.core.OverlapScheduler` the way the Ray
adapter does (events in, plans out), without models. Scorers acknowledge every chunk
at once, so a step ends as soon as the batch is complete. Randomness is injected.
"""

from __future__ import annotations

import math
import random
from array import array
from dataclasses import dataclass
from itertools import compress, repeat
from operator import itemgetter

from openrlhf_oppo.core import OverlapScheduler, StepPlan


@dataclass(frozen=True)
class LengthModel:
    """Log-normal response lengths (tokens), clipped: most short, a long tail."""

    median_tokens: int = 1000
    sigma: float = 0.9
    min_tokens: int = 16
    max_tokens: int = 16384

    def sample(self, rng: random.Random) -> int:
        x = int(rng.lognormvariate(math.log(self.median_tokens), self.sigma))
        return min(self.max_tokens, max(self.min_tokens, x))


class SyntheticRollout:
    """Holds each in-flight sample's target length and decodes in rounds.

    Each round, every unfinished sample emits up to ``tokens_per_round`` tokens
    (one vLLM streaming delta per sample); a sample that reaches its length finishes.
    """

    def __init__(self, lengths: LengthModel, rng: random.Random) -> None:
        self.lengths = lengths
        self.rng = rng
        self.remaining: dict[int, int] = {}  # sample id -> tokens still to generate

    def admit(self, plan: StepPlan) -> None:
        for group in plan.admit:
            for sid in group.sample_ids:
                self.remaining[sid] = self.lengths.sample(self.rng)

    def round(self, tokens_per_round: int) -> list[tuple[int, array, bool]]:
        """One decode round: ``(sample_id, new_token_ids, finished)`` per unfinished sample."""
        block = array("i", range(tokens_per_round))  # token ids do not matter to the scheduler
        out = []
        for sid, left in self.remaining.items():
            k = min(tokens_per_round, left)
            # a fresh array per sample per round, as the rollout actors hand vLLM's deltas over
            out.append((sid, block[:k], k == left))
        for sid, toks, done in out:
            if done:
                del self.remaining[sid]
            else:
                self.remaining[sid] -= len(toks)
        return out


_sample_id, _token_ids, _finished = itemgetter(0), itemgetter(1), itemgetter(2)


def feed_round(sched: OverlapScheduler, events: list[tuple[int, array, bool]], version: int) -> None:
    """Feed one decode round; every scorer acknowledges every chunk at once."""
    # a lazy C-level zip, not a list of (sid, toks, None): zip hands out one reused tuple,
    # so thousands per round never reach the GC's youngest generation
    chunks = sched.on_tokens_many(zip(map(_sample_id, events), map(_token_ids, events), repeat(None)), version)
    for sid in compress(map(_sample_id, events), map(_finished, events)):
        chunks += sched.on_finished(sid, "stop")
    for name in sched.scorers:
        sched.on_scored_many(name, chunks)
