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
