"""OPPO's streaming reference actors (`projections.reference_actors`): the whole frozen reference on
devices of its own or beside the engines, costed as the streaming reward actor (sim.streamer,
sim.costs, sim.memory, sim.layouts)."""

from __future__ import annotations

import dataclasses

import pytest

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import layouts, memory, presets
from openrlhf_oppo.sim.drivers import OppoDriver, simulate
from openrlhf_oppo.sim.streamer import ReferenceActors
from openrlhf_oppo.sim.world import World
from oppo_lab import schedules  # noqa: F401 (registers the ablations)

SHORT = ["workload.steps=7", "workload.warmup_steps=2", "workload.seeds=1", "workload.batch_groups=32",
         "delta.init=8", "delta.max=16"]
REF = ["streaming.reference=true", "projections.reference_actors=true"]
# a node: 1 vLLM / 3 actor / 2 critic / 1 reward / 1 reference actor
OWN = ["split.colocate=false", "split.generate_gpus=1", "split.train_gpus=3", "split.critic_gpus=2",
       "split.score_gpus=1", "split.reference_gpus=1"]
QWEN7B_PARAMS = 7_615_283_200  # 28 x (q, o 2 x 3584^2 + k, v 2 x 3584 x 512 + MLP 3 x 3584 x 18944) + 2 x 152064 x 3584
QWEN7B_KV_BYTES = 2 * 28 * 4 * 128 * 2  # K and V, 28 layers, 4 KV heads of 128, bf16


def _cfg(*sets):
    return presets.load_preset("paper-7b-h200", [*REF, *sets])


def _spans(run, role, stage):
    return [(r["t0"], r["t1"]) for r in run.rows if r["kind"] == "span" and r["role"] == role and r["stage"] == stage]


def test_a_chunk_on_a_reference_actor_costs_the_reward_actors_prefill_with_the_references_shape_by_hand():
    cfg = _cfg(*OWN)
    assert cfg.actor.params == QWEN7B_PARAMS
    ref = cost_model.reference_actors(cfg, cost_model.build(cfg))
    assert (ref.scorers, ref.scorer_on_engines) == (1, False)
    # chunk 3 of a sample: 256 new tokens on 256 prompt + 512 cached; one H200, its tokens at 50 % of
    # 989 TFLOP/s and its attention at 15 % (the preset's measured streaming-scorer terms)
    compute = 2 * QWEN7B_PARAMS * 256 / (989e12 * 0.5) + 4 * 28 * 3584 * 256 * (768 + 128) / (989e12 * 0.15)
    assert compute > 2 * QWEN7B_PARAMS / (4.8e12 * 0.7)  # above the weights' read: compute bound
    assert ref.prefill_s([(768, 256)]) == pytest.approx(0.03 + 0.0015 + compute)  # 7.885 + 0.621 ms
    assert ref.prefill_s([(768, 256)]) == pytest.approx(0.040005, abs=1e-6)
    # the reward actor's model: the same call costs the same where the reward model has the actor's shape,
    # and the reference keeps the actor's shape where the reward model is smaller
    assert ref.prefill_s([(768, 256)]) == pytest.approx(cost_model.build(cfg).prefill_s([(768, 256)]))
    small = _cfg(*OWN, "reward=qwen2.5-3b")
    assert cost_model.reference_actors(small, cost_model.build(small)).prefill_s([(768, 256)]) == pytest.approx(
        ref.prefill_s([(768, 256)]))
    beside = _cfg(*OWN, "split.reference_gpus=0", "split.generate_gpus=2", "split.tensor_parallel=2")
    b = cost_model.reference_actors(beside, cost_model.build(beside))
    assert (b.scorers, b.scorer_on_engines) == (1, True)  # one beside each engine (one engine of TP 2)


def test_make_experience_forwards_the_reference_only_for_samples_not_streamed_whole():
    cfg = _cfg(*OWN)
    world = World(cfg, cost_model.build(cfg), 0)
    actors = ReferenceActors(world, lambda *a: None)
    actors._done([(1, 0, 256, False, 256), (1, 256, 300, True, 256), (2, 0, 40, True, 256),
                  (3, 0, 256, False, 256)], 0.0)
    assert actors.prefilled_tokens == {1: 256 + 300, 2: 256 + 40, 3: 256 + 256}
    assert actors.left([1, 2, 3, 4], [300, 40, 500, 7]) == (256 + 500) + (256 + 7)  # 3 unfinished, 4 never streamed
    assert actors.streamed == set()


def test_streamed_reference_leaves_make_experience_which_keeps_old_logprobs_and_values():
    cfg = _cfg(*OWN, *SHORT)
    run = simulate(cfg, cost_model.build(cfg), "oppo", 0)
    assert _spans(run, "ref", "prefill") and _spans(run, "ref", "score")  # on the reference actors
    assert _spans(run, "ref", "ref_logprobs") and all(t1 == t0 for t0, t1 in _spans(run, "ref", "ref_logprobs"))
    # one-shot, as OpenRLHF runs them, for the samples holding older tokens (train.old_logprobs): none in the first
    # step, carried ones later
    old = _spans(run, "actor", "old_logprobs")
    assert old[0][1] == old[0][0] and any(t1 > t0 for t0, t1 in old[1:])
    assert all(t1 > t0 for t0, t1 in _spans(run, "critic", "values"))
    assert not _spans(run, "actor", "stream_forward")  # nothing streamed on the training devices
    # without streaming (carry-over only) the same settings forward the reference in make_experience
    plain = _cfg(*OWN, *SHORT, "split.reference_gpus=0", "split.train_gpus=4")
    inter = simulate(plain, cost_model.build(plain), "oppo-inter", 0)
    assert _spans(inter, "ref", "ref_logprobs") and all(t1 > t0 for t0, t1 in _spans(inter, "ref", "ref_logprobs"))


def test_a_carried_sample_is_prefilled_once_across_weight_syncs_never_recomputed():
    cfg = _cfg(*OWN, *SHORT)
    driver = OppoDriver(cfg, cost_model.build(cfg), 0, "oppo")
    versions: dict[int, set[int]] = {}
    trained: list[int] = []
    submit, left = driver.ref_actors.submit, driver.ref_actors.left

    def spy_submit(items, now_s):
        for it in items:
            versions.setdefault(it[0], set()).add(driver.version)
        submit(items, now_s)

    def spy_left(ids, lengths):
        trained.extend(ids)
        out = left(ids, lengths)
        assert out == 0  # every trained sample was streamed whole: make_experience forwards none again
        return out

    driver.ref_actors.submit, driver.ref_actors.left = spy_submit, spy_left
    run = driver.run()
    carried = [sid for sid in trained if len(versions[sid]) > 1]
    assert carried  # chunks of these samples reached the reference under two or more weight versions
    length = {r["sample"]: r["tokens"] for r in run.rows if r["kind"] == "sample"}
    p = cfg.lengths.prompt_tokens
    assert all(driver.ref_actors.prefilled_tokens[sid] == p + length[sid] for sid in trained)  # each token once


def test_reference_actors_hold_the_whole_reference_its_forward_and_kv_budget_and_the_training_devices_none():
    cfg = _cfg(*OWN)
    uses = {u.devices: dict(u.items) for u in memory.plan(cfg, streams=True, ref_actors=True)}
    seqs = 112 + 32  # (B + Δ max) x n sequences in flight, all on the one reference actor
    assert uses["reference"] == pytest.approx({
        "streaming reference actor": 2 * QWEN7B_PARAMS,
        "its forward": 2 * 16384 * QWEN7B_KV_BYTES,
        "its KV budget": seqs * (256 + 350) * QWEN7B_KV_BYTES,  # prompt + mean response each: 5.0 GB
        "reserve": 4e9})
    assert "reference" not in uses["training"]
    assert "reference" in dict(memory.training_items(cfg))  # where the reference is not streamed to actors
    assert memory.overflow(cfg, True, True) == []


def test_reference_actors_that_do_not_fit_their_device_are_refused():
    huge = _cfg(*OWN, "workload.batch_groups=1000", "lengths.mean_tokens=3000", "lengths.std_tokens=3000",
                "lengths.cap_tokens=16384", "workload.micro_batch_size=1", "workload.gradient_checkpointing=true")
    _, why = layouts.check(huge, "oppo")  # 1,032 sequences x 3,256 tokens of KV: 193 GB on one 141 GB device
    assert len(why) == 1 and why[0].startswith("reference devices:") and "its KV budget 192.7" in why[0]
    assert layouts.check(huge, "oppo-inter")[1][0].startswith("devices for streaming reference actors")
    big = _cfg(*OWN, "actor=qwen2.5-72b", "reward=qwen2.5-3b", "critic=qwen2.5-3b", "split.tensor_parallel=1")
    over = memory.overflow(big, True, True)
    assert any(m.startswith("reference devices:") and "streaming reference actor 145.4" in m for m in over)


def test_beside_the_engines_the_reference_actor_takes_its_share_of_vllms_memory():
    cfg = _cfg("split.colocate=false", "split.generate_gpus=2", "split.train_gpus=3", "split.critic_gpus=2",
               "split.score_gpus=1")
    assert memory.fit_engines(cfg) is cfg  # nothing beside a split layout's engines
    fitted = memory.fit_engines(cfg, ref_actors=True)
    ref = sum(b for _, b in memory.reference_actor_items(cfg))
    assert fitted.workload.kv_cache_fraction * 141e9 + ref + memory.RESERVE_BYTES == pytest.approx(141e9)
    assert memory.reference_kv_budget_tokens(cfg) == 72 * (256 + 350)  # 144 sequences over 2 engines' actors
    assert memory.overflow(fitted, True, True) == []
    coloc = _cfg("split.score_gpus=0", "split.generate_gpus=8", "split.train_gpus=8")
    share = memory.fit_engines(coloc, ref_actors=True).workload.kv_cache_fraction
    assert share < memory.fit_engines(coloc).workload.kv_cache_fraction


def test_the_layout_search_places_reference_actors_beside_the_engines_or_on_a_device_of_their_own():
    cfg = _cfg()
    assert any(s.reference_gpus == 1 for s in layouts.candidates(cfg, ref_actors=True))
    assert not any(s.reference_gpus for s in layouts.candidates(cfg))
    assert layouts.streams_reference_actors(cfg, "oppo") and not layouts.streams_reference_actors(cfg, "oppo-inter")
    assert not layouts.streams_reference_actors(presets.load_preset("paper-7b-h200", ["streaming.reference=true"]),
                                                "oppo")
    space = layouts.search_space(cfg, ("sync", "oppo"))
    assert {t.split.reference_gpus for t in space.runnable["oppo"]} == {0, 1}
    assert not any(t.split.reference_gpus for t in space.runnable["sync"])
    own = next(t for t in space.runnable["oppo"] if t.split.reference_gpus)
    assert "/ 1 ref (TP" in layouts.describe(own.split, True)
    assert "+ ref by vLLM" in layouts.describe(dataclasses.replace(own.split, reference_gpus=0), True)


def test_reference_actors_apply_only_where_the_reference_streams():
    cfg = presets.load_preset("paper-7b-h200", ["projections.reference_actors=true"])
    assert not layouts.streams_reference_actors(cfg, "oppo")
    with pytest.raises(ValueError, match="projections.reference_actors"):
        presets.load_preset("cpu-longtail", ["projections.reference_actors=true"])  # no roofline to cost them
