"""A streaming scorer on the engines' devices (`split.score_gpus` 0): on one device the engine
stops while it prefills; on a CPU host's shared cores (`decode_slowdown_scoring` > 0, measured by
`simulate calibrate`) the engine decodes on beside it, that much slower (by hand); and there the
reward forward of make_experience is one of the training pool's forwards."""

from __future__ import annotations

import dataclasses

import pytest

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim.engine import EventLoop, Recorder, Request, Rollout, Scorer


def finish_time(scoring: float) -> float:
    """One engine, 1 s an iteration; a 5-token request admitted at 0 s beside a 2 s prefill."""
    zero = {f.name: 0.0 for f in dataclasses.fields(cost_model.CostModel) if f.type == "float"}
    costs = cost_model.CostModel(**{**zero, "decode_overhead_s": 1.0, "prefill_call_s": 2.0,
                                    "decode_slowdown_shared": 1.0, "train_slowdown_shared": 1.0,
                                    "decode_slowdown_scoring": scoring},
                                 engines=1, scorers=1, scorer_on_engines=True, seqs_per_engine=8)
    loop, rec, done = EventLoop(), Recorder(), []
    rollout = Rollout(loop, costs, rec, lambda e, crossed, finished, now: done.extend(now for _ in finished))
    scorer = Scorer(loop, costs, rec, rollout, lambda items, now: None)
    loop.at(0.0, rollout.admit, [[Request(1, prompt_tokens=4, target_tokens=5, cap_tokens=8)]], 0.0)
    loop.at(0.0, scorer.submit, [(9, 0, 16, False, 4)], 0.0)
    loop.run(lambda: bool(done))
    return done[0]


def test_on_one_device_the_engine_stops_while_its_scorer_prefills():
    assert finish_time(0.0) == pytest.approx(2.0 + 5.0)  # 2 s stopped, then 5 iterations


def test_on_shared_cores_the_engine_decodes_on_beside_the_prefill_slower():
    # 1.5 s an iteration during the prefill: one whole iteration by 2 s (the cut keeps whole
    # iterations), then the 4 left at 1 s
    assert finish_time(1.5) == pytest.approx(2.0 + 4.0)
    assert finish_time(1.0) == pytest.approx(5.0)  # a neighbour that costs nothing


@pytest.mark.parametrize(("preset", "shared"), [("cpu-longtail", True), ("paper-7b-h200", False)])
def test_on_a_shared_host_the_reward_forward_is_one_of_make_experiences_forwards(preset, shared):
    """OpenRLHF's make_experience runs the reward model's forward beside the others: on one
    host's cores it is charged among them (stage `rewards`); on devices of its own, on the
    reward servers in parallel (stage `score`)."""
    from openrlhf_oppo.sim import drivers
    from openrlhf_oppo.sim.presets import load_preset

    cfg = load_preset(preset, ["workload.steps=4", "workload.warmup_steps=1", "workload.seeds=1"])
    res = drivers.simulate(cfg, cost_model.build(cfg), "sync", 0)
    stages = {r["stage"] for r in res.rows if r["kind"] == "span" and r["role"] == "reward"}
    assert stages == ({"rewards"} if shared else {"score"})
