"""Async admission end to end on CPU (`--oppo.staleness.max_policy_lag`): the next step's groups
are admitted as the batch is taken and decode on the real vLLM engines while DeepSpeed trains;
the ledger accounts for every group and no trained token is more than the lag behind the weights
it trains (read from the per-step trace).

The session's `restarted_and_stopped` (tests/cli/conftest.py): `oppo-async-bg` (lag 2, the
weight sync in the background with its default buffer) placed as OpenRLHF's async mode places
its models (`--train.colocate_all --train.async_enable`: the DeepSpeed models share a placement
group, vLLM has its own), with OPPO's trainer in place of OpenRLHF's async one; relaunched once
after its engine is killed, then stopped by SIGTERM (test_faults_on_cpu reads those).

`slow` (left out of CI's run for time, two launches of their own): lag 1 with a blocking sync in
the async layout (the lag bound's forced groups, exactly), and lag 1 with the weight sync in the
background from the actor's two ZeRO-3 ranks, each sending its own partitions
(`--oppo.staleness.background_sync_buffer shards`), in OpenRLHF's default placement (vLLM and each
model on logical GPUs of their own)."""

from __future__ import annotations

import json

import pytest
import torch

from openrlhf_oppo.config import ASYNC_POLICY_LAG
from openrlhf_oppo.core import ledger

pytestmark = pytest.mark.e2e  # real Ray, vLLM (CPU build), DeepSpeed and OpenRLHF processes

ASYNC_LAYOUT = ("--train.colocate_all", "--train.async_enable")  # as conftest.ASYNC_LAYOUT
LAG1 = ("oppo", "--oppo.staleness.max_policy_lag", "1", "--oppo.delta.enable", "false")
SHARDED_SYNC = ("--oppo.staleness.background_sync", "true", "--oppo.staleness.background_sync_buffer", "shards",
                "--actor.num_gpus_per_node", "2")
LAG_RUNS = {"lag1": (1, (*LAG1, *ASYNC_LAYOUT)), "lag1-background-sync-shards": (1, (*LAG1, *SHARDED_SYNC))}


def _check_lag(run, lag: int) -> list[int]:
    """No trained token more than `lag` versions behind the step that trains it, some decoded
    while the trainer trained (admitted early), and the per-step metrics count the same tokens.
    Returns the lags of every trained token."""
    trace, metrics = run.trace(), run.metrics()
    lags = [row["step"] - v for row in trace for g in row["trained"] for s in g["samples"] for v in s["versions"]]
    assert lags and max(lags) <= lag and min(lags) >= 0
    # groups admitted at the batch decode while the trainer trains: tokens one version behind
    assert sum(1 for x in lags if x >= 1) > 0, "no token was decoded during training: nothing was admitted early"
    assert len(metrics) == len(trace)
    for row in metrics:
        assert row["oppo/lag_max"] <= lag
        assert sum(row[f"oppo/lag_tokens/{b}"] for b in ("0", "1", "2", "3+")) > 0
    for b in range(lag + 1):
        assert sum(row[f"oppo/lag_tokens/{b}"] for row in metrics) == sum(1 for x in lags if x == b), b
    return lags


def _check_async_layout(run) -> None:
    log = (run.root / "train.log").read_text()
    # OpenRLHF's train() prints this only on its async branch, the one that keeps vLLM out of the
    # DeepSpeed models' placement group (`pg if colocate_all and not async_enable else None`)
    assert "[Warning] Using --colocate_all_models in async RLHF only colocates DeepSpeed models." in log
    assert "OppoPPOTrainerImpl pid=" in log and "PPOTrainerAsync pid=" not in log


def test_no_trained_token_is_more_than_the_lag_behind_and_some_decoded_during_training(restarted_and_stopped):
    _check_lag(restarted_and_stopped, ASYNC_POLICY_LAG)


def test_openrlhf_placed_the_run_as_its_async_mode_and_oppos_trainer_ran_it(restarted_and_stopped):
    _check_async_layout(restarted_and_stopped)


def test_every_background_sync_of_the_relaunch_lands_before_the_engines_decode_on(restarted_and_stopped, attempts):
    """The relaunch loaded a checkpoint with groups carried and the next step's admitted; its first
    sync (the checkpoint's weights) lands in the background too, before any carried sample decodes
    on, and so does every later one (the background sync's default buffer): one landing per sync,
    beside the driver's spans, started as the trainer was released. The last sync's landing may
    be cut short by the stop."""
    from openrlhf_oppo import timeline

    run = restarted_and_stopped
    _, again = attempts(run)
    rows = timeline.read(run.root / "timeline")
    relaunch = max(timeline.stage_spans(rows, "driver", "weight_sync"), key=lambda r: r["t0"])["pid"]
    syncs = sorted((r for r in timeline.stage_spans(rows, "driver", "weight_sync") if r["pid"] == relaunch),
                   key=lambda r: r["t0"])
    landings = sorted((r for r in timeline.stage_spans(rows, "sync", "landing") if r["pid"] == relaunch),
                      key=lambda r: r["t0"])
    assert len(syncs) == len(again) + 1  # the resume's, then one a step
    assert len(syncs) - 1 <= len(landings) <= len(syncs)
    for sync, landing in zip(syncs, landings):
        assert sync["t0"] <= landing["t0"] <= sync["t1"] + 1.0  # started as the trainer was released


# ---------------------------------------------------------------- slow: lag 1, two launches of their own


def _run(train_runs, name: str):
    lag, (schedule, *extra) = LAG_RUNS[name]
    run = train_runs(schedule, *extra)
    assert run.returncode == 0, run.failure()
    return lag, run


@pytest.fixture(scope="module", params=sorted(LAG_RUNS))
def lag_run(request, train_runs):
    return _run(train_runs, request.param)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_every_group_is_trained_once_and_the_ledger_holds(lag_run):
    _, run = lag_run
    trace = run.trace()
    trained = [g["group_id"] for row in trace for g in row["trained"]]
    assert sorted(trained) == list(range(16)), "configs/tiny-cpu.yaml: one pass of 16 prompts, each trained once"
    assert [row["step"] for row in trace] == [0, 1, 2, 3] and all(len(row["trained"]) == 4 for row in trace)
    report = ledger.check_run(run.root)
    assert report.ok and report.admitted == 16 and report.held == 0, report.summary()


@pytest.mark.slow
def test_at_lag_one_each_steps_groups_are_forced_into_its_own_batch(lag_run):
    lag, run = lag_run
    _check_lag(run, lag)
    metrics = run.metrics()
    # at lag 1 (Δ off) the groups admitted at batch t hold tokens of version t, two behind step t + 2: each
    # step's groups are forced into its own batch (step 0's are not: no batch before them), and they are all
    # of it, so the bound never holds a batch that B complete groups could make
    assert [row["oppo/forced_groups"] for row in metrics] == [0.0, 4.0, 4.0, 4.0]
    assert all(row["oppo/forced_wait_s"] == 0.0 for row in metrics)


@pytest.mark.slow
def test_openrlhf_placed_the_lag1_run_as_its_async_mode(train_runs):
    _check_async_layout(_run(train_runs, "lag1")[1])


def _check_the_last_probe_holds_the_saved_actor(run, teacher_forced, logprob_atol) -> None:
    """The last probe's logprobs are the saved actor's (within the tolerance) and not the initial one's."""
    last = run.probes()[-1]
    chosen, _, _ = teacher_forced(run.root / "model", last)
    initial, _, _ = teacher_forced(run.assets / "actor", last)
    trained_err = (chosen - torch.tensor(last["logprobs"])).abs().max()
    initial_err = (initial - torch.tensor(last["logprobs"])).abs().max()
    assert trained_err < logprob_atol < initial_err and initial_err > 3 * trained_err


@pytest.mark.slow
def test_a_sharded_background_sync_lands_every_version_before_the_engines_decode_on(train_runs, teacher_forced,
                                                                                       logprob_atol):
    """The trainer waited for its ranks' partitions to be sent only; the engines resumed once loaded
    (one landing per sync, beside the driver's spans, once both ranks' partitions had come: no
    gather). The last probe, decoded after the last landing, holds the saved actor's weights, not
    the initial ones: a partition misplaced, dropped or left padded would not."""
    from openrlhf_oppo import timeline

    _, run = _run(train_runs, "lag1-background-sync-shards")
    probes = run.probes()
    assert [p["sync"] for p in probes] == [1, 2, 3, 4]
    rows = timeline.read(run.root / "timeline")
    landings = timeline.stage_spans(rows, "sync", "landing")
    syncs = timeline.stage_spans(rows, "driver", "weight_sync")
    assert len(landings) == len(syncs) == 4
    assert len({r["pid"] for r in timeline.stage_spans(rows, "actor", "weight_sync")}) == 2  # both ranks sent
    paused = [m["oppo/engines_paused_s"] for m in _lines(run.root / "oppo_metrics.jsonl")]
    assert len(paused) == 4 and sum(paused[1:]) > 0  # a sync's pause ends when its loads land: the next step's
    for sync, landing in zip(sorted(syncs, key=lambda r: r["t0"]), sorted(landings, key=lambda r: r["t0"])):
        assert sync["t0"] <= landing["t0"] <= sync["t1"] + 1.0  # started as the trainer was released
    _check_the_last_probe_holds_the_saved_actor(run, teacher_forced, logprob_atol)
