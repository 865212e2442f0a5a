"""OverlapScheduler: every OPPO decision, as events in and plans out.

A step, as a driver runs it::

    plan = sched.begin_step(step)               # admit new groups up to B + Δ; chunk size C
    for each engine event:                      # generation and streamed scoring interleave
        chunks = sched.on_tokens(sid, toks, logprobs, policy_version)   # -> chunks to prefill
        chunks = sched.on_finished(sid, reason)                         # -> the final chunk
        sched.on_scored(sid, scorer, upto_token)
        batch = sched.take_batch()              # first B complete groups (once per step)
    report = sched.end_step(StepStats(...))     # carry the rest, adapt Δ and C

Timeline of a step with B=4, Δ=2 (paper Figure 1); ``=`` decoding, ``|`` finished:

    sync PPO   g0 ====|          OPPO   g0 ====|
               g1 ==|                   g1 ==|
               g2 ========|             g2 ======== ... carried into step t+1
               g3 =====|                g3 =====|
                          train         g4 ===|
                                        g5 ==|   train on g1 g5 g4 g0 (first 4 finished)

A group is *complete* when all its n samples finished and every scorer
acknowledged the last token of each. Only complete groups are trained, in the
order they completed, except that groups carried ``max_deferral_steps`` times are
taken first and the batch waits for them. Everything else in flight is carried,
tokens and all. With Δ=0 and no scorers streaming, each step admits B groups and
trains exactly those B: synchronous PPO.

Stdlib only: no torch, ray, vllm or deepspeed.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from openrlhf_oppo.config import OppoConfig
from openrlhf_oppo.core.controllers import ChunkSizeController, DeltaController
from openrlhf_oppo.core.types import (
    DEFERRAL_BUCKETS,
    FINISH_REASONS,
    AdmitGroup,
    ChunkReady,
    StepPlan,
    StepReport,
    StepStats,
    TrainBatch,
    TrainGroup,
    TrainSample,
    deferral_bucket,
)

STATE_VERSION = 1


class _Sample:
    """Mutable state of one sample; internal to the scheduler."""

    __slots__ = (
        "sample_id",
        "group",
        "token_chunks",
        "logprob_chunks",
        "version_runs",
        "num_tokens",
        "cut",
        "scored",
        "done_mask",
        "finish_reason",
    )

    def __init__(self, sample_id: int, group: "_Group", num_scorers: int) -> None:
        self.sample_id = sample_id
        self.group = group
        self.token_chunks: list[tuple[int, ...]] = []
        self.logprob_chunks: list[tuple[float, ...]] = []
        self.version_runs: list[tuple[int, int]] = []  # (first token offset, policy version)
        self.num_tokens = 0
        self.cut = 0  # tokens already handed to scorers as chunks
        self.scored = [0] * num_scorers  # per scorer: tokens acknowledged
        self.done_mask = 0  # per scorer bit: acknowledged the final chunk
        self.finish_reason: str | None = None


class _Group:
    __slots__ = ("group_id", "prompt_index", "admitted_step", "deferrals", "samples", "pending")

    def __init__(self, group_id: int, prompt_index: int, admitted_step: int) -> None:
        self.group_id = group_id
        self.prompt_index = prompt_index
        self.admitted_step = admitted_step
        self.deferrals = 0
        self.samples: list[_Sample] = []
        self.pending = 0  # samples not yet complete


class OverlapScheduler:
    """Decides admission, chunking, batch formation and carry-over for OPPO.

    Args:
        config: OPPO settings (Δ, C, staleness, streaming).
        batch_groups: B, prompt groups trained per step (OpenRLHF's rollout batch size).
        samples_per_group: n, samples per prompt (``n_samples_per_prompt``).
        scorers: names of the scorers that must see every token before training
            (e.g. ``("reward", "reference")``). Empty: a sample is complete when it
            finishes. Defaults to the scorers enabled in ``config.streaming``.

    Policy versions: the weights trained in step ``s`` produce version ``s + 1``;
    a token in a batch taken at step ``s`` is off-policy if its version is below ``s``.
    """

    def __init__(
        self,
        config: OppoConfig,
        batch_groups: int,
        samples_per_group: int,
        scorers: Sequence[str] | None = None,
    ) -> None:
        if batch_groups < 1:
            raise ValueError(f"rollout batch size (prompt groups) must be >= 1, got {batch_groups}")
        if samples_per_group < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {samples_per_group}")
        if config.delta.enable and config.delta.max > batch_groups:
            # Carried groups number at most Δ; with Δ <= B every group forced by
            # max_deferral_steps fits in the next batch.
            raise ValueError(
                f"--oppo.delta.max must be <= the rollout batch size ({batch_groups} prompt groups), "
                f"got {config.delta.max}"
            )
        self.config = config
        self.batch_groups = batch_groups
        self.samples_per_group = samples_per_group
        self.scorers: tuple[str, ...] = tuple(config.streaming.scorers() if scorers is None else scorers)
        if len(set(self.scorers)) != len(self.scorers):
            raise ValueError(f"scorer names must be distinct, got {self.scorers}")
        self._scorer_index = {name: i for i, name in enumerate(self.scorers)}
        self._all_done = (1 << len(self.scorers)) - 1
        self._stream = config.streaming.enable and bool(self.scorers)
        self.delta = DeltaController(config.delta)
        self.chunk = ChunkSizeController(config.chunk)

        self._groups: dict[int, _Group] = {}  # in flight: admitted, not yet trained
        self._samples: dict[int, _Sample] = {}
        self._complete: dict[int, None] = {}  # group ids in completion order (insertion-ordered)
        self._next_group_id = 0
        self._next_prompt_index = 0
        self._step: int | None = None  # step in progress
        self._last_step = -1
        self._chunk_size = self.chunk.value
        self._step_delta = self.delta.value
        self._must_finish: frozenset[int] = frozenset()
        self._batch: TrainBatch | None = None
        self._admitted_this_step = 0
        self._needs_restream = False
        # cumulative statistics
        self.admitted_groups_total = 0
        self.trained_groups_total = 0
        self.trained_tokens_total = 0
        self.offpolicy_tokens_total = 0
        self.deferral_hist_total = {b: 0 for b in DEFERRAL_BUCKETS}

    # ------------------------------------------------------------------ step phases

    def begin_step(self, step: int) -> StepPlan:
        """Start ``step``: admit groups up to B + Δ and fix C for this step."""
        if self._step is not None:
            raise RuntimeError(f"begin_step({step}) while step {self._step} is open; call end_step first")
        if step <= self._last_step:
            raise ValueError(f"step must increase: got {step} after {self._last_step}")
        self._step = step
        self._batch = None
        self._chunk_size = self.chunk.value
        self._step_delta = self.delta.value
        carried = tuple(self._groups)
        target = self.batch_groups + self._step_delta
        admit = [self._admit(step) for _ in range(max(0, target - len(self._groups)))]
        self._admitted_this_step = len(admit)
        max_deferrals = self.config.staleness.max_deferral_steps
        self._must_finish = frozenset(g.group_id for g in self._groups.values() if g.deferrals >= max_deferrals)
        restream: tuple[ChunkReady, ...] = ()
        if self._needs_restream:
            restream = tuple(self._restream_chunks())
            self._needs_restream = False
        return StepPlan(
            step=step,
            admit=tuple(admit),
            chunk_size_tokens=self._chunk_size,
            delta=self._step_delta,
            must_finish=tuple(sorted(self._must_finish)),
            carried=carried,
            restream=restream,
        )

    def _admit(self, step: int) -> AdmitGroup:
        group = _Group(self._next_group_id, self._next_prompt_index, step)
        self._next_group_id += 1
        self._next_prompt_index += 1
        n = self.samples_per_group
        first = group.group_id * n
        for k in range(n):
            sample = _Sample(first + k, group, len(self.scorers))
            group.samples.append(sample)
            self._samples[sample.sample_id] = sample
        group.pending = n
        self._groups[group.group_id] = group
        self.admitted_groups_total += 1
        return AdmitGroup(group.group_id, group.prompt_index, tuple(range(first, first + n)))

    def on_tokens(
        self,
        sample_id: int,
        token_ids: Sequence[int],
        logprobs: Sequence[float] | None = None,
        policy_version: int = 0,
    ) -> list[ChunkReady]:
        """Record newly generated tokens; return the chunks that became ready (full C-token chunks)."""
        return self.on_tokens_many(((sample_id, token_ids, logprobs),), policy_version)

    def on_tokens_many(
        self,
        outputs: Iterable[tuple[int, Sequence[int], Sequence[float] | None]],
        policy_version: int,
    ) -> list[ChunkReady]:
        """``on_tokens`` for one engine iteration: ``(sample_id, token_ids, logprobs)`` per
        sample, all decoded by weights of ``policy_version``.

        The scheduler takes ownership of the ``token_ids`` and ``logprobs`` sequences
        (vLLM's per-iteration delta lists): it keeps them without copying and the
        caller must not mutate them afterwards. Copying 6M tokens a step costs more
        than the rest of the scheduler, mostly in the garbage collector.
        """
        samples = self._samples
        stream = self._stream
        c = self._chunk_size
        ready: list[ChunkReady] = []
        for sample_id, token_ids, logprobs in outputs:
            s = samples.get(sample_id)
            if s is None:
                raise self._unknown(sample_id)
            if s.finish_reason is not None:
                raise ValueError(f"sample {sample_id}: tokens after on_finished")
            k = len(token_ids)
            if logprobs is not None and len(logprobs) != k:
                raise ValueError(f"sample {sample_id}: {k} tokens but {len(logprobs)} logprobs")
            if k == 0:
                continue
            runs = s.version_runs
            if not runs or runs[-1][1] != policy_version:
                if runs and policy_version < runs[-1][1]:
                    raise ValueError(
                        f"sample {sample_id}: policy_version went back from {runs[-1][1]} to {policy_version}"
                    )
                runs.append((s.num_tokens, policy_version))
            s.token_chunks.append(token_ids)
            s.logprob_chunks.append(logprobs if logprobs is not None else ())
            n = s.num_tokens = s.num_tokens + k
            if stream:
                cut = s.cut
                while n - cut >= c:
                    ready.append(ChunkReady(sample_id, cut, cut + c, False))
                    cut += c
                s.cut = cut
        return ready

    def on_finished(self, sample_id: int, reason: str = "stop") -> list[ChunkReady]:
        """The sample stopped generating; return its final chunk (the whole response when not streaming)."""
        s = self._sample(sample_id)
        if s.finish_reason is not None:
            raise ValueError(f"sample {sample_id}: on_finished called twice")
        if reason not in FINISH_REASONS:
            raise ValueError(f"sample {sample_id}: finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        s.finish_reason = reason
        if not self.scorers:
            self._sample_complete(s)
            return []
        final = ChunkReady(sample_id, s.cut, s.num_tokens, True)
        s.cut = s.num_tokens
        return [final]

    def on_scored(self, sample_id: int, scorer: str, upto_token: int, final: bool = False) -> None:
        """A scorer has prefilled the sample's response tokens ``[0, upto_token)``;
        ``final``: it processed the final chunk too (the score is ready)."""
        self._ack(scorer, ((sample_id, upto_token, final),))

    def on_scored_many(self, scorer: str, chunks: Iterable[ChunkReady]) -> None:
        """A scorer has processed these chunks (one batched forward), each sample's in order."""
        self._ack(scorer, chunks)

    def _ack(self, scorer: str, acks: Iterable[tuple[int, int, bool]] | Iterable[ChunkReady]) -> None:
        idx = self._scorer_index.get(scorer)
        if idx is None:
            raise ValueError(f"unknown scorer {scorer!r}; this scheduler's scorers are {self.scorers}")
        bit = 1 << idx
        samples = self._samples
        for ack in acks:
            # ChunkReady is (sample_id, start, end, final); plain acks are (sample_id, end, final)
            sample_id, upto_token, final = (ack[0], ack[2], ack[3]) if len(ack) == 4 else ack
            s = samples.get(sample_id)
            if s is None:
                raise self._unknown(sample_id)
            scored = s.scored
            if upto_token > s.cut or upto_token < scored[idx]:
                raise ValueError(
                    f"sample {sample_id}: {scorer} scored up to {upto_token}, but only [0, {s.cut}) was sent "
                    f"and {scored[idx]} already acknowledged"
                )
            scored[idx] = upto_token
            if final:
                if s.finish_reason is None or upto_token != s.num_tokens:
                    raise ValueError(
                        f"sample {sample_id}: {scorer} acknowledged a final chunk ending at {upto_token}, "
                        f"but the sample has not finished at that token"
                    )
                if not s.done_mask & bit:
                    s.done_mask |= bit
                    if s.done_mask == self._all_done:
                        self._sample_complete(s)

    def take_batch(self) -> TrainBatch | None:
        """The step's training batch once B groups are complete (and every forced group); else None.

        Returns a batch at most once per step.
        """
        if self._step is None:
            raise RuntimeError("take_batch outside a step; call begin_step first")
        if self._batch is not None:
            return None
        complete = self._complete
        if len(complete) < self.batch_groups or any(g not in complete for g in self._must_finish):
            return None
        chosen = [g for g in complete if g in self._must_finish]
        for g in complete:
            if len(chosen) == self.batch_groups:
                break
            if g not in self._must_finish:
                chosen.append(g)
        self._batch = self._build_batch(chosen)
        return self._batch

    def end_step(self, stats: StepStats) -> StepReport:
        """Close the step: count what is carried, feed the controllers."""
        if self._step is None:
            raise RuntimeError("end_step without begin_step")
        batch = self._batch
        if batch is None:
            raise RuntimeError(f"end_step({self._step}) before a batch was taken; the step is not done")
        step = self._step
        carried_tokens = 0
        for g in self._groups.values():
            g.deferrals += 1
            carried_tokens += sum(s.num_tokens for s in g.samples)
        hist = {b: 0 for b in DEFERRAL_BUCKETS}
        for tg in batch.groups:
            hist[deferral_bucket(tg.deferrals)] += 1
        for b, count in hist.items():
            self.deferral_hist_total[b] += count
        trained = len(batch.groups)
        report = StepReport(
            step=step,
            delta=self._step_delta,
            next_delta=self.delta.update(stats.mean_reward),
            chunk_size_tokens=self._chunk_size,
            next_chunk_size_tokens=self.chunk.update(stats.generated_tokens, stats.generation_time_s)
            if self._stream
            else self._chunk_size,
            trained_groups=trained,
            admitted_groups=self._admitted_this_step,
            carried_groups=tuple(self._groups),
            carried_tokens=carried_tokens,
            deferred_fraction=(trained - hist["0"]) / trained,
            deferral_hist=hist,
            offpolicy_token_fraction=batch.offpolicy_token_fraction,
        )
        self._last_step = step
        self._step = None
        return report

    # --------------------------------------------------------------------- helpers

    def _sample(self, sample_id: int) -> _Sample:
        s = self._samples.get(sample_id)
        if s is None:
            raise self._unknown(sample_id)
        return s

    @staticmethod
    def _unknown(sample_id: int) -> ValueError:
        return ValueError(f"unknown sample_id {sample_id} (never admitted, or already trained)")

    def _sample_complete(self, s: _Sample) -> None:
        g = s.group
        g.pending -= 1
        if g.pending == 0:
            self._complete[g.group_id] = None

    def _build_batch(self, group_ids: list[int]) -> TrainBatch:
        step = self._step
        assert step is not None
        groups = []
        tokens = offpolicy = 0
        for gid in group_ids:
            g = self._groups.pop(gid)
            del self._complete[gid]
            samples = []
            for s in g.samples:
                del self._samples[s.sample_id]
                tokens += s.num_tokens
                offpolicy += _tokens_below_version(s.version_runs, s.num_tokens, step)
                # the sample leaves the scheduler here: hand its lists over, no copy
                samples.append(
                    TrainSample(s.sample_id, gid, s.finish_reason, s.token_chunks, s.logprob_chunks, s.version_runs)
                )
            groups.append(TrainGroup(gid, g.prompt_index, g.admitted_step, g.deferrals, tuple(samples)))
        self.trained_groups_total += len(groups)
        self.trained_tokens_total += tokens
        self.offpolicy_tokens_total += offpolicy
        return TrainBatch(step, tuple(groups), offpolicy / tokens if tokens else 0.0)

    def _restream_chunks(self) -> Iterable[ChunkReady]:
        if not self.scorers:
            return
        c = self._chunk_size
        for s in self._samples.values():
            ends = list(range(c, s.num_tokens + 1, c)) if self._stream else []
            start = 0
            for end in ends:
                yield ChunkReady(s.sample_id, start, end, False)
                start = end
            s.cut = start
            if s.finish_reason is not None:
                yield ChunkReady(s.sample_id, start, s.num_tokens, True)
                s.cut = s.num_tokens

    # ------------------------------------------------------------- introspection

    @property
    def in_flight_groups(self) -> tuple[int, ...]:
        """Group ids admitted and not yet trained (carried or current)."""
        return tuple(self._groups)

    @property
    def next_prompt_index(self) -> int:
        return self._next_prompt_index

    def held_tokens(self, sample_id: int) -> list[int]:
        """Response tokens held for an in-flight sample (e.g. to resubmit after an abort)."""
        s = self._sample(sample_id)
        return [t for chunk in s.token_chunks for t in chunk]

    def response_tokens(self, sample_id: int, start: int, end: int) -> list[int]:
        """Response tokens ``[start, end)`` of an in-flight sample (a chunk's tokens)."""
        out: list[int] = []
        offset = 0
        for chunk in self._sample(sample_id).token_chunks:
            n = len(chunk)
            if offset + n > start and offset < end:
                out.extend(chunk[max(0, start - offset) : end - offset])
            offset += n
            if offset >= end:
                break
        return out

    def group_of(self, sample_id: int) -> int:
        return self._sample(sample_id).group.group_id

    def group_sample_ids(self, group_id: int) -> tuple[int, ...]:
        return tuple(s.sample_id for s in self._groups[group_id].samples)

    def is_finished(self, sample_id: int) -> bool:
        return self._sample(sample_id).finish_reason is not None

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state between steps: carried groups (tokens, logprobs,
        policy versions), controllers, data position and counters."""
        if self._step is not None:
            raise RuntimeError("state_dict inside a step; checkpoint between end_step and begin_step")
        return {
            "version": STATE_VERSION,
            "batch_groups": self.batch_groups,
            "samples_per_group": self.samples_per_group,
            "scorers": list(self.scorers),
            "next_group_id": self._next_group_id,
            "next_prompt_index": self._next_prompt_index,
            "last_step": self._last_step,
            "delta": self.delta.state_dict(),
            "chunk": self.chunk.state_dict(),
            "complete_order": list(self._complete),
            "groups": [
                {
                    "group_id": g.group_id,
                    "prompt_index": g.prompt_index,
                    "admitted_step": g.admitted_step,
                    "deferrals": g.deferrals,
                    "samples": [
                        {
                            "sample_id": s.sample_id,
                            "tokens": [list(c) for c in s.token_chunks],
                            "logprobs": [list(c) for c in s.logprob_chunks],
                            "version_runs": [list(r) for r in s.version_runs],
                            "finish_reason": s.finish_reason,
                        }
                        for s in g.samples
                    ],
                }
                for g in self._groups.values()
            ],
            "totals": {
                "admitted_groups": self.admitted_groups_total,
                "trained_groups": self.trained_groups_total,
                "trained_tokens": self.trained_tokens_total,
                "offpolicy_tokens": self.offpolicy_tokens_total,
                "deferral_hist": dict(self.deferral_hist_total),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint. Scorer caches do not survive a restart: the next
        plan's ``restream`` re-sends every held token, and completion waits for the
        scorers again."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"scheduler checkpoint version {state.get('version')!r}, expected {STATE_VERSION}")
        for key, mine in (
            ("batch_groups", self.batch_groups),
            ("samples_per_group", self.samples_per_group),
            ("scorers", list(self.scorers)),
        ):
            if state[key] != mine:
                raise ValueError(f"checkpoint was written with {key}={state[key]!r}, this run has {mine!r}")
        if self._step is not None or self._groups or self._last_step >= 0:
            raise RuntimeError("load_state_dict on a scheduler that already ran; build a fresh one")
        self._next_group_id = state["next_group_id"]
        self._next_prompt_index = state["next_prompt_index"]
        self._last_step = state["last_step"]
        self.delta.load_state_dict(state["delta"])
        self.chunk.load_state_dict(state["chunk"])
        for gs in state["groups"]:
            g = _Group(gs["group_id"], gs["prompt_index"], gs["admitted_step"])
            g.deferrals = gs["deferrals"]
            for ss in gs["samples"]:
                s = _Sample(ss["sample_id"], g, len(self.scorers))
                s.token_chunks = [tuple(c) for c in ss["tokens"]]
                s.logprob_chunks = [tuple(c) for c in ss["logprobs"]]
                s.version_runs = [(int(a), int(b)) for a, b in ss["version_runs"]]
                s.num_tokens = sum(len(c) for c in s.token_chunks)
                s.finish_reason = ss["finish_reason"]
                g.samples.append(s)
                self._samples[s.sample_id] = s
            g.pending = len(g.samples)
            self._groups[g.group_id] = g
            if not self.scorers:
                for s in g.samples:
                    if s.finish_reason is not None:
                        self._sample_complete(s)
        if not self.scorers:
            # keep the completion order the run had
            order = [gid for gid in state["complete_order"] if gid in self._complete]
            self._complete = dict.fromkeys(order)
        self._needs_restream = bool(self._groups) and bool(self.scorers)
        totals = state["totals"]
        self.admitted_groups_total = totals["admitted_groups"]
        self.trained_groups_total = totals["trained_groups"]
        self.trained_tokens_total = totals["trained_tokens"]
        self.offpolicy_tokens_total = totals["offpolicy_tokens"]
        self.deferral_hist_total = dict(totals["deferral_hist"])


def _tokens_below_version(runs: list[tuple[int, int]], num_tokens: int, version: int) -> int:
    count = 0
    for i, (start, v) in enumerate(runs):
        if v < version:
            end = runs[i + 1][0] if i + 1 < len(runs) else num_tokens
            count += end - start
    return count
