"""`openrlhf-oppo train` input errors: one line naming the flag or file, exit 2,
before anything heavy starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from openrlhf_oppo.cli.main import main

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny-cpu.yaml")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--schedule", "fast", "--config", CONFIG], "--schedule: unknown schedule 'fast'; allowed: sync, async"),
        (["--schedule", "oppo", "--config", CONFIG, "--", "--train.async_enable"],
         "--train.async_enable with OPPO needs --oppo.staleness.max_policy_lag >= 1"),
        (["--schedule", "oppo", "--config", CONFIG, "--", "--vllm.enable_prefix_caching"],
         "--vllm.enable_prefix_caching cannot be combined with --oppo.staleness.keep_kv_cache true"),
        (["--schedule", "sync", "--config", "missing.yaml"], "--config: file not found: missing.yaml"),
    ],
)
def test_bad_input_is_one_line_naming_what_is_wrong(capsys, argv, expected):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err


def test_unknown_yaml_key_names_file_and_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: {batchsize: 4}\n")
    assert main(["train", "--schedule", "sync", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.yaml: unknown key 'rollout.batchsize'" in err


def test_the_closing_summary_reads_the_runs_tensorboard(tmp_path):
    """Steps, the mean reward of the first half (at most 8 steps) and the last, the mean step time after the first
    (from the steps' wall times: 10 s, then 4 s and 6 s), and where the outputs are."""
    from torch.utils.tensorboard import SummaryWriter

    from openrlhf_oppo.bench.schedules import STEP_TAG
    from openrlhf_oppo.cli.train import REWARD_TAG, summary

    assert summary(tmp_path) == []  # nothing logged: nothing to sum up
    writer = SummaryWriter(str(tmp_path / "tensorboard"))
    for step, (wall, reward) in enumerate([(100.0, -0.25), (110.0, 0.5), (114.0, 0.75), (120.0, 1.0)], start=1):
        writer.add_scalar(STEP_TAG, 0.0, step, walltime=wall)
        writer.add_scalar(REWARD_TAG, reward, step, walltime=wall)
    writer.close()
    assert summary(tmp_path) == [
        "4 steps; reward +0.125 -> +0.875 (train/reward, mean of the first 2 steps -> the last 2); "
        "6.7 s a step after the first",
        f"outputs in {tmp_path}: train.log, tensorboard/, timeline/ (openrlhf-oppo plot timeline {tmp_path})",
    ]


def test_the_closing_summary_shows_what_a_learn_run_learned(tmp_path):
    """On the learn task: exact match of the trained samples (rollouts.jsonl) against the SFT
    policy's on the same prompts (data/sft_baseline.jsonl), mean response length and the
    share at the cap, the first steps against the last, by hand."""
    import json

    from openrlhf_oppo.cli.train import _learning
    from openrlhf_oppo.tasks import learn

    tok = learn.build_tokenizer(tmp_path / "actor", vocab_size=384)
    (tmp_path / "command.json").write_text(json.dumps(
        ["python", "-m", "openrlhf.cli.train_ppo_ray", "--actor.model_name_or_path", str(tmp_path / "actor"),
         "--rollout.max_new_tokens", "6"]))
    short, long = "reverse: red cat =>", "reverse: sun moon star tree =>"
    learn.write_jsonl(tmp_path / "data" / "sft_baseline.jsonl", [
        {"input": short, "reward": 1.0, "exact_match": 1.0, "samples": 8},
        {"input": long, "reward": -1.0, "exact_match": 0.25, "samples": 8}])

    def sample(prompt: str, response: str) -> dict:
        return {"prompt": prompt, "sequence": tok(prompt + response, add_special_tokens=False)["input_ids"]}

    right, loop = sample(short, " cat red<|eos|>"), sample(short, " cat red red red red red")  # 3 and 6 tokens
    wrong = sample(long, " tree star sun moon<|eos|>")  # 5 tokens
    steps = [[right, loop]] * 4 + [[right, right]] * 3 + [[right, wrong]]
    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps({"step": i, "samples": s}) + "\n"
                                                     for i, s in enumerate(steps)))
    # first 4 steps: half right, SFT 1.0 on those prompts, mean (3 + 6) / 2 tokens, half at the cap;
    # last 4: 7 of 8 right, SFT (7 + 0.25) / 8, (7 * 3 + 5) / 8 tokens, none at the cap
    assert _learning(tmp_path, steps=4) == [
        "exact match 0.50 -> 0.88 (the SFT policy on the same prompts: 1.00 -> 0.91); mean response 4 -> 3 tokens; "
        "at the 6-token cap 50% -> 0% (trained samples, first 4 steps -> last 4, rollouts.jsonl)"]
    assert _learning(tmp_path, steps=5) == []  # fewer than 10 steps: nothing to compare


def test_the_closing_summary_scores_a_learn_runs_final_actor_on_held_out_prompts(tmp_path, monkeypatch, capfd):
    """The SFT policy and the run's final actor on the prompts after the trained ones, through
    the learn task's evaluation (`tasks.learn.evaluation`, stubbed here: its own tests run it);
    nothing where the assets are not a learn build, the model was not saved or no prompt is left
    out."""
    import json
    import os

    from openrlhf_oppo.cli.train import heldout
    from openrlhf_oppo.tasks import learn
    from openrlhf_oppo.tasks.learn import evaluation

    assets, run_dir = learn.LearnAssets(tmp_path / "assets"), tmp_path / "run"
    spec = learn.VARIANTS["learn-longtail"]
    argv = ["python", "-m", "openrlhf_oppo.cli.train_ppo_ray", "--actor.model_name_or_path", str(assets.actor),
            "--ckpt.output_dir", str(run_dir / "model"), "--data.max_samples", "8"]
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "command.json").write_text(json.dumps(argv))
    learn.write_jsonl(assets.prompts, [{"input": f"reverse: w{i} =>", "label": f"w{i}"} for i in range(12)])
    calls = []

    def fake(root, spec_, actors, trained):
        calls.append((root, spec_, actors, trained))
        os.write(2, b"INFO loading the reward model\n")  # the libraries' lines go to train.log, not the terminal
        return 4, {"sft": {"exact_match": 0.5, "mean_reward": -0.25, "at_cap": 0.04},
                   "run": {"exact_match": 0.75, "mean_reward": 0.5, "at_cap": 0.01}}

    monkeypatch.setattr(evaluation, "evaluate_against_sft", fake)
    assert heldout(run_dir) == []  # no BUILD_OK: not a learn build
    (assets.root / "BUILD_OK").write_text(learn.build_marker(spec))
    assert heldout(run_dir) == []  # the final actor was not saved
    (run_dir / "model" / "config.json").write_text("{}")
    assert heldout(run_dir) == [
        "held out (4 prompts no step trained on), the SFT policy -> this run's final actor: exact match 0.500 -> "
        "0.750; learned reward -0.250 -> +0.500; at the 512-token cap 4.0% -> 1.0%"]
    assert calls == [(assets.root, spec, {"run": run_dir / "model"}, 8)]
    shown = capfd.readouterr()
    assert "scoring the SFT policy and the final actor" in shown.out and "INFO loading" not in shown.out + shown.err
    assert (run_dir / "train.log").read_text() == "INFO loading the reward model\n"
    (run_dir / "command.json").write_text(json.dumps([*argv[:-1], "12"]))
    assert heldout(run_dir) == []  # every prompt trained: none held out


def test_the_closing_summary_is_kept_in_summary_json_and_train_log_beside_a_chrome_trace(tmp_path, monkeypatch,
                                                                                        capsys):
    """What `openrlhf-oppo train` closes with, after a run (the launch stood in by a run directory as a run
    leaves it: TensorBoard scalars, a timeline, train.log): the figures in RUN_DIR/summary.json, the lines at
    the end of train.log as on the terminal, and the whole timeline as Chrome trace-event JSON."""
    import json

    from torch.utils.tensorboard import SummaryWriter

    from openrlhf_oppo.bench.schedules import STEP_TAG
    from openrlhf_oppo.cli import train
    from openrlhf_oppo.integrations.launch import launcher

    root = tmp_path / "run"
    writer = SummaryWriter(str(root / "tensorboard"))
    for step, (wall, reward) in enumerate([(100.0, -0.25), (110.0, 0.5), (114.0, 0.75), (120.0, 1.0)], start=1):
        writer.add_scalar(STEP_TAG, 0.0, step, walltime=wall)
        writer.add_scalar(train.REWARD_TAG, reward, step, walltime=wall)
    writer.close()
    (root / "timeline").mkdir()
    spans = [{"kind": "span", "role": "driver", "host": "n0", "pid": 1, "stage": stage, "t0": t0, "t1": t0 + 1.0}
             for t0, stage in ((100.0, "generate"), (101.0, "train"), (110.0, "generate"), (111.0, "train"))]
    (root / "timeline" / "n0-1.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    (root / "train.log").write_text("the run's own output\n")
    monkeypatch.setattr(train, "run", lambda argv: launcher.RunResult(0, 21.04, launcher.RunPaths(root)))
    assert train.main(["--schedule", "sync", "--config", CONFIG, "--output", str(root)]) == 0
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("openrlhf-oppo train: ")]
    record = json.loads((root / "summary.json").read_text())
    assert record == {"schedule": "sync", "config": CONFIG, "exit_code": 0, "wall_s": 21.0, "steps": 4,
                      "mean_step_s": record["mean_step_s"],
                      "reward": {"tag": "train/reward", "steps_averaged": 2, "first": 0.125, "last": 0.875}}
    assert abs(record["mean_step_s"] - 20 / 3) < 1e-6
    assert (root / "train.log").read_text().splitlines() == ["the run's own output", *shown]
    assert shown[-2:] == [f"openrlhf-oppo train: the whole run's timeline: {root / 'timeline.trace.json'} (open it "
                          "at https://ui.perfetto.dev)", f"openrlhf-oppo train: this summary: {root / 'summary.json'}"]
    trace = json.loads((root / "timeline.trace.json").read_text())
    assert sorted(e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].startswith("step ")) == \
        ["step 1", "step 2"]
