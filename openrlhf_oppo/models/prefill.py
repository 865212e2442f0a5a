"""Incremental, batched prefill of a transformers decoder with a per-sequence KV cache.

This is the engine under the three streaming scorers (`streaming.py`). It owns
the recorded tokens of every open sequence, their KV caches, the KV budget with
LRU eviction and transparent re-prefill, and the batched forward.

The batched forward's padded inputs and stacked KV cache (right-aligned pasts,
one contiguous slice per sequence) are built in `padded_batch.py`.

Written against transformers 5.15.0: models built on the generic decoder
(`Qwen2Model`, `LlamaModel`, ...) with full attention on every layer.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from openrlhf_oppo.footprint import kv_shape
from openrlhf_oppo.models.device_memory import OutOfMemoryError, release_device_memory
from openrlhf_oppo.models.padded_batch import padded_inputs, stacked_cache


class UnknownSequenceError(KeyError):
    """`seq_id` was never opened, or was dropped (or reset away)."""

    def __str__(self) -> str:  # KeyError would repr() the message, quotes and all
        return str(self.args[0]) if self.args else super().__str__()


class SequenceStateError(RuntimeError):
    """The call is illegal in the sequence's state (open twice, extend after finish)."""


class TokenIdError(ValueError):
    """A token id is not an integer in `[0, vocab_size)`."""


@dataclass(frozen=True)
class PrefillStats:
    """Counters of one engine since it was built (all monotone except `cached_tokens`)."""

    forward_calls: int  # batched model forwards (micro-batches)
    prefilled_tokens: int  # tokens run through the model, re-prefills included
    evictions: int  # sequences whose KV cache was dropped to honour the budget
    reprefilled_tokens: int  # tokens computed again because their cache was evicted
    cached_tokens: int  # tokens held in KV caches right now
    open_sequences: int  # opened and neither finished nor dropped
    oom_retries: int = 0  # forwards run again after a device out-of-memory (caches evicted first)


@dataclass(frozen=True)
class Forwarded:
    """Final hidden states one `advance` call produced for one sequence.

    `hidden[k]` is the hidden state at token position `first_pos + k`; the rows
    end at the sequence's last recorded token. `prev_hidden` is the hidden state
    at `first_pos - 1` when an earlier call computed it (None at position -1).
    """

    first_pos: int
    hidden: torch.Tensor  # (n, H) final-norm hidden states, n >= 0
    prev_hidden: torch.Tensor | None  # (H,)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Hidden states of positions `[start, end)`; `start` may be `first_pos - 1`."""
        if start >= end:
            return self.hidden[:0]
        if start >= self.first_pos:
            return self.hidden[start - self.first_pos : end - self.first_pos]
        if start != self.first_pos - 1 or self.prev_hidden is None:
            raise AssertionError(f"positions [{start}, {end}) not available from {self.first_pos}")
        tail = self.hidden[: end - self.first_pos]
        return torch.cat([self.prev_hidden.unsqueeze(0), tail], dim=0)


@dataclass
class _Sequence:
    """Mutable engine state of one sequence (internal, never handed out)."""

    token_ids: list[int]  # every recorded token, prompt first
    prompt_len_tokens: int
    cached_len_tokens: int = 0  # leading tokens whose K/V are in `kv`
    # every layer's keys and values: (layers, 2, kv_heads, cached_len_tokens, head_dim); None when empty
    kv: torch.Tensor | None = None
    # hidden state at position cached_len_tokens - 1 (kept across eviction:
    # it depends only on the tokens, so a re-prefill would give it again)
    last_hidden: torch.Tensor | None = None
    last_hidden_pos: int = -1
    last_used_tick: int = 0
    finished: bool = False
    evicted_len_tokens: int = 0  # cached tokens lost to the last eviction


def _check_backbone_config(backbone: nn.Module) -> None:
    layer_types = getattr(backbone.config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise NotImplementedError(
            "streaming prefill supports full-attention layers only; "
            f"this model has layer_types={sorted(set(layer_types))}"
        )


class PrefillEngine:
    """Per-sequence KV caches, a token budget with LRU eviction, batched incremental forward.

    Args:
        backbone: a transformers base decoder (`Qwen2Model`, `LlamaModel`, ...)
            returning `last_hidden_state`; it must be in eval mode.
        kv_budget_tokens: most tokens kept in KV caches between calls (None:
            unbounded). Over it, the least recently advanced sequences lose
            their cache and are re-prefilled from their recorded tokens when
            next advanced.
        max_batch_tokens: most padded tokens (`batch * (L + N)`) in one forward;
            bounds activation memory and padding waste.
    """

    def __init__(self, backbone: nn.Module, kv_budget_tokens: int | None = None, max_batch_tokens: int = 32768):
        if kv_budget_tokens is not None and kv_budget_tokens < 1:
            raise ValueError(f"kv_budget_tokens must be None or >= 1, got {kv_budget_tokens}")
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if backbone.training:
            raise ValueError("the scored model is in training mode (dropout on): call model.eval() first")
        _check_backbone_config(backbone)
        self.backbone = backbone
        self._kv_shape = kv_shape(backbone.config)
        self.kv_budget_tokens = kv_budget_tokens
        self.max_batch_tokens = max_batch_tokens
        self.vocab_size = backbone.get_input_embeddings().num_embeddings
        self._seqs: dict[int, _Sequence] = {}
        self._tick = 0
        self._cached_tokens = 0
        self._forward_calls = 0
        self._prefilled_tokens = 0
        self._evictions = 0
        self._reprefilled_tokens = 0
        self._oom_retries = 0
        # Filled by reset(): a seq_id then reports *why* it is unknown.
        self.unknown_hint = ""

    # ---- bookkeeping -------------------------------------------------------------

    def stats(self) -> PrefillStats:
        return PrefillStats(
            forward_calls=self._forward_calls,
            prefilled_tokens=self._prefilled_tokens,
            evictions=self._evictions,
            reprefilled_tokens=self._reprefilled_tokens,
            cached_tokens=self._cached_tokens,
            open_sequences=sum(not s.finished for s in self._seqs.values()),
            oom_retries=self._oom_retries,
        )

    @property
    def cached_tokens(self) -> int:
        """Tokens held in KV caches right now (a counter: no walk over the sequences)."""
        return self._cached_tokens

    def seq_len_tokens(self, seq_id: int) -> int:
        return len(self._get(seq_id).token_ids)

    def prompt_len_tokens(self, seq_id: int) -> int:
        return self._get(seq_id).prompt_len_tokens

    def token_ids(self, seq_id: int) -> list[int]:
        return self._get(seq_id).token_ids

    def _get(self, seq_id: int) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"unknown seq_id {seq_id!r}: never opened or already dropped{self.unknown_hint}")
        return seq

    def _check_tokens(self, seq_id: int, token_ids: Iterable[int], what: str) -> list[int]:
        if isinstance(token_ids, (str, bytes, torch.Tensor)):
            raise TokenIdError(
                f"seq_id {seq_id}: {what} must be a list of int token ids, got {type(token_ids).__name__}"
            )
        out = []
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TokenIdError(f"seq_id {seq_id}: {what} holds {t!r} ({type(t).__name__}), not an int token id")
            t = int(t)
            if not 0 <= t < self.vocab_size:
                raise TokenIdError(
                    f"seq_id {seq_id}: token id {t} in {what} is outside the vocabulary [0, {self.vocab_size})"
                )
            out.append(t)
        return out

    # ---- sequence life cycle ------------------------------------------------------

    def open(self, seq_id: int, prompt_ids: list[int]) -> None:
        if seq_id in self._seqs:
            state = "finished (drop it first)" if self._seqs[seq_id].finished else "open"
            raise SequenceStateError(f"seq_id {seq_id} is already {state}; open() twice is not allowed")
        prompt = self._check_tokens(seq_id, prompt_ids, "prompt_ids")
        if not prompt:
            raise ValueError(f"seq_id {seq_id}: prompt_ids is empty; the first response token needs a context")
        # The prompt is prefilled lazily, with the first chunk, so it joins a batch.
        self._seqs[seq_id] = _Sequence(token_ids=prompt, prompt_len_tokens=len(prompt))

    def check_extendable(self, seq_id: int, token_ids: list[int]) -> list[int]:
        seq = self._get(seq_id)
        if seq.finished:
            raise SequenceStateError(f"seq_id {seq_id} is finished; extend/finish after finish is not allowed")
        return self._check_tokens(seq_id, token_ids, "token_ids")

    def mark_finished(self, seq_id: int) -> None:
        seq = self._get(seq_id)
        seq.finished = True
        self._free(seq)

    def drop(self, seq_id: int) -> None:
        seq = self._get(seq_id)
        self._free(seq)
        del self._seqs[seq_id]

    def drop_all(self) -> None:
        for seq in self._seqs.values():
            self._free(seq)
        self._seqs.clear()

    def _free(self, seq: _Sequence) -> None:
        self._cached_tokens -= seq.cached_len_tokens
        seq.kv = None
        seq.cached_len_tokens = 0

    # ---- the forward --------------------------------------------------------------

    def advance(self, updates: dict[int, list[int]], finishing: bool = False) -> dict[int, Forwarded]:
        """Append each sequence's (already validated) tokens and prefill everything uncached.

        One call is one "tick" for LRU purposes. Sequences with nothing uncached
        cost no forward. With `finishing`, the sequences are marked finished and
        their caches freed right after their forward (not counted as evictions).
        """
        self._tick += 1
        results: dict[int, Forwarded] = {}
        prev: dict[int, tuple[torch.Tensor | None, int]] = {}
        todo: list[int] = []
        for seq_id, tokens in updates.items():
            seq = self._seqs[seq_id]
            seq.token_ids.extend(tokens)
            seq.last_used_tick = self._tick
            prev[seq_id] = (seq.last_hidden, seq.last_hidden_pos)
            if seq.cached_len_tokens < len(seq.token_ids):
                todo.append(seq_id)
            else:
                empty = seq.last_hidden.new_empty(0, seq.last_hidden.shape[-1])
                results[seq_id] = Forwarded(len(seq.token_ids), empty, seq.last_hidden)
        for group in self._micro_batches(todo):
            self._make_room(group)
            hidden = self._forward_or_evict_and_retry(group)
            for seq_id, h in zip(group, hidden, strict=True):
                seq = self._seqs[seq_id]
                first_pos = seq.cached_len_tokens - h.shape[0]
                prev_hidden, prev_pos = prev[seq_id]
                results[seq_id] = Forwarded(first_pos, h, prev_hidden if prev_pos == first_pos - 1 else None)
            if finishing:
                for seq_id in group:
                    self.mark_finished(seq_id)
            self._enforce_budget()
        if finishing:
            for seq_id in updates:
                self.mark_finished(seq_id)
        return results

    def _micro_batches(self, seq_ids: list[int]) -> list[list[int]]:
        # Sorting by cached length keeps similar pasts together: less padding.
        order = sorted(seq_ids, key=lambda s: (self._seqs[s].cached_len_tokens, len(self._seqs[s].token_ids)))
        groups: list[list[int]] = []
        cur: list[int] = []
        max_past = max_new = 0
        for seq_id in order:
            seq = self._seqs[seq_id]
            past = seq.cached_len_tokens
            new = len(seq.token_ids) - past
            # a micro-batch pads each sequence to its longest past and its longest new tokens
            if cur and (len(cur) + 1) * (max(max_past, past) + max(max_new, new)) > self.max_batch_tokens:
                groups.append(cur)
                cur = []
                max_past = max_new = 0
            cur.append(seq_id)
            max_past = max(max_past, past)
            max_new = max(max_new, new)
        if cur:
            groups.append(cur)
        return groups

    def _evict(self, seq: _Sequence) -> None:
        seq.evicted_len_tokens = max(seq.evicted_len_tokens, seq.cached_len_tokens)
        self._free(seq)
        self._evictions += 1

    def _lru(self, exclude: set[int]) -> list[_Sequence]:
        cands = [
            (s.last_used_tick, sid, s) for sid, s in self._seqs.items() if s.cached_len_tokens and sid not in exclude
        ]
        return [s for _, _, s in sorted(cands, key=lambda c: (c[0], c[1]))]

    def _make_room(self, group: list[int]) -> None:
        """Before a forward: evict other sequences so the group's caches fit the budget."""
        if self.kv_budget_tokens is None:
            return
        members = set(group)
        growth = sum(len(self._seqs[s].token_ids) - self._seqs[s].cached_len_tokens for s in group)
        for seq in self._lru(members):
            if self._cached_tokens + growth <= self.kv_budget_tokens:
                break
            self._evict(seq)

    def _enforce_budget(self) -> None:
        if self.kv_budget_tokens is None:
            return
        for seq in self._lru(set()):
            if self._cached_tokens <= self.kv_budget_tokens:
                break
            self._evict(seq)

    def _forward_or_evict_and_retry(self, group: list[int], keep: frozenset[int] = frozenset()) -> list[torch.Tensor]:
        """`_forward_group`, and on a device out-of-memory (the budget is a token count; the
        device may be shared): evict every cache outside `keep` (the caller's whole group, whose
        results are being assembled), release the allocator's blocks and run again, in halves
        if needed. A lone sequence that still does not fit re-raises. `_forward_group` commits
        nothing before its forward and copies succeed: a retry is exact."""
        keep = keep or frozenset(group)
        try:
            return self._forward_group([self._seqs[s] for s in group])
        except OutOfMemoryError:
            if len(group) == 1 and not self._lru(set(keep)):
                raise
        self._oom_retries += 1
        for seq in self._lru(set(keep)):
            self._evict(seq)
        release_device_memory()
        if len(group) == 1:
            return self._forward_or_evict_and_retry(group, keep)
        half = len(group) // 2
        first = self._forward_or_evict_and_retry(group[:half], keep)
        return first + self._forward_or_evict_and_retry(group[half:], keep)

    @torch.inference_mode()
    def _forward_group(self, group: list[_Sequence]) -> list[torch.Tensor]:
        """One batched forward of every uncached token of `group`; returns (n_i, H) per sequence."""
        past = [s.cached_len_tokens for s in group]
        new = [s.token_ids[s.cached_len_tokens :] for s in group]
        max_past, max_new = max(past), max(len(n) for n in new)
        weight = self.backbone.get_input_embeddings().weight
        device = weight.device

        input_ids, position_ids, attention_mask = padded_inputs(past, new)
        cache, buf = stacked_cache([s.kv for s in group], past, max_new, weight, self._kv_shape)
        out = self.backbone(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            past_key_values=cache,
            use_cache=True,
        )
        hidden = out.last_hidden_state  # (B, N, H)
        self._forward_calls += 1

        # Copy everything out first, commit after: an out-of-memory in a copy leaves every
        # sequence as it was (see _forward_or_evict_and_retry).
        kvs = [buf[:, :, i, :, max_past - p : max_past + len(toks)].clone()
               for i, (p, toks) in enumerate(zip(past, new, strict=True))]
        hs = [hidden[i, : len(toks)].clone() for i, toks in enumerate(new)]
        del out, cache, buf, hidden  # the padded copy: freed before the caller's next forward
        for seq, p, toks, kv, h in zip(group, past, new, kvs, hs, strict=True):
            n = len(toks)
            seq.kv = kv
            seq.cached_len_tokens = p + n
            self._cached_tokens += n
            self._prefilled_tokens += n
            if seq.evicted_len_tokens:
                self._reprefilled_tokens += min(seq.evicted_len_tokens, n)
                seq.evicted_len_tokens = 0
            # a copy, not a view: a view of h would keep the whole chunk's (n, H) alive
            seq.last_hidden = h[-1].clone()
            seq.last_hidden_pos = p + n - 1
        return hs
