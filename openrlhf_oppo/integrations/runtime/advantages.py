"""GAE advantages and REINFORCE returns in whole-tensor operations.

OpenRLHF 0.11.2's experience maker (`RemoteExperienceMaker.get_advantages_and_returns` and
`get_cumulative_returns`) walks each micro-batch's response positions backwards in Python, a
few tensor operations per position, in the trainer's process after the forwards and before the
update: 16-19 µs a position on a 2-core host (`python -m oppo_lab advantages`), so a
micro-batch padded to 16,384 tokens costs 0.27 s there, every step, while the training devices
wait. Both are one recurrence, y_t = x_t + c * y_{t+1} with y_T = 0 (GAE: x the TD residuals,
c = γλ; REINFORCE: x the masked rewards, c = γ); `discounted_reverse_cumsum` solves it in
blocks of `BLOCK` positions, each a matrix product with the powers of c (no power above 1, so
no overflow for any length), one Python iteration a block.

With `--oppo.train.vectorized_advantages` (default on) `install` puts both on OPPO's trainer's
experience maker; the values equal OpenRLHF's to float rounding
(`tests/integrations/runtime/test_advantages.py` compares them with OpenRLHF's own methods).
Either way each step reports the seconds of OpenRLHF's whole advantage step (`ADVANTAGE_S`).
"""

from __future__ import annotations

import time

import torch

ADVANTAGE_S = "oppo/advantage_s"  # seconds of the last batch's `compute_advantages_and_returns`

BLOCK = 256  # positions per matrix product: a 256 x 256 matrix of powers, 64 products for 16K tokens


def discounted_reverse_cumsum(x: torch.Tensor, c: float, block: int = BLOCK) -> torch.Tensor:
    """y with y[:, t] = x[:, t] + c * y[:, t + 1] along dim 1 (y past the end is 0), in float64
    internally and `x`'s dtype out."""
    rows, length = x.shape
    xd = x.double()
    out = torch.empty_like(xd)
    span = torch.arange(block, dtype=torch.float64, device=x.device)
    base = torch.tensor(float(c), dtype=torch.float64, device=x.device)
    gap = span[None, :] - span[:, None]  # [i, j] = j - i
    powers = torch.where(gap >= 0, base ** gap.clamp(min=0), 0.0)
    carry = xd.new_zeros(rows)
    for end in range(length, 0, -block):
        start = max(0, end - block)
        k = end - start
        # y_i = sum_{j >= i} c^(j - i) x_j within the block, plus c^(k - i) y_end from the block after it
        tail = base ** (k - span[:k])
        out[:, start:end] = xd[:, start:end] @ powers[:k, :k].T + carry[:, None] * tail[None, :]
        carry = out[:, start]
    return out.to(x.dtype)


def gae(values: torch.Tensor, rewards: torch.Tensor, action_mask: torch.Tensor | None, gamma: float,
        lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) as `RemoteExperienceMaker.get_advantages_and_returns` computes them."""
    if action_mask is not None:
        values = action_mask * values
        rewards = action_mask * rewards
    next_values = torch.zeros_like(values)
    next_values[:, :-1] = values[:, 1:]
    deltas = rewards + gamma * next_values - values
    advantages = discounted_reverse_cumsum(deltas, gamma * lambd)
    return advantages.detach(), advantages + values


def cumulative_returns(rewards: torch.Tensor, action_mask: torch.Tensor | None, gamma: float) -> torch.Tensor:
    """Returns as `RemoteExperienceMaker.get_cumulative_returns` computes them."""
    if action_mask is not None:
        rewards = action_mask * rewards
    return discounted_reverse_cumsum(rewards, gamma)


def install(maker, vectorized: bool) -> dict[str, float]:
    """Time OpenRLHF's experience `maker`'s advantage step (`compute_advantages_and_returns`: reward
    shaping, KL, the advantages, whitening) and, if `vectorized`, put `gae` and `cumulative_returns`
    in place of its loops (it calls both through the instance). Returns {ADVANTAGE_S: the last
    batch's seconds}, filled as batches come."""
    if vectorized:
        maker.get_advantages_and_returns = gae
        maker.get_cumulative_returns = cumulative_returns
    compute = maker.compute_advantages_and_returns
    stats = {}

    def timed(experiences):
        start = time.perf_counter()
        out = compute(experiences)
        stats[ADVANTAGE_S] = time.perf_counter() - start
        return out

    timed.__wrapped__ = compute
    maker.compute_advantages_and_returns = timed
    return stats
