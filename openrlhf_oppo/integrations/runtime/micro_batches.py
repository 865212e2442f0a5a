"""Length-bucketed training micro-batches: a straggler pads only beside other long samples.

OpenRLHF 0.11.2 trains the actor and the critic on micro-batches drawn from a shuffled
replay buffer and right-padded to their longest sample (without `--ds.packing_samples`,
which needs flash-attention). One 1,024-token straggler then makes its whole micro-batch
cost 1,024 tokens a sample. Its loss is one mean over each optimizer step's window of
micro-batches (`iter_grad_accum_global_norm`: every token of the window divided by the
window's global token count), so how a window's samples are grouped into micro-batches does
not change the gradient, only the padding.

With `--oppo.train.length_buckets` (default on) this module keeps OpenRLHF's shuffled
draw of each window's samples (the same samples per optimizer step, the same random
stream) and regroups them: the window's samples sorted by length, cut into micro-batches
of the same size. For equal-size groups that is the grouping with the least padding.

Installed by the site hook in the actor and critic processes of an OPPO run
(`integrations.runtime.startup`): the `ppo_actor` and `ppo_critic` modules'
`iter_grad_accum_global_norm` is wrapped. Left as it was with packing or dynamic batches
(no padding to save) and for any iterable that is not a replay buffer's DataLoader.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from openrlhf_oppo.hooks import Patch
from openrlhf_oppo.integrations.runtime.run_config import config_or_none
from openrlhf_oppo.upstream import OPENRLHF_VERSION

# the share of the padded training tokens a window's buckets saved: OpenRLHF's actor logs every
# tensor of a micro-batch's `info` in its step's status, so it reaches the run's metrics as a key of its own
PADDING_SAVED = "oppo/padding_saved"
EXPERIENCE_PADDING_SAVED = "oppo/experience_padding_saved"  # the same for experience making's forwards


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """The run is OPPO's (its config is in the environment) and asks for length buckets."""
    config = config_or_none(environ)
    return config is not None and config.train.length_buckets


def regroup(batches: Iterable[list[int]], lengths: list[int], window: int) -> Iterator[tuple[list, list]]:
    """`batches` (lists of sample indices, as a DataLoader's batch sampler draws them) window by
    window: (the window's `window` batches as drawn, as many batches of the same sizes holding the
    same samples sorted by `lengths`, shortest first). A trailing partial window comes alike."""
    pending: list[list[int]] = []
    for batch in batches:
        pending.append(list(batch))
        if len(pending) == window:
            yield pending, _sorted(pending, lengths)
            pending = []
    if pending:
        yield pending, _sorted(pending, lengths)


def _sorted(batches: list[list[int]], lengths: list[int]) -> list[list[int]]:
    order = sorted((i for batch in batches for i in batch), key=lambda i: lengths[i])
    out = []
    start = 0
    for batch in batches:
        out.append(order[start:start + len(batch)])
        start += len(batch)
    return out


def experience_micro_batches(lengths: list[int], size: int, ranks: int) -> list[list[int]]:
    """Experience making's micro-batches of sample indices with the least padding: the samples
    sorted by `lengths`, cut into OpenRLHF's fixed split's sizes (`size`, the last one short),
    and ordered so that the `ranks` contiguous runs `async_run_method_batch` hands each data-
    parallel rank (ceil(M / ranks) micro-batches each, the last rank the rest) hold about equal
    padded tokens: longest first, each to the least-loaded rank with room."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    cuts = [order[i:i + size] for i in range(0, len(order), size)]
    per = -(-len(cuts) // max(ranks, 1))
    room = [max(0, min(per, len(cuts) - r * per)) for r in range(max(ranks, 1))]
    load = [0] * len(room)  # padded tokens per rank
    held = [[] for _ in room]  # micro-batches per rank
    by_cost = sorted(((padded_tokens([c], lengths), c) for c in cuts), key=lambda pair: -pair[0])
    for cost, cut in by_cost:
        with_room = (r for r in range(len(room)) if len(held[r]) < room[r])
        r = min(with_room, key=lambda r: (load[r], r))
        held[r].append(cut)
        load[r] += cost
    return [cut for rank in held for cut in rank]


def bucket_experience_making(maker) -> dict[str, float]:
    """Make OpenRLHF's experience `maker` (`RemoteExperienceMaker`, in the driver) split a batch into
    `experience_micro_batches` instead of cutting it in rollout order: the actor, critic, reward and
    reference forwards pad each sample only to the longest beside it. Each sample keeps its
    `index` (its position in the batch), by which OpenRLHF puts group baselines and rewards back in
    rollout order, so only the padding changes; as many micro-batches as before, so every data-
    parallel rank still makes as many forward calls. Left as it was with dynamic batches.
    Returns {EXPERIENCE_PADDING_SAVED: the last batch's share of padded tokens saved}."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    args = maker.strategy.args
    group = maker.actor_model_group
    ranks = len(group._actor_handlers) // group.duplicate_actors
    split = maker.split_rollout_samples
    stats = {}

    def split_rollout_samples(rollout_samples):
        if args.train.dynamic_batch_enable:
            return split(rollout_samples)
        for i, sample in enumerate(rollout_samples):
            sample.index = [i]
        lengths = [s.sequences.shape[-1] for s in rollout_samples]
        size = args.rollout.micro_batch_size
        cuts = experience_micro_batches(lengths, size, ranks)
        plain = [list(range(len(lengths)))[i:i + size] for i in range(0, len(lengths), size)]
        stats[EXPERIENCE_PADDING_SAVED] = 1.0 - padded_tokens(cuts, lengths) / max(padded_tokens(plain, lengths), 1)
        return [Experience.concat_experiences([rollout_samples[i] for i in cut], maker.tokenizer.pad_token_id)
                for cut in cuts]

    split_rollout_samples.__wrapped__ = split
    maker.split_rollout_samples = split_rollout_samples
    return stats


def padded_tokens(batches: Iterable[list[int]], lengths: list[int]) -> int:
    """Tokens the batches cost right-padded: each batch's size x its longest sample."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches if b)


def bucketed(data_iter, accumulated_gradient: int) -> Iterator:
    """The collated micro-batches of `data_iter` (OpenRLHF's tqdm over its replay buffer's
    DataLoader) in length-bucketed order, each with `PADDING_SAVED` in its `info`; the progress
    bar advances a micro-batch at a time."""
    import torch

    loader = getattr(data_iter, "iterable", data_iter)
    buffer = loader.dataset
    lengths = [item.sequences.shape[-1] for item in buffer.items]
    # drawn as iterating the loader draws them: torch takes the iterator's base seed from the
    # loader's generator before the sampler's first draw, so each window holds the same samples
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
    pin = loader.pin_memory and torch.cuda.is_available()
    for plain, window in regroup(loader.batch_sampler, lengths, max(int(accumulated_gradient), 1)):
        saved = 1.0 - padded_tokens(window, lengths) / padded_tokens(plain, lengths)
        for batch in window:
            experience = loader.collate_fn([buffer[i] for i in batch])
            experience.info[PADDING_SAVED] = torch.full((len(batch),), saved)  # per sample: logged as their mean
            yield experience.pin_memory() if pin else experience
            if data_iter is not loader:
                data_iter.update(1)
    if data_iter is not loader:
        data_iter.close()


def _bucketable(data_iter) -> bool:
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
    from torch.utils.data import DataLoader

    loader = getattr(data_iter, "iterable", data_iter)
    return (isinstance(loader, DataLoader) and isinstance(loader.dataset, NaiveReplayBuffer)
            and not loader.dataset.packing_samples and not loader.dataset.dynamic_batch
            and loader.batch_sampler is not None)


def wrap_iter_grad_accum(module) -> None:
    """`module.iter_grad_accum_global_norm(data_iter, strategy, accumulated_gradient, mask_fn)`
    fed the bucketed micro-batches: its windows, and so its loss normalisers, are unchanged."""
    original = module.iter_grad_accum_global_norm

    def iter_grad_accum_global_norm(data_iter, strategy, accumulated_gradient, mask_fn):
        if _bucketable(data_iter):
            data_iter = bucketed(data_iter, accumulated_gradient)
        return original(data_iter, strategy, accumulated_gradient, mask_fn)

    iter_grad_accum_global_norm.__wrapped__ = original
    module.iter_grad_accum_global_norm = iter_grad_accum_global_norm


PATCHES: tuple[Patch, ...] = tuple(
    Patch(f"length_buckets_{role}", f"openrlhf.trainer.ray.ppo_{role}", wrap_iter_grad_accum,
          f"openrlhf {OPENRLHF_VERSION}")
    for role in ("actor", "critic")
)
