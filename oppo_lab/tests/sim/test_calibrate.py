"""`simulate calibrate` on a hand-made run directory with known costs."""

from __future__ import annotations

import json

import pytest

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import drivers
from openrlhf_oppo.sim.presets import load_preset
from oppo_lab.sim import calibrate

PROMPT = 8
DECODE_S, PER_SEQ_S = 0.004, 0.001  # seconds per token = 0.004 + 0.001 x responses decoding at once
OVERHEAD_S, FORWARD_S, TRAIN_S, SYNC_S = 0.1, 3e-4, 5e-4, 0.05  # forward: 3 forwards x 1e-4 per token
CALL_S, PREFILL_S = 0.02, 1e-5


def span(role, stage, t0, t1, **kw):
    return {"kind": "span", "role": role, "host": "n0", "pid": 1, "stage": stage, "t0": t0, "t1": t1, **kw}


def make_run(root, reward_streamed=True):
    """Four steps; step k decodes b_k responses of T_k tokens side by side. make_experience runs
    three forwards (old log-probs, reference, critic), four when the reward is not streamed
    (then the reward spans are `score` calls of whole sequences)."""
    forwards = 3 if reward_streamed else 4
    rows, rollouts, t, key = [], [], 1000.0, 0
    for step, (b, tokens) in enumerate([(1, 100), (2, 60), (4, 200), (8, 30)]):
        decode = tokens * (DECODE_S + PER_SEQ_S * b)
        rows.append(span("driver", "generate", t, t + decode + 0.3))
        for _ in range(b):
            rows.append({"kind": "sample", "role": "rollout", "host": "n0", "pid": 2, "key": key, "t0": t + 0.3,
                         "t1": t + 0.3 + decode, "tokens": tokens, "finish": "stop"})
            key += 1
        t += decode + 0.3
        step_tokens = b * (PROMPT + tokens)  # equal lengths: no padding in micro-batches
        for stage, per in (("make_experience", FORWARD_S / 3 * forwards), ("train", TRAIN_S)):
            rows.append(span("driver", stage, t, t + OVERHEAD_S + per * step_tokens))
            t += OVERHEAD_S + per * step_tokens
        rows.append(span("driver", "weight_sync", t, t + OVERHEAD_S + SYNC_S))
        t += OVERHEAD_S + SYNC_S
        rows.append(span("reward", "prefill" if reward_streamed else "score", t,
                         t + CALL_S + PREFILL_S * 500 * (step + 1), tokens=500 * (step + 1)))
        rollouts.append({"step": step, "samples": [{"prompt": "p", "sequence": [1] * (PROMPT + tokens), "reward": 0.0}
                                                   for _ in range(b)]})
    (root / "timeline").mkdir(parents=True)
    (root / "timeline" / "n0-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rollouts))
    return root


def test_calibrate_recovers_the_costs_of_a_hand_made_timeline(tmp_path):
    run = make_run(tmp_path / "run")
    found = calibrate.calibrate([run], load_preset("cpu-longtail"), PROMPT, warmup_steps=0)
    c = found["costs"]
    assert c["decode_step_s"] == pytest.approx(DECODE_S)
    assert c["decode_per_seq_s"] == pytest.approx(PER_SEQ_S)
    assert c["forward_per_token_s"] == pytest.approx(FORWARD_S / 3)  # reference, critic and old logprobs
    assert c["train_per_token_s"] == pytest.approx(TRAIN_S)
    assert c["weight_sync_s"] == pytest.approx(OVERHEAD_S + SYNC_S)  # the whole sync, measured
    assert found["efficiency"]["sync_overhead_s"] == 0.0
    assert c["prefill_call_s"] == pytest.approx(CALL_S)
    assert c["prefill_per_token_s"] == pytest.approx(PREFILL_S)
    assert found["efficiency"]["phase_overhead_s"] == pytest.approx(OVERHEAD_S)
    assert found["efficiency"]["generate_overhead_s"] == pytest.approx(0.3)
    assert sorted(found["lengths"]) == sorted([100] + [60] * 2 + [200] * 4 + [30] * 8)


def test_make_experience_is_fitted_per_forward_the_run_held(tmp_path):
    """A run that did not stream its reward ran one more forward in make_experience: the same
    per-forward cost explains its longer spans."""
    streamed = make_run(tmp_path / "streamed")
    batched = make_run(tmp_path / "batched", reward_streamed=False)
    base = load_preset("cpu-longtail")

    def rows(run):
        return [json.loads(line) for line in (run / "timeline" / "n0-1.jsonl").read_text().splitlines()]

    assert calibrate.experience_forwards(rows(streamed), base.workload) == 3
    assert calibrate.experience_forwards(rows(batched), base.workload) == 4
    found = calibrate.calibrate([streamed, batched], base, PROMPT, warmup_steps=0)
    assert found["costs"]["forward_per_token_s"] == pytest.approx(FORWARD_S / 3)


def test_calibrate_writes_a_preset_the_simulator_runs(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    out = tmp_path / "cal.yaml"
    assert calibrate.main([str(run), "--output", str(out), "--warmup-steps", "0"]) == 0
    assert "costs.decode_step_s = 0.004" in capsys.readouterr().out
    cfg = load_preset(str(out), ["workload.steps=6", "workload.seeds=1"])
    assert cfg.lengths.kind == "empirical" and cfg.costs.decode_per_seq_s == pytest.approx(PER_SEQ_S)
    res = drivers.simulate(cfg, cost_model.build(cfg), "sync", 0)
    assert {r["tokens"] for r in res.rows if r["kind"] == "sample"} <= {30, 60, 100, 200}


def test_a_fit_with_no_fixed_decode_cost_is_still_a_measured_engine(tmp_path):
    """Real CPU runs fit decode_step_s = 0 (all cost per sequence): the preset needs no hardware."""
    run = make_run(tmp_path / "run")
    out = tmp_path / "cal.yaml"
    assert calibrate.main([str(run), "--output", str(out), "--warmup-steps", "0"]) == 0
    cfg = load_preset(str(out), ["costs.decode_step_s=0", "workload.steps=4", "workload.seeds=1"])
    model = cost_model.build(cfg)
    assert model.decode_step_s(4, 0) == pytest.approx(4 * PER_SEQ_S)
    assert drivers.simulate(cfg, model, "oppo", 0).rows


def test_calibrate_names_what_a_run_directory_lacks(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="timeline/ and rollouts.jsonl"):
        calibrate.calibrate([tmp_path / "empty"], load_preset("cpu-longtail"), PROMPT, 0)


def test_a_background_sync_counts_until_its_loads_land():
    rows = [span("driver", "weight_sync", 10.0, 10.1), span("sync", "landing", 10.1, 10.6),
            span("driver", "weight_sync", 20.0, 20.2), span("sync", "landing", 20.2, 20.3)]
    assert calibrate.sync_seconds(rows) == pytest.approx([0.6, 0.3])
    assert calibrate.sync_seconds(rows[::2]) == pytest.approx([0.1, 0.2])  # foreground: the calls are the syncs
