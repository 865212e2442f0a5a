"""make_experience's forwards ahead of the batch (`projections.experience_ahead`, sim.streamer's
`ExperienceAhead`): groups the core commits to the step's batch (`committed_groups`) are
forwarded whole, in rounds of a micro-batch on every training device, while the training
devices wait for the batch; make_experience forwards the rest."""

from __future__ import annotations

import pytest

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import layouts, presets
from openrlhf_oppo.sim.drivers import simulate
from openrlhf_oppo.sim.streamer import ExperienceAhead
from openrlhf_oppo.sim.world import World
from oppo_lab import schedules  # noqa: F401 (registers the ablations)

# the old-log-prob forward over every sample (train.old_logprobs recompute): what the projection takes ahead
SHORT = ["workload.steps=7", "workload.warmup_steps=2", "workload.seeds=1", "workload.batch_groups=32",
         "delta.init=8", "delta.max=16", "train.old_logprobs=recompute"]
# a node: 1 vLLM / 3 actor / 3 critic / 1 reward
OWN = ["split.colocate=false", "split.generate_gpus=1", "split.train_gpus=3", "split.critic_gpus=3",
       "split.score_gpus=1"]
AHEAD = "projections.experience_ahead=true"
STAGES = ("old_logprobs", "values", "ref_logprobs")


def _cfg(*sets):
    return presets.load_preset("paper-7b-h200", [*OWN, *sets])


def _spans(run, role, stage):
    return [(r["t0"], r["t1"]) for r in run.rows if r["kind"] == "span" and r["role"] == role and r["stage"] == stage]


def test_samples_go_in_rounds_of_a_micro_batch_per_training_device_costed_as_make_experience():
    cfg = _cfg(AHEAD, "workload.packing=false")
    world = World(cfg, cost_model.build(cfg), 0)
    ahead = ExperienceAhead(world, STAGES)
    assert ahead.unit == 4 * 3  # micro_batch_size 4 on each of the actor's 3 devices
    ahead.forward([(sid, 100) for sid in range(10)], 0.0)
    assert not ahead.active and not ahead.queue and len(ahead.pending) == 10  # short of a round: held
    ahead.forward([(sid, 300) for sid in range(10, 15)], 0.0)
    assert ahead.active and ahead.forwarded == set(range(12)) and [it[0] for it in ahead.pending] == [12, 13, 14]
    c, w = world.costs, cfg.workload
    lengths = [100] * 10 + [300] * 2
    tokens = sum(4 * (256 + max(lengths[i:i + 4])) for i in range(0, 12, 4))  # padded per micro-batch
    assert world.train_tokens(lengths) == tokens
    stages = c.make_experience_s(tokens, w.reference, w.critic)
    assert c.ahead_call_s == pytest.approx(cfg.efficiency.forward_overhead_s)  # a round trip, no extra gather
    assert ahead.busy_until_s == pytest.approx(3 * c.ahead_call_s + world._forwards_s(stages))
    # the batch: samples in the call begun are done; the rest (held, or never committed) are make_experience's
    assert ahead.left([0, 11, 12, 13, 14, 20], [100, 300, 300, 300, 300, 50]) == dict.fromkeys(
        STAGES, world.train_tokens([300, 300, 300, 50]))
    assert ahead.pending == [] and ahead.forwarded == set(range(1, 11))


def test_ahead_forwards_run_only_while_the_trainer_waits_and_make_experience_forwards_less():
    base = _cfg(*SHORT)
    plain = simulate(base, cost_model.build(base), "oppo", 0)
    cfg = _cfg(*SHORT, AHEAD)
    run = simulate(cfg, cost_model.build(cfg), "oppo", 0)
    assert sorted(run.trained_group_ids) == sorted(set(run.trained_group_ids))  # every group trained once
    ahead = _spans(run, "actor", "stream_forward")
    assert ahead and not _spans(plain, "actor", "stream_forward")
    busy = [iv for stage in ("make_experience", "train", "weight_sync") for iv in _spans(run, "driver", stage)]
    for t0, t1 in ahead:  # on the weights the step trains from: never during an update or a sync
        assert all(t1 <= b0 or t0 >= b1 for b0, b1 in busy), (t0, t1)
    forwarded = [sum(t1 - t0 for t0, t1 in _spans(r, "actor", "old_logprobs")) / len(_spans(r, "actor", "old_logprobs"))
                 for r in (plain, run)]
    assert forwarded[1] < forwarded[0]  # make_experience's old log-probs over fewer tokens a step


def test_refused_with_critic_streaming_and_with_sleep_mode_naming_the_setting():
    with pytest.raises(ValueError, match=r"projections\.experience_ahead.*false with streaming\.critic"):
        presets.load_preset("paper-7b-h200", [AHEAD, "streaming.critic=true"])
    sleep = presets.load_preset("paper-7b-h200", [AHEAD, "split.colocate=true", "split.sleep=true",
                                                  "split.generate_gpus=8", "split.train_gpus=8",
                                                  "split.score_gpus=0", "split.tensor_parallel=2"])
    with pytest.raises(ValueError, match=r"projections\.experience_ahead: schedule oppo with split\.sleep"):
        simulate(sleep, cost_model.build(sleep), "oppo", 0)
    assert "sleep mode has the DeepSpeed models offloaded" in layouts.rule("oppo", sleep.split, True, True,
                                                                           ahead=True)
    assert layouts.rule("oppo", sleep.split, True, True) is None
