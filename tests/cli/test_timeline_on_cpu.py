"""The timeline of real CPU runs (`openrlhf-oppo train` writes `<run>/timeline/`): the
session's seeded sync run and its OPPO run (OpenRLHF's hybrid engine, the reward model
streamed), read back and drawn. No extra training run."""

from __future__ import annotations

import json

import pytest

from openrlhf_oppo import timeline
from openrlhf_oppo.bench import plot
from openrlhf_oppo.compat.weight_sync import PROBE_MAX_TOKENS

pytestmark = pytest.mark.e2e  # real Ray, vLLM (CPU build), DeepSpeed and OpenRLHF processes

B, N, STEPS = 4, 2, 4  # configs/tiny-cpu.yaml: 4 prompts x 2 samples per step, 4 steps


def _rows(run) -> list[dict]:
    return timeline.read(run.root / "timeline")


def _trace(run) -> list[dict]:
    return [json.loads(line) for line in (run.root / "oppo_trace.jsonl").read_text().splitlines()]


def _spans(rows, role=None, stage=None):
    return [r for r in rows if r["kind"] == "span" and role in (None, r["role"]) and stage in (None, r["stage"])]


def _requests(rows) -> dict[int, list[dict]]:
    """sample id -> its engine requests in start order (`sample` records: tokens decoded, tokens
    `held` when it started; the sync probe has no sample id). In the hybrid engine a request
    decoding at a batch stops there, and the sample decodes on in a new request after the wake."""
    out: dict[int, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["t0"]):
        if r["kind"] == "sample" and r.get("sample") is not None:
            out.setdefault(r["sample"], []).append(r)
    return out


# in the hybrid engine the generator wakes the engines as the driver's generate begins and puts them
# to sleep at the batch: those two spans lie inside a generate span of the same driver
INSIDE_GENERATE = ("wake", "sleep")


@pytest.mark.parametrize("schedule", ["sync", "oppo"])
def test_spans_of_one_worker_never_overlap(schedule, sync_run, oppo_run):
    rows = _rows(sync_run if schedule == "sync" else oppo_run)
    workers: dict[tuple, list] = {}
    for r in _spans(rows):
        if not (r["role"] == "driver" and r["stage"] in INSIDE_GENERATE):
            workers.setdefault((r["role"], r["pid"]), []).append((r["t0"], r["t1"]))
    for worker, spans in workers.items():
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert a1 <= b0 + 1e-6, f"{worker}: [{a0}, {a1}] overlaps [{b0}, {b1}]"
    generate = [(r["pid"], r["t0"], r["t1"]) for r in _spans(rows, "driver", "generate")]
    for r in (r for stage in INSIDE_GENERATE for r in _spans(rows, "driver", stage)):
        assert any(pid == r["pid"] and a <= r["t0"] and r["t1"] <= b for pid, a, b in generate), r


@pytest.mark.parametrize("schedule", ["sync", "oppo"])
def test_every_stage_of_the_step_is_on_the_timeline(schedule, sync_run, oppo_run):
    rows = _rows(sync_run if schedule == "sync" else oppo_run)
    stages = {(r["role"], r["stage"]) for r in _spans(rows)}
    expected = {("driver", "generate"), ("driver", "make_experience"), ("driver", "train"), ("driver", "weight_sync"),
                ("actor", "old_logprobs"), ("actor", "train"), ("actor", "weight_sync"), ("critic", "values"),
                ("critic", "train"), ("ref", "ref_logprobs"), ("rollout", "load_weights")}
    # OPPO's run streams into the reward model, pauses the engines for each weight sync, and in the
    # hybrid engine stops its requests at the batch (park) and sleeps its engines through the update
    expected |= {("reward", "score"), ("reward", "prefill"), ("driver", "pause"), ("rollout", "pause"),
                 ("rollout", "park"), ("driver", "sleep"), ("driver", "wake")} \
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
    requests = _requests(_rows(oppo_run))
    trained = [s for row in _trace(oppo_run) for g in row["trained"] for s in g["samples"]]
    assert len(trained) == STEPS * B * N
    for s in trained:
        assert s["sample_id"] in requests, f"trained sample {s['sample_id']} has no decode span"
        assert sum(r["tokens"] for r in requests[s["sample_id"]]) == len(s["tokens"])


def test_a_request_spans_two_policy_versions_exactly_when_its_decode_spans_a_weight_sync(oppo_run):
    """The timeline and the scheduler's per-token versions agree: the tokens one engine request
    decoded carry two policy versions if and only if its decode span holds a weight sync (in which
    it was paused), and a sample's next request decodes with a newer policy than its last one
    ended with if and only if a weight sync lies between them (in the hybrid engine every request
    stopped at a batch decodes on after the update). Whether any request is still decoding at a
    batch depends on timing on this CPU task: the check holds for every trained sample."""
    rows = _rows(oppo_run)
    syncs = [(r["t0"], r["t1"]) for r in _spans(rows, "driver", "weight_sync")]
    requests = _requests(rows)
    for s in (s for row in _trace(oppo_run) for g in row["trained"] for s in g["samples"]):
        last = None  # the request before, and the version its last token carries
        for r in requests[s["sample_id"]]:
            versions = s["versions"][r["held"]: r["held"] + r["tokens"]]
            if not versions:  # stopped before it decoded a token
                continue
            across = any(r["t0"] < a and r["t1"] > b for a, b in syncs)
            assert (len(set(versions)) > 1) == across, (s["sample_id"], versions[:1], versions[-1:], across)
            if last is not None:
                between = any(last[0]["t1"] <= a and b <= r["t0"] for a, b in syncs)
                assert (versions[0] > last[1]) == between, (s["sample_id"], last[1], versions[0], between)
            last = (r, versions[-1])


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

