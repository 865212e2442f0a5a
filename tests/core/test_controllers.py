"""Δ and C controllers against hand-computed sequences."""

from __future__ import annotations

import json

import pytest

from openrlhf_oppo.config import DELTA_RULES, ChunkConfig, DeltaConfig
from openrlhf_oppo.core import ChunkSizeController, DeltaController
from openrlhf_oppo.core.controllers import system_delta


def test_eq4_delta_follows_reward_slope_hand_computed():
    # W=3 least-squares slopes: [.1,.2,.3] +, [.2,.3,.25] + (0.05/2), [.3,.25,.2] -,
    # [.25,.2,.5] + (0.25/2), [.2,.5,.6] + (clipped at max 4).
    ctl = DeltaController(DeltaConfig(init=2, min=0, max=4, window_steps=3, inc=1, dec=1, rule="eq4"))
    seen = [ctl.update(r) for r in [0.1, 0.2, 0.3, 0.25, 0.2, 0.5, 0.6]]
    assert seen == [2, 2, 3, 4, 3, 4, 4]


def test_eq4_flat_reward_decays_delta_to_min():
    ctl = DeltaController(DeltaConfig(init=3, min=1, max=8, window_steps=2, inc=2, dec=1, rule="eq4"))
    assert [ctl.update(1.0) for _ in range(6)] == [3, 2, 1, 1, 1, 1]


def test_alg1_delta_moves_against_reward_trend_hand_computed():
    # W=2, needs 4 rewards. d = mean(last 2) - mean(previous 2); Δ -= sign(d)*max(1, Δ//4)
    # [1,2,3,4]: d=+2 -> 8-2=6; [2,3,4,4]: d=+1.5 -> 6-1=5; [3,4,4,1]: d=-1 -> 5+1=6;
    # [4,4,1,1]: d=-3 -> 7; [4,1,1,1]: d=-1.5 -> 8; [1,1,1,1]: d=0 -> 8.
    ctl = DeltaController(DeltaConfig(init=8, min=0, max=16, window_steps=2, rule="alg1"))
    seen = [ctl.update(r) for r in [1, 2, 3, 4, 4, 1, 1, 1, 1]]
    assert seen == [8, 8, 8, 6, 5, 6, 7, 8, 8]


def test_delta_disabled_is_zero_and_fixed_delta_never_moves():
    assert DeltaController(DeltaConfig(enable=False, init=4)).value == 0
    fixed = DeltaController(DeltaConfig(init=4, adaptive=False, window_steps=2))
    assert [fixed.update(r) for r in [0, 1, 2, 3]] == [4, 4, 4, 4]


def test_delta_controller_state_round_trip():
    for rule in DELTA_RULES:
        cfg = DeltaConfig(init=2, min=0, max=4, window_steps=3, rule=rule)
        a = DeltaController(cfg, batch_groups=4)
        for r, lengths in [(0.1, [(5, False), (6, False), (30, True)]), (0.3, [(4, False), (50, False)])]:
            a.update(r, lengths)
        b = DeltaController(cfg, batch_groups=4)
        b.load_state_dict(json.loads(json.dumps(a.state_dict())))
        steps = [(0.5, [(5, False), (5, True)]), (0.2, [(100, False), (3, False), (4, False)]), (0.9, [(7, False)])]
        assert [a.update(*s) for s in steps] == [b.update(*s) for s in steps], rule


def test_chunk_controller_fixed():
    ctl = ChunkSizeController(ChunkConfig(size_tokens=64))
    assert [ctl.update(100, 1.0) for _ in range(3)] == [64, 64, 64]


def test_chunk_controller_trials_each_candidate_then_keeps_fastest():
    ctl = ChunkSizeController(
        ChunkConfig(size_tokens=256, adaptive=True, candidates=(128, 256, 512), period_steps=8, trial_steps=2)
    )
    tps = {128: 100.0, 256: 300.0, 512: 200.0}  # tokens per second by C
    tried = []
    for _ in range(10):
        c = ctl.value
        tried.append(c)
        ctl.update(int(tps[c] * 2), 2.0)
    # round 1: 6 trial steps, then the best (256) until step 8 starts round 2
    assert tried == [128, 128, 256, 256, 512, 512, 256, 256, 128, 128]


def test_chunk_controller_state_round_trip():
    cfg = ChunkConfig(adaptive=True, candidates=(16, 32), period_steps=4, trial_steps=1)
    a = ChunkSizeController(cfg)
    a.update(10, 1.0)
    b = ChunkSizeController(cfg)
    b.load_state_dict(a.state_dict())
    assert [a.update(50, 1.0) for _ in range(5)] == [b.update(50, 1.0) for _ in range(5)]


@pytest.mark.parametrize("rule", DELTA_RULES)
def test_delta_stays_in_bounds_on_wild_rewards(rule):
    import random

    rng = random.Random(0)
    ctl = DeltaController(DeltaConfig(init=5, min=2, max=7, window_steps=2, inc=3, dec=3, rule=rule), batch_groups=8)
    for _ in range(200):
        lengths = [(rng.choice([1, 10, 1000]), rng.random() < 0.3) for _ in range(rng.randint(0, 8))]
        assert 2 <= ctl.update(rng.uniform(-100, 100), lengths) <= 7


def test_system_delta_hand_computed():
    # median 11 (of 9 10 10 11 11 12 50 100), threshold 22: 50 and 100 straggle, p = 2/8;
    # Δ = ⌈8 · (2/8) / (6/8)⌉ = ⌈8/3⌉ = 3
    assert system_delta(8, [10, 12, 11, 9, 50, 11, 10, 100]) == 3
    # B = 4, p = 1/5: 4 · 1/4 = 1 exactly (no float ceil to 2)
    assert system_delta(4, [10, 10, 10, 10, 100]) == 1
    # B = 112 (the simulator's), 10 % stragglers: ⌈112 · 10 / 90⌉ = ⌈12.44⌉ = 13
    assert system_delta(112, [100] * 90 + [1000] * 10) == 13
    # at B = 1,792 the same tail gives ⌈1792 / 9⌉ = 200: Δ scales with B
    assert system_delta(1792, [100] * 90 + [1000] * 10) == 200
    # no tail (all within 2 x median; "above" is strict), nothing observed yet
    assert system_delta(8, [10, 15, 20, 19]) == 0
    assert system_delta(8, [10, 10, 20]) == 0
    assert system_delta(8, []) is None
    # 2 of 5 above 2 x median 0 -> ⌈8 · 2/3⌉ = 6
    assert system_delta(8, [0, 0, 0, 1, 1]) == 6
    # a cap below twice the median: only truncation shows the tail. 3 of 8 cut at 1,024, median
    # 900, nothing above 1,800: p = 3/8, ⌈8 · 3/5⌉ = 5; half or more cut: p capped at 1/2, Δ = B
    lengths = [700, 800, 850, 900, 900, 1024, 1024, 1024]
    assert system_delta(8, lengths) == 0
    assert system_delta(8, lengths, [False] * 5 + [True] * 3) == 5
    assert system_delta(8, lengths, [False] * 4 + [True] * 4) == 8


def test_system_rule_sizes_delta_from_the_window_of_trained_lengths():
    # W = 2 steps, B = 4: Δ from the lengths of the groups trained in the last two steps
    ctl = DeltaController(DeltaConfig(init=1, min=0, max=4, window_steps=2, rule="system"), batch_groups=4)
    assert ctl.value == 1  # init until a step is seen
    def step(*lengths):
        return ctl.update(0.0, [(n, False) for n in lengths])

    assert step(10, 10, 10, 10) == 0  # no tail
    assert step(10, 10, 10, 90) == 1  # window 10x7, 90: p = 1/8, ⌈4/7⌉ = 1
    assert step(90, 90, 10, 10) == 3  # window 10 10 10 90 90 90 10 10: median 10, p = 3/8: ⌈12/5⌉
    assert step() == 0  # window 90 90 10 10: median 50, nothing above 100
    assert ctl.update(None, [(10, True)]) == 4  # window: the empty step and one cut group: p capped, Δ = B


def test_eq4_waits_for_a_known_reward():
    ctl = DeltaController(DeltaConfig(init=2, min=0, max=4, window_steps=2, rule="eq4"))
    assert [ctl.update(r) for r in (None, 0.1, None, 0.2)] == [2, 2, 2, 3]  # Nones are not seen
