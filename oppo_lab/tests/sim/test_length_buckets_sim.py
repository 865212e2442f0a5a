"""Length-bucketed micro-batches in the simulator and its calibration: an OPPO schedule forwards
(make_experience) and trains micro-batches of its step's responses sorted by length; `calibrate`
reads which runs did so from their command."""

from __future__ import annotations

import json

import pytest

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import drivers
from openrlhf_oppo.sim.drivers.oppo import OppoDriver
from openrlhf_oppo.sim.presets import load_preset
from openrlhf_oppo.sim.world import World
from oppo_lab.sim import calibrate

PROMPT = 8  # cpu-longtail's prompt tokens; micro-batches of 4


def test_train_tokens_with_buckets_hand_computed():
    cfg = load_preset("cpu-longtail")
    world = World(cfg, cost_model.build(cfg), 0)
    lengths = [10, 900, 20, 30, 800, 40, 50, 60]
    # in order: [10 900 20 30] -> 4 x 908, [800 40 50 60] -> 4 x 808
    assert world.train_tokens(lengths) == 4 * 908 + 4 * 808
    # sorted: [10 20 30 40] -> 4 x 48, [50 60 800 900] -> 4 x 908
    assert world.train_tokens(lengths, buckets=True) == 4 * 48 + 4 * 908


def _spans(res: drivers.RunResult, stage: str) -> list[float]:
    return [r["t1"] - r["t0"] for r in res.rows if r["kind"] == "span" and r["role"] == "driver"
            and r["stage"] == stage]


def test_oppo_forwards_and_trains_bucketed_micro_batches_and_oppo_padded_does_not():
    cfg = load_preset("cpu-longtail", ["workload.seeds=1"])
    costs = cost_model.build(cfg)
    runs = {s: drivers.simulate(cfg, costs, s, 0) for s in ("oppo", "oppo-padded")}
    for stage in ("train", "make_experience"):
        per_step = {s: sum(_spans(r, stage)) / len(_spans(r, stage)) for s, r in runs.items()}
        assert per_step["oppo"] < 0.9 * per_step["oppo-padded"], stage  # the longtail's stragglers pad less
    assert OppoDriver(cfg, costs, 0, "oppo").length_buckets
    assert not OppoDriver(cfg, costs, 0, "oppo-padded").length_buckets


def _rollouts(root, steps: list[list[int]]):
    root.mkdir(parents=True, exist_ok=True)
    rows = [{"step": k, "samples": [{"sequence": [1] * n} for n in seqs]} for k, seqs in enumerate(steps)]
    (root / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "rollouts.jsonl"


def test_calibrate_counts_a_bucketed_runs_tokens_sorted(tmp_path):
    path = _rollouts(tmp_path, [[10, 50, 12, 40]])
    # micro-batches of 2: in order [10 50] [12 40] -> 100 + 80; sorted [10 12] [40 50] -> 24 + 100
    assert calibrate.step_tokens(path, PROMPT, 2, False) == ([180], [2, 42, 4, 32])
    assert calibrate.step_tokens(path, PROMPT, 2, False, buckets=True) == ([124], [2, 42, 4, 32])
    assert calibrate.step_tokens(path, PROMPT, 2, True, buckets=True)[0] == [112]  # packed: no padding


@pytest.mark.parametrize(("argv", "bucketed"), [
    (["python", "-m", "openrlhf_oppo.cli.train_ppo_ray", "--oppo.delta.init", "4"], True),  # OPPO's default
    (["python", "-m", "openrlhf_oppo.cli.train_ppo_ray", "--oppo.train.length_buckets", "false"], False),
    (["python", "-m", "openrlhf.cli.train_ppo_ray", "--train.async_enable"], False),  # OpenRLHF's own
])
def test_calibrate_reads_whether_a_run_bucketed_from_its_command(tmp_path, argv, bucketed):
    (tmp_path / "command.json").write_text(json.dumps(argv))
    assert calibrate.length_buckets(tmp_path) is bucketed


def test_phase_points_scale_make_experience_by_its_forwards():
    rows = [{"kind": "span", "role": "driver", "stage": stage, "t0": t, "t1": t + 1.0}
            for t, stage in ((0.0, "make_experience"), (1.0, "train"))]
    points = calibrate.phase_points(rows, [124], 0, forwards=3)
    assert [(p.stage, p.tokens) for p in points] == [("make_experience", 372.0), ("train", 124.0)]
