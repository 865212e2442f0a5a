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
    assert proc.stdout.rstrip().endswith("All other flags are OpenRLHF's: python -m openrlhf.cli.train_ppo_ray --help")


def test_the_cluster_entry_point_refuses_an_incompatible_flag_before_starting_ray():
    proc = _entry("--train.async_enable")
    assert proc.returncode == 2
    assert proc.stderr.startswith("openrlhf_oppo.cli.train_ppo_ray: error: --train.async_enable cannot be combined "
                                  "with OPPO (python -m openrlhf_oppo.cli.train_ppo_ray)")


def test_the_cli_modules_re_export_the_launch_functions():
    from openrlhf_oppo.cli import train, train_ppo_ray
    from openrlhf_oppo.integrations.launch import driver, train_run

    assert (train.main, train.run) == (train_run.main, train_run.run)
    for name in train_ppo_ray.__all__:
        assert getattr(train_ppo_ray, name) is getattr(driver, name)
