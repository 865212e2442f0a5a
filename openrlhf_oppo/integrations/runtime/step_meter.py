"""Per-step measurements of an OPPO step: timings, tokens, the streaming reward (and reference)
actors' busy time and KV use, and how much of their prefill overlapped decoding (`oppo/*` metrics)."""

from __future__ import annotations

import time
from collections.abc import Callable

from tqdm import tqdm

from openrlhf_oppo.core import StepReport
from openrlhf_oppo.integrations.runtime.log import get_logger

log = get_logger(__name__)
FORCED_WARN_SHARE = 0.25  # warn when the staleness bounds held the batch for this share of a step or more
FORCED_WARN_EVERY = 50  # ... at most once in this many steps


class StepMeter:
    """Fed by the generator (step boundaries, finished samples) and by the reward
    dispatcher (every acknowledged reward call); read once per step by `metrics`."""

    def __init__(self, scorers: int, clock: Callable[[], float] = time.time, show_progress: bool = True,
                 name: str = "scorer", bounds: str = "the staleness bounds") -> None:
        """`scorers`: streaming reward actors (0: rewards are not streamed); `name`: the prefix of
        their metrics (`oppo/scorer_*`, and `oppo/overlap_fraction`); `bounds`: the flags that force
        groups into a batch, as a warning names them."""
        self.scorers = scorers
        self.name = name
        self.bounds = bounds
        self.forced_since: float | None = None  # the open step's batch began to wait only for forced groups
        self.forced_wait_s = 0.0  # the last batch's wait for forced groups only (StepStats.forced_wait_s)
        self.forced_warned_step: int | None = None
        self.others: list[StepMeter] = []  # meters of other streamed scorers, one step's phases with this
        self.clock = clock
        self.started_s = 0.0  # clock() at the open step's start
        self.gen_s = 0.0  # generation+scoring phase of the open step
        self.generated_tokens = 0  # decoded in that phase
        # response tokens whose reward prefill finished before / not before their sample finished
        self.overlap_tokens = [0, 0]
        self.finished_s: dict[int, float] = {}  # sample id -> when its engine finished it
        # sample id -> [(prefill end, tokens)] acknowledged before the driver saw it finish
        self.prefilled_early: dict[int, list[tuple[float, int]]] = {}
        self.scorer_busy: list[tuple[float, float]] = []  # acknowledged reward calls' (start, end)
        # actor index -> (most KV tokens held after a call this step, after its latest call)
        self.scorer_kv_tokens: dict[int, tuple[int, int]] = {}
        self.scorer_kv_budget_tokens = 0  # summed over actors, from their replies
        # actor index -> its latest (evictions, reprefilled tokens, OOM retries), counted since it started
        self.scorer_counters: dict[int, tuple[int, int, int]] = {}
        self.scorer_step_counts = [0, 0, 0]  # the same, summed over actors, this step
        # prompt + response tokens the engines prefill again this step: samples decoding on
        # after a sleep, an aborted request or a restart
        self.reprefilled_tokens = 0
        self.progress = tqdm(desc="OPPO", unit="step", dynamic_ncols=True, disable=not show_progress)

    def plan(self, total_steps: int | None, done: int = 0) -> None:
        """The progress bar's total (OpenRLHF's global steps of the run: with it, tqdm shows the ETA)
        and the steps done before this start (a resumed run's checkpoint)."""
        self.progress.total = total_steps or None
        self.progress.n = self.progress.last_print_n = self.progress.initial = done  # the rate counts this start's
        self.progress.refresh()

    # ------------------------------------------------------------------ fed during a step

    def add_scorer(self, name: str, scorers: int) -> StepMeter:
        """A meter for another streamed scorer's `scorers` actors, read with this one's step
        (`oppo/{name}_*` metrics, `oppo/{name}_overlap_fraction`)."""
        other = StepMeter(scorers, self.clock, show_progress=False, name=name)
        self.others.append(other)
        return other

    def start_step(self) -> None:
        if not self.progress.disable and not self.started_s:  # the first step: the bar's clock, rate and ETA
            self.progress.start_t = self.progress.last_print_t = self.progress._time()  # start now, not at the load
        self.started_s = self.clock()
        self.overlap_tokens = [0, 0]
        self.reprefilled_tokens = 0
        for other in self.others:
            other.overlap_tokens = [0, 0]

    def end_generation(self, generated_tokens: int) -> None:
        self.gen_s = self.clock() - self.started_s
        self.generated_tokens = generated_tokens

    def waiting(self, only_forced: bool) -> None:
        """Polled while the batch is not taken; `only_forced` (`OverlapScheduler.waiting_on_forced`): B groups
        are complete and the batch waits only for groups the staleness bounds force into it."""
        if only_forced and self.forced_since is None:
            self.forced_since = self.clock()

    def batch_taken(self) -> None:
        since, self.forced_since = self.forced_since, None
        self.forced_wait_s = 0.0 if since is None else self.clock() - since

    def on_finished(self, sample_id: int, time_s: float) -> None:
        """Its engine finished the sample at `time_s`: judge the prefills acknowledged before."""
        self.finished_s[sample_id] = time_s
        for end_s, n in self.prefilled_early.pop(sample_id, ()):
            self.overlap_tokens[0 if end_s <= time_s else 1] += n
        for other in self.others:
            other.on_finished(sample_id, time_s)

    def on_final_tokens(self, tokens: int) -> None:
        """Tokens sent with their sample's final chunk: prefilled with it, not overlapped."""
        self.overlap_tokens[1] += tokens

    def on_reply(self, actor: int, reply, ahead: dict[int, int]) -> None:
        """An acknowledged scorer call (`scorer.ScoreReply`); `ahead`: sample id -> tokens it
        prefilled ahead of the sample's final chunk."""
        self.scorer_busy.append((reply.start_s, reply.end_s))
        step_max, _ = self.scorer_kv_tokens.get(actor, (0, 0))
        self.scorer_kv_tokens[actor] = (max(step_max, reply.kv_tokens), reply.kv_tokens)
        self.scorer_kv_budget_tokens = reply.kv_budget_tokens * self.scorers
        now = (reply.evictions, reply.reprefilled_tokens, reply.oom_retries)
        before = self.scorer_counters.get(actor, (0, 0, 0))
        restarted = any(n < b for n, b in zip(now, before))  # a restarted actor counts from 0
        for i, (n, b) in enumerate(zip(now, before)):
            self.scorer_step_counts[i] += n if restarted else n - b
        self.scorer_counters[actor] = now
        for sid, n in ahead.items():  # overlapped: the prefill was done before the sample was
            if sid in self.finished_s:
                self.overlap_tokens[0 if reply.end_s <= self.finished_s[sid] else 1] += n
            else:  # its end is not known yet: judged when it is
                self.prefilled_early.setdefault(sid, []).append((reply.end_s, n))

    # ------------------------------------------------------------------ read at the step's end

    def metrics(self, report: StepReport, policy_version: int, scorer_restarts: int,
                aborted_requests: int, engines_paused_s: float = 0.0) -> dict[str, float]:
        """The step's `oppo/*` metrics; rolls the per-step scorer-actor figures over. `engines_paused_s`: seconds
        the engines sat paused (for a weight sync, or held from the batch) in pauses that ended since the last call."""
        before, at_end = self.overlap_tokens
        metrics = {
            **report.metrics(),
            "oppo/generated_tokens": float(self.generated_tokens),
            "oppo/policy_version": float(policy_version),
            "oppo/overlap_fraction": before / max(before + at_end, 1),
            "oppo/scorer_restarts": float(scorer_restarts),
            "oppo/aborted_requests": float(aborted_requests),
            "oppo/reprefilled_tokens": float(self.reprefilled_tokens),
            "oppo/engines_paused_s": float(engines_paused_s),
        }
        if self.scorers:
            metrics.update(self._scorer_metrics(self.started_s, self.gen_s))
        for other in self.others:
            before, at_end = other.overlap_tokens
            metrics[f"oppo/{other.name}_overlap_fraction"] = before / max(before + at_end, 1)
            metrics.update(other._scorer_metrics(self.started_s, self.gen_s))
        return metrics

    def _scorer_metrics(self, start: float, gen_s: float) -> dict[str, float]:
        # calls acknowledged by now; busy time summed over actors, clipped to the phase
        end = start + gen_s
        prefix = f"oppo/{self.name}_"
        busy = sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.scorer_busy)
        out = {prefix + "idle_fraction": 1.0 - min(1.0, busy / max(gen_s * self.scorers, 1e-9))}
        self.scorer_busy = [(a, b) for a, b in self.scorer_busy if b > end]
        # KV tokens held: each actor's most after a call this step, summed; an actor without a
        # reply this step still holds what it held after its latest call
        out[prefix + "kv_tokens"] = float(sum(m for m, _ in self.scorer_kv_tokens.values()))
        out[prefix + "kv_budget_tokens"] = float(self.scorer_kv_budget_tokens)
        self.scorer_kv_tokens = {idx: (last, last) for idx, (_, last) in self.scorer_kv_tokens.items()}
        # eviction thrash shows here: re-prefilled tokens near the prefilled ones mean the budget
        # holds fewer tokens than the sequences in flight (chunks arrive round-robin: LRU's worst case)
        evictions, reprefilled, oom_retries = self.scorer_step_counts
        out[prefix + "evictions"] = float(evictions)
        out[prefix + "reprefilled_tokens"] = float(reprefilled)
        out[prefix + "oom_retries"] = float(oom_retries)
        self.scorer_step_counts = [0, 0, 0]
        return out

    def forget(self, sample_ids: list[int]) -> None:
        """Trained samples: nothing of them is measured again."""
        for sid in sample_ids:
            self.finished_s.pop(sid, None)
        for other in self.others:
            other.forget(sample_ids)

    def show(self, report: StepReport, mean_reward: float, response_tokens: list[int]) -> None:
        """One progress line: the trained batch's mean reward and response length, Δ, C, the
        deferred share and the step's time; a warning when the staleness bounds held the batch long."""
        step_s = self.clock() - self.started_s
        self.progress.set_postfix(  # drawn by the update: one line a step in a log
            reward=f"{mean_reward:.3f}", len=f"{sum(response_tokens) / max(len(response_tokens), 1):.0f}",
            delta=report.delta, C=report.chunk_size_tokens,
            deferred=f"{report.deferred_fraction:.0%}", step_s=f"{step_s:.1f}", refresh=False,
        )
        self.progress.update()
        last = self.forced_warned_step
        if report.forced_wait_s >= FORCED_WARN_SHARE * step_s > 0 and (
                last is None or report.step - last >= FORCED_WARN_EVERY):
            self.forced_warned_step = report.step
            log.warning("OPPO step %d: the batch waited %.1f s of the step's %.1f s only for the %d group(s) that "
                        "%s forced into it, responses decoding for longer than the bound lets a group be carried. A "
                        "looser bound lets them decode over more steps, with older tokens (oppo/forced_wait_s, "
                        "oppo/lag_tokens/*)", report.step, report.forced_wait_s, step_s, report.forced_groups,
                        self.bounds)
