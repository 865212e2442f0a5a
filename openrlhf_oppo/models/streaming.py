"""Streaming scorers: the reward, reference and critic models prefill a response chunk by chunk.

OPPO's intra-step overlap (README: What OPPO changes in a PPO step): while the actor decodes chunk k of
a sequence, a scorer prefills chunk k-1 into that sequence's KV cache, so when
the sequence ends only its last chunk is left:

    actor   : [chunk 0][chunk 1][chunk 2][last]
    scorer  :          [pre 0  ][pre 1  ][pre 2][last + head]   <- streamed
    one-shot:                                   [whole sequence .......][head]

Every scorer has the same life cycle, with batched forms that run one batched
forward over sequences of different cached lengths:

    scorer.open(seq_id, prompt_ids)          # recorded; prefilled with the first chunk
    scorer.extend(seq_id, token_ids)         # prefill one chunk
    scorer.finish(seq_id, token_ids)         # last chunk (may be empty) + result
    scorer.drop(seq_id)                      # forget the sequence (also after finish)
    scorer.extend_many({seq_id: token_ids}) / scorer.finish_many({seq_id: token_ids})

The result equals a one-shot forward of the whole sequence for any chunking
(tests/models/test_streaming_on_cpu.py). A KV budget in tokens bounds memory:
the least recently extended sequences lose their cache and are re-prefilled from
their recorded tokens when next extended (see `stats()`).

Cache validity: the reward and reference models are frozen, so a
cache stays valid across PPO steps; the critic changes every step, so a
`StreamingCriticScorer` cache is valid for one critic `version` only.
"""

from __future__ import annotations

import torch
from torch import nn

from openrlhf_oppo.models.heads import causal_lm_parts, normalized, value_model_parts
from openrlhf_oppo.models.prefill import (
    Forwarded,
    PrefillEngine,
    PrefillStats,
    SequenceStateError,
    TokenIdError,
    UnknownSequenceError,
)

__all__ = [
    "CriticVersionError",
    "PrefillStats",
    "SequenceStateError",
    "StreamingCriticScorer",
    "StreamingReferenceScorer",
    "StreamingRewardScorer",
    "TokenIdError",
    "UnknownSequenceError",
]

# Rows of hidden states pushed through an lm_head at once: bounds the (rows, vocab) logits.
_LM_HEAD_ROWS = 1024


class CriticVersionError(RuntimeError):
    """A critic scorer was used with a critic version other than the one its caches were built with."""


class _StreamingScorer:
    """Shared life cycle of the three scorers; subclasses turn hidden states into results."""

    def __init__(self, backbone: nn.Module, kv_budget_tokens: int | None, max_batch_tokens: int):
        self._engine = PrefillEngine(backbone, kv_budget_tokens=kv_budget_tokens, max_batch_tokens=max_batch_tokens)

    @property
    def kv_budget_tokens(self) -> int | None:
        return self._engine.kv_budget_tokens

    @property
    def cached_tokens(self) -> int:
        """Tokens held in KV caches right now (cheap: a counter)."""
        return self._engine.cached_tokens

    def stats(self) -> PrefillStats:
        """Forward, prefill, eviction and re-prefill counters, and tokens cached now."""
        return self._engine.stats()

    def open(self, seq_id: int, prompt_ids: list[int]) -> None:
        """Start a sequence with its (non-empty) prompt; raises if `seq_id` is open or finished.

        The prompt is only recorded here and prefilled with the sequence's first
        chunk, in the same batched forward. To prefill prompts early (e.g. while
        the actor is still producing chunk 0) call `extend_many({seq_id: []})`.
        """
        self._engine.open(seq_id, prompt_ids)
        self._on_open(seq_id)

    def drop(self, seq_id: int) -> None:
        """Forget a sequence (open or finished) and free its cache."""
        self._engine.drop(seq_id)
        self._on_drop(seq_id)

    def _validated(self, chunks: dict[int, list[int]]) -> dict[int, list[int]]:
        # All checks before any state change: a bad entry leaves every sequence as it was.
        return {seq_id: self._engine.check_extendable(seq_id, toks) for seq_id, toks in chunks.items()}

    def _advance(self, chunks: dict[int, list[int]], finishing: bool = False
                 ) -> tuple[dict[int, Forwarded], dict[int, int]]:
        """Validate, prefill (then free, when finishing); also return each sequence's length before the call."""
        valid = self._validated(chunks)
        old_len = {seq_id: self._engine.seq_len_tokens(seq_id) for seq_id in valid}
        return self._engine.advance(valid, finishing=finishing), old_len

    def _on_open(self, seq_id: int) -> None:
        raise NotImplementedError

    def _on_drop(self, seq_id: int) -> None:
        raise NotImplementedError


class StreamingRewardScorer(_StreamingScorer):
    """Reward model with incremental prefill; `finish` returns the sequence's scalar reward.

    Args:
        model: a transformers `*ForSequenceClassification` with `num_labels=1`, or an
            OpenRLHF-layout reward model (see `loaders.load_reward_model`); in eval mode.
        kv_budget_tokens: most tokens kept in KV caches between calls (None: unbounded).
        max_batch_tokens: most padded tokens (`batch * (past + new)`) in one forward.
        pooling: where the head reads. 'last' (default): the last token of
            prompt+response, as OpenRLHF's reward model reads any checkpoint;
            'non_pad': the rightmost token that is not `pad_token_id`, as a
            transformers `*ForSequenceClassification` forward reads it. They
            differ when a response ends in the pad id (EOS with pad == eos).

    OpenRLHF's `(r - mean) / std` applies when the model has `normalize_reward`
    set (for a transformers model: `config.normalize_reward`, see `load_reward_model`).
    """

    def __init__(self, model: nn.Module, kv_budget_tokens: int | None = None, max_batch_tokens: int = 32768,
                 pooling: str = "last"):
        self.parts = value_model_parts(model, pooling)
        super().__init__(self.parts.backbone, kv_budget_tokens, max_batch_tokens)
        # seq_id -> hidden state (H,) the head will read, and how many positions were scanned for it
        self._pooled: dict[int, torch.Tensor | None] = {}
        self._scanned_tokens: dict[int, int] = {}

    def _on_open(self, seq_id: int) -> None:
        self._pooled[seq_id] = None
        self._scanned_tokens[seq_id] = 0

    def _on_drop(self, seq_id: int) -> None:
        self._pooled.pop(seq_id, None)
        self._scanned_tokens.pop(seq_id, None)

    def extend(self, seq_id: int, token_ids: list[int]) -> None:
        """Prefill one chunk of response tokens."""
        self.extend_many({seq_id: token_ids})

    def extend_many(self, chunks: dict[int, list[int]]) -> None:
        """Prefill one chunk for each sequence, in batched forwards."""
        results, _ = self._advance(chunks)
        self._pool(results)

    def finish(self, seq_id: int, token_ids: list[int]) -> float:
        """Prefill the last chunk (may be empty) and return the reward of the whole sequence."""
        return self.finish_many({seq_id: token_ids})[seq_id]

    def finish_many(self, chunks: dict[int, list[int]]) -> dict[int, float]:
        """`finish` for several sequences: one batched forward, one batched head."""
        results, _ = self._advance(chunks, finishing=True)
        self._pool(results)
        if not results:
            return {}
        seq_ids = list(results)
        with torch.inference_mode():
            hidden = torch.stack([self._pooled[s] for s in seq_ids])  # (B, H)
            rewards = normalized(self.parts.value_head(hidden).squeeze(-1).float(), self.parts)
        return {seq_id: float(r) for seq_id, r in zip(seq_ids, rewards.tolist())}

    def _pool(self, results: dict[int, Forwarded]) -> None:
        """Remember, per sequence, the hidden state at the position the head must read."""
        ignore = self.parts.ignore_token_id
        for seq_id, fw in results.items():
            tokens = self._engine.token_ids(seq_id)
            start, end = self._scanned_tokens[seq_id], len(tokens)
            if start == end:
                continue
            pos = end - 1
            if ignore is not None:
                # 'non_pad' pooling: rightmost non-pad token, position 0 if there is none
                while pos > start and tokens[pos] == ignore:
                    pos -= 1
                if tokens[pos] == ignore and pos > 0:
                    pos = -1  # nothing new to read: keep the earlier choice
            if pos >= 0:
                self._pooled[seq_id] = fw.rows(pos, pos + 1)[0]
            self._scanned_tokens[seq_id] = end


class _PerTokenScorer(_StreamingScorer):
    """Reference and critic: one number per response token, from the state before it."""

    def __init__(self, backbone: nn.Module, kv_budget_tokens: int | None, max_batch_tokens: int):
        super().__init__(backbone, kv_budget_tokens, max_batch_tokens)
        self._per_token: dict[int, list[float]] = {}  # seq_id -> one number per response token so far

    def _on_open(self, seq_id: int) -> None:
        self._per_token[seq_id] = []

    def _on_drop(self, seq_id: int) -> None:
        self._per_token.pop(seq_id, None)

    def _score_rows(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(M, H) hidden states before each target token, (M,) targets -> (M,) numbers."""
        raise NotImplementedError

    def _extend_many(self, chunks: dict[int, list[int]], finishing: bool = False) -> dict[int, list[float]]:
        results, old_len = self._advance(chunks, finishing=finishing)
        rows, targets, counts = [], [], []
        for seq_id, fw in results.items():
            new_len = self._engine.seq_len_tokens(seq_id)
            # token at position p is predicted/valued from the hidden state at p - 1
            rows.append(fw.rows(old_len[seq_id] - 1, new_len - 1))
            targets.extend(self._engine.token_ids(seq_id)[old_len[seq_id] : new_len])
            counts.append(new_len - old_len[seq_id])
        out: dict[int, list[float]] = {}
        if sum(counts):
            with torch.inference_mode():
                scores = self._score_rows(torch.cat(rows), torch.tensor(targets, dtype=torch.long)).tolist()
        else:
            scores = []
        offset = 0
        for seq_id, n in zip(results, counts):
            out[seq_id] = scores[offset : offset + n]
            self._per_token[seq_id].extend(out[seq_id])
            offset += n
        return out

    def _finish_many(self, chunks: dict[int, list[int]]) -> dict[int, list[float]]:
        self._extend_many(chunks, finishing=True)
        return {seq_id: list(self._per_token[seq_id]) for seq_id in chunks}


class StreamingReferenceScorer(_PerTokenScorer):
    """Reference (frozen) causal LM with incremental prefill: log-probabilities of response tokens.

    Args:
        causal_lm: a transformers `*ForCausalLM` in eval mode.
        kv_budget_tokens: most tokens kept in KV caches between calls (None: unbounded).
        temperature: logits are divided by it before the softmax, as OpenRLHF's
            reference `Actor` does with `--rollout.temperature`.
        max_batch_tokens: most padded tokens (`batch * (past + new)`) in one forward.

    The model is frozen, so caches stay valid across PPO steps.
    """

    def __init__(
        self,
        causal_lm: nn.Module,
        kv_budget_tokens: int | None = None,
        temperature: float = 1.0,
        max_batch_tokens: int = 32768,
    ):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.parts = causal_lm_parts(causal_lm)
        super().__init__(self.parts.backbone, kv_budget_tokens, max_batch_tokens)
        self.temperature = temperature

    def extend(self, seq_id: int, token_ids: list[int]) -> list[float]:
        """Prefill one chunk; return the log-probability of each of its tokens."""
        return self._extend_many({seq_id: token_ids})[seq_id]

    def extend_many(self, chunks: dict[int, list[int]]) -> dict[int, list[float]]:
        """`extend` for several sequences in batched forwards."""
        return self._extend_many(chunks)

    def finish(self, seq_id: int, token_ids: list[int]) -> list[float]:
        """Prefill the last chunk (may be empty); return the log-probs of every response token."""
        return self._finish_many({seq_id: token_ids})[seq_id]

    def finish_many(self, chunks: dict[int, list[int]]) -> dict[int, list[float]]:
        """`finish` for several sequences in batched forwards."""
        return self._finish_many(chunks)

    def _score_rows(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = []
        for lo in range(0, hidden.shape[0], _LM_HEAD_ROWS):
            logits = self.parts.lm_head(hidden[lo : lo + _LM_HEAD_ROWS]).float()
            if self.temperature != 1.0:
                logits = logits / self.temperature
            logp = torch.log_softmax(logits, dim=-1)
            out.append(logp.gather(-1, targets[lo : lo + _LM_HEAD_ROWS, None].to(logp.device)).squeeze(-1))
        return torch.cat(out).cpu()


class StreamingCriticScorer(_PerTokenScorer):
    """Critic with incremental prefill: the value of the state before each response token.

    Args:
        critic: an OpenRLHF-layout critic (see `loaders.load_critic_model`) or a
            transformers `*ForSequenceClassification` with `num_labels=1`; eval mode.
        version: the critic weights' version (e.g. the PPO step that produced them).
        kv_budget_tokens: most tokens kept in KV caches between calls (None: unbounded).
        max_batch_tokens: most padded tokens (`batch * (past + new)`) in one forward.

    Values match OpenRLHF's `CriticModel.forward` (`values[:, :-1]` of the action
    tokens, `(v - mean) / std` when `normalize_reward`). The critic is trained
    every step, so **a cache is valid for one critic version only**: after the
    weights change call `reset(new_version)`, which drops every sequence (they
    must be re-opened). Every method takes an optional `version`; passing one
    that differs from the scorer's raises `CriticVersionError` instead of
    silently mixing caches of two critics.
    """

    def __init__(
        self,
        critic: nn.Module,
        version: int = 0,
        kv_budget_tokens: int | None = None,
        max_batch_tokens: int = 32768,
    ):
        self.parts = value_model_parts(critic)
        super().__init__(self.parts.backbone, kv_budget_tokens, max_batch_tokens)
        self.version = version

    def reset(self, version: int) -> None:
        """The critic's weights changed: drop every sequence and cache, adopt `version`."""
        self._engine.drop_all()
        self._per_token.clear()
        self._engine.unknown_hint = (
            f" (the critic scorer was reset from version {self.version} to {version}; re-open sequences after a reset)"
        )
        self.version = version

    def _check_version(self, version: int | None) -> None:
        if version is not None and version != self.version:
            raise CriticVersionError(
                f"critic scorer caches were built with critic version {self.version}, called with version {version}; "
                "call reset(version) after the critic's weights change"
            )

    def open(self, seq_id: int, prompt_ids: list[int], version: int | None = None) -> None:
        """Start a sequence; see `_StreamingScorer.open`."""
        self._check_version(version)
        super().open(seq_id, prompt_ids)

    def extend(self, seq_id: int, token_ids: list[int], version: int | None = None) -> list[float]:
        """Prefill one chunk; return the value before each of its tokens."""
        return self.extend_many({seq_id: token_ids}, version=version)[seq_id]

    def extend_many(self, chunks: dict[int, list[int]], version: int | None = None) -> dict[int, list[float]]:
        """`extend` for several sequences in batched forwards."""
        self._check_version(version)
        return self._extend_many(chunks)

    def finish(self, seq_id: int, token_ids: list[int], version: int | None = None) -> list[float]:
        """Prefill the last chunk (may be empty); return the values of every response token."""
        return self.finish_many({seq_id: token_ids}, version=version)[seq_id]

    def finish_many(self, chunks: dict[int, list[int]], version: int | None = None) -> dict[int, list[float]]:
        """`finish` for several sequences in batched forwards."""
        self._check_version(version)
        return self._finish_many(chunks)

    def _score_rows(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        values = self.parts.value_head(hidden).squeeze(-1).float()
        return normalized(values, self.parts).cpu()
