"""Length-bucketed training micro-batches (integrations.runtime.micro_batches), on OpenRLHF
0.11.2's own replay buffer, DataLoader set-up, window normaliser and loss aggregation."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
import torch
from openrlhf.models.loss import aggregate_loss
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
from openrlhf.utils import loss_utils
from torch.utils.data import DataLoader
from tqdm import tqdm

from openrlhf_oppo import run_env
from openrlhf_oppo.integrations.runtime import micro_batches, startup

PROMPT = 2
VOCAB = 11


def test_regroup_sorts_each_window_and_keeps_batch_sizes():
    lengths = [5, 1, 9, 3, 7, 2, 8, 4]
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
    windows = list(micro_batches.regroup(batches, lengths, window=2))
    assert [plain for plain, _ in windows] == [batches[:2], batches[2:]]  # as drawn
    out = [b for _, bucketed in windows for b in bucketed]
    # window 1 holds samples 0-3 (lengths 5 1 9 3), window 2 samples 4-7 (7 2 8 4)
    assert out == [[1, 3], [0, 2], [5, 7], [4, 6]]
    # padded: 2x5 + 2x9 + 2x7 + 2x8 = 58 before, 2x3 + 2x9 + 2x4 + 2x8 = 48 after
    assert micro_batches.padded_tokens(batches, lengths) == 58
    assert micro_batches.padded_tokens(out, lengths) == 48


def test_regroup_keeps_a_trailing_partial_window_and_uneven_batches():
    lengths = [4, 1, 3, 2, 9]
    out = [b for _, bucketed in micro_batches.regroup([[0, 1, 2], [3], [4]], lengths, window=2) for b in bucketed]
    assert out == [[1, 3, 2], [0], [4]]  # lengths 1 2 3 | 4 | 9


def test_enabled_reads_the_oppo_config_in_the_environment():
    assert not micro_batches.enabled({})
    assert micro_batches.enabled({run_env.CONFIG_JSON: json.dumps({})})  # the default is on
    assert not micro_batches.enabled({run_env.CONFIG_JSON: json.dumps({"train": {"length_buckets": False}})})
    assert micro_batches.PATCHES in startup.patch_lists({run_env.CONFIG_JSON: "{}"})
    assert micro_batches.PATCHES not in startup.patch_lists({})


def _buffer(responses: list[int], seed: int = 0) -> NaiveReplayBuffer:
    g = torch.Generator().manual_seed(seed)
    buffer = NaiveReplayBuffer(sample_batch_size=2, cpu_offload=True)
    for n in responses:
        t = PROMPT + n
        buffer.items.append(Experience(
            sequences=torch.randint(0, VOCAB, (t,), generator=g), attention_mask=torch.ones(t, dtype=torch.long),
            action_mask=torch.ones(n, dtype=torch.bool), advantages=torch.randn(n, generator=g),
            total_length=torch.tensor(t), response_length=torch.tensor(n)))
    return buffer


def _epoch(buffer: NaiveReplayBuffer, module, gas: int, seed: int) -> list:
    """One epoch as OpenRLHF 0.11.2's `ppo_train` runs it: a shuffled DataLoader over the replay
    buffer, in a progress bar, through `module.iter_grad_accum_global_norm`."""
    torch.manual_seed(seed)
    loader = DataLoader(buffer, batch_size=buffer.sample_batch_size, shuffle=True, drop_last=True,
                        collate_fn=buffer.collate_fn)
    pbar = tqdm(loader, file=io.StringIO())  # rank 0's bar
    out = list(module.iter_grad_accum_global_norm(pbar, None, gas, lambda e: e.action_mask))
    assert pbar.n == len(loader)
    return out


def _gradient(micro: list) -> torch.Tensor:
    """The gradient of a token-level policy-gradient loss over the epoch, each micro-batch's loss
    aggregated by OpenRLHF's `aggregate_loss` with its window's normalisers."""
    weight = torch.linspace(-1, 1, VOCAB, requires_grad=True)
    for experience, info in micro:
        actions = experience.sequences[:, PROMPT:]
        loss = -(experience.advantages * weight[actions])
        aggregate_loss(loss, experience.action_mask, token_level_loss=True, **info).backward()
    return weight.grad


def test_openrlhf_epoch_is_regrouped_with_the_same_windows_less_padding_and_the_same_gradient():
    responses = [3, 40, 5, 7, 90, 2, 11, 4, 60, 6, 8, 3]  # 12 samples: 3 windows of 2 micro-batches of 2
    buffer, gas = _buffer(responses), 2
    plain = _epoch(buffer, loss_utils, gas, seed=7)
    module = SimpleNamespace(iter_grad_accum_global_norm=loss_utils.iter_grad_accum_global_norm)
    micro_batches.wrap_iter_grad_accum(module)
    bucketed = _epoch(buffer, module, gas, seed=7)

    def samples(micro):
        return [sorted(int(n) for e, _ in micro[w:w + gas] for n in e.response_length) for w in range(0, 12 // 2, gas)]

    assert samples(bucketed) == samples(plain)  # every optimizer step trains the same samples
    for (_, info_b), (_, info_p) in zip(bucketed, plain, strict=True):  # and normalises alike
        assert float(info_b["batch_num_tokens"]) == float(info_p["batch_num_tokens"])
    for experience, _ in bucketed:  # each micro-batch sorted within its window, padded to its longest
        assert experience.sequences.shape[1] == PROMPT + int(experience.response_length.max())
    width = sum(e.sequences.numel() for e, _ in bucketed)
    assert width < sum(e.sequences.numel() for e, _ in plain)
    for w in range(0, len(plain), gas):  # each micro-batch reports its window's saving, as padded by collate
        padded = [sum(e.sequences.numel() for e, _ in micro[w:w + gas]) for micro in (bucketed, plain)]
        for e, _ in bucketed[w:w + gas]:
            assert e.info[micro_batches.PADDING_SAVED].tolist() == pytest.approx([1 - padded[0] / padded[1]] * 2)
    assert torch.allclose(_gradient(bucketed), _gradient(plain), atol=1e-6)


def test_packed_or_dynamic_buffers_and_other_iterables_are_left_alone():
    module = SimpleNamespace(iter_grad_accum_global_norm=lambda data_iter, *a: list(data_iter))
    micro_batches.wrap_iter_grad_accum(module)
    assert module.iter_grad_accum_global_norm([3, 1, 2], None, 2, None) == [3, 1, 2]
    buffer = _buffer([9, 1, 8, 2])
    buffer.packing_samples = True
    loader = DataLoader(buffer, batch_size=2, shuffle=False, collate_fn=buffer.collate_fn)
    out = module.iter_grad_accum_global_norm(tqdm(loader, disable=True), None, 2, None)
    assert [e.response_length.tolist() for e in out] == [[9, 1], [8, 2]]


@pytest.mark.gpu
def test_on_a_gpu_bucketed_micro_batches_are_pinned_as_openrlhfs_loader_pins_them():
    """`ppo_train` builds its DataLoader with `pin_memory` on a GPU: the regrouped micro-batches
    are pinned too, so `experience.to_device` copies them asynchronously as before."""
    buffer = _buffer([3, 40, 5, 7])
    loader = DataLoader(buffer, batch_size=2, shuffle=True, drop_last=True, pin_memory=True,
                        collate_fn=buffer.collate_fn)
    module = SimpleNamespace(iter_grad_accum_global_norm=loss_utils.iter_grad_accum_global_norm)
    micro_batches.wrap_iter_grad_accum(module)
    out = list(module.iter_grad_accum_global_norm(tqdm(loader, file=io.StringIO()), None, 2, lambda e: e.action_mask))
    assert len(out) == 2 and all(e.sequences.is_pinned() and e.advantages.is_pinned() for e, _ in out)


@pytest.mark.parametrize("value", [True, False])
def test_the_flag_reaches_the_config(value):
    from openrlhf_oppo import config

    cfg = config.from_dict({"train": {"length_buckets": value}})
    assert micro_batches.enabled({run_env.CONFIG_JSON: json.dumps(config.to_dict(cfg))}) is value


# ---------------------------------------------------------------- experience making's micro-batches


def test_experience_micro_batches_pad_least_and_give_each_rank_equal_work():
    lengths = [5, 100, 7, 90, 6, 8, 95, 4]
    # sorted: 4 5 6 7 8 90 95 100 -> cuts [7 0] (2x5), [4 2] (2x7), [5 3] (2x90), [6 1] (2x100); two ranks take
    # two micro-batches each: 200 -> rank 0, 180 -> rank 1, 14 -> rank 1 (194 < 200), 10 -> rank 0 (rank 1 full)
    out = micro_batches.experience_micro_batches(lengths, size=2, ranks=2)
    assert out == [[6, 1], [7, 0], [5, 3], [4, 2]]
    assert micro_batches.padded_tokens(out, lengths) == 404
    # in rollout order (OpenRLHF's split): [5 100] [7 90] [6 8] [95 4] = 200 + 180 + 16 + 190
    assert micro_batches.padded_tokens([[0, 1], [2, 3], [4, 5], [6, 7]], lengths) == 586
    # rank 0's run (the first two) and rank 1's hold 210 and 194 padded tokens
    assert [micro_batches.padded_tokens(out[:2], lengths), micro_batches.padded_tokens(out[2:], lengths)] == [210, 194]


@pytest.mark.parametrize("n, size, ranks", [(5, 2, 1), (16, 4, 1), (14, 2, 3), (12, 4, 3)])
def test_experience_micro_batches_keep_openrlhfs_sizes_and_calls_per_rank(n, size, ranks):
    """Every sample once; the micro-batch sizes OpenRLHF's fixed split makes (the last one short);
    and each rank's contiguous run as long as `async_run_method_batch` cuts it (ZeRO-3: every rank
    makes as many forward calls)."""
    lengths = [(7 * i) % 11 + 1 for i in range(n)]
    out = micro_batches.experience_micro_batches(lengths, size, ranks)
    assert sorted(i for cut in out for i in cut) == list(range(n))
    assert sorted(map(len, out)) == sorted(len(range(n)[i:i + size]) for i in range(0, n, size))
    per = -(-len(out) // ranks)
    for r in range(ranks):
        assert micro_batches.padded_tokens(out[r * per:(r + 1) * per], lengths) > 0
    assert micro_batches.padded_tokens(out, lengths) <= micro_batches.padded_tokens(
        [list(range(n))[i:i + size] for i in range(0, n, size)], lengths)


def _maker(estimator: str, bucketed: bool):
    """OpenRLHF 0.11.2's `RemoteExperienceMaker` with only what splitting and advantages read."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    ns = SimpleNamespace
    args = ns(train=ns(dynamic_batch_enable=False), rollout=ns(micro_batch_size=2, n_samples_per_prompt=2),
              algo=ns(advantage=ns(estimator=estimator, gamma=1.0, lambd=0.95, no_std_norm=False)),
              reward=ns(clip_range=None))
    maker = object.__new__(RemoteExperienceMaker)
    maker.strategy, maker.args, maker.advantage_estimator = ns(args=args), args, estimator
    maker.kl_ctl, maker.tokenizer = ns(value=0.01), ns(pad_token_id=0)
    maker.actor_model_group = ns(_actor_handlers=["rank0", "rank1"], duplicate_actors=1)
    maker.padding = micro_batches.bucket_experience_making(maker) if bucketed else None
    return maker


def _rollout(lengths: list[int]) -> list[Experience]:
    """Single-sample experiences as the generator hands them over (groups of 2 in a row), with the
    values and KL the forwards would have attached."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(lengths):
        sequences = torch.randint(1, VOCAB, (1, PROMPT + n), generator=gen)
        sequences[0, 0] = i + 1  # tells samples apart
        out.append(Experience(sequences=sequences, attention_mask=torch.ones_like(sequences),
                              action_mask=torch.ones(1, n, dtype=torch.bool), values=torch.randn(1, n, generator=gen),
                              kl=0.1 * torch.randn(1, n, generator=gen), rewards=torch.randn(1, generator=gen),
                              info={}, prompts=[f"p{i // 2}"], labels=["l"]))
    return out


@pytest.mark.parametrize("estimator", ["group_norm", "rloo", "gae"])
def test_bucketed_experience_making_gives_every_sample_openrlhfs_advantages(estimator):
    """Same batch, OpenRLHF's split and the bucketed one: every sample gets the same advantages
    and returns (group baselines follow OpenRLHF's `index`, not the micro-batch a sample sits
    in), and the forwards pad fewer tokens."""
    lengths = [3, 40, 5, 38, 4, 6, 41, 2]
    results = {}
    for bucketed in (False, True):
        maker = _maker(estimator, bucketed)
        batches = maker.split_rollout_samples(_rollout(lengths))
        padded = sum(b.sequences.numel() for b in batches)
        experiences = type(maker).compute_advantages_and_returns(maker, batches)  # OpenRLHF's own
        per_sample = {}
        for exp in experiences:
            for row, i in enumerate(exp.index):
                n = int(exp.action_mask[row].sum())
                per_sample[i] = (exp.sequences[row, :PROMPT + n], exp.advantages[row, :n], exp.returns[row, :n])
        results[bucketed] = per_sample, padded, len(batches)
    (plain, plain_padded, plain_calls), (ours, ours_padded, ours_calls) = results[False], results[True]
    # 2 prompt tokens each: [3 40] [5 38] [4 6] [41 2] pad to 2 x (42 + 40 + 8 + 43) = 266 tokens,
    # [2 3] [4 5] [6 38] [40 41] to 2 x (5 + 7 + 40 + 43) = 190
    assert (plain_padded, ours_padded) == (266, 190)
    assert maker.padding == {micro_batches.EXPERIENCE_PADDING_SAVED: pytest.approx(1 - 190 / 266)}
    assert sorted(ours) == sorted(plain) == list(range(len(lengths))) and ours_calls == plain_calls == 4
    for i in plain:
        assert torch.equal(ours[i][0], plain[i][0])
        torch.testing.assert_close(ours[i][1], plain[i][1])
        torch.testing.assert_close(ours[i][2], plain[i][2])
    assert ours_padded < plain_padded


def test_dynamic_batches_are_left_to_openrlhf():
    maker = _maker("gae", bucketed=False)
    maker.split_rollout_samples = lambda samples: ("openrlhf's split", samples)
    micro_batches.bucket_experience_making(maker)
    samples = _rollout([3, 4])
    maker.args.train.dynamic_batch_enable = True
    assert maker.split_rollout_samples(samples) == ("openrlhf's split", samples)
    maker.args.train.dynamic_batch_enable = False
    assert [b.index for b in maker.split_rollout_samples(samples)] == [[0, 1]]
