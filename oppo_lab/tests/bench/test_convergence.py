"""`python -m oppo_lab convergence`: per-step series read from hand-built run directories
(the files `openrlhf-oppo train` writes), and the summary's numbers computed by hand."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from openrlhf_oppo.bench.schedules import STEP_TAG
from openrlhf_oppo.tasks import learn
from oppo_lab import convergence
from oppo_lab.convergence import cli, final_eval

T0 = 1000.0  # time.time() of the first driver `generate` span of every synthetic run


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The learn task's tokenizer (every word one token after a space), built in ~2 s."""
    path = tmp_path_factory.mktemp("learn-tokenizer")
    learn.build_tokenizer(path, vocab_size=learn.LearnSpec().actor.vocab_size)
    return path


@pytest.fixture(scope="module")
def text(tokenizer_dir) -> convergence.ResponseText:
    return convergence.load_tokenizer(tokenizer_dir)


# ------------------------------------------------------------ synthetic run directories


def sample(text, n_words: int, correct: bool = True) -> dict:
    """A rollouts.jsonl sample: prompt ids + response ids (n_words + EOS: n_words + 1 tokens),
    the gold reversal or the gold with its first word substituted."""
    words = list(learn.WORDS[:n_words])
    prompt = learn.make_prompt(words)
    answer = words[::-1]
    if not correct:
        answer[0] = next(w for w in learn.WORDS if w != answer[0])
    tok = text.tokenizer
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tok(" " + " ".join(answer), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return {"prompt": prompt, "sequence": prompt_ids + response_ids, "reward": None}


DEFAULT_STEP = ((1, True), (4, False))  # lengths [2, 5], exact match 0.5


@dataclass
class Run:
    rewards: list[float]
    ends_s: list[float]  # step ends, seconds after T0
    samples: list[tuple] = field(default_factory=list)  # per step: ((n_words, correct), ...); default DEFAULT_STEP
    offpolicy: list[float] | None = None  # oppo_metrics.jsonl
    vllm_kl: list[float] | None = None  # TensorBoard train/vllm_kl
    trace: list[dict] | None = None  # oppo_trace.jsonl rows


def write_tensorboard(tb_dir: Path, scalars: dict[str, list[tuple[float, int, float]]]) -> None:
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(tb_dir / "run"))  # OpenRLHF logs under tensorboard/<run name>/
    for tag, events in scalars.items():
        for wall, step, value in events:
            writer.add_event(Event(wall_time=wall, step=step,
                                   summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)])))
    writer.close()


def write_run(root: Path, run: Run, text, returncode: int | None = 0) -> Path:
    """The files of a finished `openrlhf-oppo train` run: TensorBoard (OpenRLHF's global
    steps 1..n), timeline (driver generate spans), rollouts.jsonl and, for OPPO,
    oppo_metrics.jsonl and oppo_trace.jsonl."""
    n = len(run.rewards)
    walls = [T0 + e for e in run.ends_s]
    scalars = {STEP_TAG: [(w, k + 1, 0.1) for k, w in enumerate(walls)],
               "train/rollout/reward_mean": [(w, k + 1, r) for k, (w, r) in enumerate(zip(walls, run.rewards))],
               "train/reward": [(w, k + 1, -9.0) for k, w in enumerate(walls)]}  # the first tag wins
    if run.vllm_kl:
        scalars["train/vllm_kl"] = [(w, k + 1, v) for k, (w, v) in enumerate(zip(walls, run.vllm_kl))]
    write_tensorboard(root / "tensorboard", scalars)
    (root / "timeline").mkdir(parents=True)
    starts = [T0, *walls[:-1]]
    (root / "timeline" / "h-1.jsonl").write_text("".join(
        json.dumps({"kind": "span", "role": "driver", "host": "h", "pid": 1, "stage": "generate", "t0": a,
                    "t1": a + 0.5}) + "\n" for a in starts))
    steps = run.samples + [DEFAULT_STEP] * (n - len(run.samples))
    with open(root / "rollouts.jsonl", "w") as fh:
        for k, spec in enumerate(steps):
            fh.write(json.dumps({"step": k, "samples": [sample(text, w, ok) for w, ok in spec]}) + "\n")
    if run.offpolicy is not None:
        (root / "oppo_metrics.jsonl").write_text("".join(
            json.dumps({"global_step": k + 1, "oppo/offpolicy_token_fraction": v}) + "\n"
            for k, v in enumerate(run.offpolicy)))
    if run.trace is not None:
        (root / "oppo_trace.jsonl").write_text("".join(json.dumps(row) + "\n" for row in run.trace))
    if returncode is not None:
        (root / "result.json").write_text(json.dumps({"returncode": returncode, "wall_s": run.ends_s[-1] + 30}))
    return root


def trace_row(step: int, trained: dict[int, list[int]], carried: dict[int, list[int]]) -> dict:
    """An oppo_trace.jsonl row: `trained` sample id -> tokens (one group), `carried` sample id -> held tokens."""
    return {"step": step, "admitted_groups": 2, "next_prompt_index": 2 * step + 2,
            "trained": [{"group_id": step, "prompt_index": step, "prompt_ids": [1, 2], "deferrals": 0,
                         "samples": [{"sample_id": sid, "tokens": toks, "versions": [step] * len(toks),
                                      "finish_reason": "stop", "reward": None} for sid, toks in trained.items()]}],
            "carried_groups": [99] if carried else [],
            "carried_tokens": {str(sid): toks for sid, toks in carried.items()}}


# Step 0 trains two 2-token samples and carries sample 10 (done: trained at step 1 with the
# same 3 tokens) and 11 (1 of its 4 tokens); step 1 carries 12, never trained (run ends).
TRACE = [trace_row(0, {1: [4, 4], 2: [4, 4]}, {10: [5, 5, 5], 11: [6]}),
         trace_row(1, {10: [5, 5, 5], 11: [6, 6, 6, 6]}, {12: [7, 7]}),
         trace_row(2, {3: [4, 4]}, {}), trace_row(3, {4: [4, 4]}, {}), trace_row(4, {5: [4, 4]}, {})]

GOOD = ((1, True), (4, True))  # lengths [2, 5], exact match 1.0
# sync: the same rewards in both seeds, seed 1 twice as slow. Moving averages (3 steps) from
# step 2: 0.3, 0.6, 0.8; threshold 0.72 = 0 + 0.9 * (0.8 - 0); reached at step 4 (50 s, 100 s).
# oppo: moving averages 0.5, 0.8 | 0.6, 0.8: reached at step 3 (32 s, 40 s).
RUNS = {
    ("sync", 0): Run([0.0, 0.3, 0.6, 0.9, 0.9], [10, 20, 30, 40, 50]),
    ("oppo", 0): Run([0.0, 0.6, 0.9, 0.9, 0.9], [8, 16, 24, 32, 40],
                     [((1, True), (1, True)), DEFAULT_STEP, GOOD, GOOD, GOOD],
                     offpolicy=[0.0, 0.25, 0.5, 0.5, 0.5], vllm_kl=[0.01] * 5, trace=TRACE),
    ("sync", 1): Run([0.0, 0.3, 0.6, 0.9, 0.9], [20, 40, 60, 80, 100]),
    ("oppo", 1): Run([0.3, 0.6, 0.9, 0.9, 0.6], [10, 20, 30, 40, 50],
                     [((1, True), (2, False)), DEFAULT_STEP, GOOD, GOOD, GOOD],
                     offpolicy=[0.0, 0.25, 0.5, 0.5, 0.5], vllm_kl=[0.03] * 5, trace=TRACE),
}


def write_all(out: Path, text, runs=RUNS) -> None:
    for (schedule, seed), run in runs.items():
        write_run(out / f"{schedule}-s{seed}", run, text)


def read_all(out: Path, text) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for schedule, seed in RUNS:
        runs.setdefault(schedule, {})[seed] = convergence.read_run(out / f"{schedule}-s{seed}", text)
    return runs


def test_read_run_cuts_the_prompt_off_decodes_and_aligns_steps(tmp_path, text):
    run = convergence.read_run(write_run(tmp_path / "oppo-s0", RUNS[("oppo", 0)], text), text)
    assert run["steps"] == 5 and run["time_origin"] == "first driver generate"
    assert run["time_s"] == pytest.approx([8, 16, 24, 32, 40])
    assert run["reward"] == pytest.approx([0.0, 0.6, 0.9, 0.9, 0.9])
    assert run["reward_source"] == "train/rollout/reward_mean"
    assert run["lengths"] == [[2, 2], [2, 5], [2, 5], [2, 5], [2, 5]]  # words + EOS
    assert run["exact_match"] == [1.0, 0.5, 1.0, 1.0, 1.0]
    assert run["split_mismatches"] == 0
    assert run["oppo/offpolicy_token_fraction"] == [0.0, 0.25, 0.5, 0.5, 0.5]
    assert run["vllm_kl"] == pytest.approx([0.01] * 5) and run["ref_kl"] is None
    # the trace: sample 10 finished by step 0's end (held = trained tokens), 11 did not, 12 is never trained
    assert run["trace_trained_lengths"][:2] == [[2, 2], [3, 4]]
    assert run["trace_finished_carried_lengths"][:2] == [[3], []]
    assert run["trace_carried_unplaced"] == 1
    # step 0: trained [2, 2] vs all finished [2, 2, 3]: at 2, 1 against 2/3
    assert run["ks_trained_vs_finished"][:2] == [pytest.approx(1 / 3), 0.0]


def test_read_run_without_a_trace_and_with_a_foreign_prefix(tmp_path, text):
    root = write_run(tmp_path / "sync-s0", RUNS[("sync", 0)], text)
    rows = [json.loads(line) for line in (root / "rollouts.jsonl").read_text().splitlines()]
    rows[0]["samples"][0]["sequence"][0] += 1  # not the prompt's tokens: left out, counted
    rows.append({"step": 5, "samples": rows[0]["samples"]})  # generated, never trained (async): left out
    (root / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = convergence.read_run(root, text)
    assert run["split_mismatches"] == 1 and run["lengths"][0] == [5] and run["exact_match"][0] == 0.0
    assert len(run["lengths"]) == 5
    assert "trace_trained_lengths" not in run and run["oppo/offpolicy_token_fraction"] is None


def baseline_for(text, rewards: dict[int, float], exact: dict[int, float]) -> dict:
    """A Baseline of the prompts of `sample` (n_words -> the SFT policy's reward / exact match)."""
    return {sample(text, n)["prompt"]: (rewards[n], exact[n]) for n in rewards}


def test_read_run_subtracts_the_sft_baseline_of_each_steps_prompts(tmp_path, text):
    root = write_run(tmp_path / "oppo-s0", RUNS[("oppo", 0)], text)
    # steps: (1 word, 1 word), then (1 word, 4 words) x 4
    baseline = baseline_for(text, {1: 0.2, 4: -1.0}, {1: 1.0, 4: 0.0})
    run = convergence.read_run(root, text, baseline)
    assert run["reward_gain"] == pytest.approx([0.0 - 0.2, 0.6 + 0.4, 0.9 + 0.4, 0.9 + 0.4, 0.9 + 0.4])
    assert run["exact_match_gain"] == pytest.approx([0.0, 0.0, 0.5, 0.5, 0.5])  # exact match 1, .5, 1, 1, 1
    partial = convergence.read_run(root, text, baseline_for(text, {1: 0.2}, {1: 1.0}))
    assert partial["reward_gain"] == [pytest.approx(-0.2), None, None, None, None]  # a prompt without a baseline
    assert "reward_gain" not in convergence.read_run(root, text)


def test_baseline_file_is_what_the_learn_build_writes(tmp_path):
    path = tmp_path / "sft_baseline.jsonl"
    assert convergence.load_baseline(path) is None
    path.write_text(json.dumps({"input": "reverse: a b =>", "reward": -0.5, "exact_match": 0.25, "samples": 8}) + "\n")
    assert convergence.load_baseline(path) == {"reverse: a b =>": (-0.5, 0.25)}


def test_summary_of_the_gain_over_the_sft_baseline(tmp_path, text):
    write_all(tmp_path, text)
    baseline = baseline_for(text, {1: 0.0, 2: 0.0, 4: 0.0}, {1: 0.0, 2: 0.0, 4: 0.0})  # gain = reward
    runs = {s: {seed: convergence.read_run(tmp_path / f"{s}-s{seed}", text, baseline) for seed in (0, 1)}
            for s in ("sync", "oppo")}
    summary = convergence.summarize(runs, window=3)
    sync, oppo = summary["rows"]
    assert oppo["final_reward_gain"] == pytest.approx(oppo["final_reward"])
    assert oppo["gain_within_ref_band"] == oppo["within_ref_band"]
    assert summary["per_step"]["reward_gain"]["oppo"] == summary["per_step"]["reward"]["oppo"]
    plain = convergence.summarize(read_all(tmp_path, text), window=3)
    assert plain["rows"][1]["gain_within_ref_band"] is None and "reward_gain" not in plain["per_step"]


def test_summary_threshold_time_to_reward_ratios_and_seed_band(tmp_path, text):
    write_all(tmp_path, text)
    summary = convergence.summarize(read_all(tmp_path, text), window=3)
    assert summary["reference"] == "sync"
    # sync's 3-step moving averages .3 .6 .8: 90 % of the way from .3 to .8
    assert summary["threshold"] == pytest.approx(0.75) and summary["threshold_per_seed"] == pytest.approx([0.75, 0.75])
    sync, oppo = summary["rows"]
    assert sync["per_seed"]["0"]["time_to_reward_s"] == pytest.approx(50)
    assert sync["per_seed"]["1"]["time_to_reward_s"] == pytest.approx(100)
    assert [oppo["per_seed"][s]["steps_to_reward"] for s in "01"] == [3, 3]
    assert oppo["time_to_reward_s"] == pytest.approx((36, 32, 40))
    # sync's time / oppo's, seed by seed: 50 / 32 and 100 / 40
    assert oppo["x_ref_time_to_reward"] == pytest.approx(((1.5625 + 2.5) / 2, 1.5625, 2.5))
    assert sync["x_ref_time_to_reward"] == pytest.approx((1, 1, 1)) and oppo["reached"] == "2/2"
    # final reward: last 3 steps; oppo 0.9 and 0.8 against sync's 0.8 and 0.8
    assert sync["final_reward"] == pytest.approx((0.8, 0.8, 0.8))
    assert oppo["final_reward"] == pytest.approx((0.85, 0.8, 0.9))
    assert oppo["final_reward_diff"] == pytest.approx((0.05, 0.0, 0.1))
    assert sync["final_exact_match"] == pytest.approx((0.5, 0.5, 0.5))
    assert oppo["final_exact_match"] == pytest.approx((1.0, 1.0, 1.0))
    assert oppo["mean_offpolicy_token_fraction"] == pytest.approx((0.35, 0.35, 0.35))
    # every trained response: sync [2, 5] a step; oppo's first step [2, 2] (seed 0) and [2, 3] (seed 1), then [2, 5]
    assert sync["mean_trained_length"] == pytest.approx((3.5, 3.5, 3.5))
    assert oppo["mean_trained_length"] == pytest.approx((3.25, 3.2, 3.3))
    assert oppo["mean_vllm_kl"] == pytest.approx((0.02, 0.01, 0.03))
    # moving averages from step 2: oppo's median .55 .8 .85 against sync's band (one value a step) .3 .6 .8
    assert oppo["within_ref_band"] == {"steps": 3, "inside": 0, "outside_steps": [2, 3, 4], "all": False}
    assert sync["within_ref_band"]["all"] is True


def test_given_threshold_and_a_seed_that_never_reaches_it(tmp_path, text):
    write_all(tmp_path, text)
    summary = convergence.summarize(read_all(tmp_path, text), threshold=0.85, window=3)
    sync, oppo = summary["rows"]
    assert summary["threshold_how"].startswith("given")
    assert sync["reached"] == "0/2" and sync["time_to_reward_s"] == (None, None, None)
    # oppo seed 0's moving average reaches 0.9 at step 4 (40 s); seed 1 peaks at 0.8
    assert oppo["reached"] == "1/2" and oppo["time_to_reward_s"] == pytest.approx((40, 40, 40))
    assert oppo["x_ref_time_to_reward"] == (None, None, None)


def test_length_ks_per_step_pooled_over_seeds(tmp_path, text):
    write_all(tmp_path, text)
    per_step = convergence.summarize(read_all(tmp_path, text), window=1)["per_step"]  # curves: the steps' own values
    # step 0: oppo [2, 2] + [2, 3] against sync [2, 5] + [2, 5]; later steps: the same lengths
    assert per_step["ks_trained_lengths_vs_ref"]["oppo"] == pytest.approx([0.5, 0, 0, 0, 0])
    assert "sync" not in per_step["ks_trained_lengths_vs_ref"]
    # both seeds hold TRACE: trained [2, 2, 2, 2] against those + [3, 3]
    assert per_step["ks_trained_vs_finished"]["oppo"] == pytest.approx([1 / 3, 0, 0, 0, 0])
    assert per_step["reward"]["oppo"][0] == pytest.approx((0.15, 0.0, 0.3))
    assert per_step["exact_match"]["oppo"][0] == pytest.approx((0.75, 0.5, 1.0))


# --------------------------------------------------------------------------------- CLI


def test_report_only_writes_json_table_and_pngs(tmp_path, tokenizer_dir, text, capsys, monkeypatch):
    from openrlhf_oppo.integrations.launch import train_run as train
    from oppo_lab.__main__ import main as lab_main

    monkeypatch.setattr(train, "run", lambda argv: pytest.fail("--report-only ran a run"))
    assets = learn.LearnAssets(tmp_path / "assets")
    assets.data.mkdir(parents=True)
    assets.sft_baseline.write_text("".join(json.dumps({"input": sample(text, n)["prompt"], "reward": -0.5,
                                                       "exact_match": 0.5}) + "\n" for n in (1, 2, 4)))
    for module in (cli, final_eval):  # the baseline's task and the final evaluation's: assets not built
        monkeypatch.setattr(module, "task_root", lambda config: ("learn", assets.root))
    out = tmp_path / "bench"
    write_all(out, text)
    argv = ["convergence", "--report-only", "--seeds", "2", "--schedules", "sync", "oppo", "--output", str(out),
            "--tokenizer", str(tokenizer_dir), "--window", "3"]
    assert lab_main(argv) == 0
    printed = capsys.readouterr().out
    assert "threshold: 0.7500" in printed and "time-to-reward" in printed
    oppo_line = next(line for line in printed.splitlines() if line.startswith("oppo "))
    assert "2.03 [1.56-2.50]" in oppo_line and "no 0/3" in oppo_line
    assert "+1.350 [+1.300-+1.400]" in oppo_line  # final reward 0.85 [0.8-0.9] + 0.5
    data = json.loads((out / "convergence.json").read_text())
    assert data["seeds"] == [0, 1] and set(data["runs"]) == {"sync", "oppo"}
    assert data["runs"]["oppo"]["1"]["reward"] == pytest.approx([0.3, 0.6, 0.9, 0.9, 0.6])
    assert data["summary"]["rows"][1]["final_reward_diff"] == pytest.approx([0.05, 0.0, 0.1])
    for name in convergence.PLOTS:
        assert (out / name).stat().st_size > 1000, name


def test_a_failed_run_is_left_out(tmp_path, text):
    out = tmp_path / "bench"
    write_all(out, text)
    (out / "oppo-s1" / "result.json").write_text(json.dumps({"returncode": 1, "wall_s": 5.0}))
    assert convergence.main(["--report-only", "--seeds", "2", "--schedules", "sync", "oppo", "--output", str(out),
                             "--tokenizer", str(out / "no-tokenizer"), "--window", "3"]) == 1
    data = json.loads((out / "convergence.json").read_text())
    oppo = data["summary"]["rows"][1]
    assert oppo["runs_ok"] == "1/2" and oppo["final_reward"] == pytest.approx([0.9, 0.9, 0.9])
    assert data["tokenizer"] is None and oppo["final_exact_match"] == [None, None, None]  # no tokenizer


@dataclass
class FakeResult:
    returncode: int
    wall_s: float
    stopped_by: int | None = None


def fake_train(monkeypatch, text) -> list[list[str]]:
    """`train.run` replaced by one that writes RUNS' run for the schedule and seed of its
    argv; the argvs it was called with."""
    from openrlhf_oppo.integrations.launch import train_run as train

    calls = []

    def fake_run(argv):
        calls.append(argv)
        root = Path(argv[argv.index("--output") + 1])
        name = "oppo" if argv[argv.index("--schedule") + 1] == "oppo" else "sync"
        write_run(root, RUNS[(name, int(argv[argv.index("--train.seed") + 1]))], text, returncode=None)
        return FakeResult(0, 12.0)

    monkeypatch.setattr(train, "run", fake_run)
    return calls


def test_runs_seed_major_through_the_launcher_with_seed_and_variant_flags(tmp_path, tokenizer_dir, text, monkeypatch):
    calls = fake_train(monkeypatch, text)
    out = tmp_path / "bench"
    assert convergence.main(["--config", "configs/learn-cpu.yaml", "--seeds", "2", "--schedules", "sync", "oppo-tis",
                             "--output", str(out), "--tokenizer", str(tokenizer_dir),
                             "--no-final-eval", "--", "--actor.adam.lr", "1e-4"]) == 0
    order = [(a[a.index("--schedule") + 1], a[a.index("--train.seed") + 1], Path(a[a.index("--output") + 1]).name)
             for a in calls]
    assert order == [("sync", "0", "sync-s0"), ("oppo", "0", "oppo-tis-s0"), ("sync", "1", "sync-s1"),
                     ("oppo", "1", "oppo-tis-s1")]
    tis = calls[1][calls[1].index("--") + 1:]
    assert tis == ["--actor.adam.lr", "1e-4", "--train.full_determinism_enable", "--oppo.staleness.correction", "tis",
                   "--train.seed", "0"]
    assert "--oppo.staleness.correction" not in calls[0]
    assert json.loads((out / "oppo-tis-s1" / "result.json").read_text()) == {"returncode": 0, "wall_s": 12.0}
    assert json.loads((out / "convergence.json").read_text())["summary"]["rows"][1]["schedule"] == "oppo-tis"


def test_keep_done_runs_only_what_did_not_finish(tmp_path, tokenizer_dir, text, monkeypatch):
    calls = fake_train(monkeypatch, text)
    out = tmp_path / "bench"
    common = ["--config", "configs/learn-cpu.yaml", "--seeds", "2", "--output", str(out),
              "--tokenizer", str(tokenizer_dir), "--no-final-eval"]
    assert convergence.main([*common, "--schedules", "sync"]) == 0
    shutil.rmtree(out / "sync-s1")  # cut short: only its result
    (out / "sync-s1").mkdir()
    (out / "sync-s1" / "result.json").write_text(json.dumps({"returncode": 1, "wall_s": 3.0}))
    calls.clear()
    assert convergence.main([*common, "--schedules", "sync", "oppo-icepop", "--keep-done"]) == 0
    assert [Path(a[a.index("--output") + 1]).name for a in calls] == ["oppo-icepop-s0", "sync-s1", "oppo-icepop-s1"]
    rows = json.loads((out / "convergence.json").read_text())["summary"]["rows"]
    assert [r["schedule"] for r in rows] == ["sync", "oppo-icepop"]


def test_a_signal_that_stops_a_run_stops_the_bench(tmp_path, tokenizer_dir, text, monkeypatch, capsys):
    import signal

    from openrlhf_oppo.integrations.launch import train_run as train

    calls = fake_train(monkeypatch, text)
    signalled = train.run

    def stopped_in_second_run(argv):
        result = signalled(argv)
        return FakeResult(143, 5.0, signal.SIGTERM) if len(calls) == 2 else result

    monkeypatch.setattr(train, "run", stopped_in_second_run)
    out = tmp_path / "bench"
    assert convergence.main(["--config", "configs/learn-cpu.yaml", "--seeds", "2", "--schedules", "sync", "oppo",
                             "--output", str(out), "--tokenizer", str(tokenizer_dir), "--no-final-eval"]) == 143
    assert len(calls) == 2  # not the two runs of seed 1
    assert json.loads((out / "oppo-s0" / "result.json").read_text())["returncode"] == 143
    out_text = capsys.readouterr().out
    assert "stopped by SIGTERM in run 2/4: no further runs; the same command with --keep-done" in out_text
