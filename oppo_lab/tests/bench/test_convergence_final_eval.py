"""`bench convergence --final-eval` on the learn task: the SFT policy and every finished run's
final actor scored on the same held-out prompts (the evaluation itself stubbed), and which
prompts are held out."""

from __future__ import annotations

import json

import pytest

from openrlhf_oppo.tasks import learn
from openrlhf_oppo.tasks.learn import evaluation
from oppo_lab.convergence import final_eval


def test_final_eval_scores_the_sft_policy_and_each_finished_run_on_the_same_heldout_prompts(tmp_path, monkeypatch):
    root = tmp_path / "learn"
    root.mkdir()
    (root / "BUILD_OK").write_text("x")
    config = tmp_path / "learn.yaml"
    config.write_text(f"task: {{variant: learn, assets: {root}}}\ndata: {{max_samples: 512}}\n")
    out = tmp_path / "bench"
    for run in ("sync-s0", "sync-s1", "oppo-s0"):
        (out / run / "model").mkdir(parents=True)
    seen = {}

    def fake_evaluate(root_, actors, trained, spec, samples_per_prompt):
        seen.update(root=root_, actors=actors, trained=trained, spec=spec, samples_per_prompt=samples_per_prompt)

        def ev(em, reward):
            return {
                "prompts": 256,
                "exact_match": em,
                "mean_reward": reward,
                "response_tokens": {"median": 7, "at_cap": 0.0},
                "exact_match_by_band": {"mid": {"exact_match": em / 2}, "short": {"exact_match": 1.0}},
            }

        return {
            name: ev(*{"sft": (0.6, -1.0), "sync-s0": (0.7, 0.5), "sync-s1": (0.8, 1.5), "oppo-s0": (0.75, 1.0)}[name])
            for name in actors
        }

    monkeypatch.setattr(evaluation, "evaluate_actors", fake_evaluate)
    runs = {"sync": {0: {"returncode": 0}, 1: {"returncode": 0}}, "oppo": {0: {"returncode": 0}, 1: {"returncode": 1}}}
    fe = final_eval.evaluate(str(config), out, runs)
    assert (
        seen["trained"] == 512 and seen["root"] == root and seen["samples_per_prompt"] == final_eval.SAMPLES_PER_PROMPT
    )
    assert seen["spec"] == learn.VARIANTS["learn"]  # the config's variant's spec: its response cap
    assert seen["actors"] == {
        "sft": root / "actor",
        "sync-s0": out / "sync-s0" / "model",
        "sync-s1": out / "sync-s1" / "model",
        "oppo-s0": out / "oppo-s0" / "model",
    }
    rows = {r["schedule"]: r for r in fe["rows"]}
    assert rows["sft"]["exact_match"] == (0.6, 0.6, 0.6)
    assert rows["sync"]["exact_match"] == (0.75, 0.7, 0.8) and rows["sync"]["mean_reward"] == (1.0, 0.5, 1.5)
    assert rows["oppo"]["runs"] == 1 and rows["oppo"]["exact_match_mid"] == (0.375, 0.375, 0.375)
    assert rows["oppo"]["exact_match_long"] == (None, None, None)  # no long list among the prompts
    # against the first schedule: one oppo seed, 0.75 inside sync's 0.7-0.8, no p with one value
    assert fe["reference"] == "sync" and "against_ref" not in rows["sync"]
    assert rows["oppo"]["against_ref"]["exact_match"] == {"inside_ref_range": True, "mean_diff": pytest.approx(0.0),
                                                          "p": None}
    (root / "BUILD_OK").unlink()
    assert final_eval.evaluate(str(config), out, runs) is None  # assets not built: said, skipped


def test_heldout_prompts_follow_the_trained_rows(tmp_path):
    assets = learn.LearnAssets(tmp_path)
    rows = [{"input": f"reverse: w{i} =>", "label": f"w{i}"} for i in range(10)]
    assets.prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = learn.LearnSpec(rl_prompts=10, eval_prompts=3)
    assert evaluation.heldout_records(assets, spec, 4) == rows[4:7]
    with pytest.raises(ValueError, match=r"no prompts after the first 10 \(--data.max_samples\)"):
        evaluation.heldout_records(assets, spec, 10)


def test_against_the_reference_over_seeds():
    def figs(*em):
        return [{"exact_match": e, "mean_reward": 2 * e, "at_cap": None} for e in em]

    got = final_eval.against(figs(0.60, 0.61, 0.62), figs(0.64, 0.65, 0.66))
    assert got["exact_match"] == {"inside_ref_range": False, "mean_diff": pytest.approx(-0.04),
                                  "p": pytest.approx(2 / 20)}  # the two most extreme of 20 splits
    assert got["mean_reward"]["mean_diff"] == pytest.approx(-0.08) and "at_cap" not in got  # no figure, no row
    assert final_eval.against(figs(0.64, 0.70), figs(0.60, 0.66))["exact_match"]["inside_ref_range"] is False
    assert final_eval.against(figs(0.61, 0.70), figs(0.60, 0.66))["exact_match"]["inside_ref_range"] is True
