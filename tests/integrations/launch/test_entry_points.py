"""The CLI modules are thin entry points over integrations.launch: users keep launching
`python -m openrlhf_oppo.cli.train_ppo_ray` (e.g. under `ray job submit`) and callers of
`openrlhf_oppo.cli.train.run` keep working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _entry(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "openrlhf_oppo.cli.train_ppo_ray", *argv], capture_output=True,
                          text=True, cwd=REPO, timeout=120)


def test_the_cluster_entry_point_prints_its_help():
    proc = _entry("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m openrlhf_oppo.cli.train_ppo_ray")
    assert "--oppo.delta.init" in proc.stdout
    assert proc.stdout.rstrip().endswith("All other flags are OpenRLHF's: --help-openrlhf lists them with their "
                                         "defaults and help")


def test_the_cluster_entry_point_refuses_an_incompatible_flag_before_starting_ray():
    proc = _entry("--train.partial_rollout_enable")
    assert proc.returncode == 2
    assert proc.stderr.startswith("openrlhf_oppo.cli.train_ppo_ray: error: --train.partial_rollout_enable cannot be "
                                  "combined with OPPO (python -m openrlhf_oppo.cli.train_ppo_ray)")


def test_the_cluster_entry_point_refuses_a_bad_dataset_row_before_starting_ray(tmp_path, monkeypatch):
    """The same input checks as `openrlhf-oppo train`, before the cluster starts: a row without
    the input key is an error naming the file and row (exit 2), not a failure inside an actor."""
    from openrlhf_oppo.integrations.launch import cluster_entry, driver

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"question": "2 + 2?"}\n{"prompt": "no question key"}\n')
    started = []
    monkeypatch.setattr(driver, "run_openrlhf", lambda cfg, rest: started.append(rest))
    monkeypatch.setenv(cluster_entry.REPORT_ENV, str(tmp_path / "preflight.json"))
    argv = ["--actor.model_name_or_path", "org/some-model", "--reward.model_name_or_path", "org/some-rm",
            "--data.prompt_dataset", str(data), "--data.input_key", "question"]
    assert cluster_entry.main(argv) == 2 and started == []
    good = tmp_path / "good.jsonl"
    good.write_text('{"question": "2 + 2?"}\n')
    argv[argv.index(str(data))] = str(good)
    assert cluster_entry.main(argv) == 0 and len(started) == 1
    assert (tmp_path / "preflight.json").exists()


def test_under_openrlhf_oppo_train_the_cluster_entry_leaves_the_input_checks_to_the_launcher(tmp_path, monkeypatch):
    """`openrlhf-oppo train` checks the inputs (or is told to skip them) before it launches the
    entry: the entry's environment says so, and it does not check (nor print) them again."""
    from openrlhf_oppo import run_env
    from openrlhf_oppo.integrations.launch import cluster_entry, driver, launcher

    env = launcher.child_env(launcher.RunPaths(tmp_path / "run"), {}, None)
    assert env[run_env.SKIP_INPUT_CHECKS] == "1"
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "no question key"}\n')  # a row the checks refuse
    started = []
    monkeypatch.setattr(driver, "run_openrlhf", lambda cfg, rest: started.append(rest))
    monkeypatch.setenv(run_env.SKIP_INPUT_CHECKS, env[run_env.SKIP_INPUT_CHECKS])
    assert cluster_entry.main(["--actor.model_name_or_path", "org/m", "--reward.model_name_or_path", "org/rm",
                               "--data.prompt_dataset", str(data), "--data.input_key", "question"]) == 0
    assert len(started) == 1


def test_the_cluster_entry_point_names_the_row(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"question": "2 + 2?"}\n{"prompt": "no question key"}\n')
    proc = _entry("--actor.model_name_or_path", "org/m", "--reward.model_name_or_path", "org/rm",
                  "--data.prompt_dataset", str(data), "--data.input_key", "question")
    assert proc.returncode == 2
    assert f"error: --data.prompt_dataset {data}: row 2 (line 2) has no --data.input_key 'question'" in proc.stderr


def test_the_cli_modules_re_export_the_launch_functions():
    from openrlhf_oppo.cli import train, train_ppo_ray
    from openrlhf_oppo.integrations.launch import cluster_entry, driver, train_run

    assert train.run is train_run.run
    assert train_ppo_ray.main is cluster_entry.main
    for name in set(train_ppo_ray.__all__) - {"main"}:
        assert getattr(train_ppo_ray, name) is getattr(driver, name)
