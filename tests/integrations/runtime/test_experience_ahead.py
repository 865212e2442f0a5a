"""make_experience's forwards ahead of the batch (`--oppo.streaming.experience_ahead`), driven through
OpenRLHF 0.11.2's own `RemoteExperienceMaker.make_experience_batch` with stand-in model groups: Ray's
object store is replaced by the objects themselves (no cluster: the groups answer in this process), and
each group's `forward` gives every row a value of its own tokens and position only, as a model does
whatever it is batched with (the real forwards: `tests/cli/test_train_oppo_on_cpu.py`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from openrlhf.trainer.ppo_utils import experience_maker
from openrlhf.trainer.ppo_utils.experience import Experience

from openrlhf_oppo.integrations.runtime import experience_ahead, micro_batches
from openrlhf_oppo.integrations.runtime.experience_ahead import AHEAD_FRACTION, ExperienceAhead

PROMPT, VOCAB = 2, 50
IDENTITY_RAY = SimpleNamespace(put=lambda obj: obj, get=lambda refs: refs)


@pytest.fixture(autouse=True)
def no_object_store(monkeypatch):
    monkeypatch.setattr(experience_ahead, "ray", IDENTITY_RAY)
    monkeypatch.setattr(experience_maker, "ray", IDENTITY_RAY)


class Group:
    """A model group of `ranks` data-parallel ranks whose forward is row-local: `scale` x the next token."""

    def __init__(self, scale: float, ranks: int = 1):
        self._actor_handlers, self.duplicate_actors, self.scale = ["rank"] * ranks, 1, scale
        self.calls: list[list[int]] = []  # per call: the rows of each micro-batch each rank forwards

    def async_run_method_batch(self, method_name, sequences, action_mask, attention_mask, **_):
        assert method_name == "forward"
        ranks = len(self._actor_handlers)
        per = -(-len(sequences) // ranks)  # OpenRLHF's round-robin chunks
        chunks = [list(range(len(sequences)))[r * per:(r + 1) * per] for r in range(ranks)]
        assert len({len(c) for c in chunks}) == 1, f"ranks make unequal forward calls: {chunks}"
        self.calls.append([int(sequences[i].shape[0]) for i in range(len(sequences))])
        return [[self.scale * sequences[i][:, 1:].float() * action_mask[i].float() for i in c] for c in chunks]

    def async_run_method(self, method_name, **_):
        return []


def _maker(ranks: int = 1, bucket: bool = True, ahead: bool = True):
    ns = SimpleNamespace
    args = ns(train=ns(dynamic_batch_enable=False, colocate_all=False, colocate_actor_ref=False,
                       colocate_critic_reward=False),
              rollout=ns(micro_batch_size=4, n_samples_per_prompt=2), ds=ns(ring_attn_size=1, tensor_parallel_size=1),
              algo=ns(advantage=ns(estimator="gae", gamma=1.0, lambd=0.95, no_std_norm=False),
                      kl=ns(use_loss=False, estimator="k1")),
              reward=ns(clip_range=None))
    maker = object.__new__(experience_maker.RemoteExperienceMaker)
    maker.strategy, maker.args, maker.advantage_estimator = ns(args=args), args, "gae"
    maker.kl_ctl, maker.tokenizer = ns(value=0.01), ns(pad_token_id=0)
    maker.actor_model_group, maker.critic_model_group = Group(0.01, ranks), Group(-0.02, ranks)
    maker.initial_model_group, maker.reward_model_group = Group(0.005, ranks), None
    maker.ahead = ExperienceAhead(maker, reference_streamed=False) if ahead else None
    micro_batches.bucket_experience_making(maker, bucket, maker.ahead.partition if ahead else None)
    return maker


def _samples(lengths: list[int]) -> list[Experience]:
    """Single-sample experiences as the generator builds them (groups of 2 in a row), rewards streamed."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate(lengths):
        sequences = torch.randint(1, VOCAB, (1, PROMPT + n), generator=gen)
        sequences[0, 0] = i + 1  # tells samples apart
        action_mask = torch.zeros(1, PROMPT + n - 1, dtype=torch.bool)
        action_mask[0, PROMPT - 1:] = True
        out.append(Experience(sequences=sequences, attention_mask=torch.ones_like(sequences), action_mask=action_mask,
                              rewards=torch.randn(1, generator=gen), info={}, prompts=[f"p{i // 2}"], labels=["l"]))
    return out


LENGTHS = [3, 40, 5, 38, 4, 6, 41, 2, 9, 17, 30, 1, 12, 8, 25, 7]  # 8 groups of 2


def _by_sample(experiences) -> dict[int, tuple]:
    out = {}
    for exp in experiences:
        for row, i in enumerate(exp.index):
            where = exp.action_mask[row].bool()
            out[i] = (exp.action_log_probs[row][where], exp.values[row][where], exp.advantages[row][where])
    return out


@pytest.mark.parametrize("ranks, committed, forwarded, lead", [
    (1, 6, 12, 1),  # 12 committed samples in rounds of 4: the batch's last 4 left, one micro-batch
    (2, 6, 8, 2),  # rounds of 8 (4 a rank): 8 forwarded, 4 pending + 4 left = 8 samples, 2 micro-batches
    (1, 0, 0, 4),  # nothing committed before the batch: make_experience forwards everything
])
def test_forwards_ahead_give_make_experience_the_same_rows_and_leave_only_the_rest(ranks, committed, forwarded,
                                                                                  lead):
    plain = _maker(ranks, ahead=False)
    expected = _by_sample(plain.make_experience_batch(_samples(LENGTHS)))
    maker = _maker(ranks)
    samples = _samples(LENGTHS)
    maker.ahead.add_groups(range(committed), lambda g: samples[2 * g:2 * g + 2])
    maker.ahead.add_groups(range(committed), lambda g: pytest.fail("a group handed over twice"))
    assert all(c == [4] * ranks for c in maker.actor_model_group.calls)  # one micro-batch a rank a round
    assert sum(map(sum, maker.actor_model_group.calls)) == forwarded
    got = _by_sample(maker.make_experience_batch(samples))
    assert maker.ahead.lead == lead and maker.ahead.stats[AHEAD_FRACTION] == forwarded / len(LENGTHS)
    for group in (maker.actor_model_group, maker.critic_model_group, maker.initial_model_group):
        made = group.calls[len(group.calls) - (1 if lead else 0):]
        assert sum(map(len, made)) == lead and sum(map(sum, made)) == len(LENGTHS) - forwarded
    assert sorted(got) == sorted(expected) == list(range(len(LENGTHS)))
    for i in expected:  # the rows exactly; GAE's sums over other micro-batch shapes to rounding
        torch.testing.assert_close(got[i][:2], expected[i][:2], rtol=0, atol=0)
        torch.testing.assert_close(got[i][2], expected[i][2])
    maker.ahead.reset()
    assert maker.ahead.lead is None and not any(maker.ahead.rows.values()) and not maker.ahead.seen


def test_the_rest_is_topped_up_with_the_shortest_forwarded_samples_so_every_rank_forwards_alike():
    """2 ranks, 12 samples, 8 forwarded: the 4 left make one micro-batch, so the shortest forwarded
    sample joins them (two micro-batches, one a rank); the rest come from the rows."""
    maker = _maker(ranks=2, bucket=False)
    samples = _samples(LENGTHS[:12])
    maker.ahead.add_groups(range(4), lambda g: samples[2 * g:2 * g + 2])
    todo, held = maker.ahead.partition(samples)
    shortest = min(range(8), key=lambda i: LENGTHS[i])  # sample 7, 2 tokens
    assert todo == [8, 9, 10, 11, shortest] and sorted(held) == sorted(set(range(8)) - {shortest})
    assert maker.ahead.lead == 2


def test_a_sample_split_as_forwarded_without_rows_is_refused_by_name():
    maker = _maker()
    samples = _samples(LENGTHS[:4])
    maker.ahead.add_groups(range(2), lambda g: samples[2 * g:2 * g + 2])
    assert maker.ahead.partition(samples) == [[], [0, 2, 3, 1]] and maker.ahead.lead == 0  # shortest first
    maker.ahead.rows["actor"].clear()  # lost: make_experience must not train on zeros
    batch = Experience.concat_experiences(samples, 0)
    with pytest.raises(RuntimeError, match="row 0 of a micro-batch .* has no actor rows forwarded ahead"):
        maker._dispatch_forward(maker.actor_model_group, False, sequences=[batch.sequences],
                                attention_mask=[batch.attention_mask], action_mask=[batch.action_mask])
