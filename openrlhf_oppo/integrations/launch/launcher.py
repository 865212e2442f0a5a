"""Run OpenRLHF 0.11.2's `python -m openrlhf.cli.train_ppo_ray` unmodified (or a
drop-in entry point with the same flags, named by the schedule).

The run is a child process in its own session: OpenRLHF's own `ray.init()` starts
a local Ray cluster under it, and when it ends everything left in that session
(raylet, workers, vLLM engine processes) is ended, so no zombies outlive a run.
Where CUDA is absent the child gets `openrlhf_oppo.compat.launch_env()` (the
sitecustomize that patches every process of the run, logical GPUs for Ray, ...).
On any hardware its compile caches live in the project cache, and entries an
interrupted compile left broken are removed before it starts (`compat.caches`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrlhf_oppo import compat, hooks, run_env
from openrlhf_oppo.compat import caches
from openrlhf_oppo.core import ledger
from openrlhf_oppo.integrations.launch import wandb_offline
from openrlhf_oppo.integrations.launch.openrlhf_flags import TRAIN_MODULE
from openrlhf_oppo.integrations.launch.yaml_config import to_argv

PROBE_TEXT = "question: red cat answer:"


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def critic(self) -> Path:
        return self.root / "model_critic"  # OpenRLHF saves the critic to <output_dir>_critic

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def sync_probe(self) -> Path:
        return self.root / "sync_probe.jsonl"

    @property
    def oppo_metrics(self) -> Path:
        return self.root / "oppo_metrics.jsonl"  # one row per step (OPPO schedules)

    @property
    def oppo_trace(self) -> Path:
        return self.root / "oppo_trace.jsonl"  # admitted / trained / carried per step (OPPO schedules)

    @property
    def ledger(self) -> Path:
        return self.root / ledger.LEDGER_FILE  # admitted / trained / held groups per step, across restarts

    @property
    def log(self) -> Path:
        return self.root / "train.log"  # the run's stdout and stderr (a restart appends)

    @property
    def timeline(self) -> Path:
        return self.root / "timeline"  # spans of every stage on every worker (openrlhf_oppo.timeline)

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts.jsonl"  # each step's trained samples (every schedule)

    @property
    def stop_file(self) -> Path:
        return self.root / "stop_requested"  # made on SIGTERM/SIGINT: OPPO ends the step, checkpoints, stops

    @property
    def preflight(self) -> Path:
        return self.root / "preflight.json"  # input checks before launch (integrations.launch.preflight)


@dataclass(frozen=True)
class RunResult:
    returncode: int
    wall_s: float
    paths: RunPaths
    stopped_by: int | None = None  # the signal that asked the run to stop


def run_flags(paths: RunPaths, flags: dict[str, Any]) -> dict[str, Any]:
    """Output locations of a run, unless the config sets them."""
    defaults = {
        "ckpt.output_dir": str(paths.model),
        "ckpt.path": str(paths.checkpoints),
        "logger.tensorboard_dir": str(paths.tensorboard),
    }
    return {**defaults, **flags}


def probe_prompt_ids(tokenizer_json: Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_json)).encode(PROBE_TEXT).ids


def child_env(paths: RunPaths, flags: dict[str, Any], probe_ids: list[int] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(compat.launch_env(env))
    env.update(caches.cache_env(env))
    # the site hook records OpenRLHF's stages on the timeline and seeds its rollouts, on any hardware
    env["PYTHONPATH"] = hooks.site_pythonpath(env.get("PYTHONPATH", ""))
    env[run_env.TIMELINE_DIR] = str(paths.timeline)
    env[run_env.METRICS_JSONL] = str(paths.oppo_metrics)
    env[run_env.TRACE_JSONL] = str(paths.oppo_trace)
    env[run_env.LEDGER_JSONL] = str(paths.ledger)  # appended across restarts: never cleared here
    env[run_env.STOP_FILE] = str(paths.stop_file)
    env[run_env.ROLLOUTS_JSONL] = str(paths.rollouts)
    # `openrlhf-oppo train` checked the inputs before launching (or was told to skip them): the
    # cluster entry does not check them again
    env[run_env.SKIP_INPUT_CHECKS] = "1"
    env[run_env.CHECKED] = "1"  # its memory table is on the terminal already: the child's check refuses only
    if probe_ids:
        env[run_env.SYNC_PROBE] = str(paths.sync_probe)
        env[run_env.SYNC_PROBE_PROMPT] = ",".join(map(str, probe_ids))
    return env


TIMEOUT_RETURNCODE = 124


def launch(
    flags: dict[str, Any],
    paths: RunPaths,
    extra_argv: list[str],
    probe_ids: list[int] | None,
    timeout_s: float | None = None,
    entry_module: str = TRAIN_MODULE,
    fresh: bool = True,
    graceful_stop: bool = False,
    verbose: bool = True,
    env: dict[str, str] | None = None,
) -> RunResult:
    """Run the child to its end. ``fresh``: clear the per-run logs first (a restart
    appends to them). On SIGTERM/SIGINT (unless the process's owner handles them, see
    `_handle_signals`): with ``graceful_stop`` (OPPO schedules) the current step ends, a
    checkpoint with the carried samples is written and the run stops; otherwise the child
    gets SIGINT. A second signal ends the run at once. ``env``: more
    variables for the run's processes (e.g. OPPO_FIXED_LENGTHS)."""
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.stop_file.unlink(missing_ok=True)
    if fresh:
        paths.log.unlink(missing_ok=True)
        paths.sync_probe.unlink(missing_ok=True)
        paths.oppo_metrics.unlink(missing_ok=True)
        paths.oppo_trace.unlink(missing_ok=True)
        paths.rollouts.unlink(missing_ok=True)
        shutil.rmtree(paths.timeline, ignore_errors=True)
    flags = run_flags(paths, flags)
    wandb_flags, wandb_env = wandb_offline.wandb_settings({**flags, **wandb_offline.argv_flags(extra_argv)}, os.environ)
    flags.update(wandb_flags)
    argv = [sys.executable, "-m", entry_module, *to_argv(flags), *extra_argv]
    (paths.root / "command.json").write_text(json.dumps(argv, indent=1))
    print("openrlhf-oppo train: " + " ".join(argv[1:]), flush=True)
    env = {**child_env(paths, flags, probe_ids), **(env or {})}
    if wandb_flags:  # wandb's run files go to RUN_DIR/wandb unless WANDB_DIR says otherwise
        env.update(wandb_env)
        env.setdefault("WANDB_DIR", str(paths.root))
    stopped_by: list[int] = []
    steps_before = _steps_done(paths.oppo_metrics)  # a relaunch appends to the file
    stop_by: list[float] = []  # when a graceful stop is given up on

    def on_signal(signum, frame):
        name = signal.Signals(signum).name
        if stopped_by:
            echo.say(f"{name} again: ending the run now")
            raise KeyboardInterrupt
        stopped_by.append(signum)
        if graceful_stop and _steps_done(paths.oppo_metrics) > steps_before:
            paths.stop_file.touch()
            stop_by.append(time.monotonic() + STOP_GRACE_S)
            echo.say(f"{name}: the current step ends, a checkpoint is written, then the run stops (within "
                     f"{STOP_GRACE_S:.0f} s; signal again to stop at once)")
            return
        why = ("no step has ended yet: nothing to checkpoint" if graceful_stop
               else "OpenRLHF's schedules write no checkpoint on a stop")
        echo.say(f"{name}: ending the run now ({why})")
        raise KeyboardInterrupt

    with caches.in_use(env, log=_log), paths.log.open("ab") as log_file:  # cache held until the session is ended
        start = time.monotonic()
        log_file.write(f"openrlhf-oppo train: {' '.join(argv[1:])}\n".encode())
        log_file.flush()
        # the child writes to RUN_DIR/train.log (it outlives this process if need be) and a
        # thread copies what it writes to this process's stdout
        echo = _Follower(paths.log, log_file.tell(), keep=None if verbose else QuietLines())
        if not verbose:
            _log(f"Ray's, vLLM's and OpenRLHF's output goes to {paths.log}; here: OPPO's progress, warnings and "
                 "errors (--verbose shows everything)")
        child = subprocess.Popen(argv, env=env, start_new_session=True, stdout=log_file, stderr=subprocess.STDOUT)
        echo.start()
        previous = _handle_signals(on_signal)
        try:
            returncode = _wait(child, start, timeout_s, stop_by, echo)
        except KeyboardInterrupt:  # a stop at once (or Ctrl-C where no handler could be installed)
            returncode = 128 + signal.SIGINT
        finally:
            _restore_signals(previous)
            echo.stop()  # what the processes ended below write (their tracebacks) stays in train.log
            _end_session(child.pid)
    if stopped_by:
        returncode = 128 + stopped_by[0]  # non-zero whatever the child made of it
        _log(f"stopped on {signal.Signals(stopped_by[0]).name} (exit {returncode})")
    return RunResult(returncode=returncode, wall_s=time.monotonic() - start, paths=paths,
                     stopped_by=stopped_by[0] if stopped_by else None)


STOP_GRACE_S = 600.0  # a graceful stop (the step ends, a checkpoint is written) is given this long


def _steps_done(metrics: Path) -> int:
    """Steps an OPPO run has ended: rows of RUN_DIR/oppo_metrics.jsonl, one a step."""
    try:
        with metrics.open("rb") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _wait(child: subprocess.Popen, start: float, timeout_s: float | None, stop_by: list[float], echo) -> int:
    """The child's exit code; TIMEOUT_RETURNCODE `timeout_s` after `start` (monotonic), and 128 + SIGTERM
    when a graceful stop (once asked: `stop_by[0]`) has not ended the run in time."""
    while True:
        try:
            return child.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if timeout_s is not None and now - start >= timeout_s:
                echo.say(f"no result after {timeout_s:.0f}s; ending the run")
                return TIMEOUT_RETURNCODE
            if stop_by and now >= stop_by[0]:
                echo.say(f"the step did not end within {STOP_GRACE_S:.0f} s of the stop: ending the run now "
                         "(a relaunch resumes from the last checkpoint)")
                return 128 + signal.SIGTERM


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAY_PREFIX = re.compile(r"^(\(\w+ pid=\d+(?:, ip=[\d.]+)?\) ?)+")  # "(ActorName pid=12) (Worker pid=13) "
_TROUBLE = re.compile(r"Traceback|Error\b|Exception\b|^\s*File \"|\bERROR\b|Killed|FAILED|error:")
# the last line of a traceback: `Type: message` (Ray's `RayTaskError(Type): ...` too) or a bare `Type`
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(\([\w.]*\))?(: |$)")


class QuietLines:
    """What a quiet run shows of its log, line by line: this package's lines (the launcher's, and
    the `OPPO` progress bar and messages of the Ray actors, a progress bar's last redraw only) and
    errors, every line of a traceback through its exception's message; None for the rest (Ray's,
    vLLM's and OpenRLHF's INFO and warnings, their metric dicts and progress bars), which stays in
    train.log. Progress bars redraw with carriage returns (OpenRLHF's may share OPPO's line): the
    last redraw worth showing."""

    def __init__(self) -> None:
        # "body": inside a traceback, until its exception line; "tail": after it, until a line that
        # neither is indented nor names an exception; None: outside
        self.traceback: str | None = None

    def __call__(self, line: str) -> str | None:
        message = _RAY_PREFIX.sub("", _ANSI.sub("", line))
        if self.traceback:
            if message[:1].isspace() or message.startswith(("During handling", "The above exception")):
                return message
            if _EXCEPTION.match(message):
                self.traceback = "tail"
                return message
            # In the body, any other line is another process's output that Ray wrote into the middle
            # of the traceback (an actor's progress bar): the traceback goes on, that line is judged
            # by the rules below.
            if self.traceback == "tail":
                self.traceback = None
        for part in reversed(message.split("\r")):
            if part.startswith("Traceback"):
                self.traceback = "body"
            if part.startswith(("openrlhf-oppo", "OPPO")):
                return part
            if _TROUBLE.search(part) and not _LIBRARY_NOTE.match(part):
                return part
        return None


# a redraw of OPPO's progress bar (step_meter's tqdm; with the run's total steps, its percentage and bar)
_PROGRESS = re.compile(r"^OPPO: (\d+step |\s*\d+%\|)")
# a library's log line below ERROR (vLLM's `WARNING 12-07 22:54:23 [utils.py:539] ...`, DeepSpeed's
# `[2026-12-07 ...] [WARNING] [...]`, Ray's `2026-12-07 16:03:05,948\tINFO ...`): kept in train.log
# even where it quotes an error it recovered from ("Failed to create oneDNN linear, fallback to torch
# linear. Exception: OneDNN error")
_LIBRARY_NOTE = re.compile(r"^(?:\[[^\]]*\] |\d{4}-\d\d-\d\d [\d:,.]+\s+)?\[?(?:DEBUG|INFO|WARNING|WARN)\]?\s")


class _Follower:
    """Copies what is appended to a file from `offset` on to stdout, from a thread, until
    `stop` (which copies the rest); with `keep`, line by line what `keep` returns. On a terminal
    (`in_place`, default: stdout is one) each progress-bar line redraws the one before it, as
    tqdm does, so a run's terminal holds one bar line, not one a step."""

    def __init__(self, path: Path, offset: int, poll_s: float = 0.2, keep=None, in_place: bool | None = None):
        import threading

        self.path = path
        self.offset = offset
        self.poll_s = poll_s
        self.keep = keep
        self.in_place = sys.stdout.isatty() if in_place is None else in_place
        self._pending = ""  # with `keep`: the start of a line not yet ended
        self._bar_open = False  # in place: a progress line is drawn and not ended
        # the thread's copies and `say` from the main thread (re-entered by a second signal's handler)
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="train.log", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        import codecs

        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        with self.path.open("rb") as f:
            f.seek(self.offset)
            while True:
                done = self._done.is_set()  # read once more after stop: nothing is left behind
                data = f.read()
                if data or done:
                    self._write(text.decode(data, final=done), done)
                if done:
                    return
                if not data:
                    self._done.wait(self.poll_s)

    def say(self, message: str) -> None:
        """The launcher's own line while the run goes on (below an open progress bar)."""
        with self._lock:
            sys.stdout.write(self._line(f"openrlhf-oppo train: {message}"))
            sys.stdout.flush()

    def _write(self, chunk: str, done: bool) -> None:
        with self._lock:
            self._copy(chunk, done)

    def _copy(self, chunk: str, done: bool) -> None:
        if self.keep is None:
            sys.stdout.write(chunk)
        else:
            lines = (self._pending + chunk).split("\n")
            self._pending = "" if done else lines.pop()
            shown = [kept for kept in map(self.keep, lines) if kept is not None]
            sys.stdout.write("".join(map(self._line, shown)))
            if done and self._bar_open:
                sys.stdout.write("\n")
                self._bar_open = False
        sys.stdout.flush()

    def _line(self, line: str) -> str:
        """What the terminal gets for one shown line: in place, a progress line overwrites the
        open one (carriage return, clear to the end of the line) and stays open; another line
        first ends it. Called under the lock."""
        if self.in_place and _PROGRESS.match(line):
            opened, self._bar_open = self._bar_open, True
            return f"\r{line}\x1b[K" if opened else line
        ended = "\n" if self._bar_open else ""
        self._bar_open = False
        return f"{ended}{line}\n"


def _handle_signals(handler) -> dict:
    """Install ``handler`` for SIGTERM and SIGINT where this process handles them as Python
    does by default; the previous handlers, to restore with `_restore_signals`. A handler
    the process's owner installed stays (a test session ends on SIGTERM, and `launch`'s
    clean-up then ends the run's processes). Only the main thread can: elsewhere (a helper
    thread) nothing changes."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
    return {sig: signal.signal(sig, handler) for sig, default in defaults.items() if signal.getsignal(sig) == default}


def _restore_signals(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _log(line: str) -> None:
    print(f"openrlhf-oppo train: {line}", flush=True)


def _end_session(session_id: int, grace_s: float = 5.0) -> None:
    """End what is left in the child's session (Ray daemons, workers, vLLM)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(session_id, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(session_id, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.2)


def read_probe(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
