"""The timeline of real CPU runs (`openrlhf-oppo train` writes `<run>/timeline/`): the
session's seeded sync run and its OPPO run, read back and drawn. No extra training run."""

from __future__ import annotations

import json

import pytest

from openrlhf_oppo import timeline
from openrlhf_oppo.bench import plot
from openrlhf_oppo.compat.weight_sync import PROBE_MAX_TOKENS

pytestmark = pytest.mark.e2e  # real Ray, vLLM (CPU build), DeepSpeed and OpenRLHF processes

B, N, STEPS = 4, 2, 4  # configs/tiny-cpu.yaml: 4 prompts x 2 samples per step, 4 steps


@pytest.fixture(scope="module")
def oppo_run(train_runs):
    run = train_runs("oppo")
    assert run.returncode == 0, run.failure()
    return run


def _rows(run) -> list[dict]:
    return timeline.read(run.root / "timeline")


def _trace(run) -> list[dict]:
    return [json.loads(line) for line in (run.root / "oppo_trace.jsonl").read_text().splitlines()]


def _spans(rows, role=None, stage=None):
    return [r for r in rows if r["kind"] == "span" and role in (None, r["role"]) and stage in (None, r["stage"])]


@pytest.mark.parametrize("schedule", ["sync", "oppo"])
def test_spans_of_one_worker_never_overlap(schedule, sync_run, oppo_run):
    rows = _rows(sync_run if schedule == "sync" else oppo_run)
    workers: dict[tuple, list] = {}
    for r in _spans(rows):
        workers.setdefault((r["role"], r["pid"]), []).append((r["t0"], r["t1"]))
    for worker, spans in workers.items():
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert a1 <= b0 + 1e-6, f"{worker}: [{a0}, {a1}] overlaps [{b0}, {b1}]"


@pytest.mark.parametrize("schedule", ["sync", "oppo"])
def test_every_stage_of_the_step_is_on_the_timeline(schedule, sync_run, oppo_run):
    rows = _rows(sync_run if schedule == "sync" else oppo_run)
    stages = {(r["role"], r["stage"]) for r in _spans(rows)}
    expected = {("driver", "generate"), ("driver", "make_experience"), ("driver", "train"), ("driver", "weight_sync"),
                ("actor", "old_logprobs"), ("actor", "train"), ("actor", "weight_sync"), ("critic", "values"),
                ("critic", "train"), ("ref", "ref_logprobs"), ("rollout", "load_weights")}
    expected |= {("reward", "score"), ("reward", "prefill"), ("driver", "pause"), ("rollout", "pause")} \
        if schedule == "oppo" else {("reward", "score")}
    assert expected <= stages, sorted(expected - stages)
    # OpenRLHF asks its generator once more at the end, and gets nothing: STEPS or STEPS + 1
    assert len(_spans(rows, "driver", "generate")) - STEPS in (0, 1) and len(_spans(rows, "actor", "train")) == STEPS


def test_every_trained_sample_has_a_decode_span(sync_run, oppo_run):
    rows = _rows(sync_run)
    steps = [(r["t0"], r["t1"]) for r in _spans(rows, "driver", "generate")]
    # responses started by the driver's generate. The launcher's sync probe decodes one more
    # greedy response after each weight sync (not a rollout); it may start inside the next
    # generate span, so it is told apart by what it is: PROBE_MAX_TOKENS tokens, cut at its cap
    # (a rollout cut at its cap has max_new_tokens, 192)
    sync_samples = [r for r in rows if r["kind"] == "sample" and any(a <= r["t0"] <= b for a, b in steps)
                    and not (r.get("finish") == "length" and r["tokens"] == PROBE_MAX_TOKENS)]
    assert len(sync_samples) == STEPS * B * N  # OpenRLHF's own generate, one record per response
    assert all(r["t1"] >= r["t0"] and r["tokens"] >= 1 for r in sync_samples)
    decoded = {r["sample"]: r for r in _rows(oppo_run) if r["kind"] == "sample" and "sample" in r}
    trained = [s for row in _trace(oppo_run) for g in row["trained"] for s in g["samples"]]
    assert len(trained) == STEPS * B * N
    for s in trained:
        assert s["sample_id"] in decoded, f"trained sample {s['sample_id']} has no decode span"
        assert decoded[s["sample_id"]]["tokens"] == len(s["tokens"])


def test_a_sample_spans_two_policy_versions_exactly_when_its_decode_spans_a_weight_sync(oppo_run):
    """The timeline and the scheduler's per-token versions agree: a trained sample has tokens
    of two policy versions if and only if its decode span holds a weight sync in which it
    was paused. (Whether any carried sample is still decoding at a sync depends on timing
    on this CPU task: the check holds for every trained sample, crossing or not.)"""
    rows = _rows(oppo_run)
    syncs = [(r["t0"], r["t1"]) for r in _spans(rows, "driver", "weight_sync")]
    decoded = {r["sample"]: r for r in rows if r["kind"] == "sample" and "sample" in r}  # not the sync probe
    trained = [s for row in _trace(oppo_run) for g in row["trained"] for s in g["samples"]]
    for s in trained:
        d = decoded[s["sample_id"]]
        across = any(d["t0"] < a and d["t1"] > b for a, b in syncs)
        assert (len(set(s["versions"])) > 1) == across, (s["sample_id"], s["versions"][:1], s["versions"][-1:], across)


def test_idle_fraction_of_each_role_is_logged_per_step(sync_run):
    from openrlhf_oppo.bench.schedules import tensorboard_scalars

    scalars = tensorboard_scalars(sync_run.root / "tensorboard")
    for role in ("rollout", "reward", "ref", "actor", "critic"):
        values = [v for tag, events in scalars.items() if tag.endswith(f"timing/idle/{role}") for _, _, v in events]
        assert len(values) == STEPS and all(0.0 <= v <= 1.0 for v in values), (role, values)
    # sync decodes, then scores: the reward model idles while the engine decodes. Step 0 is left
    # out: its one-off start-up stall idles both (measured 0.892 reward against 0.922 rollout)
    rollout_idle = [v for tag, ev in scalars.items() if tag.endswith("timing/idle/rollout") for _, _, v in ev]
    reward_idle = [v for tag, ev in scalars.items() if tag.endswith("timing/idle/reward") for _, _, v in ev]
    assert all(r > g for r, g in zip(reward_idle[1:], rollout_idle[1:]))


def test_plots_are_drawn_from_real_runs(sync_run, oppo_run, tmp_path):
    out = plot.plot_timeline(oppo_run.root, tmp_path / "oppo.png")
    both = plot.plot_compare(sync_run.root, oppo_run.root, tmp_path / "compare.png")
    lengths = plot.plot_lengths(sync_run.root, tmp_path / "lengths.png")
    for png in (out, both, lengths):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

