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

import math
from array import array
from functools import lru_cache
from itertools import islice
from typing import Any, Iterable, Sequence

from openrlhf_oppo.config import OppoConfig
from openrlhf_oppo.core import checkpoint
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

# Builds a NamedTuple message from a tuple without the Python-level ``__new__`` frame;
# tens of thousands are made per step.
_new_tuple = tuple.__new__


class _Sample:
    """Mutable state of one sample; internal to the scheduler.

    Two GC-tracked objects per sample (this record and ``token_chunks``; scorer acks
    live in flat per-scorer dicts, version runs in shared tuples): a step admits
    thousands of samples, and each new container brings the cyclic GC's next pass
    nearer, and every pass walks all held containers again (token deltas are arrays: not walked).
    """

    __slots__ = (
        "sample_id",
        "group",
        "token_chunks",
        "logprob_chunks",
        "version_runs",
        "version",
        "num_tokens",
        "cut",
        "done_mask",
        "finish_reason",
    )

    def __init__(self, sample_id: int, group: "_Group") -> None:
        self.sample_id = sample_id
        self.group = group
        self.token_chunks: list[Sequence[int]] = []  # the engine deltas (arrays), as handed over
        # None while no on_tokens event carried logprobs (then every entry would be empty)
        self.logprob_chunks: list[Sequence[float]] | None = None
        # (first token offset, policy version) runs; a tuple, shared between samples while equal
        self.version_runs: tuple[tuple[int, int], ...] = ()
        self.version: int | None = None  # policy version of the last run
        self.num_tokens = 0
        self.cut = 0  # tokens already handed to scorers as chunks
        self.done_mask = 0  # per scorer bit: acknowledged the final chunk
        self.finish_reason: str | None = None


class _Group:
    __slots__ = ("group_id", "prompt_index", "admitted_step", "deferrals", "sample_ids", "pending")

    def __init__(self, group_id: int, prompt_index: int, admitted_step: int, sample_ids: tuple[int, ...]) -> None:
        self.group_id = group_id
        self.prompt_index = prompt_index
        self.admitted_step = admitted_step
        self.deferrals = 0
        self.sample_ids = sample_ids
        self.pending = len(sample_ids)  # samples not yet complete


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
        # per scorer: sample id -> response tokens acknowledged (flat dicts, not a list per sample);
        # every in-flight sample has an entry
        self._scored: tuple[dict[int, int], ...] = tuple({} for _ in self.scorers)
        self._first_run: tuple[tuple[int, int], ...] = ()  # ((0, v),) for the latest v, shared by samples
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
        self._step_batch_groups = batch_groups  # B, or fewer for a pass's last batch (begin_step)
        self._needs_restream = False
        self._ledger = array("q")  # checkpoint.LEDGER_FIELDS per trained group
        # cumulative statistics
        self.admitted_groups_total = 0
        self.trained_groups_total = 0
        self.trained_tokens_total = 0
        self.offpolicy_tokens_total = 0
        self.deferral_hist_total = {b: 0 for b in DEFERRAL_BUCKETS}

    # ------------------------------------------------------------------ step phases

    def begin_step(self, step: int, admit_until: int | None = None) -> StepPlan:
        """Start ``step``: admit groups up to B + Δ and fix C for this step.

        ``admit_until``: admit only prompt positions below it (the end of a pass over the
        prompts: OpenRLHF trains every prompt of an episode before the next one starts).
        When the groups in flight then number fewer than B, the step's batch is all of
        them: the pass's last, short batch, as OpenRLHF's last batch of an episode."""
        if type(step) is not int:
            raise TypeError(f"step must be an int, got {step!r}")
        if admit_until is not None and (type(admit_until) is not int or admit_until < 0):
            raise ValueError(f"admit_until must be an int >= 0 or None, got {admit_until!r}")
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
        count = max(0, target - len(self._groups))
        if admit_until is not None:
            count = min(count, max(0, admit_until - self._next_prompt_index))
        admit = self._admit(step, count)
        self._admitted_this_step = len(admit)
        self._step_batch_groups = min(self.batch_groups, len(self._groups))
        max_deferrals = self.config.staleness.max_deferral_steps
        self._must_finish = frozenset(g.group_id for g in self._groups.values() if g.deferrals >= max_deferrals)
        restream: tuple[ChunkReady, ...] = ()
        if self._needs_restream:
            restream = tuple(self._restream_chunks())
            self._needs_restream = False
        return StepPlan(
            step=step,
            admit=admit,
            chunk_size_tokens=self._chunk_size,
            delta=self._step_delta,
            must_finish=tuple(sorted(self._must_finish)),
            carried=carried,
            restream=restream,
        )

    def _admit(self, step: int, count: int) -> tuple[AdmitGroup, ...]:
        n = self.samples_per_group
        groups, samples, scored = self._groups, self._samples, self._scored
        admit = []
        for _ in range(count):
            gid, prompt_index = self._next_group_id, self._next_prompt_index
            self._next_group_id += 1
            self._next_prompt_index += 1
            sample_ids = tuple(range(gid * n, gid * n + n))
            group = _Group(gid, prompt_index, step, sample_ids)
            for sid in sample_ids:
                samples[sid] = _Sample(sid, group)
                for acked in scored:
                    acked[sid] = 0
            groups[gid] = group
            admit.append(_new_tuple(AdmitGroup, (gid, prompt_index, sample_ids)))
        self.admitted_groups_total += count
        return tuple(admit)

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
        (one engine delta each): it keeps them without copying and the caller must not
        mutate them afterwards. Hand ``array("i")`` / ``array("d")`` (as the rollout
        actors do), not lists: the scheduler holds millions of token ids between
        steps, and every pass of Python's cyclic GC walks each list item again, while
        arrays are not GC-tracked. With lists, GC pauses cost more than the scheduler.
        """
        outputs = outputs if isinstance(outputs, (list, tuple)) else list(outputs)
        _check_version(policy_version)
        samples = self._samples
        found: list[_Sample] = []  # the entries' samples, in order
        add_found, int_codes = found.append, _INT_CODES
        sample_id = None
        try:  # validate every entry before recording any: a rejected call changes nothing
            for sample_id, token_ids, logprobs in outputs:
                s = samples[sample_id]  # a subscript, not .get(): an unknown id is reported below
                if (
                    s.finish_reason is not None
                    or (logprobs is not None and len(logprobs) != len(token_ids))
                    or (s.version is not None and policy_version < s.version)
                    or type(token_ids) is not array
                    or token_ids.typecode not in int_codes
                ):
                    _check_delta(s, token_ids, logprobs, policy_version)  # raises, or accepts a list of ints
                add_found(s)
        except KeyError:
            if sample_id not in samples:
                raise self._unknown(sample_id) from None
            raise
        # 0: no chunks before the final one (not streaming, or a restream after a
        # checkpoint load is due: it re-sends every held token with the step's C)
        c = self._chunk_size if self._stream and not self._needs_restream else 0
        ready: list[ChunkReady] = []
        add_ready, new_tuple, chunk_ready = ready.append, _new_tuple, ChunkReady  # locals: hot loop
        for s, (sample_id, token_ids, logprobs) in zip(found, outputs):
            k = len(token_ids)
            if k == 0:
                continue
            if s.version != policy_version:
                self._start_version_run(s, policy_version)
            s.token_chunks.append(token_ids)
            if logprobs is not None or s.logprob_chunks is not None:
                self._add_logprobs(s, logprobs)
            n = s.num_tokens = s.num_tokens + k
            cut = s.cut
            if c and n - cut >= c:
                while n - cut >= c:
                    add_ready(new_tuple(chunk_ready, (sample_id, cut, cut + c, False)))
                    cut += c
                s.cut = cut
        return ready

    @staticmethod
    def _add_logprobs(s: _Sample, logprobs: Sequence[float] | None) -> None:
        """Logprobs for the token chunk just appended; the list is made at the first recorded ones."""
        lps = s.logprob_chunks
        if lps is None:
            lps = s.logprob_chunks = [()] * (len(s.token_chunks) - 1)
        lps.append(logprobs if logprobs is not None else ())

    def _start_version_run(self, s: _Sample, version: int) -> None:
        if s.version_runs:
            s.version_runs += ((s.num_tokens, version),)
        else:
            if not self._first_run or self._first_run[0][1] != version:
                self._first_run = ((0, version),)
            s.version_runs = self._first_run
        s.version = version

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
        if self._needs_restream:  # the next plan's restream sends the final chunk
            return []
        final = _new_tuple(ChunkReady, (sample_id, s.cut, s.num_tokens, True))
        s.cut = s.num_tokens
        return [final]

    def on_scored(self, sample_id: int, scorer: str, upto_token: int, final: bool = False) -> None:
        """A scorer has prefilled the sample's response tokens ``[0, upto_token)``;
        ``final``: it processed the final chunk too (the score is ready)."""
        self._ack(scorer, ((sample_id, 0, upto_token, final),))

    def on_scored_many(self, scorer: str, chunks: Iterable[ChunkReady]) -> None:
        """A scorer has processed these chunks (one batched forward), each sample's in order."""
        self._ack(scorer, chunks)

    def _ack(self, scorer: str, acks: Iterable[ChunkReady] | Iterable[tuple[int, int, int, bool]]) -> None:
        idx = self._scorer_index.get(scorer)
        if idx is None:
            raise ValueError(f"unknown scorer {scorer!r}; this scheduler's scorers are {self.scorers}")
        acks = acks if isinstance(acks, (list, tuple)) else list(acks)
        samples = self._samples
        scored = self._scored[idx]
        upto: dict[int, int] = {}  # acknowledged so far, this call's earlier entries included
        sample_id = None
        try:  # validate every entry before applying any: a rejected call changes nothing
            for sample_id, start, end, final in acks:
                s = samples[sample_id]
                before = upto.get(sample_id, scored[sample_id])
                if not start <= before <= end <= s.cut:
                    raise ValueError(
                        f"sample {sample_id}: {scorer} acknowledged [{start}, {end}), but [0, {s.cut}) was sent "
                        f"and [0, {before}) acknowledged; a sample's chunks are acknowledged in order"
                    )
                if final and (s.finish_reason is None or end != s.num_tokens):
                    raise ValueError(
                        f"sample {sample_id}: {scorer} acknowledged a final chunk ending at {end}, "
                        f"but the sample has not finished at that token"
                    )
                upto[sample_id] = end
        except KeyError:
            if sample_id not in samples:
                raise self._unknown(sample_id) from None
            raise
        bit = 1 << idx
        for sample_id, _, end, final in acks:
            scored[sample_id] = end
            s = samples[sample_id]
            if final and not s.done_mask & bit:
                s.done_mask |= bit
                if s.done_mask == self._all_done:
                    self._sample_complete(s)

    def rescore(self, scorer: str, sample_ids: Iterable[int]) -> list[ChunkReady]:
        """A scorer lost its state (its actor restarted): forget what it acknowledged for
        these held samples and return one chunk per sample re-sending every token cut so
        far (final if the sample finished). Completion waits for the scorer again."""
        idx = self._scorer_index.get(scorer)
        if idx is None:
            raise ValueError(f"unknown scorer {scorer!r}; this scheduler's scorers are {self.scorers}")
        chosen = [self._sample(sid) for sid in dict.fromkeys(sample_ids)]  # validates every id first
        bit, scored, chunks = 1 << idx, self._scored[idx], []
        for s in chosen:
            scored[s.sample_id] = 0
            if s.done_mask & bit:
                if s.done_mask == self._all_done:  # complete no more
                    g = s.group
                    g.pending += 1
                    self._complete.pop(g.group_id, None)
                s.done_mask &= ~bit
            if s.finish_reason is not None or s.cut:
                chunks.append(_new_tuple(ChunkReady, (s.sample_id, 0, s.cut, s.finish_reason is not None)))
        return chunks

    def take_batch(self) -> TrainBatch | None:
        """The step's training batch once B groups are complete (and every forced group); else None.
        (Fewer than B when a pass ends with fewer in flight: `begin_step`'s ``admit_until``.)

        Returns a batch at most once per step.
        """
        if self._step is None:
            raise RuntimeError("take_batch outside a step; call begin_step first")
        if self._batch is not None:
            return None
        complete = self._complete
        size = self._step_batch_groups
        if size == 0 or len(complete) < size or any(g not in complete for g in self._must_finish):
            return None
        forced = self._must_finish
        chosen = [g for g in complete if g in forced] if forced else []
        chosen += islice((g for g in complete if g not in forced), size - len(chosen))
        self._batch = self._build_batch(chosen)
        return self._batch

    def end_step(self, stats: StepStats) -> StepReport:
        """Close the step: count what is carried, feed the controllers."""
        if self._step is None:
            raise RuntimeError("end_step without begin_step")
        batch = self._batch
        if batch is None:
            raise RuntimeError(f"end_step({self._step}) before a batch was taken; the step is not done")
        _check_stats(stats, self._step)
        step = self._step
        samples = self._samples
        carried_tokens = sum(samples[sid].num_tokens for g in self._groups.values() for sid in g.sample_ids)
        for g in self._groups.values():
            g.deferrals += 1
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
        samples, scored = self._samples, self._scored
        groups = []
        tokens = offpolicy = 0
        for gid in group_ids:
            g = self._groups.pop(gid)
            del self._complete[gid]
            trained = []
            for sid in g.sample_ids:
                s = samples.pop(sid)
                for acked in scored:
                    del acked[sid]
                n = s.num_tokens
                runs = s.version_runs
                tokens += n
                if len(runs) == 1:
                    offpolicy += n if runs[0][1] < step else 0
                else:
                    offpolicy += _tokens_below_version(runs, n, step)
                lps = s.logprob_chunks
                if lps is None:
                    lps = _no_logprobs(len(s.token_chunks))
                # the sample leaves the scheduler here: hand its lists over, no copy
                trained.append(_new_tuple(TrainSample, (sid, gid, s.finish_reason, s.token_chunks, lps, runs)))
            groups.append(_new_tuple(TrainGroup, (gid, g.prompt_index, g.admitted_step, g.deferrals, tuple(trained))))
            self._ledger.extend((gid, g.prompt_index, g.admitted_step, step, g.deferrals))
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

    @property
    def oldest_prompt_index(self) -> int:
        """The lowest prompt position still in flight (`next_prompt_index` when none is)."""
        return min((g.prompt_index for g in self._groups.values()), default=self._next_prompt_index)

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
        return self._groups[group_id].sample_ids

    def is_finished(self, sample_id: int) -> bool:
        return self._sample(sample_id).finish_reason is not None

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state between steps: carried groups (tokens, logprobs,
        policy versions), controllers, data position, counters and the ledger of
        trained groups (`openrlhf_oppo.core.checkpoint`)."""
        if self._step is not None:
            raise RuntimeError("state_dict inside a step; checkpoint between end_step and begin_step")
        return checkpoint.dump(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint, whole or not at all; a Δ or C this run's flags forbid
        is clamped with a logged notice. Scorer caches do not survive a restart: the
        next plan's ``restream`` re-sends every held token, and completion waits for
        the scorers again."""
        checkpoint.restore(self, state)

    @property
    def ledger(self) -> list[tuple[int, ...]]:
        """One row per trained group: (group id, prompt index, admitted step, trained step, deferrals)."""
        rows, w = self._ledger, len(checkpoint.LEDGER_FIELDS)
        return [tuple(rows[i : i + w]) for i in range(0, len(rows), w)]


_INT_CODES = frozenset("bBhHiIlLqQ")  # array typecodes of integers


def _check_version(version: Any) -> None:
    if type(version) is not int or version < 0:
        raise TypeError(f"policy_version must be an int >= 0 (weight syncs so far), got {version!r}")


def _check_delta(s: "_Sample", token_ids: Sequence[int], logprobs: Sequence[float] | None, version: int) -> None:
    """The slow path of `on_tokens_many`'s check: raise for a bad delta; a list of ints passes."""
    sid = s.sample_id
    if s.finish_reason is not None:
        raise ValueError(f"sample {sid}: tokens after on_finished")
    if logprobs is not None and len(logprobs) != len(token_ids):
        raise ValueError(f"sample {sid}: {len(token_ids)} tokens but {len(logprobs)} logprobs")
    if s.version is not None and version < s.version:
        raise ValueError(f"sample {sid}: policy_version went back from {s.version} to {version}")
    if not (type(token_ids) is array and token_ids.typecode in _INT_CODES) and not all(type(t) is int for t in token_ids):
        raise TypeError(f"sample {sid}: token ids must be ints, got {list(token_ids)[:8]!r}")


def _check_stats(stats: StepStats, step: int) -> None:
    if not isinstance(stats, StepStats):
        raise TypeError(f"end_step({step}) takes a StepStats, got {type(stats).__name__}")
    if not math.isfinite(stats.mean_reward):
        raise ValueError(f"step {step}: the batch's mean reward is {stats.mean_reward}; refusing to adapt Δ on it")
    if type(stats.generated_tokens) is not int or stats.generated_tokens < 0:
        raise ValueError(f"step {step}: generated_tokens must be an int >= 0, got {stats.generated_tokens!r}")
    if not (math.isfinite(stats.generation_time_s) and stats.generation_time_s >= 0):
        raise ValueError(f"step {step}: generation_time_s must be finite and >= 0, got {stats.generation_time_s!r}")


@lru_cache(maxsize=256)
def _no_logprobs(num_chunks: int) -> tuple[tuple[()], ...]:
    """Logprob chunks of a sample that recorded none: one empty entry per token chunk,
    shared between samples (immutable) rather than a list per sample."""
    return ((),) * num_chunks


def _tokens_below_version(runs: Sequence[tuple[int, int]], num_tokens: int, version: int) -> int:
    count = 0
    for i, (start, v) in enumerate(runs):
        if v < version:
            end = runs[i + 1][0] if i + 1 < len(runs) else num_tokens
            count += end - start
    return count
