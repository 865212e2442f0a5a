"""EnginePool with fake engines: placement, starts, polling, aborts, the weight-sync pause."""

from __future__ import annotations

import time

import pytest
import ray

from openrlhf_oppo.integrations.runtime.engine_pool import ABORT_RETRIES, EnginePool
from openrlhf_oppo.integrations.runtime.rollout import SampleRequest


def make_pool(fakes, engines: int = 2, outputs=None):
    """A pool over `engines` fake engines; `outputs[i]`: FakeRefs engine i answers `next_outputs` with, in turn."""
    outputs = outputs or {}

    def engine(i):
        replies = iter(outputs.get(i, ()))
        silent = fakes.FakeRef([], ready=False)
        return fakes.make_actor(start_samples=None, next_outputs=lambda *a: next(replies, silent),
                                pause_generation=None, resume_generation=None, set_policy_version=None,
                                set_reward_tokenizer=None, abort_one=None)

    calls = fakes.FakeCalls()
    return EnginePool([engine(i) for i in range(engines)], calls), calls


def request(sid: int, held=()) -> SampleRequest:
    return SampleRequest(sid, [1, 2], list(held), 8)


def test_a_group_goes_whole_to_the_engine_decoding_fewest_groups(fakes):
    pool, _ = make_pool(fakes, engines=3)
    assert [pool.place(g) for g in range(4)] == [0, 1, 2, 0]  # ties: the lowest index
    pool.release(1, [2, 3])
    assert pool.place(4) == 1  # engine 1 decodes nothing now


def test_requests_start_on_their_groups_engine_in_one_call_per_engine(fakes):
    pool, _ = make_pool(fakes)
    pool.place(0), pool.place(1)
    pool.start([(0, request(0)), (1, request(2)), (0, request(1))], "params")
    (first,) = pool.engines[0].start_samples.calls
    (second,) = pool.engines[1].start_samples.calls
    assert [r.sample_id for r in first[0]] == [0, 1] and first[1] == "params"
    assert [r.sample_id for r in second[0]] == [2]


def test_poll_keeps_one_call_per_engine_in_flight_and_returns_deltas_engine_by_engine(fakes):
    d0, d1 = fakes.make_delta(0, [5]), fakes.make_delta(2, [6, 7])
    slow = fakes.FakeRef([d1], ready=False)
    pool, _ = make_pool(fakes, outputs={0: [fakes.FakeRef([d0])], 1: [slow]})
    assert pool.poll(wake_tokens=4) == [d0]
    assert pool.polls == {1: slow}  # engine 1's call is still in flight: not sent again
    slow.ready = True
    assert pool.poll(wake_tokens=4) == [d1]
    assert [len(e.next_outputs.calls) for e in pool.engines] == [2, 1]
    assert pool.replies_this_step == 2


def test_poll_wakes_on_a_reward_call_too(fakes):
    pool, _ = make_pool(fakes)
    assert pool.poll(wake_tokens=4, also=[fakes.FakeRef("scored")]) == []  # no engine answered yet


def test_a_dead_engine_stops_the_run_naming_the_step_and_the_resume(fakes):
    pool, _ = make_pool(fakes, engines=1, outputs={0: [fakes.FakeRef(error=ray.exceptions.RayActorError())]})
    pool.begin_step(3)
    with pytest.raises(RuntimeError, match=r"rollout engine 0 died in step 3 .*--ckpt.load_enable"):
        pool.poll(wake_tokens=4)


def test_an_aborted_sample_decodes_on_from_its_tokens_on_its_groups_engine(fakes):
    pool, _ = make_pool(fakes)
    pool.place(0), pool.place(1)
    pool.restart_aborted([(fakes.make_delta(2, [], finish="abort", error="boom"), 1, request(2, held=[7, 8]))], "p")
    ((reqs, params),) = pool.engines[1].start_samples.calls
    assert [(r.sample_id, r.held_ids) for r in reqs] == [(2, [7, 8])] and params == "p"
    assert pool.aborted_this_step == 1 and pool.engines[0].start_samples.calls == []


def test_a_sample_aborted_more_than_abort_retries_times_fails_the_step(fakes):
    pool, _ = make_pool(fakes)
    pool.place(0)
    pool.begin_step(5)
    aborted = [(fakes.make_delta(1, [], finish="abort", error="EngineDeadError"), 0, request(1))]
    for _ in range(ABORT_RETRIES):
        pool.restart_aborted(aborted, None)
    with pytest.raises(RuntimeError, match=rf"step 5: sample 1 was aborted by its engine {ABORT_RETRIES + 1} times"):
        pool.restart_aborted(aborted, None)
    pool.release(0, [1])
    assert pool.aborts == {}  # a trained sample's count is dropped


def test_resume_sets_the_policy_version_and_resumes_only_what_was_paused(fakes):
    pool, _ = make_pool(fakes, engines=2)
    pool.resume(1)  # Δ = 0: nothing was paused
    assert all(e.set_policy_version.calls == [(1,)] and e.resume_generation.calls == [] for e in pool.engines)
    pool.pause(keep_kv_cache=True)
    assert all(e.pause_generation.calls == [(True,)] for e in pool.engines)
    pool.resume(2)
    assert all(e.resume_generation.calls == [()] for e in pool.engines) and not pool.paused


class GatedCalls:
    """`FakeCalls` whose `get` of a `gate` ref blocks until the test opens it (an engine still
    loading weights); records the order of the engine calls made through it."""

    def __init__(self, fakes) -> None:
        import threading

        self.inner, self.gate, self.opened = fakes.FakeCalls(), fakes.FakeRef("loaded"), threading.Event()

    def get(self, refs, timeout_s: float | None = None):
        if refs is self.gate or (isinstance(refs, list) and self.gate in refs):
            assert self.opened.wait(10), "the load never finished"
        return self.inner.get(refs)


def _gated_pool(fakes):
    pool, _ = make_pool(fakes, engines=2)
    for e in pool.engines:
        e.reset_prefix_cache = fakes.FakeMethod()
    pool.calls = GatedCalls(fakes)
    return pool


def test_a_background_sync_resumes_the_engines_only_once_they_loaded_the_weights_and_the_caller_goes_on(fakes):
    pool = _gated_pool(fakes)
    pool.pause(keep_kv_cache=True)
    pool.resume_when_loaded([pool.calls.gate], policy_version=3, reset_prefix_cache=True)  # returns at once
    assert pool.landing.is_alive() and pool.paused
    assert all(e.set_policy_version.calls == [] and e.resume_generation.calls == [] for e in pool.engines)
    time.sleep(0.2)  # the engines' load
    pool.calls.opened.set()
    pool.join_landing()
    assert pool.take_paused_s() >= 0.2 and pool.take_paused_s() == 0.0  # paused until the loads landed
    for e in pool.engines:  # the prefix cache was reset before decoding resumed, with the new version
        assert e.reset_prefix_cache.calls == [()] and e.set_policy_version.calls == [(3,)]
        assert e.resume_generation.calls == [()]
    assert not pool.paused and pool.landing is None


def test_the_next_pause_waits_for_the_last_background_sync_to_land(fakes):
    import threading

    pool = _gated_pool(fakes)
    pool.pause(keep_kv_cache=False)
    pool.resume_when_loaded([pool.calls.gate], policy_version=1, reset_prefix_cache=False)
    second = threading.Thread(target=pool.pause, args=(False,))
    second.start()
    second.join(0.3)
    assert second.is_alive(), "the next sync paused the engines before the last one's weights were loaded"
    assert all(len(e.pause_generation.calls) == 1 for e in pool.engines)
    pool.calls.opened.set()
    second.join(10)
    assert all(e.pause_generation.calls == [(False,), (False,)] for e in pool.engines)
    assert all(e.resume_generation.calls == [()] for e in pool.engines) and pool.paused


def test_a_failed_load_stops_the_run_at_the_next_poll_naming_the_background_sync(fakes):
    pool, _ = make_pool(fakes, engines=1)
    pool.pause(keep_kv_cache=True)
    pool.resume_when_loaded([fakes.FakeRef(error=ValueError("worker died"))], 2, reset_prefix_cache=False)
    pool.landing.join(10)
    with pytest.raises(RuntimeError, match=r"weight load \(background sync\) failed: ValueError\('worker died'\)"):
        pool.poll(wake_tokens=4)
    assert pool.engines[0].resume_generation.calls == []  # never decodes on half-loaded weights
