"""OpenRLHF's async modes in the simulator follow OpenRLHF 0.11.2's generator/trainer actors
(one slot, one queue, the vLLM lock), checked against timelines worked out by hand.

Every case: B = 8 groups of 2, every response 10 tokens at 0.2 s an engine iteration (a vLLM
call takes 2.0 s), training 1.0 s a batch, the weight sync 0.5 s, no other cost, no slowdown.
"""

from __future__ import annotations

import json

import pytest

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import drivers
from openrlhf_oppo.sim.presets import load_preset

TRAIN_TOKENS = 16 * (8 + 10)  # 4 micro-batches of 4 responses, 8 prompt + 10 response tokens each


def make_world(tmp_path, schedule: str, lengths: list[int] | None = None, steps: int = 6, *sets: str):
    """A simulated run of `schedule` with hand-checkable costs; `lengths` replayed (default: all 10)."""
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(lengths or [10]))
    costs = {"decode_step_s": 0.2, "decode_per_seq_s": 0, "decode_per_context_token_s": 0, "forward_per_token_s": 0,
             "train_per_token_s": 1 / TRAIN_TOKENS, "weight_sync_s": 0.5, "prefill_call_s": 0,
             "prefill_per_token_s": 1e-12}
    zero = ("phase_overhead_s", "experience_overhead_s", "chunk_overhead_s", "generate_overhead_s")
    cfg = load_preset("cpu-longtail", [
        f"workload.steps={steps}", "workload.dataset_steps=true", "workload.seeds=1", "workload.warmup_steps=1",
        "lengths.kind=replay",
        f"lengths.path={path}", "lengths.prompt_tokens=8", *(f"costs.{k}={v}" for k, v in costs.items()),
        *(f"efficiency.{k}=0" for k in zero), "efficiency.decode_slowdown_shared=1",
        "efficiency.train_slowdown_shared=1", *sets])
    return drivers.simulate(cfg, cost_model.build(cfg), schedule, 0)


def call_starts(res) -> list[float]:
    return [r["t0"] for r in res.rows if r["kind"] == "span" and r["role"] == "driver" and r["stage"] == "generate"]


def test_async_weight_sync_waits_for_the_call_in_flight(tmp_path):
    """Call k+1 starts as the trainer takes batch k; the sync after training k waits for it (the lock)."""
    res = make_world(tmp_path, "async")
    #  call 0 [0, 2]; take 0 at 2: call 1 [2, 4], train [2, 3], sync waits -> [4, 4.5]; take 1 at 4.5 ...
    assert [r.sync_end_s for r in res.steps] == pytest.approx([4.5, 7.0, 9.5, 12.0, 14.5, 16.0])
    assert call_starts(res) == pytest.approx([0.0, 2.0, 4.5, 7.0, 9.5, 12.0])


def test_partial_rollout_syncs_without_waiting_and_the_call_goes_on_after(tmp_path):
    res = make_world(tmp_path, "partial")
    #  take 0 at 2: call 1 [2, 4] paused by the sync [3, 3.5] -> ends 4.5; take 1 at 4.5, sync [5.5, 6] ...
    assert [r.sync_end_s for r in res.steps] == pytest.approx([3.5, 6.0, 8.5, 11.0, 13.5, 16.0])
    assert [r.batch_ready_s for r in res.steps] == pytest.approx([2.0, 4.5, 7.0, 9.5, 12.0, 14.5])


def test_oversampling_starts_the_next_call_when_the_trainer_takes_the_buffered_batch(tmp_path):
    """With 2B prompts a call, the second batch comes from the buffer; the generator needs a slot
    to hand it over, so the next call waits until the trainer takes that batch."""
    res = make_world(tmp_path, "oversample")
    #  call 0 [0, 2]: A at 2 (train [2, 3], sync [3, 3.5]), B buffered; take B at 3.5: call 1 [3.5, 5.5],
    #  train B [3.5, 4.5], sync waits -> [5.5, 6]; take C at 6 (train, sync -> 7.5), take D at 7.5: call 2 ...
    assert [r.sync_end_s for r in res.steps] == pytest.approx([3.5, 6.0, 7.5, 10.0, 11.5, 13.0])
    assert call_starts(res) == pytest.approx([0.0, 3.5, 7.5])


def test_oversampling_trains_first_the_groups_that_finished_first(tmp_path):
    """Prompts 0-7 answer in 20 tokens, 8-15 in 10: the first batch of the call is prompts 8-15."""
    res = make_world(tmp_path, "oversample", lengths=[20] * 16 + [10] * 16, steps=4)
    assert res.steps[0].prompt_indices == tuple(range(8, 16))
    assert res.steps[1].prompt_indices == tuple(range(8))


def test_the_last_batch_trains_with_the_dataset_exhausted(tmp_path):
    """The dataset holds steps x B prompts: nothing generates beside the last batch, its sync does not wait."""
    res = make_world(tmp_path, "async", steps=4)
    assert len(call_starts(res)) == 4
    assert res.steps[-1].sync_end_s - res.steps[-1].batch_ready_s == pytest.approx(1.5)


def test_a_window_of_a_longer_run_keeps_generating_beside_its_last_batch(tmp_path):
    res = make_world(tmp_path, "async", None, 4, "workload.dataset_steps=false")
    assert len(call_starts(res)) == 5
    assert res.steps[-1].sync_end_s - res.steps[-1].batch_ready_s == pytest.approx(2.5)


def test_step_latency_is_the_gap_between_the_steps_events_after_their_weight_syncs(tmp_path):
    res = make_world(tmp_path, "async")
    assert drivers.step_latencies_s(res, warmup_steps=1) == pytest.approx([2.5, 2.5, 2.5, 2.5, 1.5])


def test_training_beside_the_call_it_just_started_is_slowed_for_the_share_of_it_the_call_decodes(tmp_path):
    """The trainer hands the slot back before it trains: the next call decodes beside that training,
    which runs 1 + (3 - 1) f slower, f the share of the training span during which the call decodes."""
    res = make_world(tmp_path, "async", None, 6, "efficiency.train_slowdown_shared=3")
    #  take 0 at 2: call 1 decodes [2, 4]; training T solves T = 1 * (1 + 2 * 2 / T): T = (1 + sqrt(17)) / 2
    train_s = (1 + 17 ** 0.5) / 2  # 2.56 s > the call's 2 s, so f = 2 / T
    assert res.steps[0].train_end_s == pytest.approx(2 + train_s)
    assert res.steps[0].sync_end_s == pytest.approx(2 + train_s + 0.5)
