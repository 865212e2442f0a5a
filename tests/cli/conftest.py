"""Session-scoped end-to-end runs of `openrlhf-oppo train`, shared by the *_on_cpu
tests: each schedule runs at most once per test session (each run costs 1-2
minutes here, most of it process start-up)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny-cpu.yaml"
RUN_TIMEOUT_S = 600  # a healthy run takes 1-3 minutes here; a hang fails instead of blocking CI


@dataclass(frozen=True)
class TrainRun:
    schedule: str
    returncode: int
    root: Path
    assets: Path

    def failure(self) -> str:
        """Why the run failed, for an assertion message: its exit code and the error lines of
        its train.log (a traceback's last lines, lines naming an error), not the whole log."""
        log = self.root / "train.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        keep = [i for i, line in enumerate(lines)
                if re.search(r"Error|Exception|Traceback|error:|FAILED|Killed", line)]
        shown = sorted({j for i in keep[-12:] for j in range(max(0, i - 1), i + 2) if j < len(lines)})
        body = "\n".join(lines[j][:400] for j in shown) or "\n".join(lines[-20:])
        return f"train --schedule {self.schedule} exited {self.returncode}; {log}:\n{body}"

    def probes(self) -> list[dict]:
        path = self.root / "sync_probe.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def trace(self) -> list[dict]:
        """OPPO's per-step trace: the groups trained, carried and their tokens."""
        return [json.loads(line) for line in (self.root / "oppo_trace.jsonl").read_text().splitlines()]


def _check_resumed_ledger(trace_a: list[dict], trace_b: list[dict]) -> None:
    """Run B (its per-step trace: trace_b) resumed from the checkpoint written after trace_a's
    last step, with groups carried there: across both every admitted group was trained exactly
    once or is still in flight, the carried groups were trained in B (or are in flight) and
    resumed with every token they had, decoded by A's policies up to the checkpoint and by the
    checkpoint's or a later one after it."""
    at_checkpoint = trace_a[-1]
    assert trace_b[0]["step"] == at_checkpoint["step"] + 1
    assert at_checkpoint["carried_groups"], "nothing was carried at the checkpoint; the test proves nothing"
    trained = [g for row in trace_a + trace_b for g in row["trained"]]
    ids = [g["group_id"] for g in trained]
    assert len(ids) == len(set(ids)), "a group was trained twice across the restart"
    in_flight = set(trace_b[-1]["carried_groups"])
    assert set(ids) | in_flight == set(range(trace_b[-1]["next_prompt_index"])) and not in_flight & set(ids)
    samples_b = {s["sample_id"]: (row["step"], s) for row in trace_b for g in row["trained"] for s in g["samples"]}
    version = at_checkpoint["step"] + 1  # the checkpoint's policy
    for sid, held in at_checkpoint["carried_tokens"].items():
        if int(sid) in samples_b:
            step, sample = samples_b[int(sid)]
            assert sample["tokens"][: len(held)] == held
            # (a carried group may also be complete already: first-B takes B of the complete ones)
            assert all(v < version for v in sample["versions"][: len(held)])
            assert all(version <= v <= step for v in sample["versions"][len(held):])
    assert set(at_checkpoint["carried_groups"]) <= {g["group_id"] for g in trained} | in_flight


@pytest.fixture(scope="session")
def check_resumed_ledger():
    """`_check_resumed_ledger(trace_a, trace_b)`, for the resume tests of both training backends."""
    return _check_resumed_ledger


# vLLM's logprobs of the tiny actor (bf16 on CPU; the logprobs come back in fp32, not bf16-rounded) against
# an fp32 HF forward of the same weights differ by bf16 rounding through the layers and the logits. The
# largest difference over a probe's 16 tokens after a sync measured 0.011-0.021 (one CI run reached 0.0206,
# past the 0.02 this used to be); a first step or the untrained actor differ by 0.25 or more. Two bf16 ulps
# at the logprobs' magnitude (about -5.5: 2**-5 an ulp), and the tests check the 3x separation beside it.
LOGPROB_ATOL = 2 * 2**-5


def _teacher_forced(model_dir: Path, probe: dict):
    """HF logprobs of vLLM's greedy tokens in a sync probe, HF argmax and top-2 gap per position
    (compare within LOGPROB_ATOL)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt, tokens = probe["prompt_token_ids"], probe["token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits.float()
    logp = torch.log_softmax(logits[0, len(prompt) - 1 : -1], dim=-1)
    chosen = logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    top2 = logp.topk(2, dim=-1).values
    return chosen, logp.argmax(-1), top2[:, 0] - top2[:, 1]


@pytest.fixture(scope="session")
def logprob_atol() -> float:
    return LOGPROB_ATOL


@pytest.fixture(scope="session")
def teacher_forced():
    """`_teacher_forced(model_dir, probe)`, for the tests that check what a weight sync sent."""
    return _teacher_forced


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> Path:
    from openrlhf_oppo.tasks import tiny

    return tiny.build(tmp_path_factory.mktemp("tiny-assets")).root


def _train_argv(schedule: str, root: Path, assets: Path, extra=(), config: Path = CONFIG) -> list[str]:
    """`openrlhf-oppo train`'s arguments for a run of the tiny task into `root`."""
    argv = ["train", "--schedule", schedule, "--config", str(config), "--assets", str(assets),
            "--output", str(root), "--timeout-s", str(RUN_TIMEOUT_S)]
    return [*argv, "--", *extra] if extra else argv


@pytest.fixture(scope="session")
def train_runs(tmp_path_factory, tiny_assets):
    """schedule -> TrainRun, run on first request."""
    from openrlhf_oppo.bench import cpu_use
    from openrlhf_oppo.cli.main import main

    cache: dict[tuple, TrainRun] = {}

    def run(schedule: str, *extra: str, output: Path | None = None, config: Path = CONFIG) -> TrainRun:
        key = (schedule, extra, output, config)
        if key not in cache:
            root = output or tmp_path_factory.mktemp(f"run-{schedule}")
            with cpu_use.Sampler(root / cpu_use.FILE):  # as `bench schedules` samples its runs
                cache[key] = TrainRun(schedule, main(_train_argv(schedule, root, tiny_assets, extra, config)), root,
                                      tiny_assets)
        return cache[key]

    return run


ASYNC_LAYOUT = ("--train.colocate_all", "--train.async_enable")  # where OpenRLHF's async mode places its models


@dataclass(frozen=True)
class StoppedAndResumed:
    stopped: TrainRun  # asked to stop with SIGTERM once a step was done
    output: str  # what it printed
    resumed: TrainRun  # loaded the checkpoint the stop wrote and finished the pass


@pytest.fixture(scope="session")
def stopped_and_resumed(tiny_assets, tmp_path_factory, train_runs) -> StoppedAndResumed:
    """`oppo-async-bg` (lag 2, carry-over, the weight sync in the background) in OpenRLHF's async
    layout, 24 prompts (6 steps), run as a user does (`python -m openrlhf_oppo.cli.main train`) and
    sent SIGTERM once its ledger shows step 1 done: the step that is running ends, a checkpoint with
    the carried groups (and the next step's, admitted and decoding) is written, the run stops. A
    second run loads that checkpoint and finishes the pass. One run serves the stop's tests and the
    resume's."""
    from openrlhf_oppo.core import ledger

    root = tmp_path_factory.mktemp("stopped")
    argv = _train_argv("oppo-async-bg", root, tiny_assets, (*ASYNC_LAYOUT, "--data.max_samples", "24"))
    proc = subprocess.Popen([sys.executable, "-m", "openrlhf_oppo.cli.main", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    events: list[dict] = []
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not any(e["event"] == "step" and e["step"] >= 1 for e in events):  # two steps done
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be stopped"
            time.sleep(0.5)
            path = root / ledger.LEDGER_FILE
            events = ledger.read_events(path) if path.exists() else []
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:  # the check above failed: end the run (the launcher takes its processes down)
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    stopped = TrainRun("oppo-async-bg", proc.returncode, root, tiny_assets)
    resumed = train_runs("oppo-async-bg", *ASYNC_LAYOUT, "--data.max_samples", "24", "--ckpt.load_enable",
                         "--ckpt.path", str(root / "checkpoints"), output=tmp_path_factory.mktemp("resumed"))
    return StoppedAndResumed(stopped, out, resumed)


@pytest.fixture(scope="session")
def sync_run(train_runs):
    """`--schedule sync` with per-request vLLM seeds and a seeded prompt order
    (integrations.runtime.seeding): what the sync tests read, and the baseline that OPPO at
    Δ=0 without streaming must reproduce."""
    run = train_runs("sync", "--train.full_determinism_enable")
    assert run.returncode == 0, run.failure()
    return run


HYBRID = ("--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep")  # OpenRLHF's hybrid engine
REWARD_FUNC = '''
import torch


def reward_func(queries, prompts, labels):
    """How close the response's word count is to the label (tiny task: a number)."""
    rewards = [-abs(len(q[len(p):].split()) - int(lb)) / 10 for q, p, lb in zip(queries, prompts, labels)]
    return {"rewards": torch.tensor(rewards), "scores": torch.tensor(rewards),
            "extra_logs": {"response_words": torch.tensor([float(len(q[len(p):].split()))
                                                           for q, p in zip(queries, prompts)])}}
'''


@pytest.fixture(scope="session")
def reward_py(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("reward") / "reward_func.py"
    path.write_text(REWARD_FUNC)
    return path


@pytest.fixture(scope="session")
def hybrid_rule_run(train_runs, reward_py, tiny_assets):
    """OPPO in OpenRLHF's hybrid engine with a rule reward, as GRPO runs are usually set up
    (3 steps): `--train.colocate_all --vllm.enable_sleep --ds.enable_sleep`, a `.py` reward
    function with `group_norm`, `--eval.dataset` after every step, wandb configured without a
    key (offline). Shared by the compat-matrix and the hybrid-engine tests: one run's start-up.
    Δ is held at B (4 groups) over 12 prompts, 3 steps: step 0 admits 8 and trains the first 4
    that finish; step 1 admits the last 4. Something is decoding at one of the two batches by
    construction: at step 0's unless every other group ends on the batch's engine iteration
    (the tiny actor's samples often run to the 192-token cap together), and then step 1's 4
    complete carried groups form its batch at once, while its 4 new groups decode."""
    return train_runs(
        "oppo", "--data.max_samples", "12", "--oppo.delta.init", "4", "--oppo.delta.adaptive", "false", *HYBRID,
        "--reward.remote_url", str(reward_py), "--algo.advantage.estimator", "group_norm",
        "--eval.dataset", str(tiny_assets / "prompts.jsonl"), "--eval.n_samples_per_prompt", "2", "--eval.steps", "1",
        "--logger.wandb.project", "oppo-matrix", "--logger.wandb.run_name", "rule",
    )
