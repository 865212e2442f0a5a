"""Input checks of the scheduler's calls and of a checkpoint's fields.

Each check raises (``ValueError``, ``TypeError`` or ``RuntimeError``, with the message a
user sees) and changes nothing: the scheduler validates a whole call before it records
any of it (docs/design.md section 3, "all or nothing").
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import Any

from openrlhf_oppo.config import OppoConfig
from openrlhf_oppo.core.records import Sample
from openrlhf_oppo.core.types import FINISH_REASONS, StepStats

INT_CODES = frozenset("bBhHiIlLqQ")  # array typecodes of integers


def check_setup(config: OppoConfig, batch_groups: int, samples_per_group: int, scorers: tuple[str, ...]) -> None:
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
    if len(set(scorers)) != len(scorers):
        raise ValueError(f"scorer names must be distinct, got {scorers}")


def check_begin(step: Any, admit_until: Any, open_step: int | None, last_step: int) -> None:
    if type(step) is not int:
        raise TypeError(f"step must be an int, got {step!r}")
    if admit_until is not None and (type(admit_until) is not int or admit_until < 0):
        raise ValueError(f"admit_until must be an int >= 0 or None, got {admit_until!r}")
    if open_step is not None:
        raise RuntimeError(f"begin_step({step}) while step {open_step} is open; call end_step first")
    if step <= last_step:
        raise ValueError(f"step must increase: got {step} after {last_step}")


def unknown_sample(sample_id: int) -> ValueError:
    return ValueError(f"unknown sample_id {sample_id} (never admitted, or already trained)")


def unknown_scorer(scorer: str, scorers: tuple[str, ...]) -> ValueError:
    return ValueError(f"unknown scorer {scorer!r}; this scheduler's scorers are {scorers}")


def check_version(version: Any) -> None:
    if type(version) is not int or version < 0:
        raise TypeError(f"policy_version must be an int >= 0 (weight syncs so far), got {version!r}")


def check_delta(s: Sample, token_ids: Sequence[int], logprobs: Sequence[float] | None, version: int) -> None:
    """The slow path of `on_tokens_many`'s check: raise for a bad delta; a list of ints passes."""
    sid = s.sample_id
    if s.finish_reason is not None:
        raise ValueError(f"sample {sid}: tokens after on_finished")
    if logprobs is not None and len(logprobs) != len(token_ids):
        raise ValueError(f"sample {sid}: {len(token_ids)} tokens but {len(logprobs)} logprobs")
    if s.version is not None and version < s.version:
        raise ValueError(f"sample {sid}: policy_version went back from {s.version} to {version}")
    int_array = type(token_ids) is array and token_ids.typecode in INT_CODES
    if not int_array and not all(type(t) is int for t in token_ids):
        raise TypeError(f"sample {sid}: token ids must be ints, got {list(token_ids)[:8]!r}")


def check_outputs(samples: dict[int, Sample], outputs: Sequence[tuple], version: Any) -> list[Sample]:
    """`on_tokens_many`'s entries ``(sample_id, token_ids, logprobs)``: their samples, in
    order, once every entry passed (a fast test per entry; `check_delta` names the fault)."""
    check_version(version)
    found: list[Sample] = []
    # locals: the loop below runs once an engine delta
    add_found = found.append
    int_codes = INT_CODES
    sample_id = None
    try:
        for sample_id, token_ids, logprobs in outputs:
            s = samples[sample_id]  # a subscript, not .get(): an unknown id is reported below
            if (
                s.finish_reason is not None
                or (logprobs is not None and len(logprobs) != len(token_ids))
                or (s.version is not None and version < s.version)
                or type(token_ids) is not array
                or token_ids.typecode not in int_codes
            ):
                check_delta(s, token_ids, logprobs, version)  # raises, or accepts a list of ints
            add_found(s)
    except KeyError:
        if sample_id not in samples:
            raise unknown_sample(sample_id) from None
        raise
    return found


def check_finish(s: Sample, reason: Any) -> None:
    """`on_finished`'s checks: raise for a sample finished already or an unknown reason."""
    if s.finish_reason is not None:
        raise ValueError(f"sample {s.sample_id}: on_finished called twice")
    if reason not in FINISH_REASONS:
        raise ValueError(f"sample {s.sample_id}: finish reason must be one of {FINISH_REASONS}, got {reason!r}")


def check_acks(samples: dict[int, Sample], scored: dict[int, int], scorer: str, bit: int,
               acks: Sequence[Sequence]) -> None:
    """A scorer's acknowledgements ``(sample_id, start, end, final, ...)``: each sample's in
    order, within what was sent, final only at the sample's last token and only once every
    chunk sent before the final one was acknowledged (``bit``: the scorer's bit in
    `Sample.resent_mask`)."""
    upto: dict[int, int] = {}  # acknowledged so far, this call's earlier entries included
    sample_id = None
    try:
        for ack in acks:  # a ChunkReady or a plain 4-tuple: indexed (unpacking would need one length)
            sample_id = ack[0]
            start = ack[1]
            end = ack[2]
            s = samples[sample_id]
            before = upto.get(sample_id, scored[sample_id])
            if not start <= before <= end <= s.cut:
                raise ValueError(
                    f"sample {sample_id}: {scorer} acknowledged [{start}, {end}), but [0, {s.cut}) was sent "
                    f"and [0, {before}) acknowledged; a sample's chunks are acknowledged in order"
                )
            if ack[3] and (s.finish_reason is None or end != s.num_tokens):
                raise ValueError(
                    f"sample {sample_id}: {scorer} acknowledged a final chunk ending at {end}, "
                    f"but the sample has not finished at that token"
                )
            if ack[3] and before < s.final_start and not s.resent_mask & bit:
                # an ack of [0, end) (on_scored) starts at 0 whatever was sent: it must not skip chunks
                raise ValueError(
                    f"sample {sample_id}: {scorer} acknowledged the final chunk with [0, {before}) acknowledged, "
                    f"but [0, {s.final_start}) was sent before it; a sample's chunks are acknowledged in order"
                )
            upto[sample_id] = end
    except KeyError:
        if sample_id not in samples:
            raise unknown_sample(sample_id) from None
        raise


def check_stats(stats: StepStats, step: int) -> None:
    if not isinstance(stats, StepStats):
        raise TypeError(f"end_step({step}) takes a StepStats, got {type(stats).__name__}")
    if stats.mean_reward is not None and not math.isfinite(stats.mean_reward):
        raise ValueError(f"step {step}: the batch's mean reward is {stats.mean_reward}; refusing to adapt Δ on it")
    if type(stats.generated_tokens) is not int or stats.generated_tokens < 0:
        raise ValueError(f"step {step}: generated_tokens must be an int >= 0, got {stats.generated_tokens!r}")
    if not (math.isfinite(stats.generation_time_s) and stats.generation_time_s >= 0):
        raise ValueError(f"step {step}: generation_time_s must be finite and >= 0, got {stats.generation_time_s!r}")
    if not (math.isfinite(stats.forced_wait_s) and 0 <= stats.forced_wait_s):
        raise ValueError(f"step {step}: forced_wait_s must be finite and >= 0, got {stats.forced_wait_s!r}")


def check_int(value: Any, what: str, low: int = 0) -> int:
    """A checkpoint field that must be an int >= ``low``."""
    if type(value) is not int or value < low:
        raise ValueError(f"{what} must be an int >= {low}, got {value!r}")
    return value


def check_ints(values: Any, what: str) -> list[int]:
    """A checkpoint field that must be a list of ints."""
    values = list(values)
    if not all(type(v) is int for v in values):
        raise ValueError(f"{what} must be ints, got {[v for v in values if type(v) is not int][:4]!r}")
    return values
