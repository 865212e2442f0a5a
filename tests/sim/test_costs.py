"""The cost model against hand-computed numbers."""

from __future__ import annotations

import pytest

from openrlhf_oppo.sim import costs
from openrlhf_oppo.sim.presets import ModelShape, load_preset


def make_costs(**over) -> costs.CostModel:
    base = dict(decode_overhead_s=0.001, decode_weights_read_s=0.004, decode_kv_read_per_token_s=1e-6,
                decode_compute_per_seq_s=1e-4, prefill_call_s=0.01, prefill_weights_read_s=0.002,
                prefill_per_token_s=1e-5, prefill_per_pair_s=1e-8, prefill_per_chunk_s=0.001,
                forward_per_token_s=1e-5, critic_forward_per_token_s=2e-5, train_per_token_s=3e-5,
                weight_sync_s=0.5, phase_overhead_s=0.0, generate_overhead_s=0.0, engines=1, scorers=1,
                scorer_on_engines=False, seqs_per_engine=256, decode_slowdown_shared=1.0, train_slowdown_shared=1.0)
    base.update(over)
    return costs.CostModel(**base)


def test_decode_step_is_memory_bound_and_grows_with_context():
    c = make_costs()
    # 0.001 + max(0.004 + 1e-6 * ctx, 1e-4 * b)
    assert c.decode_step_s(16, 0) == pytest.approx(0.005)
    assert c.decode_step_s(16, 1000) == pytest.approx(0.006)
    assert c.decode_step_s(16, 10000) == pytest.approx(0.015)


def test_decode_step_has_a_compute_floor_that_grows_with_batch():
    c = make_costs()
    assert c.decode_step_s(40, 0) == pytest.approx(0.005)  # 40 x 1e-4 = 0.004: still at the memory bound
    assert c.decode_step_s(100, 0) == pytest.approx(0.011)  # 100 x 1e-4 = 0.01 above 0.004
    assert c.decode_step_s(200, 0) == pytest.approx(0.021)


def test_decode_run_is_the_sum_of_its_iterations_across_the_switch_to_memory_bound():
    c = make_costs(decode_kv_read_per_token_s=1e-5)
    batch, ctx, steps = 80, 0, 50  # compute bound (0.008) until the context reaches 400 tokens, then memory bound
    by_hand = sum(c.decode_step_s(batch, ctx + batch * j) for j in range(steps))
    assert c.decode_run_s(batch, ctx, steps) == pytest.approx(by_hand, rel=1e-12)
    assert c.decode_steps_within(batch, ctx, steps, by_hand) == steps
    assert c.decode_steps_within(batch, ctx, steps, c.decode_run_s(batch, ctx, 17) + 1e-9) == 17


def test_prefill_of_a_chunk_pays_attention_over_its_cached_prefix():
    c = make_costs()
    # 0.01 + 1 x 0.001 + max(0.002, 1e-5 x 100 + 1e-8 x 100 x (1000 + 50))
    assert c.prefill_s([(1000, 100)]) == pytest.approx(0.01 + 0.001 + 0.001 + 0.00105)
    assert c.prefill_s([(0, 10)]) == pytest.approx(0.01 + 0.001 + 0.002)  # tiny: reading the weights bounds it


def test_qwen25_7b_shape_gives_its_parameter_count_and_kv_bytes():
    m = ModelShape("qwen2.5-7b", layers=28, hidden=3584, heads=28, kv_heads=4, intermediate=18944, vocab=152064)
    # per layer: q,o 2 x 3584^2 + k,v 2 x 3584 x 4 x 128 + mlp 3 x 3584 x 18944; + 2 embeddings
    assert m.params == 28 * (2 * 3584**2 + 2 * 3584 * 512 + 3 * 3584 * 18944) + 2 * 152064 * 3584 == 7_615_283_200
    assert m.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57_344


def test_roofline_of_the_7b_h200_preset():
    cfg = load_preset("paper-7b-h200")
    c = costs.build(cfg)
    bw = 4.8e12 * 0.7
    assert c.decode_weights_read_s == pytest.approx(2 * 7_615_283_200 / bw)
    assert c.decode_kv_read_per_token_s == pytest.approx(57_344 / bw)
    assert c.train_per_token_s == pytest.approx(6 * 2 * 7_615_283_200 / (7 * 989e12 * 0.35))
    # the ZeRO-3 gather, then the broadcast to the engines, both over NVLink (one node)
    assert c.weight_sync_s == pytest.approx(0.5 + 2 * 2 * 7_615_283_200 / (450e9 * 0.7))
    assert (c.engines, c.scorers) == (7, 1)


def test_across_nodes_a_sync_gathers_and_broadcasts_through_one_devices_network():
    # 8 nodes of H200 (400 GB/s a node: 50 GB/s a device), vLLM on one node of its own, Qwen2.5-72B
    cfg = load_preset("paper-7b-h200", ["split.nodes=8", "split.engine_nodes=1", "split.colocate=false",
                                        "split.generate_gpus=0", "split.tensor_parallel=2", "split.train_gpus=8",
                                        "split.score_gpus=0", "split.reward_with_train=true", "actor=qwen2.5-72b",
                                        "critic=qwen2.5-72b", "reward=qwen2.5-72b"])
    c = costs.build(cfg)
    one_way = cfg.actor.weight_bytes / (50e9 * 0.7)  # 145 GB through one device's 50 GB/s: about 4.2 s
    assert c.weight_sync_s == pytest.approx(0.5 + 2 * one_way)
    assert c.sync_gather_s == pytest.approx(1.0 + one_way)  # the background sync's wait: its fixed cost, the gather
    colocated = costs.build(load_preset("paper-7b-h200", [
        "split.nodes=8", "split.generate_gpus=8", "split.train_gpus=8", "split.score_gpus=0",
        "split.reward_with_train=true", "split.tensor_parallel=4", "actor=qwen2.5-72b", "critic=qwen2.5-72b",
        "reward=qwen2.5-72b"]))
    local = cfg.actor.weight_bytes / (450e9 * 0.7)  # each rank to the engine on its own device
    assert colocated.weight_sync_s == pytest.approx(0.5 + one_way + local)


def test_a_phase_beside_decoding_is_slowed_for_the_share_of_it_that_decoding_covers():
    # compute 2 s, overheads 0.5 s, decoding for the first 1 s, slowdown 1.5 (k = 0.5):
    # T = 0.5 + 2 (1 + 0.5 * 1 / T)  ->  T^2 - 2.5 T - 1 = 0  ->  T = (2.5 + sqrt(10.25)) / 2
    t = costs.shared_phase_s(2.0, 0.5, 1.0, 1.5)
    assert t == pytest.approx((2.5 + 10.25 ** 0.5) / 2)
    assert t == pytest.approx(0.5 + 2.0 * (1 + 0.5 * 1.0 / t))  # f = 1 s / T
    assert costs.shared_phase_s(2.0, 0.5, 10.0, 1.5) == pytest.approx(3.5)  # decoding covers it: 0.5 + 2 x 1.5
    assert costs.shared_phase_s(2.0, 0.5, 0.0, 1.5) == pytest.approx(2.5)  # nothing decodes beside it
    assert costs.shared_phase_s(2.0, 0.5, 10.0, 1.0) == pytest.approx(2.5)  # no shared host (GPU presets)


def test_the_engines_drain_time_decodes_what_they_hold_and_the_requests_about_to_arrive():
    from openrlhf_oppo.sim.engine import EventLoop, Recorder, Request, Rollout

    model = make_costs(decode_overhead_s=0.1, decode_weights_read_s=0.0, decode_kv_read_per_token_s=0.0,
                       decode_compute_per_seq_s=0.01, seqs_per_engine=2)
    rollout = Rollout(EventLoop(), model, Recorder(), lambda *a: None)
    held = [Request(0, 8, 3, 100)]
    rollout.admit([held], 0.0)
    rollout.factor = 2.0
    # 3 and 5 tokens decode at b = 2 for 3 iterations (0.1 + 2 x 0.01 each); the 4-token one takes
    # the freed slot: b = 2 for 2 more, then it decodes its last 2 alone (0.11 each); all x the factor 2
    incoming = [Request(1, 8, 5, 100), Request(2, 8, 4, 100)]
    assert rollout.drain_s(incoming) == pytest.approx(2 * (3 * 0.12 + 2 * 0.12 + 2 * 0.11))


def test_streaming_scorers_attention_runs_at_its_measured_utilisation_and_an_engines_at_prefill_mfu():
    cfg = load_preset("paper-7b-h200")
    peak, s, r, a = cfg.hardware.peak_bf16_flops, cfg.split, cfg.reward, cfg.actor
    assert (cfg.efficiency.attention_mfu, cfg.efficiency.prefill_mfu) == (0.15, 0.5)
    built = costs.build(cfg)
    assert built.prefill_per_pair_s == pytest.approx(4 * r.layers * r.hidden / (s.score_tensor_parallel * peak * 0.15))
    assert built.prefill_per_token_s == pytest.approx(2 * r.params / (s.score_tensor_parallel * peak * 0.5))
    engine = costs.engine_prefill(cfg, built)  # vLLM's own prefill (a stopped sample resumed)
    assert engine.prefill_per_pair_s == pytest.approx(4 * a.layers * a.hidden / (s.tensor_parallel * peak * 0.5))
    unset = load_preset("paper-7b-h200", ["efficiency.attention_mfu=0"])  # 0: as prefill_mfu
    assert costs.build(unset).prefill_per_pair_s == pytest.approx(
        4 * r.layers * r.hidden / (s.score_tensor_parallel * peak * 0.5))
