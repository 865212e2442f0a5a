"""The end-to-end runs of `openrlhf-oppo train` that the *_on_cpu tests read, each started at most
once per test session and shared by every test that can read it: a launch costs about a minute
of start-up here (Ray, vLLM, DeepSpeed), most of a test's time.

CI's run (`python -m pytest tests`) makes these launches (tests/README.md lists what each carries):

- `sync_run`: OpenRLHF's `sync`, seeded;
- `oppo_run`: `oppo` in OpenRLHF's hybrid engine, the reward model (named by a hub id, normalised)
  streamed, GAE with a critic;
- `restarted_and_stopped`: `oppo-async-bg` in OpenRLHF's async layout; its rollout engine is
  killed in step 2, the launcher relaunches it from the last checkpoint, and the relaunch is
  stopped by SIGTERM (two launches);
- `megatron_run`: `oppo` with the actor on Megatron-Core (TP = 2), a rule reward and
  `group_norm`, the reference streamed, its actor killed and an engine's request aborted on the
  way; wandb offline.

Every run is `python -m openrlhf_oppo.cli.main train`, as a user starts it, in a session of its
own, waited for with a bound: the launcher ends a run after RUN_TIMEOUT_S (exit 124), and a
launcher still running at the fixture's deadline, or when the test session ends early (Ctrl-C;
a SIGTERM to pytest ends the session through the root conftest.py), is sent two SIGINTs (the
second ends its run at once) and then killed."""

from __future__ import annotations

import contextlib
import json
import os
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
RUN_TIMEOUT_S = 600  # one attempt of a run (`--timeout-s`); a healthy one takes 1-3 minutes here
START_MARGIN_S = 120  # the launcher's own start, input checks and task build, beside its attempts
END_GRACE_S = 60  # a launcher sent two SIGINTs ends its run and exits within this, or is killed


@dataclass(frozen=True)
class TrainRun:
    schedule: str
    returncode: int
    root: Path
    assets: Path
    output: str  # what `openrlhf-oppo train` printed (stdout and stderr)

    def failure(self) -> str:
        """Why the run failed, for an assertion message: its exit code and the error lines of
        its train.log (a traceback's last lines, lines naming an error), not the whole log."""
        log = self.root / "train.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        keep = [i for i, line in enumerate(lines)
                if re.search(r"Error|Exception|Traceback|error:|FAILED|Killed", line)]
        shown = sorted({j for i in keep[-12:] for j in range(max(0, i - 1), i + 2) if j < len(lines)})
        body = "\n".join(lines[j][:400] for j in shown) or "\n".join(lines[-20:])
        return f"train --schedule {self.schedule} exited {self.returncode}; {log}:\n{body}\n{self.output[-2000:]}"

    def probes(self) -> list[dict]:
        path = self.root / "sync_probe.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def trace(self) -> list[dict]:
        """OPPO's per-step trace: the groups trained, carried and their tokens (every attempt's, in order)."""
        return _jsonl(self.root / "oppo_trace.jsonl")

    def metrics(self) -> list[dict]:
        """OPPO's per-step metrics (every attempt's, in order)."""
        return _jsonl(self.root / "oppo_metrics.jsonl")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _attempts(run: TrainRun) -> list[list[dict]]:
    """A run's per-step trace cut into its attempts: a relaunch starts an attempt (the ledger's
    start events), whether or not it starts again from an earlier step."""
    from openrlhf_oppo.core import ledger

    steps: list[int] = []  # steps traced by each attempt
    for event in ledger.read_events(run.root / ledger.LEDGER_FILE):
        if event["event"] == "start":
            steps.append(0)
        elif event["event"] == "step":
            steps[-1] += 1
    trace, cut, start = run.trace(), [], 0
    for n in steps:
        cut.append(trace[start:start + n])
        start += n
    assert start == len(trace), (steps, len(trace))
    return cut


@pytest.fixture(scope="session")
def attempts():
    """`_attempts(run)`: the trace of a run with restarts, cut into its attempts."""
    return _attempts


def _check_resumed_ledger(trace_a: list[dict], trace_b: list[dict], held: list[int] | None = None) -> None:
    """Run B (its per-step trace: trace_b) resumed from the checkpoint written after trace_a's
    last step, with groups carried there: across both every admitted group was trained exactly
    once or is still in flight, the carried groups were trained in B (or are in flight) and
    resumed with every token they had, decoded by A's policies up to the checkpoint and by the
    checkpoint's or a later one after it. `held`: the groups in flight after B's last step (the
    ledger's; default B's carried groups: with async admission the next step's groups, admitted
    at the batch, are in flight too)."""
    at_checkpoint = trace_a[-1]
    assert trace_b[0]["step"] == at_checkpoint["step"] + 1
    assert at_checkpoint["carried_groups"], "nothing was carried at the checkpoint; the test proves nothing"
    trained = [g for row in trace_a + trace_b for g in row["trained"]]
    ids = [g["group_id"] for g in trained]
    assert len(ids) == len(set(ids)), "a group was trained twice across the restart"
    if held is None:
        in_flight, admitted = set(trace_b[-1]["carried_groups"]), trace_b[-1]["next_prompt_index"]
    else:
        in_flight, admitted = set(held), max([*ids, *held]) + 1
        assert set(trace_b[-1]["carried_groups"]) <= in_flight
    assert set(ids) | in_flight == set(range(admitted)) and not in_flight & set(ids)
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


def _train_argv(schedule: str, root: Path, assets: Path, extra=(), config: Path = CONFIG, restarts: int = 0):
    """`openrlhf-oppo train`'s arguments for a run of the tiny task into `root`."""
    argv = ["train", "--schedule", schedule, "--config", str(config), "--assets", str(assets),
            "--output", str(root), "--timeout-s", str(RUN_TIMEOUT_S), "--restarts", str(restarts)]
    return [*argv, "--", *extra] if extra else argv


def _start(argv: list[str], out: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m openrlhf_oppo.cli.main <argv>` in a session of its own, its output into `out`."""
    with out.open("w") as fh:  # the child holds its own copy of the descriptor
        # SIGINT as a terminal delivers it, even where the test session was started in the background
        # (`cmd &` hands its children SIGINT ignored): `_end` and the Ctrl-C tests send it
        return subprocess.Popen([sys.executable, "-m", "openrlhf_oppo.cli.main", *argv], cwd=REPO,
                                env={**os.environ, **(env or {})}, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _end(proc: subprocess.Popen) -> None:
    """End a launcher still running: a SIGINT asks its run to stop, a second ends the run at once
    (the launcher ends the run's session); a launcher that has not exited END_GRACE_S later is
    killed, with its own session and its run's."""
    import psutil

    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)  # two signals pending at once would be handled as one
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=END_GRACE_S)
    except subprocess.TimeoutExpired:
        sessions = {proc.pid}
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(OSError):
                    sessions.add(os.getsid(child.pid))
        for session in sessions:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(session, signal.SIGKILL)
        proc.wait(timeout=END_GRACE_S)


def _bound_s(restarts: int) -> float:
    """How long a launcher with `restarts` may run: each attempt ends at RUN_TIMEOUT_S."""
    return (restarts + 1) * RUN_TIMEOUT_S + START_MARGIN_S


def _wait(proc: subprocess.Popen, deadline: float) -> int:
    """The launcher's exit code; on the deadline (or an interrupted session) it is ended, and the
    test fails naming the wait."""
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _end(proc)
        pytest.fail(f"openrlhf-oppo train (pid {proc.pid}) did not end by its deadline; ended it", pytrace=False)
    except BaseException:
        _end(proc)
        raise


@pytest.fixture(scope="session")
def start_train(tiny_assets):
    """`start(schedule, root, out, *extra) -> (process, wait)`: a run of the tiny task into `root` started as a
    user starts it, its output into `out`, for a test that acts on it while it runs; `wait(bound_s)` is its
    exit code (the run ended by the bound fails the test)."""
    def start(schedule: str, root: Path, out: Path, *extra: str):
        proc = _start(_train_argv(schedule, root, tiny_assets, extra), out)
        return proc, lambda bound_s: _wait(proc, time.monotonic() + bound_s)

    return start


@pytest.fixture(scope="session")
def train_runs(tmp_path_factory, tiny_assets):
    """`run(schedule, *extra, output=, config=, assets=, env=, restarts=)` -> TrainRun, run on first
    request and kept for the session. `assets`: the task's (default: the tiny task's, built once);
    `env`: more variables for the run (e.g. OPPO_FAULTS)."""
    from openrlhf_oppo.bench import cpu_use

    cache: dict[tuple, TrainRun] = {}

    def run(schedule: str, *extra: str, output: Path | None = None, config: Path = CONFIG,
            assets: Path | None = None, env: dict[str, str] | None = None, restarts: int = 0) -> TrainRun:
        assets = assets or tiny_assets
        key = (schedule, extra, output, config, assets, tuple(sorted((env or {}).items())), restarts)
        if key not in cache:
            root = output or tmp_path_factory.mktemp(f"run-{schedule}")
            out = root.with_name(root.name + ".out")
            proc = _start(_train_argv(schedule, root, assets, extra, config, restarts), out, env)
            with cpu_use.Sampler(root / cpu_use.FILE, root_pid=proc.pid):  # as `bench schedules` samples its runs
                returncode = _wait(proc, time.monotonic() + _bound_s(restarts))
            cache[key] = TrainRun(schedule, returncode, root, assets, out.read_text(errors="replace"))
        return cache[key]

    return run


@pytest.fixture(scope="session")
def sync_run(train_runs):
    """`--schedule sync` with per-request vLLM seeds and a seeded prompt order
    (integrations.runtime.seeding): what the sync tests read, and the baseline that OPPO at
    Δ=0 without streaming must reproduce."""
    run = train_runs("sync", "--train.full_determinism_enable")
    assert run.returncode == 0, run.failure()
    return run


@dataclass(frozen=True)
class HubReward:
    """The tiny reward model in a Hugging Face hub cache, as a download leaves it, with
    normalisation constants in its config (`--reward.normalize_enable` reads them)."""

    repo: str  # the hub id a run names it by
    mean: float
    std: float
    cache: Path  # HF_HUB_CACHE for the run (with HF_HUB_OFFLINE=1)

    def env(self) -> dict[str, str]:
        return {"HF_HUB_CACHE": str(self.cache), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="session")
def hub_reward(tmp_path_factory, tiny_assets) -> HubReward:
    reward = HubReward("oppo-tiny/reward", 0.25, 2.0, tmp_path_factory.mktemp("hf-hub"))
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = reward.cache / f"models--{reward.repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in (tiny_assets / "reward").iterdir():
        if f.is_file():
            (snap / f.name).write_bytes(f.read_bytes())
    config = json.loads((snap / "config.json").read_text())
    config.update(mean=reward.mean, std=reward.std)
    (snap / "config.json").write_text(json.dumps(config))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(rev)
    return reward


HYBRID = ("--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep")  # OpenRLHF's hybrid engine


@pytest.fixture(scope="session")
def oppo_run(train_runs, hub_reward):
    """`oppo` as configs/cluster/qwen2.5-7b-hybrid-8gpu.yaml runs it, in miniature: OpenRLHF's
    hybrid engine (`--train.colocate_all --vllm.enable_sleep --ds.enable_sleep`), response chunks
    streamed into the reward model while vLLM decodes, GAE with a critic. 16 prompts, 4 steps.
    The reward model is named by a hub id resolved from a local hub cache, normalised by the
    mean and std in its config, and loaded with `--ds.attn_implementation eager`. Δ is held at
    B (4 groups): step 0 admits 8 and trains the first 4 that finish, so something is decoding
    at a batch by construction unless every other group ends on the batch's engine iteration
    (the tiny actor's samples often run to the 192-token cap together)."""
    run = train_runs(
        "oppo", "--oppo.delta.init", "4", "--oppo.delta.adaptive", "false", *HYBRID,
        "--reward.model_name_or_path", hub_reward.repo, "--reward.normalize_enable",
        "--ds.attn_implementation", "eager", env=hub_reward.env(),
    )
    assert run.returncode == 0, run.failure()
    return run


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


ASYNC_LAYOUT = ("--train.colocate_all", "--train.async_enable")  # where OpenRLHF's async mode places its models
ENGINE_FAULT = "rollout@2"  # the engine is killed in step 2, after a seeded number of its replies


def _relaunched_step(events: list[dict]) -> bool:
    """The ledger shows a relaunch (a second start) and a step done after it."""
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    return len(starts) >= 2 and any(e["event"] == "step" for e in events[starts[1]:])


@pytest.fixture(scope="session")
def restarted_and_stopped(tiny_assets, tmp_path_factory) -> TrainRun:
    """`oppo-async-bg` (async admission at lag 2, carry-over, the weight sync in the background,
    streaming off: OpenRLHF's reward forward) in OpenRLHF's async layout, as
    configs/cluster/qwen2.5-7b-async-8gpu.yaml places it, GAE with a critic; 24 prompts (6 steps),
    a checkpoint after every step, `--restarts 1`, run as a user does. Its rollout engine is
    killed in step 2 (ENGINE_FAULT): the launcher relaunches it from the last checkpoint, and the
    relaunch is sent SIGTERM once it has done a step: the step that is running ends, a checkpoint
    with the carried groups (and the next step's, admitted and decoding) is written, the run
    stops. One run serves the restart's tests, the resume's, the stop's and the lag bound's."""
    from openrlhf_oppo.core import ledger

    root = tmp_path_factory.mktemp("restarted")
    out = root.with_name(root.name + ".out")
    extra = (*ASYNC_LAYOUT, "--data.max_samples", "24", "--ckpt.save_steps", "1")
    proc = _start(_train_argv("oppo-async-bg", root, tiny_assets, extra, restarts=1), out,
                  {"OPPO_FAULTS": ENGINE_FAULT})
    deadline = time.monotonic() + _bound_s(1)
    path = root / ledger.LEDGER_FILE
    try:
        while not _relaunched_step(ledger.read_events(path) if path.exists() else []):
            if proc.poll() is not None:
                pytest.fail(f"the run ended (exit {proc.returncode}) before its relaunch could be stopped:\n"
                            f"{out.read_text(errors='replace')[-3000:]}", pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail("no relaunched step in the ledger by the deadline", pytrace=False)
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        returncode = _wait(proc, deadline)
    finally:
        _end(proc)  # the run still going: the poll above failed
    return TrainRun("oppo-async-bg", returncode, root, tiny_assets, out.read_text(errors="replace"))


MEGATRON = ("--oppo.megatron.enable", "true", "--oppo.megatron.tensor_parallel_size", "2",
            "--actor.num_gpus_per_node", "2")
SCORER_FAULTS = "reference@1,abort@2"  # the streaming reference actor killed in step 1, a request aborted in 2


@pytest.fixture(scope="session")
def megatron_run(train_runs, reward_py):
    """`oppo` as configs/cluster/qwen2.5-72b-megatron-64gpu.yaml runs it, in miniature: the actor
    trained by Megatron-Core at tensor-parallel size 2 (the reference on DeepSpeed), a `.py` rule
    reward with `group_norm` (GRPO, no critic), the reference streamed
    (`--oppo.streaming.reference true`); 16 prompts, a checkpoint every second step. Its streaming
    reference actor is killed in the middle of step 1 (Ray restarts it; the driver re-prefills its
    held samples from their recorded tokens) and one request is aborted by its engine in step 2
    (it decodes on from its tokens). Δ is fixed at the config's
    init (2): an engine fault fires on the k-th engine reply of its step, and with B complete
    groups already carried (the system Δ rule sizes Δ up to B here) a step takes its batch before
    any engine reply. wandb is configured without a key (offline)."""
    return train_runs("oppo", *MEGATRON, "--reward.remote_url", str(reward_py), "--algo.advantage.estimator",
                      "group_norm", "--oppo.streaming.reference", "true", "--oppo.delta.adaptive", "false",
                      "--ckpt.save_steps", "2", "--logger.wandb.project", "oppo-matrix", "--logger.wandb.run_name",
                      "megatron", env={"OPPO_FAULTS": SCORER_FAULTS})


@pytest.fixture(scope="session")
def hybrid_rule_run(train_runs, reward_py, tiny_assets):
    """(`slow` tests) OPPO in OpenRLHF's hybrid engine with a rule reward, as GRPO runs are
    usually set up (3 steps): `--train.colocate_all --vllm.enable_sleep --ds.enable_sleep`, a `.py`
    reward function with `group_norm`, `--eval.dataset` after every step, wandb configured without
    a key (offline). Δ is held at B (4 groups) over 12 prompts, 3 steps."""
    return train_runs(
        "oppo", "--data.max_samples", "12", "--oppo.delta.init", "4", "--oppo.delta.adaptive", "false", *HYBRID,
        "--reward.remote_url", str(reward_py), "--algo.advantage.estimator", "group_norm",
        "--eval.dataset", str(tiny_assets / "prompts.jsonl"), "--eval.n_samples_per_prompt", "2", "--eval.steps", "1",
        "--logger.wandb.project", "oppo-matrix", "--logger.wandb.run_name", "rule",
    )
