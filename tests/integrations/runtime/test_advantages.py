"""Whole-tensor GAE and REINFORCE returns (integrations.runtime.advantages) against OpenRLHF
0.11.2's own per-position loops, on right-padded micro-batches as its experience maker builds them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="OpenRLHF's trainer imports Ray (scripts/gpu_checks.sh carries none)")
import torch
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

from openrlhf_oppo.integrations.runtime import advantages


def _micro_batch(lengths: list[int], seed: int, dtype=torch.float32):
    """values, rewards (a KL term on every token, the reward on the last) and the action mask of
    right-padded responses of `lengths`."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    mask = torch.zeros(len(lengths), width)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    values = torch.randn(len(lengths), width, generator=gen).to(dtype)
    rewards = (0.01 * torch.randn(len(lengths), width, generator=gen)).to(dtype)
    return values, rewards, mask


def test_discounted_reverse_cumsum_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]])
    # c = 0.5: y2 = x2, y1 = x1 + 0.5 y2, y0 = x0 + 0.5 y1
    assert advantages.discounted_reverse_cumsum(x, 0.5).tolist() == [[1 + 0.5 * 3.5, 3.5, 3.0], [1.0, 2.0, 4.0]]
    assert advantages.discounted_reverse_cumsum(x, 1.0, block=2).tolist() == [[6.0, 5.0, 3.0], [4.0, 4.0, 4.0]]
    assert advantages.discounted_reverse_cumsum(x, 0.0).tolist() == x.tolist()


@pytest.mark.parametrize("lengths", [[1], [5, 3], [255, 256, 257], [700, 12, 513, 1]])
@pytest.mark.parametrize("gamma,lambd", [(1.0, 0.95), (1.0, 1.0), (0.99, 0.9), (0.9, 0.0)])
def test_gae_equals_openrlhfs_loop(lengths, gamma, lambd):
    values, rewards, mask = _micro_batch(lengths, seed=len(lengths))
    want = RemoteExperienceMaker.get_advantages_and_returns(None, values, rewards, mask, gamma, lambd)
    got = advantages.gae(values, rewards, mask, gamma, lambd)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths", [[1], [300, 40], [1024, 8, 600]])
@pytest.mark.parametrize("gamma", [1.0, 0.97])
def test_cumulative_returns_equal_openrlhfs_loop(lengths, gamma):
    _, rewards, mask = _micro_batch(lengths, seed=7)
    want = RemoteExperienceMaker.get_cumulative_returns(None, rewards, mask, gamma)
    got = advantages.cumulative_returns(rewards, mask, gamma)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _maker(estimator: str):
    """OpenRLHF 0.11.2's `RemoteExperienceMaker` with only what its advantage step reads."""
    ns = SimpleNamespace
    args = ns(rollout=ns(n_samples_per_prompt=2), reward=ns(clip_range=None),
              algo=ns(advantage=ns(estimator=estimator, gamma=1.0, lambd=0.95, no_std_norm=False)))
    maker = object.__new__(RemoteExperienceMaker)
    maker.strategy, maker.args, maker.advantage_estimator, maker.kl_ctl = ns(args=args), args, estimator, ns(value=0.01)
    return maker


def _experiences(lengths: list[list[int]]) -> list[Experience]:
    """Micro-batches of experiences with the values, KL and rewards the forwards attach."""
    out, index = [], 0
    for i, micro in enumerate(lengths):
        values, kl, mask = _micro_batch(micro, seed=i)
        out.append(Experience(action_mask=mask.bool(), values=values, kl=kl, info={},
                              rewards=torch.randn(len(micro), generator=torch.Generator().manual_seed(i)),
                              index=list(range(index, index + len(micro)))))
        index += len(micro)
    return out


@pytest.mark.parametrize("estimator", ["gae", "reinforce", "reinforce_baseline"])
def test_installed_on_the_experience_maker_every_sample_gets_openrlhfs_advantages(estimator):
    """OpenRLHF's own `compute_advantages_and_returns` (reward shaping, KL, whitening) with and
    without `install`: the same advantages and returns for every sample."""
    lengths = [[3, 40], [600, 5], [2, 300]]
    plain, ours = _maker(estimator), _maker(estimator)
    timed_plain, timed_ours = advantages.install(plain, vectorized=False), advantages.install(ours, vectorized=True)
    assert ours.get_advantages_and_returns is advantages.gae and "get_advantages_and_returns" not in vars(plain)
    assert timed_plain == timed_ours == {}
    want = plain.compute_advantages_and_returns(_experiences(lengths))
    got = ours.compute_advantages_and_returns(_experiences(lengths))
    # each timed the whole advantage step of its batch
    assert 0 < timed_ours[advantages.ADVANTAGE_S] and 0 < timed_plain[advantages.ADVANTAGE_S]
    for w, g in zip(want, got):
        torch.testing.assert_close(g.advantages, w.advantages, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(g.returns, w.returns, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_gae_on_cuda_tensors_equals_openrlhfs_loop():
    """The blocks are built on the input's device: CUDA tensors in, CUDA tensors out, OpenRLHF's values."""
    values, rewards, mask = (t.cuda() for t in _micro_batch([700, 12, 513, 1], seed=3))
    want = RemoteExperienceMaker.get_advantages_and_returns(None, values, rewards, mask, 1.0, 0.95)
    got = advantages.gae(values, rewards, mask, 1.0, 0.95)
    for w, g in zip(want, got):
        assert g.device == w.device
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
