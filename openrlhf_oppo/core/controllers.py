"""Online controllers for OPPO's two knobs: overcommit Δ and chunk size C.

Both share the shape of OpenRLHF's KL controllers: ``.value`` and ``.update(...)``,
bounded steps, and a ``state_dict`` so a resumed run continues where it stopped.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

from openrlhf_oppo.config import ChunkConfig, DeltaConfig

TAIL_FACTOR = 2.0  # system rule: a group longer than this x the window's median length is a straggler


class DeltaController:
    """Overcommit degree Δ (prompt groups admitted beyond the batch size B).

    * ``system`` (default): sized every step from B and the measured length tail.
      With ``L`` the lengths (longest response, in tokens) of the groups trained over
      the last W steps, ``p`` the share of them longer than 2 x median(L) or cut at the
      generation cap (a cap below twice the median would hide the tail; p at most 1/2),
      ``Δ_{t+1} = clip(⌈B·p / (1 − p)⌉, Δ_min, Δ_max)``: of B+Δ groups about p·(B+Δ)
      straggle, so B+Δ holds B that do not, and the batch need not wait for a straggler.
      The trained groups over a window are an unbiased sample of the admitted ones
      (every group is trained once, stragglers later), so no censoring correction is
      needed; it scales with B and falls to Δ_min when lengths have no tail.

    Two update rules from the paper (arXiv 2509.25762), which disagree in sign:

    * ``eq4``, eq. 4: with ``s_t`` the slope of the per-step mean reward
      over the last W steps (least squares),
      ``Δ_{t+1} = clip(Δ_t + δ_inc, Δ_min, Δ_max)`` if ``s_t > 0`` else
      ``clip(Δ_t − δ_dec, Δ_min, Δ_max)``. While the reward still climbs, more
      overcommit is affordable; "as training converges, s_t → 0 and Δ decays
      toward Δ_min" (the paper's text), which this rule does. It moves by δ whatever B is.
    * ``alg1``, Algorithm 1 lines 21–27: ``d = mean(last W) − mean(previous W)``,
      ``Δ ← clip(Δ − sign(d)·max(1, ⌊Δ/4⌋), Δ_min, Δ_max)``: a rising reward
      *lowers* Δ. Offered as written, for reproducing the algorithm box.

    Before one step (system), W (eq4) or 2W (alg1) steps are seen, Δ stays at ``init``.
    """

    def __init__(self, cfg: DeltaConfig, batch_groups: int = 1) -> None:
        self.cfg = cfg
        self.batch_groups = batch_groups
        self.value = cfg.init if cfg.enable else 0
        history = 2 * cfg.window_steps if cfg.rule == "alg1" else cfg.window_steps
        self._rewards: deque[float] = deque(maxlen=history)
        # system: per step, (longest response, truncated at the cap) of each trained group
        self._lengths: deque[tuple[tuple[int, bool], ...]] = deque(maxlen=cfg.window_steps)

    def update(self, mean_reward: float | None, groups: Sequence[tuple[int, bool]] = ()) -> int:
        """Observe one step: its mean reward (None: not known yet, eq4/alg1 wait) and, per
        trained group, (longest response in tokens, truncated at the cap); return the Δ for the next step."""
        cfg = self.cfg
        if not (cfg.enable and cfg.adaptive):
            return self.value
        if cfg.rule == "system":
            self._lengths.append(tuple((int(n), bool(cut)) for n, cut in groups))
            window = [g for step in self._lengths for g in step]
            target = system_delta(self.batch_groups, [n for n, _ in window], [cut for _, cut in window])
            if target is not None:
                self.value = min(cfg.max, max(cfg.min, target))
            return self.value
        if mean_reward is None:
            return self.value
        self._rewards.append(float(mean_reward))
        if len(self._rewards) < self._rewards.maxlen:
            return self.value
        if cfg.rule == "eq4":
            step = cfg.inc if _slope(self._rewards) > 0 else -cfg.dec
        else:
            w = cfg.window_steps
            rewards = list(self._rewards)
            d = sum(rewards[w:]) / w - sum(rewards[:w]) / w
            step = -_sign(d) * max(1, self.value // 4)
        self.value = min(cfg.max, max(cfg.min, self.value + step))
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "rewards": list(self._rewards),
                "lengths": [[[n, cut] for n, cut in step] for step in self._lengths]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = int(state["value"])
        self._rewards.clear()
        self._rewards.extend(float(r) for r in state["rewards"])
        self._lengths.clear()
        # "lengths" is absent in checkpoints from before the system rule
        self._lengths.extend(tuple((int(n), bool(cut)) for n, cut in step) for step in state.get("lengths", ()))


def system_delta(batch_groups: int, lengths: Sequence[int], truncated: Sequence[bool] = ()) -> int | None:
    """The system rule's Δ for group lengths ``lengths`` (None when there are none):
    ``⌈B·p/(1 − p)⌉`` with ``p`` the share of groups above ``TAIL_FACTOR`` x the median
    length or ``truncated`` at the generation cap, at most 1/2 (then Δ = B)."""
    if not lengths:
        return None
    threshold = TAIL_FACTOR * statistics.median(lengths)
    cut = truncated or (False,) * len(lengths)
    total = len(lengths)
    tail = sum(n > threshold or c for n, c in zip(lengths, cut, strict=True))
    if 2 * tail >= total:
        return batch_groups  # p capped at 1/2: B·p/(1 − p) = B
    return -(-batch_groups * tail // (total - tail))  # ⌈B·tail / (total − tail)⌉ in integers: p = tail/total


def _slope(ys: deque[float] | list[float]) -> float:
    """Least-squares slope of ys against 0..n-1."""
    n = len(ys)
    x_mean = (n - 1) / 2
    y_mean = sum(ys) / n
    num = sum((i - x_mean) * (y - y_mean) for i, y in enumerate(ys))
    den = sum((i - x_mean) ** 2 for i in range(n))
    return num / den


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


class ChunkSizeController:
    """Chunk size C in tokens (paper §3.1).

    Fixed, or adaptive: a round of trials tries each candidate for ``trial_steps``
    steps, then C is the candidate with the best generated tokens per second of the
    generation+scoring phase; a new round starts every ``period_steps`` steps
    (counted from the start of the previous round). The first round starts at once.
    """

    def __init__(self, cfg: ChunkConfig) -> None:
        self.cfg = cfg
        self._best = cfg.size_tokens
        self._steps_since_round = 0
        # candidates still to try this round, one entry per step
        self._trial_queue: list[int] = self._new_round() if cfg.adaptive else []
        self._tokens: dict[int, int] = {}
        self._seconds: dict[int, float] = {}

    @property
    def value(self) -> int:
        return self._trial_queue[0] if self._trial_queue else self._best

    @property
    def in_trial(self) -> bool:
        return bool(self._trial_queue)

    @property
    def best(self) -> int:
        """C after the last round of trials (``size_tokens`` before the first round ends)."""
        return self._best

    def trial_sizes(self) -> set[int]:
        """Candidates of the round under way: still to try, or measured."""
        return {*self._trial_queue, *self._tokens}

    def _new_round(self) -> list[int]:
        return [c for c in self.cfg.candidates for _ in range(self.cfg.trial_steps)]

    def update(self, generated_tokens: int, generation_time_s: float) -> int:
        """Observe one step under the current C; return C for the next step."""
        if not self.cfg.adaptive:
            return self.value
        self._steps_since_round += 1
        if self._trial_queue:
            c = self._trial_queue.pop(0)
            self._tokens[c] = self._tokens.get(c, 0) + int(generated_tokens)
            self._seconds[c] = self._seconds.get(c, 0.0) + float(generation_time_s)
            if not self._trial_queue:
                self._best = max(self._tokens, key=lambda k: self._tokens[k] / max(self._seconds[k], 1e-9))
                self._tokens.clear()
                self._seconds.clear()
        elif self._steps_since_round >= self.cfg.period_steps:
            self._steps_since_round = 0
            self._trial_queue = self._new_round()
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self._best,
            "steps_since_round": self._steps_since_round,
            "trial_queue": list(self._trial_queue),
            "tokens": {str(k): v for k, v in self._tokens.items()},
            "seconds": {str(k): v for k, v in self._seconds.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._best = int(state["best"])
        self._steps_since_round = int(state["steps_since_round"])
        self._trial_queue = [int(c) for c in state["trial_queue"]]
        self._tokens = {int(k): int(v) for k, v in state["tokens"].items()}
        self._seconds = {int(k): float(v) for k, v in state["seconds"].items()}
