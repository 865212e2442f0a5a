"""Chunks re-sent to scorers, and the token slices every `ChunkReady` carries.

Chunks cut while tokens stream in are made in the scheduler's hot loop
(`OverlapScheduler.on_tokens_many`); the ones here re-send what a scorer lost: all
held tokens after a checkpoint load (`restream_chunks`), or one scorer's share after
its actor restarted (`resend_chunks`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from openrlhf_oppo.core.records import InFlight, Sample
from openrlhf_oppo.core.types import ChunkReady

# Builds a NamedTuple message from a tuple without the Python-level ``__new__`` frame.
_new_tuple = tuple.__new__


def restream_chunks(flight: InFlight, chunk_size_tokens: int, stream: bool) -> tuple[ChunkReady, ...]:
    """Every held token again, cut in ``chunk_size_tokens`` chunks when ``stream`` (else one
    final chunk per finished sample): fresh scorers after a checkpoint load. The restream
    is then done: ``flight.needs_restream`` is cleared."""
    flight.needs_restream = False
    flight.restored_complete_order = []
    out = []
    for s in flight.samples.values():
        n = s.num_tokens
        toks = joined_tokens(s.token_chunks)
        start = 0
        ends = range(chunk_size_tokens, n + 1, chunk_size_tokens) if stream else ()
        for end in ends:
            out.append(_new_tuple(ChunkReady, (s.sample_id, start, end, False, toks[start:end])))
            start = end
        s.cut = start
        s.resent_mask = 0  # every scorer is fresh: each gets these chunks
        if s.finish_reason is not None:
            out.append(_new_tuple(ChunkReady, (s.sample_id, start, n, True, toks[start:n])))
            s.final_start = start
            s.cut = n
    return tuple(out)


def resend_chunks(flight: InFlight, scorer_index: int, all_done: int, chosen: Iterable[Sample]) -> list[ChunkReady]:
    """Forget what scorer ``scorer_index`` acknowledged for ``chosen`` (validated) samples;
    one chunk per sample re-sends every token cut so far (final if it finished)."""
    bit = 1 << scorer_index
    scored = flight.scored[scorer_index]
    chunks = []
    for s in chosen:
        scored[s.sample_id] = 0
        if s.done_mask & bit:
            if s.done_mask == all_done:  # complete no more
                g = s.group
                g.pending += 1
                flight.complete.pop(g.group_id, None)
            s.done_mask &= ~bit
        if s.finish_reason is not None:
            s.resent_mask |= bit  # this scorer's final chunk is now the whole response
        if s.finish_reason is not None or s.cut:
            toks = token_slice(s.token_chunks, s.num_tokens, 0, s.cut)
            chunks.append(_new_tuple(ChunkReady, (s.sample_id, 0, s.cut, s.finish_reason is not None, toks)))
    return chunks


def token_slice(chunks: list[Sequence[int]], num_tokens: int, start: int, end: int) -> Sequence[int]:
    """Response tokens ``[start, end)`` of a sample holding ``chunks`` (``num_tokens`` in all):
    the delta itself when the range is exactly one, else a copy in the deltas' own container
    (an array slice is one memcpy).

    Walks back from the newest delta: a chunk is cut from the newest tokens, so it
    reads one or two deltas however long the sample is."""
    i = len(chunks) - 1
    if i < 0:
        return ()
    offset = num_tokens - len(chunks[i])  # first token of delta i
    while offset > start:
        i -= 1
        offset -= len(chunks[i])
    piece = chunks[i]
    pos = offset + len(piece)
    if start == offset and end == pos:
        return piece  # exactly one delta: shared, not copied (read-only, as every chunk's tokens)
    out = piece[start - offset : end - offset]
    while pos < end:
        i += 1
        piece = chunks[i]
        out = _extend(out, piece[: end - pos])
        pos += len(piece)
    return out


def joined_tokens(chunks: list[Sequence[int]]) -> Sequence[int]:
    """All of a sample's response tokens in one sequence (for re-sending a whole response)."""
    if not chunks:
        return ()
    out = chunks[0][:]
    for piece in chunks[1:]:
        out = _extend(out, piece)
    return out


def _extend(out: Any, piece: Sequence[int]) -> Any:
    try:
        out += piece  # array += array of its typecode, list += any sequence
    except TypeError:  # deltas of mixed containers (an array and a list): fall back to a list
        out = list(out)
        out += piece
    return out
