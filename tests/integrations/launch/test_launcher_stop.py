"""Ctrl-C (SIGINT) or SIGTERM to `openrlhf-oppo train`'s launcher: before the run's first step ends it
stops at once, and after a step it asks for the step's end and a checkpoint, within a bound; either
way one line on the terminal, no traceback (what the ended processes print stays in train.log).

A real launcher process and a real child, a stand-in entry module for OpenRLHF's pipeline (no Ray):
`tests/cli/test_faults_on_cpu.py` stops the real pipeline, after a step (CI) and during start-up (slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LAUNCHER = '''
import sys
from pathlib import Path
from openrlhf_oppo.integrations.launch import launcher
launcher.STOP_GRACE_S = float(sys.argv[2])
result = launcher.launch({}, launcher.RunPaths(Path(sys.argv[1])), [], None, timeout_s=120, entry_module="fake_entry",
                         graceful_stop=True, verbose=False)
sys.exit(result.returncode)
'''

# The run's stand-in: "starting" (its start-up, the time Ray, vLLM and the models take), then as many steps as
# argv says, a metrics row each (OPPO's oppo_metrics.jsonl), then it waits for the stop file, as the trainer
# does at a step's end, unless told to ignore it. SIGTERM (the launcher ending the session) gets a traceback,
# as Ray's processes print one, and a SIGTERM is ignored once, so the end needs the SIGKILL that follows.
ENTRY = '''
import json, os, signal, sys, time
from openrlhf_oppo import run_env
steps, heed_stop = int(os.environ["FAKE_STEPS"]), os.environ["FAKE_HEED_STOP"] == "1"
terms = []
def on_term(signum, frame):
    terms.append(signum)
    print("Traceback (most recent call last):\\nKeyboardInterrupt: ended", file=sys.stderr, flush=True)
signal.signal(signal.SIGTERM, on_term)
print("starting", flush=True)
for step in range(1, steps + 1):
    with open(run_env.path(run_env.METRICS_JSONL), "a") as fh:
        fh.write(json.dumps({"global_step": step}) + "\\n")
    print(f"OPPO: {step}/9 [00:01<00:08]", flush=True)
while True:
    if heed_stop and run_env.stop_requested():
        print(f"OPPO: stopped on request after step {steps}: checkpoint global_step{steps} written", flush=True)
        sys.exit(3)
    time.sleep(0.1)
'''


def _stop(tmp_path: Path, steps: int, heed_stop: bool = True, grace_s: float = 60.0, signum=signal.SIGINT):
    """(exit code, seconds from the signal to the exit, the terminal's output, train.log) of a launcher sent
    `signum` once its child has made `steps` steps."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "fake_entry.py").write_text(ENTRY)
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "pkg"), "FAKE_STEPS": str(steps),
           "FAKE_HEED_STOP": "1" if heed_stop else "0"}
    # SIGINT as a terminal delivers it: a test session started in the background (`cmd &`) hands its
    # children SIGINT ignored, and Python then leaves it ignored
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(run), str(grace_s)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    metrics = run / "oppo_metrics.jsonl"
    deadline = time.monotonic() + 60
    while not ((run / "train.log").exists() and "starting" in (run / "train.log").read_text()
               and (not steps or (metrics.exists() and len(metrics.read_text().splitlines()) == steps))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
        time.sleep(0.1)
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, time.monotonic() - t0, out, (run / "train.log").read_text()


def _after(out: str, line: str) -> list[str]:
    """The terminal's lines from `line` on (the launcher's own start lines before it)."""
    lines = out.splitlines()
    return lines[next(i for i, x in enumerate(lines) if x.startswith(line)):]


def test_a_stop_during_start_up_ends_the_run_at_once_in_one_line(tmp_path):
    rc, took_s, out, log = _stop(tmp_path, steps=0)
    assert rc == 128 + signal.SIGINT
    assert took_s < 15  # the session's SIGTERM, 5 s, then its SIGKILL
    assert _after(out, "openrlhf-oppo train: SIGINT") == [
        "openrlhf-oppo train: SIGINT: ending the run now (no step has ended yet: nothing to checkpoint)",
        "openrlhf-oppo train: stopped on SIGINT (exit 130)"]
    assert "Traceback" not in out and "KeyboardInterrupt: ended" in log  # the ended child's output: in the log
    assert not (tmp_path / "run" / "stop_requested").exists()


def test_a_stop_after_a_step_ends_that_step_with_a_checkpoint_then_the_run(tmp_path):
    rc, took_s, out, log = _stop(tmp_path, steps=2, signum=signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM and took_s < 15
    assert _after(out, "openrlhf-oppo train: SIGTERM") == [
        "openrlhf-oppo train: SIGTERM: the current step ends, a checkpoint is written, then the run stops (within "
        "60 s; signal again to stop at once)",
        "OPPO: stopped on request after step 2: checkpoint global_step2 written",
        "openrlhf-oppo train: stopped on SIGTERM (exit 143)"]
    assert "Traceback" not in out and (tmp_path / "run" / "stop_requested").exists()
    assert [json.loads(x)["global_step"] for x in (tmp_path / "run" / "oppo_metrics.jsonl").read_text().splitlines()] \
        == [1, 2]


def test_a_stop_whose_step_does_not_end_is_given_up_on_after_the_grace(tmp_path):
    rc, took_s, out, _ = _stop(tmp_path, steps=1, heed_stop=False, grace_s=2.0)
    assert rc == 128 + signal.SIGINT  # the signal's code, whatever ended the run
    assert 2.0 <= took_s < 20
    assert "openrlhf-oppo train: the step did not end within 2 s of the stop: ending the run now (a relaunch " \
           "resumes from the last checkpoint)" in out
    assert "Traceback" not in out
