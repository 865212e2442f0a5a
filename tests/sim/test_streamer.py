"""Streamed reference / critic / old-logprob forwards on the training devices (sim.streamer)."""

from __future__ import annotations

import pytest

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import presets
from openrlhf_oppo.sim.drivers import simulate
from openrlhf_oppo.sim.streamer import TrainStreamer
from openrlhf_oppo.sim.world import World

SHORT = ["workload.steps=7", "workload.warmup_steps=2", "workload.seeds=1", "workload.batch_groups=32",
         "delta.init=8", "delta.max=16", "delta.adaptive=false"]  # Δ fixed at delta.init
SPLIT = ["split.colocate=false", "split.generate_gpus=2", "split.train_gpus=5", "split.score_gpus=1"]


def _spans(run, role, stage):
    return [(r["t0"], r["t1"]) for r in run.rows if r["kind"] == "span" and r["role"] == role and r["stage"] == stage]


def _run(sets, schedule="oppo"):
    cfg = presets.load_preset("paper-7b-h200", [*SHORT, *sets])
    return cfg, simulate(cfg, cost_model.build(cfg), schedule, 0)


def test_a_call_costs_a_zero3_gather_of_each_streamed_model_by_hand():
    cfg = presets.load_preset("paper-7b-h200")
    c = cost_model.build(cfg)
    assert c.stream_call_s == pytest.approx(0.03 + cfg.actor.weight_bytes / (450e9 * 0.7))  # a call + a gather
    st = TrainStreamer(World(cfg, c, 0), ("reference", "critic"), lambda *a: None)
    assert st.call_s == pytest.approx(3 * c.stream_call_s)  # reference, actor and critic: a gather each
    assert st.per_token_s == pytest.approx(2 * c.forward_per_token_s + c.critic_forward_per_token_s)


def test_streamed_reference_leaves_make_experience_and_never_overlaps_training():
    _, run = _run([*SPLIT, "streaming.reference=true"])
    streamed = _spans(run, "actor", "stream_forward")
    assert streamed
    assert all(t1 == t0 for t0, t1 in _spans(run, "ref", "ref_logprobs"))  # nothing left for make_experience
    busy = [iv for role, stage in (("actor", "old_logprobs"), ("critic", "values"), ("driver", "train"),
                                   ("driver", "weight_sync")) for iv in _spans(run, role, stage)]
    assert not any(a0 < b1 - 1e-9 and b0 < a1 - 1e-9 for a0, a1 in streamed for b0, b1 in busy)
    _, plain = _run(SPLIT)
    assert all(t1 > t0 for t0, t1 in _spans(plain, "ref", "ref_logprobs"))


def test_values_and_old_logprobs_of_a_sample_prefilled_under_older_weights_are_recomputed_whole():
    cfg = presets.load_preset("paper-7b-h200")
    world = World(cfg, cost_model.build(cfg), 0)
    st = TrainStreamer(world, ("critic",), lambda *a: None)
    st.version_of = {1: 0, 2: 1, 3: 2}
    world.version = 2
    p = cfg.lengths.prompt_tokens
    assert st.recompute([1, 2, 3, 4], [10, 20, 30, 40]) == (p + 10) + (p + 20)
    assert st.version_of == {} and st.recomputed_tokens == 2 * p + 30
    assert TrainStreamer(world, ("reference",), lambda *a: None).recompute([1], [5]) == 0


def test_carried_samples_are_recomputed_in_a_real_run():
    _, run = _run([*SPLIT, "streaming.critic=true"])
    assert run.steps[-1].step == 6
    carried = [r for r in run.rows if r["kind"] == "span" and r["stage"] == "old_logprobs" and r["t1"] > r["t0"]]
    assert carried  # a step whose batch held a group decoded before the last update


def test_colocated_a_streamed_call_pauses_every_engine():
    cfg, run = _run(["streaming.reference=true"])  # the preset: colocated 7 + 1 reward
    assert cfg.split.colocate
    streamed = _spans(run, "actor", "stream_forward")
    assert streamed
    decoding = [iv for iv in run.busy["rollout"]]
    assert not any(a0 < b1 - 1e-9 and b0 < a1 - 1e-9 for a0, a1 in streamed for b0, b1 in decoding)
