"""Version budgets, the lags OpenRLHF's modes train with, equal-budget pairing and bands, each
checked against figures worked out by hand.

The hand-sized world (as tests/sim/test_openrlhf_drivers.py): B = 8 groups of 2, every response
10 tokens at 0.2 s an engine iteration (a vLLM call of B prompts takes 2.0 s), training 1.0 s a
batch, the weight sync 0.5 s, no other cost; a batch holds 16 x 10 = 160 response tokens.
"""

from __future__ import annotations

import json

import pytest

from openrlhf_oppo.sim import bands, drivers, report
from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim.presets import load_preset

TRAIN_TOKENS = 16 * (8 + 10)


def hand_cfg(tmp_path, steps: int = 6, *sets: str):
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([10]))
    costs = {"decode_step_s": 0.2, "decode_per_seq_s": 0, "decode_per_context_token_s": 0, "forward_per_token_s": 0,
             "train_per_token_s": 1 / TRAIN_TOKENS, "weight_sync_s": 0.5, "prefill_call_s": 0,
             "prefill_per_token_s": 1e-12}
    zero = ("phase_overhead_s", "experience_overhead_s", "chunk_overhead_s", "generate_overhead_s")
    return load_preset("cpu-longtail", [
        f"workload.steps={steps}", "workload.dataset_steps=true", "workload.seeds=1", "workload.warmup_steps=1",
        "lengths.kind=replay", f"lengths.path={path}", "lengths.prompt_tokens=8",
        *(f"costs.{k}={v}" for k, v in costs.items()), *(f"efficiency.{k}=0" for k in zero),
        "efficiency.decode_slowdown_shared=1", "efficiency.train_slowdown_shared=1", *sets])


def run(cfg, schedule: str):
    return drivers.simulate(cfg, cost_model.build(cfg), schedule, 0)


@pytest.mark.parametrize(("schedule", "steps", "lags"), [
    # each batch generated from the weights it trains from
    ("sync", 6, [0, 0, 0, 0, 0, 0]),
    # call k+1 starts (version k) as the trainer takes batch k; the sync after k waits for it: batch k+1 trains at k+1
    ("async", 6, [0, 1, 1, 1, 1, 1]),
    # 2B a call: call 0 (version 0) -> batches 0, 1 at versions 0, 1; call 1 starts as batch 1 is taken (version 1),
    # its batches 2, 3 train at 2, 3; call 2 (version 3) -> 4, 5
    ("oversample", 6, [0, 1, 1, 2, 1, 2]),
    # 3B: call 0 -> batches 0-2 at versions 0-2; call 1 starts as batch 2 is taken (version 2): 3-5 at 3-5
    ("oversample-3b", 6, [0, 1, 2, 1, 2, 3]),
    ("oversample-4b", 8, [0, 1, 2, 3, 1, 2, 3, 4]),
])
def test_openrlhf_modes_train_tokens_as_old_as_worked_out_by_hand(tmp_path, schedule, steps, lags):
    cfg = hand_cfg(tmp_path, steps)
    res = run(cfg, schedule)
    assert res.lag_tokens == [{lag: 160} for lag in lags]
    assert drivers.staleness(res, 0)["max_lag"] == max(lags) == drivers.version_budget(cfg, schedule)


def test_partial_rollout_trains_half_its_tokens_one_version_old(tmp_path):
    """Call k+1 [t, t+2] is paused by the sync after training k at t+1: 5 of each response's 10 tokens came
    before it (one version old), 5 after."""
    res = run(hand_cfg(tmp_path), "partial")
    assert res.lag_tokens == [{0: 160}] + [{1: 80, 0: 80}] * 5


def test_async_with_the_background_sync_lets_the_trainer_go_on_before_the_broadcast_ends(tmp_path):
    """OpenRLHF's async trainer with OPPO's transport (the measured preset's gather costs 0): the sync of
    batch 0 waits for call 1 [2, 4] (the lock), broadcasts [4, 4.5] in the background; the trainer logs the
    step and takes batch 1 at 4.0; call 2 waits for the broadcast's lock: [4.5, 6.5]; and so on every 2.5 s."""
    res = run(hand_cfg(tmp_path), drivers.SAME_TRANSPORT)
    assert [r.sync_end_s for r in res.steps][:5] == pytest.approx([4.0, 6.5, 9.0, 11.5, 14.0])
    assert res.lag_tokens == [{0: 160}] + [{1: 160}] * 5


def _sim_with_steps(steps: dict[str, float]) -> report.Simulated:
    """A Simulated whose schedules have these mean step s (one seed), in the 7B preset's config."""
    cfg = load_preset("paper-7b-h200")
    sim = report.Simulated(cfg, {s: [] for s in steps}, {s: [{"mean_step_s": v}] for s, v in steps.items()})
    sim.layouts = {s: cfg for s in steps}
    return sim


def test_equal_budget_pairs_each_side_fastest_within_the_budget():
    """paper-7b-h200: max_deferral_steps 3, so `oppo` (lag 0, carrying) may train tokens 3 versions old and
    `oppo-async-bg` (lag 2) 2. At budget 2 OPPO has only oppo-async-bg (5.5 s) against oversample (6 s, the
    fastest of sync / async / oversample): 6 / 5.5; at 3 OPPO's fastest is oppo (4.5 s) against
    oversample-3b (5 s): 5 / 4.5. The headline is budget 3, oppo's."""
    sim = _sim_with_steps({"sync": 10.0, "async": 8.0, "oversample": 6.0, "oversample-3b": 5.0,
                           "oppo": 4.5, "oppo-async-bg": 5.5})
    assert report.budgets(sim) == {"sync": 0, "async": 1, "oversample": 2, "oversample-3b": 3, "oppo": 3,
                                   "oppo-async-bg": 2}
    rows = report.equal_budget(sim)
    assert [(r.budget, r.oppo, r.openrlhf, r.openrlhf_as) for r in rows] == [
        (2, "oppo-async-bg", "oversample", "as shipped"), (3, "oppo", "oversample-3b", "as shipped")]
    assert [r.ratio for r in rows] == pytest.approx([6.0 / 5.5, 5.0 / 4.5])
    assert report.headline_budget(sim) == 3


def test_same_transport_row_counts_openrlhf_with_oppos_transport_at_its_budget():
    """async+bg (budget 1, 5.2 s) beats oversample (6 s) within budget 2: the same-transport row pairs it."""
    sim = _sim_with_steps({"async": 8.0, "oversample": 6.0, "oppo-async-bg": 5.0})
    sim.beside[drivers.SAME_TRANSPORT] = (sim.cfg, [{"mean_step_s": 5.2}])
    rows = report.equal_budget(sim)
    assert [(r.openrlhf, r.openrlhf_as) for r in rows] == [("oversample", "as shipped"),
                                                           (drivers.SAME_TRANSPORT, "same transport")]
    assert [r.ratio for r in rows] == pytest.approx([6.0 / 5.0, 5.2 / 5.0])


def test_a_band_over_the_phase_cost_in_the_hand_sized_world(tmp_path):
    """With a phase cost p (make_experience and train each pay it; the sync's own cost pinned at 0):
    sync's step = 2.0 call + p + 1.0 train + p + 0.5 sync = 3.5 + 2p. async's: call k+1 [t, t+2] beside
    training [t, t + 1 + 2p]; the sync starts at the later end: max(2, 1 + 2p) + 0.5. The ratio sync / async
    at p = 0 (the preset): 3.5 / 2.5 = 1.4; p = 0.1: 3.7 / 2.5 = 1.48; p = 2: 7.5 / 5.5."""
    cfg = hand_cfg(tmp_path, 8, "workload.dataset_steps=false")
    phase = bands.Constant("efficiency.phase_overhead_s", 0.1, 2.0, pins=("sync_overhead_s",))
    found = bands.bands([("sync", "async")], {"sync": cfg, "async": cfg}, {("sync", "async"): 1.4}, 1, (phase,))
    band = found[("sync", "async")]
    assert band.by_constant["efficiency.phase_overhead_s"] == pytest.approx((3.7 / 2.5, 7.5 / 5.5))
    assert (band.low, band.high) == pytest.approx((7.5 / 5.5, 3.7 / 2.5))
    assert band.extremes == ("phase_overhead_s=2", "phase_overhead_s=0.1")


def test_a_band_constant_the_preset_lacks_is_named():
    cfg = load_preset("paper-7b-h200")
    with pytest.raises(ValueError, match="efficiency.no_such_cost"):
        bands.with_constant(cfg, bands.Constant("efficiency.no_such_cost", 0.1, 1.0), 0.5)
