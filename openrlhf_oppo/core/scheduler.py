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

from collections.abc import Iterable, Sequence
from typing import Any

from openrlhf_oppo.config import OppoConfig
from openrlhf_oppo.core import checkpoint, validate
from openrlhf_oppo.core.batch import batch_members, deferral_histogram, forced_groups, held_by_forced, take_groups
from openrlhf_oppo.core.chunks import resend_chunks, restream_chunks, token_slice
from openrlhf_oppo.core.controllers import ChunkSizeController, DeltaController
from openrlhf_oppo.core.ledger import LEDGER_FIELDS
from openrlhf_oppo.core.records import InFlight, Sample
from openrlhf_oppo.core.types import FINISH_REASONS, ChunkReady, StepPlan, StepReport, StepStats, TrainBatch

# Builds a NamedTuple message from a tuple without the Python-level ``__new__`` frame;
# tens of thousands are made per step.
_new_tuple = tuple.__new__


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
    State kept between steps lives in one `InFlight` record (``core/records.py``),
    which `state_dict` / `load_state_dict` hand to ``core/checkpoint.py``.
    """

    def __init__(
        self,
        config: OppoConfig,
        batch_groups: int,
        samples_per_group: int,
        scorers: Sequence[str] | None = None,
    ) -> None:
        self.scorers: tuple[str, ...] = tuple(config.streaming.scorers() if scorers is None else scorers)
        validate.check_setup(config, batch_groups, samples_per_group, self.scorers)
        self.config = config
        self.batch_groups = batch_groups
        self.samples_per_group = samples_per_group
        self._setup = checkpoint.Setup(batch_groups, samples_per_group, self.scorers)  # what a checkpoint must match
        self._scorer_index = {name: i for i, name in enumerate(self.scorers)}
        self._all_done = (1 << len(self.scorers)) - 1
        self._stream = config.streaming.enable and bool(self.scorers)
        self.delta = DeltaController(config.delta, batch_groups)
        self.chunk = ChunkSizeController(config.chunk)
        self._flight = InFlight(len(self.scorers))
        self._first_run: tuple[tuple[int, int], ...] = ()  # ((0, v),) for the latest v, shared by samples
        # the open step (None between steps) and what was fixed for it at begin_step
        self._step: int | None = None
        self._chunk_size = self.chunk.value
        self._step_delta = self.delta.value
        self._must_finish: frozenset[int] = frozenset()
        self._batch: TrainBatch | None = None
        self._admitted_this_step = 0
        self._step_batch_groups = batch_groups  # B, or fewer for a pass's last batch (begin_step)

    # ------------------------------------------------------------------ step phases

    def begin_step(self, step: int, admit_until: int | None = None) -> StepPlan:
        """Start ``step``: admit groups up to B + Δ and fix C for this step.

        ``admit_until``: admit only prompt positions below it (the end of a pass over the
        prompts: OpenRLHF trains every prompt of an episode before the next one starts).
        When the groups in flight then number fewer than B, the step's batch is all of
        them: the pass's last, short batch, as OpenRLHF's last batch of an episode."""
        flight = self._flight
        validate.check_begin(step, admit_until, self._step, flight.last_step)
        self._step = step
        self._batch = None
        self._chunk_size = self.chunk.value
        self._step_delta = self.delta.value
        carried = tuple(flight.groups)
        count = max(0, self.batch_groups + self._step_delta - len(flight.groups))
        if admit_until is not None:
            count = min(count, max(0, admit_until - flight.next_prompt_index))
        admit = flight.admit(step, count, self.samples_per_group)
        self._admitted_this_step = len(admit)
        self._step_batch_groups = min(self.batch_groups, len(flight.groups))
        self._must_finish = forced_groups(flight, step, self.config.staleness)
        restream = restream_chunks(flight, self._chunk_size, self._stream) if flight.needs_restream else ()
        return StepPlan(
            step=step,
            admit=admit,
            chunk_size_tokens=self._chunk_size,
            delta=self._step_delta,
            must_finish=tuple(sorted(self._must_finish)),
            carried=carried,
            restream=restream,
        )

    def on_tokens(self, sample_id: int, token_ids: Sequence[int], logprobs: Sequence[float] | None = None,
                  policy_version: int = 0) -> list[ChunkReady]:
        """Record newly generated tokens; return the chunks that became ready (full C-token chunks)."""
        return self.on_tokens_many(((sample_id, token_ids, logprobs),), policy_version)

    def on_tokens_many(self, outputs: Iterable[tuple[int, Sequence[int], Sequence[float] | None]],
                       policy_version: int) -> list[ChunkReady]:
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
        # every entry is checked before any is recorded: a rejected call changes nothing
        found = validate.check_outputs(self._flight.samples, outputs, policy_version)
        # 0: no chunks before the final one (not streaming, or a restream after a
        # checkpoint load is due: it re-sends every held token with the step's C)
        c = self._chunk_size if self._stream and not self._flight.needs_restream else 0
        ready: list[ChunkReady] = []
        # locals: the loop below runs once an engine delta
        add_ready = ready.append
        new_tuple = _new_tuple
        chunk_ready = ChunkReady
        for s, (sample_id, token_ids, logprobs) in zip(found, outputs, strict=True):
            k = len(token_ids)
            if k == 0:
                continue
            if s.version != policy_version:
                self._start_version_run(s, policy_version)
            s.token_chunks.append(token_ids)
            if logprobs is not None or s.logprob_chunks is not None:
                s.add_logprobs(logprobs)
            s.num_tokens += k
            n = s.num_tokens
            cut = s.cut
            if c and n - cut >= c:
                base = n - k  # offset of this delta's first token
                while n - cut >= c:
                    # its tokens: this very delta (no copy), a slice of it, or a join with older ones
                    if cut >= base:
                        toks = token_ids if c == k else token_ids[cut - base : cut - base + c]
                    else:
                        toks = token_slice(s.token_chunks, n, cut, cut + c)
                    add_ready(new_tuple(chunk_ready, (sample_id, cut, cut + c, False, toks)))
                    cut += c
                s.cut = cut
        return ready

    def _start_version_run(self, s: Sample, version: int) -> None:
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
        if s.finish_reason is not None or reason not in FINISH_REASONS:
            validate.check_finish(s, reason)  # raises
        s.finish_reason = reason
        if not self.scorers:
            self._flight.sample_complete(s)
            return []
        if self._flight.needs_restream:  # the next plan's restream sends the final chunk
            return []
        n = s.num_tokens
        cut = s.cut
        chunks = s.token_chunks
        if chunks and len(chunks[-1]) == n - cut:
            toks = chunks[-1]  # most often the final chunk is the last delta, whole (no copy)
        else:
            toks = token_slice(chunks, n, cut, n)
        s.final_start = cut
        s.cut = n
        return [_new_tuple(ChunkReady, (sample_id, cut, n, True, toks))]

    def on_scored(self, sample_id: int, scorer: str, upto_token: int, final: bool = False) -> None:
        """A scorer has prefilled the sample's response tokens ``[0, upto_token)``;
        ``final``: it processed the final chunk too (the score is ready), which it may
        say only once it has acknowledged every chunk cut before the final one."""
        self._ack(scorer, ((sample_id, 0, upto_token, final),))

    def on_scored_many(self, scorer: str, chunks: Iterable[ChunkReady]) -> None:
        """A scorer has processed these chunks (one batched forward), each sample's in order."""
        self._ack(scorer, chunks)

    def _ack(self, scorer: str, acks: Iterable[ChunkReady] | Iterable[tuple[int, int, int, bool]]) -> None:
        idx = self._scorer_idx(scorer)
        acks = acks if isinstance(acks, (list, tuple)) else list(acks)
        samples = self._flight.samples
        scored = self._flight.scored[idx]
        bit = 1 << idx
        validate.check_acks(samples, scored, scorer, bit, acks)  # every entry before applying any
        all_done = self._all_done
        for ack in acks:  # a ChunkReady or a plain (sample_id, start, end, final)
            sample_id = ack[0]
            scored[sample_id] = ack[2]
            if ack[3]:
                s = samples[sample_id]
                if not s.done_mask & bit:
                    s.done_mask |= bit
                    if s.done_mask == all_done:
                        self._flight.sample_complete(s)

    def rescore(self, scorer: str, sample_ids: Iterable[int]) -> list[ChunkReady]:
        """A scorer lost its state (its actor restarted): forget what it acknowledged for
        these held samples and return one chunk per sample re-sending every token cut so
        far (final if the sample finished). Completion waits for the scorer again."""
        idx = self._scorer_idx(scorer)
        chosen = [self._sample(sid) for sid in dict.fromkeys(sample_ids)]  # validates every id first
        return resend_chunks(self._flight, idx, self._all_done, chosen)

    def take_batch(self) -> TrainBatch | None:
        """The step's training batch once B groups are complete (and every forced group); else None.
        (Fewer than B when a pass ends with fewer in flight: `begin_step`'s ``admit_until``.)

        Returns a batch at most once per step.
        """
        if self._step is None:
            raise RuntimeError("take_batch outside a step; call begin_step first")
        if self._batch is not None:
            return None
        complete = self._flight.complete
        size = self._step_batch_groups
        if size == 0 or len(complete) < size or any(g not in complete for g in self._must_finish):
            return None
        chosen = batch_members(self._flight, self._must_finish, size)
        self._batch = take_groups(self._flight, chosen, self._step, self.config.staleness.keep_kv_cache)
        return self._batch

    @property
    def waiting_on_forced(self) -> bool:
        """The open step's batch waits only for groups the staleness bounds force into it (`StepPlan.must_finish`):
        without them it would be taken now. A driver times this as `StepStats.forced_wait_s`."""
        if self._step is None or self._batch is not None:
            return False
        return held_by_forced(self._flight, self._must_finish, self._step_batch_groups)

    def committed_groups(self) -> list[int]:
        """Complete groups this step's batch will hold, before it can be taken (what experience
        making may forward ahead of `take_batch`); empty outside a step or once it is taken. A
        scorer restart can make a group incomplete again (`rescore`)."""
        if self._step is None or self._batch is not None:
            return []
        return batch_members(self._flight, self._must_finish, self._step_batch_groups)

    def end_step(self, stats: StepStats) -> StepReport:
        """Close the step: count what is carried, feed the controllers."""
        if self._step is None:
            raise RuntimeError("end_step without begin_step")
        batch = self._batch
        if batch is None:
            raise RuntimeError(f"end_step({self._step}) before a batch was taken; the step is not done")
        validate.check_stats(stats, self._step)
        step = self._step
        flight = self._flight
        carried_tokens = sum(flight.samples[sid].num_tokens for g in flight.groups.values() for sid in g.sample_ids)
        for g in flight.groups.values():
            g.deferrals += 1
        hist = deferral_histogram(batch)
        for b, count in hist.items():
            flight.deferral_hist_total[b] += count
        trained = len(batch.groups)
        # (longest response, truncated at the cap): what the system Δ rule reads
        lengths = [(max(s.num_tokens for s in g.samples), any(s.finish_reason == "length" for s in g.samples))
                   for g in batch.groups]
        if self._stream:
            next_chunk_size = self.chunk.update(stats.generated_tokens, stats.generation_time_s)
        else:
            next_chunk_size = self._chunk_size
        report = StepReport(
            step=step,
            delta=self._step_delta,
            next_delta=self.delta.update(stats.mean_reward, lengths),
            chunk_size_tokens=self._chunk_size,
            next_chunk_size_tokens=next_chunk_size,
            trained_groups=trained,
            admitted_groups=self._admitted_this_step,
            carried_groups=tuple(flight.groups),
            carried_tokens=carried_tokens,
            deferred_fraction=(trained - hist["0"]) / trained,
            deferral_hist=hist,
            offpolicy_token_fraction=batch.offpolicy_token_fraction,
            lag_tokens=batch.lag_tokens,
            max_lag=batch.max_lag,
            stale_kv_token_fraction=batch.stale_kv_tokens / batch.tokens if batch.tokens else 0.0,
            forced_groups=len(self._must_finish),
            forced_wait_s=stats.forced_wait_s,
        )
        flight.last_step = step
        self._step = None
        return report

    # --------------------------------------------------------------------- helpers

    def _scorer_idx(self, scorer: str) -> int:
        idx = self._scorer_index.get(scorer)
        if idx is None:
            raise validate.unknown_scorer(scorer, self.scorers)
        return idx

    def _sample(self, sample_id: int) -> Sample:
        s = self._flight.samples.get(sample_id)
        if s is None:
            raise validate.unknown_sample(sample_id)
        return s

    # ------------------------------------------------------------- introspection

    @property
    def in_flight_groups(self) -> tuple[int, ...]:
        """Group ids admitted and not yet trained (carried or current)."""
        return tuple(self._flight.groups)

    @property
    def next_prompt_index(self) -> int:
        """The prompt position the next admitted group takes."""
        return self._flight.next_prompt_index

    @property
    def oldest_prompt_index(self) -> int:
        """The lowest prompt position still in flight (`next_prompt_index` when none is)."""
        flight = self._flight
        return min((g.prompt_index for g in flight.groups.values()), default=flight.next_prompt_index)

    def held_tokens(self, sample_id: int) -> list[int]:
        """Response tokens held for an in-flight sample (e.g. to resubmit after an abort)."""
        s = self._sample(sample_id)
        return [t for chunk in s.token_chunks for t in chunk]

    def group_of(self, sample_id: int) -> int:
        return self._sample(sample_id).group.group_id

    def group_sample_ids(self, group_id: int) -> tuple[int, ...]:
        return self._flight.groups[group_id].sample_ids

    def is_finished(self, sample_id: int) -> bool:
        return self._sample(sample_id).finish_reason is not None

    # cumulative statistics, checkpoints included

    @property
    def admitted_groups_total(self) -> int:
        return self._flight.admitted_groups_total

    @property
    def trained_groups_total(self) -> int:
        return self._flight.trained_groups_total

    @property
    def trained_tokens_total(self) -> int:
        return self._flight.trained_tokens_total

    @property
    def offpolicy_tokens_total(self) -> int:
        return self._flight.offpolicy_tokens_total

    @property
    def deferral_hist_total(self) -> dict[str, int]:
        """Trained groups per deferral bucket."""
        return self._flight.deferral_hist_total

    @property
    def ledger(self) -> list[tuple[int, ...]]:
        """One row per trained group: (group id, prompt index, admitted step, trained step, deferrals)."""
        rows = self._flight.ledger
        width = len(LEDGER_FIELDS)
        return [tuple(rows[i : i + width]) for i in range(0, len(rows), width)]

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state between steps: carried groups (tokens, logprobs,
        policy versions), controllers, data position, counters and the ledger of
        trained groups (`openrlhf_oppo.core.checkpoint`). Also inside a step whose batch
        is not taken yet (async admission: the next step begins as the trainer takes a
        batch): its admitted groups are then held as carried, and a resumed run begins
        that step again, admitting only what is missing."""
        if self._step is not None and self._batch is not None:
            raise RuntimeError("state_dict after take_batch; checkpoint after end_step")
        return checkpoint.dump(self._flight, self.delta, self.chunk, self._setup)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint, whole or not at all; a Δ or C this run's flags forbid
        is clamped with a logged notice. Scorer caches do not survive a restart: the
        next plan's ``restream`` re-sends every held token, and completion waits for
        the scorers again."""
        checkpoint.check_header(state, self._setup)
        if self._step is not None or self._flight.groups or self._flight.last_step >= 0:
            raise RuntimeError("load_state_dict on a scheduler that already ran; build a fresh one")
        # load builds new objects (or raises): the scheduler changes only here, and entirely
        self._flight, self.delta, self.chunk = checkpoint.load(state, self._setup, self.config)
        self._chunk_size = self.chunk.value
        self._step_delta = self.delta.value
