"""`openrlhf-oppo train` input errors: one line naming the flag or file, exit 2,
before anything heavy starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from openrlhf_oppo.cli.main import main

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny-cpu.yaml")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--schedule", "fast", "--config", CONFIG], "--schedule: unknown schedule 'fast'; allowed: sync, async"),
        (["--schedule", "oppo", "--config", CONFIG, "--", "--train.async_enable"],
         "--train.async_enable cannot be combined with OPPO"),
        (["--schedule", "oppo", "--config", CONFIG, "--", "--vllm.enable_prefix_caching"],
         "--vllm.enable_prefix_caching cannot be combined with --oppo.staleness.keep_kv_cache true"),
        (["--schedule", "sync", "--config", "missing.yaml"], "--config: file not found: missing.yaml"),
    ],
)
def test_bad_input_is_one_line_naming_what_is_wrong(capsys, argv, expected):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err


def test_unknown_yaml_key_names_file_and_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: {batchsize: 4}\n")
    assert main(["train", "--schedule", "sync", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.yaml: unknown key 'rollout.batchsize'" in err
