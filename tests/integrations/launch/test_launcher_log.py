"""`launcher.launch` keeps what the run prints in RUN_DIR/train.log and shows it on stdout
(a real child process, a stand-in entry module: no Ray, no OpenRLHF)."""

from __future__ import annotations

from openrlhf_oppo.integrations.launch import launcher

ENTRY = '''
import sys
print("step 0 réward 0.5", flush=True)
sys.stdout.buffer.write("ünïcode split across writes\\n".encode()[:3]); sys.stdout.flush()
sys.stdout.buffer.write("ünïcode split across writes\\n".encode()[3:]); sys.stdout.flush()
print("Traceback (most recent call last):", file=sys.stderr)
print("ValueError: bad row 7", file=sys.stderr)
sys.exit(3)
'''


def _launch(tmp_path, monkeypatch, fresh=True):
    (tmp_path / "pkg").mkdir(exist_ok=True)
    (tmp_path / "pkg" / "fake_entry.py").write_text(ENTRY)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "pkg"))
    paths = launcher.RunPaths(tmp_path / "run")
    return launcher.launch({}, paths, [], None, timeout_s=120, entry_module="fake_entry", fresh=fresh)


def test_the_run_log_holds_stdout_and_stderr_and_is_echoed(tmp_path, monkeypatch, capsys):
    result = _launch(tmp_path, monkeypatch)
    assert result.returncode == 3
    log = result.paths.log.read_text()
    lines = log.splitlines()
    assert lines[0].startswith("openrlhf-oppo train: -m fake_entry")
    assert lines[1:] == ["step 0 réward 0.5", "ünïcode split across writes",
                         "Traceback (most recent call last):", "ValueError: bad row 7"]
    assert "\n".join(lines[1:]) + "\n" in capsys.readouterr().out  # shown as it came, split character whole


def test_a_restart_appends_to_the_log_and_a_fresh_run_starts_it_anew(tmp_path, monkeypatch):
    _launch(tmp_path, monkeypatch)
    result = _launch(tmp_path, monkeypatch, fresh=False)
    assert result.paths.log.read_text().count("ValueError: bad row 7") == 2
    result = _launch(tmp_path, monkeypatch, fresh=True)
    assert result.paths.log.read_text().count("ValueError: bad row 7") == 1


RUN_LOG = [  # as OpenRLHF's Ray pipeline writes train.log (colours, actor prefixes, tqdm redraws)
    "openrlhf-oppo train: input checks: 256 rows in 1 file(s)",
    "\x1b[36m(OppoRolloutActor pid=2336)\x1b[0m INFO 11-26 06:42:16 [model.py:684] Resolved architecture",
    "\x1b[36m(OppoRolloutActor pid=2336)\x1b[0m (Worker pid=2693) WARNING 11-26 [cpu_worker.py:127] libtcmalloc",
    "\x1b[36m(OppoPPOTrainerImpl pid=3391)\x1b[0m INFO ppo_trainer.py:551] ✨ Global step 4: {'critic_loss': 0.005}",
    "\x1b[36m(OppoPPOTrainerImpl pid=3391)\x1b[0m \rOPPO: 4step [00:23, 23.25s/step]\rOPPO: 4step [00:23, reward=0.008]"
    "\rEpisode [1/1]: 100%|##########| 16/16",
    "\x1b[36m(PolicyModelActor pid=3157)\x1b[0m Train epoch [1/1]:   0%|          | 0/2 [00:00<?, ?it/s]",
    "\x1b[36m(OppoPPOTrainerImpl pid=3391)\x1b[0m Traceback (most recent call last):",
    '\x1b[36m(OppoPPOTrainerImpl pid=3391)\x1b[0m   File "generator.py", line 7, in step',
    "\x1b[36m(OppoPPOTrainerImpl pid=3391)\x1b[0m RuntimeError: OPPO step 3: sample 9 failed",
    # library lines below ERROR that quote an error they recovered from stay in the log (a CPU without AMX)
    "\x1b[36m(OppoRolloutActor pid=2336)\x1b[0m WARNING 12-07 22:54:23 [utils.py:539] Failed to create oneDNN linear, "
    "fallback to torch linear. Exception: OneDNN error: could not create a primitive",
    "[2026-12-07 22:53:34,442] [WARNING] [engine.py:12:load] retrying after error",
    "2026-12-07 16:03:05,948\tINFO worker.py:2003 -- an earlier error was cleared",
    "\x1b[36m(OppoRolloutActor pid=2336)\x1b[0m ERROR 12-07 22:54:23 [core.py:9] EngineCore failed",
]


def test_a_quiet_run_shows_oppos_lines_and_errors_and_keeps_the_rest_in_the_log():
    shown = list(map(launcher.QuietLines(), RUN_LOG))
    assert [i for i, line in enumerate(shown) if line is not None] == [0, 4, 6, 7, 8, 12]
    assert shown[4] == "OPPO: 4step [00:23, reward=0.008]"  # OPPO's bar's last redraw, not OpenRLHF's after it
    assert shown[8] == "RuntimeError: OPPO step 3: sample 9 failed"  # without the actor's colours and prefix


def test_the_quiet_follower_shows_whole_lines_only_and_the_last_one_at_the_end(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text("")
    follower = launcher._Follower(log, 0, poll_s=0.01, keep=launcher.QuietLines())
    follower._write("INFO noise\nOPPO: 1st", done=False)
    assert capsys.readouterr().out == ""  # the progress line has not ended yet
    follower._write("ep\nWARNING noise\nValueError: bad row", done=True)
    assert capsys.readouterr().out == "OPPO: 1step\nValueError: bad row\n"


def test_on_a_terminal_the_progress_bar_redraws_one_line(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text("")
    follower = launcher._Follower(log, 0, poll_s=0.01, keep=launcher.QuietLines(), in_place=True)
    follower._write("OPPO: 1step [00:01, reward=1]\nINFO noise\nOPPO: 2step [00:02, reward=2]\n", done=False)
    assert capsys.readouterr().out == "OPPO: 1step [00:01, reward=1]\rOPPO: 2step [00:02, reward=2]\x1b[K"
    follower._write("OPPO streaming reward actor: loaded\nOPPO: 3step [00:03, reward=3]\n", done=False)
    # a message ends the bar's line and takes its own; the bar starts again below it
    assert capsys.readouterr().out == "\nOPPO streaming reward actor: loaded\nOPPO: 3step [00:03, reward=3]"
    follower._write("openrlhf-oppo train: 3 steps", done=True)
    assert capsys.readouterr().out == "\nopenrlhf-oppo train: 3 steps\n"
    follower._write("OPPO: 4step [00:04, reward=4]\n", done=False)
    follower.say("SIGINT: the current step ends")  # the launcher's own line goes below the bar
    assert capsys.readouterr().out == ("OPPO: 4step [00:04, reward=4]\n"
                                       "openrlhf-oppo train: SIGINT: the current step ends\n")
    follower._write("OPPO: 5step [00:05, reward=5]\n", done=True)  # the run's end ends an open bar
    assert capsys.readouterr().out == "OPPO: 5step [00:05, reward=5]\n"
    # with the run's total steps the bar has a percentage, a bar and an ETA, and still redraws in place
    follower._write("OPPO:  50%|█████     | 2/4 [00:10<00:10]\nOPPO:  75%|███████▌  | 3/4 [00:15<00:05]\n", done=True)
    assert capsys.readouterr().out == ("OPPO:  50%|█████     | 2/4 [00:10<00:10]\rOPPO:  75%|███████▌  | 3/4 "
                                       "[00:15<00:05]\x1b[K\n")


def test_a_quiet_run_shows_a_whole_ray_traceback_and_nothing_after_it():
    """A stop on request ends in Ray's traceback of the trainer's exception: its message (where the
    checkpoint is and how to resume) is shown, though neither it nor its type says Error."""
    prefix = "\x1b[36m(OppoPPOTrainerImpl pid=3391)\x1b[0m "
    log = ["Traceback (most recent call last):",
           '  File "/ray/_private/worker.py", line 1023, in get_objects',
           "ray.exceptions.RayTaskError(StopRequested): ray::OppoPPOTrainerImpl.fit() (pid=3391)",
           prefix + '  File "/openrlhf_oppo/integrations/runtime/trainer.py", line 147, in save_logs',
           "openrlhf_oppo.integrations.runtime.trainer.StopRequested: OPPO: stopped on request after step 2",
           "INFO 11-26 ray shutting down",
           "openrlhf-oppo train: stopped on SIGTERM (exit 143)"]
    shown = list(map(launcher.QuietLines(), log))
    assert shown[:5] == [line.replace(prefix, "") for line in log[:5]]
    assert shown[5:] == [None, log[6]]


def test_a_line_of_another_process_inside_a_traceback_does_not_end_it():
    """Ray writes every actor's output into the driver's log as it comes: an actor's progress bar
    can land in the middle of the driver's traceback (seen in a run stopped on SIGTERM, train.log
    as written), and the exception's message after it must still be shown."""
    log = ["Traceback (most recent call last):",
           '  File "/ray/_private/worker.py", line 2980, in get',
           "    \x1b[36m(OppoPPOTrainerImpl pid=464)\x1b[0m ",
           "Episode [1/1]:  75%|███████▌  | 12/16 [00:36<00:12,  3.04s/it]",
           "values, debugger_breakpoint = worker.get_objects(",
           '  File "/ray/_private/worker.py", line 1023, in get_objects',
           "ray.exceptions.RayTaskError(StopRequested): \x1b[36mray::OppoPPOTrainerImpl.fit()\x1b[39m (pid=464)",
           "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
           '  File "/openrlhf_oppo/integrations/runtime/trainer.py", line 147, in save_logs_and_checkpoints',
           "openrlhf_oppo.integrations.runtime.trainer.StopRequested: OPPO: stopped on request after step 2",
           "\x1b[36m(CriticModelActor pid=369)\x1b[0m /ray/cloudpickle.py:1544: ZeroCopyTensorsWarning: read-only",
           "openrlhf-oppo train: stopped on SIGTERM (exit 143)"]
    shown = list(map(launcher.QuietLines(), log))
    assert shown[3] is None and shown[4] is None  # the actor's bar and the broken source line stay in the log
    assert shown[9] == log[9] and shown[6].startswith("ray.exceptions.RayTaskError(StopRequested)")
    assert shown[10] is None and shown[11] == log[11]  # the traceback ended with its message
