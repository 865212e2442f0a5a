"""make_experience's forwards ahead of the batch (`--oppo.streaming.experience_ahead`).

Without async admission the trainer's weights do not change between a step's admission and its
make_experience, and the training devices wait while the batch decodes. The scheduler core names
the groups certain to be in the step's batch (`OverlapScheduler.committed_groups`: complete, and
not displaced by whatever completes later); the generator hands their samples here as they are
committed, as the single-sample OpenRLHF experiences make_experience will see, and each full round
(a micro-batch of `--rollout.micro_batch_size` samples for every data-parallel rank, sorted by
length) is forwarded at once through the actor (old log-probs), the critic (values) and the
reference group (unless the reference is streamed): the forwards make_experience would make, on
the same weights, while the stragglers still decode.

At the batch, make_experience's split puts first the samples not forwarded ahead (with as few
forwarded ones as make their micro-batches a multiple of every group's ranks: under ZeRO-3 every
rank makes as many forward calls), then the rest; its dispatch to those groups forwards only the
leading micro-batches and answers the others with the rows kept here, found by the sample's
tokens as the streamed reference's are (`reference.rows_for`): each sample's values where its
action mask is set, 0 elsewhere, as the forward returns them. Only micro-batching differs from
make_experience's own forwards (rounding, as between any two micro-batch layouts). The rows are
dropped once make_experience has them: the update that follows changes the weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import ray

from openrlhf_oppo.integrations.runtime import reference

AHEAD_FRACTION = "oppo/experience_ahead_fraction"  # the batch's samples whose forwards were made ahead


class ExperienceAhead:
    def __init__(self, maker, reference_streamed: bool):
        """`maker`: OpenRLHF's `RemoteExperienceMaker` (driver); its groups are forwarded ahead, the
        reference group unless `reference_streamed` (its rows come from the streaming actors)."""
        named = {"actor": maker.actor_model_group, "critic": maker.critic_model_group,
                 "reference": None if reference_streamed else maker.initial_model_group}
        self.groups = {name: g for name, g in named.items() if g is not None}
        self.maker, self.args = maker, maker.strategy.args
        self.size = self.args.rollout.micro_batch_size
        # a round holds a micro-batch for every rank of every group: each rank makes as many calls
        self.ranks = math.lcm(*(len(g._actor_handlers) // g.duplicate_actors for g in self.groups.values()))
        self.rows: dict[str, dict[tuple[int, ...], object]] = {name: {} for name in self.groups}
        self.pending: list = []  # committed samples' experiences not yet forwarded
        self.flight: list[tuple[str, list, list]] = []  # (group name, micro-batches, refs) not yet collected
        self.seen: set[int] = set()  # group ids handed over this step
        self.lead: int | None = None  # make_experience's leading micro-batches to forward (None: not split here)
        self.stats = {AHEAD_FRACTION: 0.0}
        self._install()

    # ------------------------------------------------------------------ while the batch decodes

    def add_groups(self, group_ids: Iterable[int], experiences: Callable[[int], list]) -> None:
        """Committed groups (`experiences(gid)`: their samples' single-sample experiences); every full
        round is forwarded now."""
        for gid in group_ids:
            if gid not in self.seen:
                self.seen.add(gid)
                self.pending += experiences(gid)
        per_round = self.size * self.ranks
        while len(self.pending) >= per_round:
            self._forward(self.pending[:per_round])
            del self.pending[:per_round]

    def _forward(self, samples: list) -> None:
        from openrlhf.trainer.ppo_utils.experience import Experience

        samples = sorted(samples, key=lambda s: s.sequences.shape[-1])
        pad = self.maker.tokenizer.pad_token_id
        batches = [Experience.concat_experiences(samples[i:i + self.size], pad)
                   for i in range(0, len(samples), self.size)]
        for name, group in self.groups.items():
            refs = group.async_run_method_batch(method_name="forward", sequences=[b.sequences for b in batches],
                                                action_mask=[b.action_mask for b in batches],
                                                attention_mask=[b.attention_mask for b in batches])
            self.flight.append((name, batches, refs))

    def _collect(self) -> None:
        duplicate = self.args.ds.ring_attn_size * self.args.ds.tensor_parallel_size
        for name, batches, refs in self.flight:
            outputs = [out for chunk in ray.get(refs)[::duplicate] for out in chunk]
            for batch, out in zip(batches, outputs, strict=True):
                for i in range(batch.sequences.shape[0]):
                    mask = batch.action_mask[i].bool()
                    self.rows[name][reference.key(batch.sequences[i], batch.attention_mask[i])] = out[i][mask]
        self.flight.clear()

    # ------------------------------------------------------------------ make_experience

    def partition(self, rollout_samples: list) -> list[list[int]]:
        """The batch's sample indices as [to forward, forwarded ahead]; sets `lead`, the micro-batches
        the first part makes. Waits for the forwards still running (make_experience needs them)."""
        self._collect()
        ahead = [all(reference.key(s.sequences[0], s.attention_mask[0]) in rows for rows in self.rows.values())
                 for s in rollout_samples]
        todo = [i for i, a in enumerate(ahead) if not a]
        held = sorted((i for i, a in enumerate(ahead) if a), key=lambda i: rollout_samples[i].sequences.shape[-1])
        while todo and held and -(-len(todo) // self.size) % self.ranks:
            todo.append(held.pop(0))  # the shortest: the cheapest to forward again
        self.lead = -(-len(todo) // self.size)
        self.stats[AHEAD_FRACTION] = len(held) / max(len(rollout_samples), 1)
        return [todo, held]

    def reset(self) -> None:
        """The step's make_experience is done: the update changes the weights the rows were made on."""
        for rows in self.rows.values():
            rows.clear()
        self.pending, self.flight, self.seen, self.lead = [], [], set(), None

    def _install(self) -> None:
        """make_experience's dispatch to the groups forwarded ahead: the leading `lead` micro-batches
        forwarded, the others answered from the rows (after `partition`; before it, as it was)."""
        dispatch, names = self.maker._dispatch_forward, {id(g): name for name, g in self.groups.items()}

        def dispatch_forward(group, sync_condition, **kwargs):
            name = names.get(id(group))
            if name is None or self.lead is None:
                return dispatch(group, sync_condition, **kwargs)
            lead = self.lead
            refs = dispatch(group, sync_condition, **{k: v[:lead] for k, v in kwargs.items()}) if lead else []
            rows = [reference.rows_for(self.rows[name], s, a, m, f"{name} rows forwarded ahead") for s, a, m in
                    zip(kwargs["sequences"][lead:], kwargs["attention_mask"][lead:], kwargs["action_mask"][lead:])]
            duplicate = self.args.ds.ring_attn_size * self.args.ds.tensor_parallel_size
            return refs + ([ray.put(rows)] * duplicate if rows else [])

        self.maker._dispatch_forward = dispatch_forward
