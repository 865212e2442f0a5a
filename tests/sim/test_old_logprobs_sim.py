"""The old-log-prob cut in the simulator (`train.old_logprobs`, `drivers.CUT`): make_experience's
old-log-prob forward is charged for the samples holding a token older than the weights that train
them, and not for the rest; OpenRLHF's modes run with the same cut for the "same cut" row.

The hand-sized world of tests/sim/test_version_budget.py (B = 8 groups of 2, every response 10
tokens, a vLLM call 2.0 s, training 1.0 s, the weight sync 0.5 s) with a forward cost: the
old-log-prob forward of a whole batch (16 x 18 padded tokens) takes 0.5 s, as does the reference's.
"""

from __future__ import annotations

import statistics

import pytest

from openrlhf_oppo.sim import drivers, report
from openrlhf_oppo.sim.presets import load_preset
from tests.sim.test_version_budget import TRAIN_TOKENS, _sim_with_steps, hand_cfg, run

FORWARD_S = 0.5  # the old-log-prob forward of a whole batch


def cfg_with_forward(tmp_path, *sets: str):
    return hand_cfg(tmp_path, 6, f"costs.forward_per_token_s={FORWARD_S / TRAIN_TOKENS}", *sets)


def old_logprob_spans(result) -> list[float]:
    return [row["t1"] - row["t0"] for row in result.rows if row.get("stage") == "old_logprobs"]


def mean_step(result) -> float:
    return statistics.fmean(drivers.step_latencies_s(result, 1))


def test_sync_with_the_cut_skips_every_old_log_prob_forward(tmp_path):
    """Each batch is generated from the weights that train it: the cut takes the whole forward off the step."""
    cfg = cfg_with_forward(tmp_path)
    full, cut = run(cfg, "sync"), run(cfg, "sync" + drivers.CUT)
    assert old_logprob_spans(full) == pytest.approx([FORWARD_S] * 6)
    assert old_logprob_spans(cut) == pytest.approx([0.0] * 6)
    assert mean_step(full) - mean_step(cut) == pytest.approx(FORWARD_S)
    assert drivers.version_budget(cfg, "sync" + drivers.CUT) == 0


def test_async_with_the_cut_recomputes_the_batches_decoded_by_older_weights(tmp_path):
    """async trains batch 0 at lag 0 and every later one at lag 1 (test_version_budget): only batch 0 skips
    the forward, so its step time is unchanged."""
    cfg = cfg_with_forward(tmp_path)
    full, cut = run(cfg, "async"), run(cfg, "async" + drivers.CUT)
    assert old_logprob_spans(cut) == pytest.approx([0.0] + [FORWARD_S] * 5)
    assert cut.lag_tokens == full.lag_tokens == [{0: 160}] + [{1: 160}] * 5
    assert drivers.version_budget(cfg, "async" + drivers.CUT) == 1


def test_oppo_charges_the_forward_for_its_stale_samples_only(tmp_path):
    """Δ = 0 and sync admission: every trained token is the trained weights' (no forward); async admission
    at lag 1 with nothing carried: every batch after the first decoded beside the step before (the whole
    forward); OPPO carrying groups: in between, never more than with the forward for every sample."""
    cfg = cfg_with_forward(tmp_path, "delta.enable=false")
    assert old_logprob_spans(run(cfg, "oppo")) == pytest.approx([0.0] * 6)
    recompute = cfg_with_forward(tmp_path, "delta.enable=false", "train.old_logprobs=recompute")
    assert old_logprob_spans(run(recompute, "oppo")) == pytest.approx([FORWARD_S] * 6)
    lag1 = cfg_with_forward(tmp_path, "delta.enable=false", "staleness.max_policy_lag=1")
    assert old_logprob_spans(run(lag1, "oppo-async"))[1:] == pytest.approx([FORWARD_S] * 5)
    carry = cfg_with_forward(tmp_path, "delta.init=2", "delta.adaptive=false")
    with_cut = old_logprob_spans(run(carry, "oppo"))
    carry_full = cfg_with_forward(tmp_path, "delta.init=2", "delta.adaptive=false", "train.old_logprobs=recompute")
    without = old_logprob_spans(run(carry_full, "oppo"))
    assert all(a <= b + 1e-12 for a, b in zip(with_cut, without, strict=True))
    assert with_cut[0] == 0.0


def test_the_same_cut_row_pairs_openrlhfs_best_with_the_cut_at_its_budget():
    """sync+cut (5.5 s) beats oversample (6 s) within budget 2: the same-cut row pairs it; the same-transport
    row is absent (none simulated)."""
    sim = _sim_with_steps({"sync": 7.0, "oversample": 6.0, "oppo-async-bg": 5.0})
    sim.beside["sync" + drivers.CUT] = (sim.cfg, [{"mean_step_s": 5.5}])
    rows = report.equal_budget(sim)
    assert [(r.openrlhf, r.openrlhf_as) for r in rows] == [("oversample", "as shipped"),
                                                           ("sync" + drivers.CUT, "same cut")]
    assert [r.ratio for r in rows] == pytest.approx([6.0 / 5.0, 5.5 / 5.0])


def test_same_cut_runs_every_openrlhf_mode_only_where_oppo_takes_rollout_log_probs():
    cfg = load_preset("paper-7b-h200", ["workload.steps=6", "workload.warmup_steps=2", "workload.seeds=1"])
    sim = report.run_all(cfg, ("sync", "oppo"))
    assert report.add_same_cut(sim) == ["sync" + drivers.CUT]
    assert len(sim.beside["sync" + drivers.CUT][1]) == 1
    off = load_preset("paper-7b-h200", ["workload.steps=6", "workload.warmup_steps=2", "workload.seeds=1",
                                        "train.old_logprobs=recompute"])
    assert report.add_same_cut(report.run_all(off, ("sync", "oppo"))) == []
