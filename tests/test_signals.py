"""A SIGTERM to the test runner ends it (`timeout 300 python -m pytest ...` must end):
the repository's conftest.py turns it into `pytest.exit`, and the launcher leaves a handler the
process's owner installed in place, so a run a test launched in-process is ended with
the session rather than asked for a graceful stop that the session outlives."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # where the conftest.py of the tests sits
# pytest's exit after the signal, the launcher ending its child's session included: a few
# seconds, more on a loaded machine
END_S = 30.0

SLEEPS = """
import os, time
from pathlib import Path

def test_sleeps():
    Path(os.environ["PROBE_READY"]).write_text(str(os.getpid()))
    time.sleep(600)
"""

LAUNCHES = """
import os, time
from pathlib import Path
from openrlhf_oppo.integrations.launch import launcher

def test_launches_a_run_that_sleeps(tmp_path):
    paths = launcher.RunPaths(tmp_path / "run")
    launcher.launch({}, paths, [], None, timeout_s=600, entry_module="sleeper", graceful_stop=True,
                    env={"PYTHONPATH": os.environ["PROBE_DIR"]})
"""

SLEEPER = """
import os, time
from pathlib import Path
Path(os.environ["PROBE_READY"]).write_text(str(os.getpid()))
time.sleep(600)
"""


def _run_until_ready(tmp_path: Path, test_source: str) -> tuple[subprocess.Popen, int]:
    """pytest on one test file beside a copy of the repository's conftest.py, started in its own
    session; returns once the probe wrote its pid."""
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(test_source)
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    ready = tmp_path / "ready"
    env = {**os.environ, "PROBE_READY": str(ready), "PROBE_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probe.py"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not ready.exists() or not ready.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"the probe did not start: {proc.communicate(timeout=10)[0][-3000:]}")
        time.sleep(0.1)
    return proc, int(ready.read_text())


def _terminate(proc: subprocess.Popen) -> tuple[int, str]:
    """SIGTERM to pytest alone: its exit code and output, once it exited (within `END_S`)."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=END_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate(timeout=10)[0]
        raise AssertionError(f"pytest still running {END_S:.0f}s after SIGTERM: {out[-3000:]}") from None
    return proc.returncode, out


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def test_a_sigterm_ends_the_test_session(tmp_path):
    proc, _ = _run_until_ready(tmp_path, SLEEPS)
    returncode, out = _terminate(proc)
    assert returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "SIGTERM: the test session ends" in out, out[-3000:]


def test_a_sigterm_ends_the_session_and_the_run_a_test_launched(tmp_path):
    proc, run_pid = _run_until_ready(tmp_path, LAUNCHES)
    try:
        returncode, out = _terminate(proc)
        assert returncode == 128 + signal.SIGTERM, out[-3000:]
        assert "current step ends" not in out, out[-3000:]  # no graceful stop for the session to wait on
        assert _gone(run_pid), f"the launched run (pid {run_pid}) outlived the session: {out[-3000:]}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(run_pid, signal.SIGKILL)  # a run that outlived the session
