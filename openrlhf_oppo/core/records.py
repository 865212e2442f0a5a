"""The scheduler's records: samples, groups, and the in-flight state a checkpoint saves.

`InFlight` is everything `OverlapScheduler` keeps from one step to the next; the
scheduler mutates it, `openrlhf_oppo.core.checkpoint` writes and reads it. Plain
records (``__slots__``, no behaviour beyond small queries): the scheduler's hot
paths bind their fields to locals.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from openrlhf_oppo.core.types import DEFERRAL_BUCKETS, AdmitGroup

# Builds a NamedTuple message from a tuple without the Python-level ``__new__`` frame.
_new_tuple = tuple.__new__


class Sample:
    """Mutable state of one in-flight sample.

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
        "final_start",
        "resent_mask",
        "done_mask",
        "finish_reason",
    )

    def __init__(self, sample_id: int, group: Group) -> None:
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
        # where the final chunk starts: a scorer acknowledges it only after every chunk before it
        self.final_start = 0
        # per scorer bit: `rescore` re-sent the finished response whole, so that scorer's final chunk starts at 0
        self.resent_mask = 0
        self.done_mask = 0  # per scorer bit: acknowledged the final chunk
        self.finish_reason: str | None = None

    def add_logprobs(self, logprobs: Sequence[float] | None) -> None:
        """Logprobs for the token chunk just appended; the list is made at the first recorded ones."""
        lps = self.logprob_chunks
        if lps is None:
            lps = self.logprob_chunks = [()] * (len(self.token_chunks) - 1)
        lps.append(logprobs if logprobs is not None else ())


class Group:
    """One prompt group in flight: n samples of one prompt."""

    __slots__ = ("group_id", "prompt_index", "admitted_step", "deferrals", "sample_ids", "pending")

    def __init__(self, group_id: int, prompt_index: int, admitted_step: int, sample_ids: tuple[int, ...]) -> None:
        self.group_id = group_id
        self.prompt_index = prompt_index
        self.admitted_step = admitted_step
        self.deferrals = 0  # steps carried so far
        self.sample_ids = sample_ids
        self.pending = len(sample_ids)  # samples not yet complete


class InFlight:
    """Everything the scheduler keeps between steps; what a checkpoint saves (besides
    the Δ and C controllers) and what `load_state_dict` replaces whole."""

    __slots__ = (
        "groups",
        "samples",
        "scored",
        "complete",
        "restored_complete_order",
        "needs_restream",
        "ledger",
        "next_group_id",
        "next_prompt_index",
        "last_step",
        "admitted_groups_total",
        "trained_groups_total",
        "trained_tokens_total",
        "offpolicy_tokens_total",
        "deferral_hist_total",
    )

    def __init__(self, num_scorers: int) -> None:
        self.groups: dict[int, Group] = {}  # admitted, not yet trained; in admission order
        self.samples: dict[int, Sample] = {}
        # per scorer: sample id -> response tokens acknowledged (flat dicts, not a list per sample);
        # every in-flight sample has an entry. Not checkpointed: scorer caches do not survive a restart.
        self.scored: tuple[dict[int, int], ...] = tuple({} for _ in range(num_scorers))
        self.complete: dict[int, None] = {}  # group ids in completion order (insertion-ordered)
        # A loaded checkpoint's completion order while its restream is due: completion then
        # waits for the scorers again, but a checkpoint written before that is the one loaded.
        self.restored_complete_order: list[int] = []
        self.needs_restream = False  # the next plan re-sends every held token to fresh scorers
        self.ledger = array("q")  # ledger.LEDGER_FIELDS per trained group, flat
        self.next_group_id = 0
        self.next_prompt_index = 0
        self.last_step = -1  # the last step ended
        self.admitted_groups_total = 0
        self.trained_groups_total = 0
        self.trained_tokens_total = 0
        self.offpolicy_tokens_total = 0
        self.deferral_hist_total: dict[str, int] = {b: 0 for b in DEFERRAL_BUCKETS}

    def admit(self, step: int, count: int, n: int) -> tuple[AdmitGroup, ...]:
        """Admit ``count`` new groups of ``n`` samples at the next prompt positions."""
        admit = []
        for _ in range(count):
            gid = self.next_group_id
            prompt_index = self.next_prompt_index
            self.next_group_id += 1
            self.next_prompt_index += 1
            sample_ids = tuple(range(gid * n, gid * n + n))
            group = Group(gid, prompt_index, step, sample_ids)
            for sid in sample_ids:
                self.samples[sid] = Sample(sid, group)
                for acked in self.scored:
                    acked[sid] = 0
            self.groups[gid] = group
            admit.append(_new_tuple(AdmitGroup, (gid, prompt_index, sample_ids)))
        self.admitted_groups_total += count
        return tuple(admit)

    def add_sample(self, s: Sample) -> None:
        """Hold a new (or restored) sample: no scorer has acknowledged any of it."""
        self.samples[s.sample_id] = s
        for acked in self.scored:
            acked[s.sample_id] = 0

    def sample_complete(self, s: Sample) -> None:
        """``s`` finished and every scorer acknowledged its final chunk."""
        g = s.group
        g.pending -= 1
        if g.pending == 0:
            self.complete[g.group_id] = None

    def complete_order(self) -> list[int]:
        """Completion order as a checkpoint records it."""
        return list(self.restored_complete_order) if self.needs_restream else list(self.complete)

