"""`python -m oppo_lab advantages`: GAE and REINFORCE returns, OpenRLHF 0.11.2's per-position
loop against OPPO's whole-tensor version (`integrations.runtime.advantages`), on this host.

Both run where OpenRLHF runs them: in the trainer's process, on CPU tensors, once per
make_experience micro-batch, after the forwards and before the update. Prints, per micro-batch
shape (rows x padded response length), each one's milliseconds, its microseconds per padded
position, and the ratio. The loop's cost per position is what the simulator charges OpenRLHF's
schedules for a micro-batch's advantages (`efficiency.advantage_loop_s_per_token`).
"""

from __future__ import annotations

import argparse
import time
from functools import partial

SHAPES = ((4, 256), (4, 1024), (16, 1024), (1, 4096), (4, 8192), (1, 16384))


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oppo_lab advantages", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="timed calls per shape and method (after one warm-up)")
    p.add_argument("--estimator", choices=("gae", "reinforce"), default="gae",
                   help="gae: get_advantages_and_returns (gamma 1, lambda 0.95); reinforce: get_cumulative_returns")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats: {args.repeats}; allowed: an integer >= 1")

    import torch

    from openrlhf_oppo import compat

    compat.apply()  # OpenRLHF's models package imports flash-attn at module top: the stand-in on CPU
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker as Maker

    from openrlhf_oppo.integrations.runtime import advantages

    torch.manual_seed(0)
    print(f"{args.estimator}: OpenRLHF 0.11.2's loop against the whole-tensor version, {torch.get_num_threads()} "
          f"torch threads, mean of {args.repeats} calls")
    print(f"{'rows x length':>14} {'loop ms':>9} {'us/position':>12} {'ours ms':>9} {'us/position':>12} {'x':>7}")
    for rows, length in SHAPES:
        values, rewards, mask = torch.randn(rows, length), torch.randn(rows, length), torch.ones(rows, length)
        if args.estimator == "gae":
            calls = (partial(Maker.get_advantages_and_returns, None, values, rewards, mask, 1.0, 0.95),
                     partial(advantages.gae, values, rewards, mask, 1.0, 0.95))
        else:
            calls = (partial(Maker.get_cumulative_returns, None, rewards, mask, 1.0),
                     partial(advantages.cumulative_returns, rewards, mask, 1.0))
        loop, ours = (_time(call, args.repeats) for call in calls)
        print(f"{f'{rows} x {length}':>14} {loop * 1e3:9.2f} {loop / length * 1e6:12.2f} {ours * 1e3:9.2f} "
              f"{ours / length * 1e6:12.2f} {loop / ours:6.1f}x")
    return 0
