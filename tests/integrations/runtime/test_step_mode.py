"""The generator's step mode, resolved from the flags, and its per-step state's transitions
(`integrations.runtime.step_mode`). What each mode makes the generator do: test_generator.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from openrlhf_oppo.config import StalenessConfig
from openrlhf_oppo.core import StepPlan, TrainBatch
from openrlhf_oppo.integrations.runtime.step_mode import (
    BegunStep,
    Carried,
    Phase,
    StepKind,
    StepMode,
    StepState,
    TakenBatch,
    carried_in_training,
    resolve_mode,
)

SYNC = StepMode(StepKind.SYNC, Carried.DECODE, keep_kv_cache=True, max_policy_lag=0)
HOLD = StepMode(StepKind.SYNC, Carried.HOLD, keep_kv_cache=True, max_policy_lag=0)
SLEEP = StepMode(StepKind.SLEEP, Carried.DECODE, keep_kv_cache=False, max_policy_lag=0)
ASYNC = StepMode(StepKind.ASYNC, Carried.DECODE, keep_kv_cache=True, max_policy_lag=2)
BACKGROUND = StepMode(StepKind.ASYNC_BACKGROUND_SYNC, Carried.DECODE, keep_kv_cache=True, max_policy_lag=2)


def make_args(sleep: bool = False, colocate_all: bool = False) -> SimpleNamespace:
    """The OpenRLHF flags the step mode reads."""
    return SimpleNamespace(vllm=SimpleNamespace(enable_sleep=sleep), train=SimpleNamespace(colocate_all=colocate_all))


def make_taken(report=None) -> TakenBatch:
    return TakenBatch(TrainBatch(step=0, groups=(), offpolicy_token_fraction=0.0), sample_ids=[], report=report)


def make_begun(step: int = 1) -> BegunStep:
    plan = StepPlan(step=step, admit=(), chunk_size_tokens=4, delta=0, must_finish=(), carried=())
    return BegunStep(plan, pass_end=6)


@pytest.mark.parametrize("lag, background_sync, sleep, colocate_all, kind, carried, keep_kv_cache", [
    (0, False, False, False, StepKind.SYNC, Carried.DECODE, True),  # vLLM on GPUs of its own
    (0, False, False, True, StepKind.SYNC, Carried.HOLD, True),  # vLLM on the training GPUs
    (0, False, True, True, StepKind.SLEEP, Carried.HOLD, False),  # the hybrid engine: asleep, no KV kept
    (2, False, False, False, StepKind.ASYNC, Carried.DECODE, True),
    (2, False, False, True, StepKind.ASYNC, Carried.DECODE, True),  # the next step's groups decode in training
    (2, True, False, False, StepKind.ASYNC_BACKGROUND_SYNC, Carried.DECODE, True),
])
def test_the_mode_is_resolved_once_from_the_flags(lag, background_sync, sleep, colocate_all, kind, carried,
                                                  keep_kv_cache):
    staleness = StalenessConfig(max_policy_lag=lag, background_sync=background_sync)
    mode = resolve_mode(staleness, make_args(sleep, colocate_all), cpu_host=False)
    assert mode == StepMode(kind, carried, keep_kv_cache=keep_kv_cache, max_policy_lag=lag)


@pytest.mark.parametrize("given, cpu_host, colocate_all, lag, resolved", [
    ("auto", True, False, 0, "hold"),  # a CPU run: every role on one host's cores
    ("auto", False, True, 0, "hold"),  # --train.colocate_all: the engines on the training GPUs
    ("auto", False, False, 0, "decode"),  # vLLM on GPUs of its own
    ("auto", True, False, 2, "decode"),  # async admission: the next step's groups decode while it trains
    ("decode", True, False, 0, "decode"),
    ("hold", False, False, 0, "hold"),
])
def test_auto_holds_carried_groups_where_the_engines_share_the_trainers_devices(given, cpu_host, colocate_all, lag,
                                                                                  resolved):
    staleness = StalenessConfig(max_policy_lag=lag, carried_in_training=given)
    args = SimpleNamespace(train=SimpleNamespace(colocate_all=colocate_all))
    assert carried_in_training(staleness, args, cpu_host) is Carried(resolved)


def test_a_combination_the_launcher_refuses_is_refused_by_name():
    refused = r"--vllm\.enable_sleep cannot be combined with --oppo\.staleness\.max_policy_lag 2"
    with pytest.raises(ValueError, match=refused):
        resolve_mode(StalenessConfig(max_policy_lag=2), make_args(sleep=True), cpu_host=False)
    with pytest.raises(ValueError, match=r"--oppo\.staleness\.background_sync true needs"):
        resolve_mode(StalenessConfig(background_sync=True), make_args(), cpu_host=False)
    with pytest.raises(ValueError, match="async kinds need a lag >= 1"):
        StepMode(StepKind.ASYNC, Carried.DECODE, keep_kv_cache=True, max_policy_lag=0)
    with pytest.raises(ValueError, match="carried_in_training hold needs"):
        StepMode(StepKind.ASYNC, Carried.HOLD, keep_kv_cache=True, max_policy_lag=2)


@pytest.mark.parametrize("mode, with_carried, with_none", [
    (SYNC, True, False),  # the carried groups decode: paused so the new weights land between tokens
    (HOLD, False, False),  # paused at the batch already
    (SLEEP, False, False),  # asleep: nothing decodes
    (ASYNC, True, False),
    (BACKGROUND, True, True),  # nothing may start on half-loaded weights
])
def test_the_engines_pause_for_a_weight_sync_where_something_could_decode_on_old_weights(mode, with_carried,
                                                                                           with_none):
    assert mode.pauses_for_weight_sync(carrying=True) is with_carried
    assert mode.pauses_for_weight_sync(carrying=False) is with_none


def test_only_held_carried_groups_pause_as_the_batch_is_taken():
    assert HOLD.pauses_at_batch(carrying=True)
    assert not HOLD.pauses_at_batch(carrying=False)
    for mode in (SYNC, SLEEP, ASYNC, BACKGROUND):
        assert not mode.pauses_at_batch(carrying=True)


def test_a_step_starts_from_the_phase_the_last_event_left():
    state = StepState()
    assert state.phase is Phase.READY
    restored = state.restored()
    assert restored.phase is Phase.RESTORED
    assert restored.phase.engines_lost_carried and restored.phase.scorers_lost_carried
    running = restored.started()
    assert running == StepState()  # from here on the engines and scorers hold what the step restarted
    parked = running.batch_taken(SLEEP, make_taken(), parked=True, begun=None)
    assert parked.phase is Phase.PARKED and parked.taken is not None
    assert parked.phase.engines_lost_carried and not parked.phase.scorers_lost_carried
    closed = parked.finished()
    assert closed.phase is Phase.PARKED and closed.taken is None  # the phase stands for the next step
    begun = make_begun()
    after = StepState().batch_taken(ASYNC, make_taken(report="the step's report"), parked=False, begun=begun)
    assert after.phase is Phase.BEGUN and after.begun is begun
    assert not (after.phase.engines_lost_carried or after.phase.scorers_lost_carried)


def test_a_transition_the_mode_does_not_make_is_refused():
    with pytest.raises(RuntimeError, match="before finish_step closed the previous step"):
        StepState(taken=make_taken()).started()
    with pytest.raises(RuntimeError, match="no batch taken"):
        StepState().finished()
    with pytest.raises(ValueError, match="parks nothing"):
        StepState().batch_taken(SYNC, make_taken(), parked=True, begun=None)
    with pytest.raises(ValueError, match="begins no step at the batch"):
        StepState().batch_taken(SYNC, make_taken(), parked=False, begun=make_begun())
    with pytest.raises(ValueError, match="report is made at the batch"):
        StepState().batch_taken(ASYNC, make_taken(), parked=False, begun=None)
    with pytest.raises(ValueError, match="held in phase begun, and only there"):
        StepState(Phase.BEGUN)
