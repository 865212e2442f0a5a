"""PPO's old log-probs from the rollout where they are exact: the actor's forward only for samples
holding tokens of older weights (`--oppo.train.old_logprobs rollout`, the default).

OpenRLHF 0.11.2's experience maker sends every sample through the actor's `forward` for its old
log-probs, the anchor of the PPO ratio and the policy side of the KL-in-reward term, once, before
any update of the step. For a sample whose every token was decoded by the weights the actor holds
then, vLLM already computed them while sampling: the log-probs of the temperature-scaled
distribution (vLLM's `logprobs_mode="processed_logprobs"`, which the rollout actors are started
with), the same up to inference numerics. Only samples holding older tokens (carried across a
weight sync, admitted while the trainer trained, parked and re-prefilled by the hybrid engine)
need the forward.

What is exact, and what is not:
- a sample is *fresh* when every response token is stamped with the policy version of the batch
  (`is_fresh`): the generator's version counter is the number of weight syncs done, the actor's
  weights at `make_experience` are that version, and the engines' prefix cache is reset at each
  sync, so a fresh token attended to nothing older;
- with `--rollout.top_p` < 1 vLLM's processed log-probs are renormalised over the nucleus, which
  the actor's forward is not: there `resolve` falls back to the forward for every sample, with a
  start-up warning (OPPO refuses a multi-turn agent, whose environment tokens carry none);
- the mismatch accepted is reported: every `--oppo.train.old_logprobs_audit_steps` steps (the
  first included) every sample goes through the forward and the step reports how far the fresh
  ones' rollout log-probs lie from it (`MISMATCH_KL`: OpenRLHF's `vllm_kl`, the mean of rollout
  minus recomputed over their action tokens, and `MISMATCH_ABS`).

How: `OldLogprobs` wraps the maker's `_dispatch_forward` and `_flatten_results` on the trainer's
instance (as `reference.streamed_reference_forward` does for the reference). At dispatch, the
actor group receives only the distinct token sequences of stale samples, regrouped into as few
micro-batches as they need, a multiple of the data-parallel ranks (every ZeRO-3 rank makes as
many forward calls); the maker gathers the results after dispatching the other groups, as before,
and each micro-batch's rows are filled from the rollout or from the forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from openrlhf_oppo.core import TrainSample
from openrlhf_oppo.integrations.runtime.reference import action_logprobs, key

__all__ = ["FRESH_SHARE", "MISMATCH_ABS", "MISMATCH_KL", "RECOMPUTED_SHARE", "OldLogprobs", "is_fresh", "keep",
           "recompute_count", "recompute_micro_batches", "resolve"]

RECOMPUTED_SHARE = "oppo/old_logprobs/recomputed_share"  # samples through the actor's forward this step
FRESH_SHARE = "oppo/old_logprobs/fresh_share"  # samples that can take their rollout log-probs (`keep`)
MISMATCH_KL = "oppo/old_logprobs/mismatch_kl"  # audited steps: mean(rollout - recomputed), fresh tokens
MISMATCH_ABS = "oppo/old_logprobs/mismatch_abs"  # audited steps: mean |rollout - recomputed|, fresh tokens


def resolve(setting: str, args) -> tuple[bool, str | None]:
    """Whether old log-probs come from the rollout for fresh samples (`--oppo.train.old_logprobs`
    `setting` under OpenRLHF's `args`), and the warning to print when 'rollout' falls back."""
    if setting != "rollout":
        return False, None
    if args.rollout.top_p >= 1.0:
        return True, None
    return False, (f"OPPO: --oppo.train.old_logprobs rollout falls back to the actor's forward for every sample "
                   f"under --rollout.top_p {args.rollout.top_p} (vLLM's log-probs are renormalised over the "
                   "nucleus); set --oppo.train.old_logprobs recompute to silence this")


def is_fresh(sample: TrainSample, version: int) -> bool:
    """Every response token of `sample` was decoded by policy `version` and has its rollout log-prob."""
    if not sample.version_runs or any(v != version for _, v in sample.version_runs):
        return False
    return sum(len(c) for c in sample.logprob_chunks) == sample.num_tokens > 0


def keep(rollout: dict[tuple[int, ...], torch.Tensor | None], experience, sample: TrainSample,
         version: int) -> None:
    """Keep one trained `sample`'s source of old log-probs by its single-sample OpenRLHF `experience`'s
    tokens: its rollout log-probs of the action tokens when `is_fresh` at the batch's policy `version`,
    None (the forward) when not, or when a stale sample of the batch holds the same tokens."""
    k = key(experience.sequences[0], experience.attention_mask[0])
    values = None
    if is_fresh(sample, version):
        values = action_logprobs(experience.action_mask[0], sample.rollout_logprobs)
    if rollout.get(k, values) is None:
        values = None
    rollout[k] = values


def recompute_count(sequences: int, size: int, ranks: int) -> int:
    """Micro-batches the forward takes for `sequences` distinct sequences: as many as `size` (OpenRLHF's
    `--rollout.micro_batch_size`) needs, rounded up to a multiple of the data-parallel `ranks` (each rank
    makes as many forward calls: ZeRO-3 gathers every layer's weights across them); 0 for none."""
    ranks = max(ranks, 1)
    needed = math.ceil(sequences / max(size, 1))
    return math.ceil(needed / ranks) * ranks


def recompute_micro_batches(lengths: list[int], count: int) -> list[list[int]]:
    """`count` micro-batches of sequence indices (`count` <= len(lengths)): sorted by `lengths`, sizes as
    equal as can be (so none larger than the size `recompute_count` was given); rank r gets the r-th
    contiguous run (`async_run_method_batch`)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    base, extra = divmod(len(order), count)
    cuts, start = [], 0
    for c in range(count):
        end = start + base + (c < extra)
        cuts.append(order[start:end])
        start = end
    return cuts


def _multimodal(kwargs) -> bool:
    """A micro-batch holds images (OpenRLHF passes `mm_train_inputs_list`, one list per micro-batch, a sample
    without any holding None, whenever any sample of the batch has a list): the forward for everything."""
    return any(x is not None for inputs in kwargs.get("mm_train_inputs_list") or () for x in inputs or ())


@dataclass
class _Row:
    """One row of one of the maker's micro-batches: its rollout log-probs, or the index of its sequence
    among those sent to the forward."""

    key: tuple[int, ...]  # the sample's tokens
    tokens: tuple[torch.Tensor, torch.Tensor]  # its sequence and action mask, unpadded
    where: torch.Tensor  # bool [A]: the row's action positions
    rollout: torch.Tensor | None  # [n action tokens], or None
    forward: int | None = None  # index into the sequences recomputed, or None


@dataclass
class _Pending:
    """What `_dispatch_forward` hands back for the actor: resolved by `_flatten_results`."""

    rows: list[list[_Row]]  # per micro-batch
    shapes: list[torch.Size]  # each micro-batch's action mask shape
    refs: list | None  # the forward's refs (None: nothing recomputed)
    masks: list[torch.Tensor]  # the recomputed micro-batches' action masks
    cuts: list[list[int]]  # sequence indices per recomputed micro-batch
    audit: bool


class OldLogprobs:
    """Installed on OpenRLHF's experience `maker` by construction. `rollout`: the open batch's fresh samples'
    action log-probs by their tokens (`reference.key`), None for a sequence some stale sample holds
    (refilled by the generator each batch); `audit_due()`: whether this batch is an audited one.
    `stats`: the last batch's `oppo/old_logprobs/*` metrics."""

    def __init__(self, maker, rollout: dict[tuple[int, ...], torch.Tensor | None], audit_due: Callable[[], bool]):
        self.maker = maker
        self.rollout = rollout
        self.audit_due = audit_due
        self.stats: dict[str, float] = {}
        self._dispatch = maker._dispatch_forward
        self._flatten = maker._flatten_results
        maker._dispatch_forward = self.dispatch_forward
        maker._flatten_results = self.flatten_results

    def dispatch_forward(self, group, sync_condition, **kwargs):
        if group is None or group is not self.maker.actor_model_group or _multimodal(kwargs):
            return self._dispatch(group, sync_condition, **kwargs)
        audit = self.audit_due()
        rows, sequences = self._plan(kwargs["sequences"], kwargs["attention_mask"], kwargs["action_mask"], audit)
        total = sum(len(r) for r in rows)
        fresh = sum(1 for mb in rows for r in mb if r.rollout is not None)
        shapes = [m.shape for m in kwargs["action_mask"]]
        if audit:
            self.stats = {RECOMPUTED_SHARE: 1.0, FRESH_SHARE: fresh / max(total, 1)}
            refs = self._dispatch(group, sync_condition, **kwargs)
            return _Pending(rows, shapes, refs, list(kwargs["action_mask"]), [], audit=True)
        ranks = len(group._actor_handlers) // group.duplicate_actors
        count = recompute_count(len(sequences), self.maker.strategy.args.rollout.micro_batch_size, ranks)
        sequences = self._fill(rows, sequences, count)
        if len(sequences) < count:  # too few distinct sequences for every rank: OpenRLHF's forward over everything
            self.stats = {RECOMPUTED_SHARE: 1.0, FRESH_SHARE: fresh / max(total, 1)}
            return self._dispatch(group, sync_condition, **kwargs)
        cuts = recompute_micro_batches([len(s[0]) for s in sequences], count) if count else []
        recomputed = sum(1 for mb in rows for r in mb if r.forward is not None)
        self.stats = {RECOMPUTED_SHARE: recomputed / max(total, 1), FRESH_SHARE: fresh / max(total, 1)}
        if not cuts:
            return _Pending(rows, shapes, None, [], [], audit=False)
        batch = {"sequences": [], "attention_mask": [], "action_mask": []}
        for cut in cuts:
            longest = max(len(sequences[i][0]) for i in cut)
            seq = torch.full((len(cut), longest), self.maker.tokenizer.pad_token_id, dtype=torch.long)
            attn = torch.zeros((len(cut), longest), dtype=torch.long)
            act = torch.zeros((len(cut), longest - 1), dtype=torch.long)
            for r, i in enumerate(cut):
                s, a = sequences[i]
                seq[r, :len(s)] = s
                attn[r, :len(s)] = 1
                act[r, :len(a)] = a
            batch["sequences"].append(seq)
            batch["attention_mask"].append(attn)
            batch["action_mask"].append(act)
        refs = self._dispatch(group, sync_condition, **batch)
        return _Pending(rows, shapes, refs, batch["action_mask"], cuts, audit=False)

    def _plan(self, sequences, attention_masks, action_masks, audit: bool):
        """Each micro-batch row's source, and the distinct stale sequences (tokens, action mask) to recompute."""
        rows: list[list[_Row]] = []
        index: dict[tuple[int, ...], int] = {}
        recompute: list[tuple[torch.Tensor, torch.Tensor]] = []
        for seq, attn, act in zip(sequences, attention_masks, action_masks):
            mb = []
            for j in range(seq.shape[0]):
                k = key(seq[j], attn[j])
                if k not in self.rollout:
                    raise RuntimeError(f"OPPO: a micro-batch row ({len(k)} tokens) is not one of the batch's samples; "
                                       "every sample handed to the experience maker should be")
                n = int(attn[j].sum())
                row = _Row(k, (seq[j, :n], act[j, :n - 1]), act[j].bool(), self.rollout[k])
                if row.rollout is not None and row.rollout.numel() != int(row.where.sum()):
                    raise RuntimeError(f"OPPO: a sample with {int(row.where.sum())} action tokens has "
                                       f"{row.rollout.numel()} rollout log-probs")
                if row.rollout is None and not audit:
                    self._send(row, index, recompute)
                mb.append(row)
            rows.append(mb)
        return rows, recompute

    @staticmethod
    def _send(row: _Row, index: dict[tuple[int, ...], int], recompute: list) -> None:
        """Route `row` through the forward: its sequence once, however many rows hold it."""
        if row.key not in index:
            index[row.key] = len(recompute)
            recompute.append(row.tokens)
        row.forward = index[row.key]

    def _fill(self, rows: list[list[_Row]], sequences: list, count: int) -> list:
        """With fewer distinct stale sequences than the `count` micro-batches the ranks need, send the shortest
        fresh ones too, so that none is empty (the forward's values are as exact for them)."""
        if len(sequences) >= count:
            return sequences
        index = {r.key: r.forward for mb in rows for r in mb if r.forward is not None}
        fresh = sorted((r for mb in rows for r in mb if r.forward is None), key=lambda r: len(r.tokens[0]))
        for row in fresh:
            if len(sequences) >= count and row.key not in index:
                continue
            self._send(row, index, sequences)
        return sequences

    def flatten_results(self, refs, duplicate_factor):
        if not isinstance(refs, _Pending):
            return self._flatten(refs, duplicate_factor)
        got = self._flatten(refs.refs, duplicate_factor) if refs.refs is not None else []
        if refs.audit:
            self._measure(refs.rows, got)
            return got
        values: dict[int, torch.Tensor] = {}
        for cut, mask, out in zip(refs.cuts, refs.masks, got):
            for r, i in enumerate(cut):
                values[i] = out[r, mask[r].bool()].float()
        result = []
        for mb, shape in zip(refs.rows, refs.shapes):
            out = torch.zeros(shape, dtype=torch.float32)
            for j, row in enumerate(mb):
                out[j, row.where] = row.rollout if row.forward is None else values[row.forward]
            result.append(out)
        return result

    def _measure(self, rows: list[list[_Row]], recomputed: list[torch.Tensor]) -> None:
        """An audited batch: how far the fresh rows' rollout log-probs lie from the forward's."""
        diffs = [row.rollout.float() - out[j, row.where].float()
                 for mb, out in zip(rows, recomputed) for j, row in enumerate(mb) if row.rollout is not None]
        if diffs:
            d = torch.cat(diffs)
            self.stats[MISMATCH_KL] = float(d.mean())
            self.stats[MISMATCH_ABS] = float(d.abs().mean())

    def take_stats(self) -> dict[str, float]:
        """The last batch's metrics, once."""
        stats, self.stats = self.stats, {}
        return stats
