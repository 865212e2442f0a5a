"""Crash injection with real Ray (`openrlhf_oppo.integrations.runtime.faults`), end to end on CPU,
and the stop a user asks for with SIGTERM. The runs are the session's (tests/cli/conftest.py):

- `megatron_run`: its streaming reference actor is killed in the middle of step 1 (Ray restarts
  it; the driver re-prefills its held samples from their recorded tokens) and one request is
  aborted by its engine in step 2 (it decodes on from its tokens and is never trained as an
  answer). The ledger check then proves every prompt group was trained exactly once, and every
  trained sample's streamed reference log-probs, the restart included, equal OpenRLHF's reference
  forward. (A scorer actor's restart is the same code for the reward's; the `slow` run kills both.)
- `restarted_and_stopped` (async admission, the weight sync in the background): its rollout
  engine is killed in step 2, the run stops, and `--restarts 1` relaunches it from the last
  checkpoint (the steps after it are rolled back and done again); the groups carried at that
  checkpoint come back with every token they had (the DeepSpeed backend's resume test; the
  Megatron one's is `slow`, in test_train_megatron_on_cpu). The relaunch is then asked to stop
  with SIGTERM: the step ends, a checkpoint with the carried samples is written, the exit code
  says so.

`slow`: one run with all five faults (the above, and the trainer killed right after the pass's
last checkpoint: relaunched again, that episode is over, nothing more is trained), three launches."""

from __future__ import annotations

import re
import signal

import pytest

from openrlhf_oppo.cli.main import main
from openrlhf_oppo.core import ledger

pytestmark = pytest.mark.e2e  # real Ray, vLLM (CPU build), DeepSpeed and OpenRLHF processes


def _fired(run) -> list[str]:
    return (run.root / (ledger.LEDGER_FILE + ".faults")).read_text().split()


def _check_scorer_faults(run, metrics: list[dict], killed: int) -> None:
    """`killed` scorer actors killed in step 1 of the first attempt, one request aborted in step 2."""
    restarts = [m["oppo/scorer_restarts"] for m in metrics]
    assert restarts[1] == killed and sum(restarts) == killed  # step 1 of the first attempt
    assert all("oppo/reference_scorer_idle_fraction" in m for m in metrics)
    # the aborted request was not trained as an answer: it decoded on from its tokens
    assert metrics[2]["oppo/aborted_requests"] == 1.0 and sum(m["oppo/aborted_requests"] for m in metrics) == 1.0
    trace = run.trace()
    assert all(s["finish_reason"] in ("stop", "length") for row in trace for g in row["trained"] for s in g["samples"])


def test_a_killed_scorer_actor_and_an_aborted_request_the_run_completes_and_the_ledger_holds(
        megatron_run, tiny_assets):
    run = megatron_run
    assert run.returncode == 0, run.failure()
    assert _fired(run) == ["reference@1", "abort@2"]
    _check_scorer_faults(run, run.metrics(), killed=1)
    assert [row["step"] for row in run.trace()] == [0, 1, 2, 3]
    assert _reference_matches_openrlhfs_forward(tiny_assets, run.trace()) == 32  # 4 steps x 4 groups x n=2
    report = ledger.check_run(run.root)
    assert report.ok, report.summary()
    assert (report.restarts, report.last_step, report.trained, report.held) == (0, 3, 16, 0)
    assert main(["ledger", "check", str(run.root)]) == 0


def _starts(run) -> list[dict]:
    return [e for e in ledger.read_events(run.root / ledger.LEDGER_FILE) if e["event"] == "start"]


def test_a_killed_rollout_engine_is_relaunched_from_the_last_checkpoint_losing_nothing(
        restarted_and_stopped, attempts, check_resumed_ledger):
    run = restarted_and_stopped
    assert _fired(run) == ["rollout@2"]
    assert re.search(r"openrlhf-oppo train: exit \d+; restart 1 of 1 from the last checkpoint", run.output), \
        run.output[-3000:]
    first, relaunch = _starts(run)
    assert first["last_step"] == -1 and relaunch["last_step"] >= 0
    resumed_from = relaunch["last_step"]  # the checkpoint the relaunch loaded: written after this step
    tried, again = attempts(run)
    assert again[0]["step"] == resumed_from + 1
    # the relaunch from that checkpoint: its carried groups came back with every token they had
    events = ledger.read_events(run.root / ledger.LEDGER_FILE)
    held = next(e for e in reversed(events) if e["event"] == "step")["held"]  # at the stop
    check_resumed_ledger([row for row in tried if row["step"] <= resumed_from], again, held)
    report = ledger.check_run(run.root)
    assert report.ok, report.summary()
    assert report.restarts == 1 and report.rolled_back_steps == sum(row["step"] > resumed_from for row in tried)


def test_sigterm_ends_the_step_writes_a_checkpoint_and_exits_non_zero(restarted_and_stopped):
    """The checkpoint the stop wrote holds OPPO's state with the groups in flight at that step (the
    carried ones and the next step's, admitted and decoding): the ones the ledger says were held."""
    import json

    import torch

    from openrlhf_oppo import compat

    run, out = restarted_and_stopped, restarted_and_stopped.output
    assert run.returncode == 128 + signal.SIGTERM, out[-3000:]

    events = ledger.read_events(run.root / ledger.LEDGER_FILE)
    last_step = max(e["step"] for e in events if e["event"] == "step")
    # after the signal: one line from the run (no traceback), its step numbered as OpenRLHF's global step, the
    # checkpoint's tag and the progress bar number it
    after = out[out.index("openrlhf-oppo train: SIGTERM: the current step ends"):]
    assert "Traceback" not in after, after[-3000:]
    stop = [line for line in after.splitlines() if "stopped on request" in line]
    assert len(stop) == 1 and stop[0].startswith(f"OPPO: stopped on request after step {last_step + 1}: checkpoint "
                                                 f"global_step{last_step + 1} written to "), after[-3000:]
    assert re.search(rf"^OPPO: .*\| {last_step + 1}/6 \[", out, re.M), out[-3000:]  # 24 prompts, 4 a step
    assert "openrlhf-oppo train: stopped on SIGTERM (exit 143)" in after
    assert events[-1] == {"event": "checkpoint", "step": last_step}  # after the step that was running
    assert ledger.check_events(events).ok
    held = next(e for e in reversed(events) if e["event"] == "step")["held"]
    (states,) = (run.root / "checkpoints" / "_actor" / f"global_step{last_step + 1}").glob("*model_states.pt")
    compat.apply()  # OpenRLHF's modules import flash_attn, which a CPU host lacks
    from openrlhf_oppo.integrations.runtime.trainer import STATE_KEY

    state = json.loads(torch.load(states, weights_only=False)[STATE_KEY])
    assert held and sorted(int(gid) for gid in state["prompts"]) == sorted(held)


def _reference_matches_openrlhfs_forward(assets, trace) -> int:
    """Every trained sample's streamed reference log-probs against OpenRLHF's reference `Actor`
    loaded from the same checkpoint in bf16 (--ds.param_dtype, which both honour), one forward
    over the whole sequence. Chunked and one-shot bf16 forwards round differently, and what they
    round is the logits: log p = z - logsumexp(z), each term a bf16-computed quantity of about
    log(vocab) = 6.7 on the tiny model, whatever p. So the bound is 2 bf16 epsilons of the larger of
    |log p| and |logsumexp(z)| (at least 1). A bound relative to |log p| alone failed in CI at
    log p = -1.01: 0.020 apart, a bound of 0.016, while the log-normaliser was 6.7 (one bf16 ulp
    there: 0.031). Measured on that run: every difference within 0.003 of that scale (0.38 eps).
    Exact equality in fp32 for any chunking is tests/integrations/runtime/test_reference_stream.py's."""
    import torch

    from openrlhf_oppo import compat

    compat.apply()
    from openrlhf.models import Actor

    actor = Actor(str(assets / "actor"), attn_implementation="sdpa", param_dtype="bf16", temperature=1.0).eval()
    compared = 0
    for row in trace:
        for g in row["trained"]:
            prompt = g["prompt_ids"]
            for s in g["samples"]:
                seq = torch.tensor([prompt + s["tokens"]])
                action_mask = torch.zeros(1, seq.shape[1] - 1)
                action_mask[0, len(prompt) - 1:] = 1
                with torch.no_grad():
                    one_shot = actor(seq, action_mask, torch.ones_like(seq))[0, len(prompt) - 1:].float()
                    logits = actor.model(seq).logits[0, len(prompt) - 1:-1].float()  # those of the response
                streamed = torch.tensor(s["reference_logprobs"])
                assert streamed.shape == one_shot.shape == logits.shape[:1]
                scale = torch.maximum(one_shot.abs(), torch.logsumexp(logits, -1).abs()).clamp(min=1.0)
                bound = 2 * torch.finfo(torch.bfloat16).eps * scale
                assert ((streamed - one_shot).abs() <= bound).all(), (row["step"], s["sample_id"])
                compared += 1
    return compared


@pytest.mark.slow
def test_all_five_faults_with_relaunches_the_run_completes_and_the_ledger_holds(
        train_runs, tiny_assets, attempts, check_resumed_ledger):
    """`oppo` on DeepSpeed with the reference streamed, a checkpoint every second step,
    `--restarts 3`: the scorer faults and the abort as above, the rollout engine killed in the
    middle of step 3 (relaunched from step 1's checkpoint: step 2 is rolled back and done again),
    and the trainer right after step 3's checkpoint, the pass's last step (relaunched again: that
    episode is over, nothing more is trained)."""
    run = train_runs("oppo", "--data.max_samples", "16", "--ckpt.save_steps", "2", "--oppo.delta.adaptive", "false",
                     "--oppo.streaming.reference", "true", restarts=3,
                     env={"OPPO_FAULTS": "reward@1,reference@1,abort@2,rollout@3,driver@3"})
    assert run.returncode == 0, run.failure()
    assert _fired(run) == ["reward@1", "reference@1", "abort@2", "rollout@3", "driver@3"]
    _check_scorer_faults(run, run.metrics(), killed=2)  # the reward's and the reference's
    # the trace of each attempt: steps 0-2 (step 3 died with its engine), then 2-3 from step 1's
    # checkpoint (the last attempt resumed at the pass's end and traced no step)
    tried = attempts(run)
    assert [[row["step"] for row in rows] for rows in tried] == [[0, 1, 2], [2, 3], []]
    check_resumed_ledger([row for row in tried[0] if row["step"] <= 1], tried[1])
    assert _reference_matches_openrlhfs_forward(tiny_assets, run.trace()) >= 16

    report = ledger.check_run(run.root)
    assert report.ok, report.summary()
    assert report.restarts == 2 and report.rolled_back_steps == 1  # step 2 of the first attempt
    assert {1, 3} <= set(report.checkpoints)
    # the last relaunch resumed from the pass's final checkpoint: the episode was over, no step
    # was added (one pass of 16 prompts is OpenRLHF's 4 steps), every prompt trained once
    assert report.last_step == 3 and report.trained == 16
    assert main(["ledger", "check", str(run.root)]) == 0


@pytest.mark.slow
def test_ctrl_c_during_start_up_stops_the_run_at_once_in_one_line(start_train, tmp_path):
    """SIGINT while Ray, vLLM and the models start: no step has ended, nothing to checkpoint, so the run
    ends at once (its processes too), with one line and no traceback, and no checkpoint is written (a
    relaunch starts afresh)."""
    import time

    root, out = tmp_path / "run", tmp_path / "out.txt"
    proc, wait = start_train("oppo", root, out)
    log = root / "train.log"
    deadline = time.monotonic() + 300
    while not (log.exists() and "Started a local Ray instance" in log.read_text(errors="replace")):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert wait(60) == 128 + signal.SIGINT
    assert time.monotonic() - t0 < 30
    text = out.read_text()
    after = text[text.index("openrlhf-oppo train: SIGINT"):]
    assert after.splitlines()[:2] == [
        "openrlhf-oppo train: SIGINT: ending the run now (no step has ended yet: nothing to checkpoint)",
        "openrlhf-oppo train: stopped on SIGINT (exit 130)"], after
    assert "Traceback" not in after and not (root / "checkpoints" / "_actor").exists()
