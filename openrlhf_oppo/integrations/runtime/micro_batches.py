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

import json
from collections.abc import Iterable, Iterator, Mapping

from openrlhf_oppo import config as oppo_config
from openrlhf_oppo import run_env
from openrlhf_oppo.hooks import Patch
from openrlhf_oppo.upstream import OPENRLHF_VERSION

# the share of the padded training tokens a window's buckets saved: OpenRLHF's actor logs every
# tensor of a micro-batch's `info` in its step's status, so it reaches the run's metrics as a key of its own
PADDING_SAVED = "oppo/padding_saved"


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """The run is OPPO's (its config is in the environment) and asks for length buckets."""
    raw = run_env.config_json(environ)
    return raw is not None and oppo_config.from_dict(json.loads(raw)).train.length_buckets


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
    out, start = [], 0
    for batch in batches:
        out.append(order[start:start + len(batch)])
        start += len(batch)
    return out


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
