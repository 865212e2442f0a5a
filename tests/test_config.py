"""OppoConfig: validation names the field, YAML and CLI flags come from the fields."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from openrlhf_oppo import config as C


def test_every_field_has_help():
    helps = C.field_help()
    assert len(helps) >= 20
    assert all(h.strip() for h in helps.values())


@pytest.mark.parametrize(
    "data, flag",
    [
        ({"delta": {"min": 5, "max": 2, "init": 2}}, "--oppo.delta.min"),
        ({"delta": {"init": 20, "max": 16}}, "--oppo.delta.init"),
        ({"chunk": {"size_tokens": 0}}, "--oppo.chunk.size_tokens"),
        ({"chunk": {"candidates": []}}, "--oppo.chunk.candidates"),
        (
            {"chunk": {"adaptive": True, "candidates": [1, 2, 3], "trial_steps": 2, "period_steps": 5}},
            "--oppo.chunk.period_steps",
        ),
        ({"staleness": {"max_deferral_steps": 0}}, "--oppo.staleness.max_deferral_steps"),
        ({"staleness": {"correction": "foo"}}, "--oppo.staleness.correction"),
        ({"staleness": {"carried_in_training": "pause"}}, "--oppo.staleness.carried_in_training"),
        ({"staleness": {"carried_in_training": "hold", "max_policy_lag": 2}}, "--oppo.staleness.carried_in_training"),
        ({"delta": {"rule": "eq5"}}, "--oppo.delta.rule"),
        ({"delta": {"init": "many"}}, "--oppo.delta.init"),
        ({"streaming": {"enable": "maybe"}}, "--oppo.streaming.enable"),
    ],
)
def test_bad_values_name_the_flag(data, flag):
    with pytest.raises(ValueError, match=flag.replace(".", r"\.")):
        C.from_dict(data)


def test_unknown_yaml_key_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("oppo:\n  delta:\n    initial: 3\n")
    with pytest.raises(ValueError, match=r"oppo\.delta\.initial.*allowed: .*init"):
        C.load_yaml(str(path))


def test_yaml_loads_nested_values_and_ignores_other_sections(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(
        textwrap.dedent("""
        actor: {lr: 1e-6}
        oppo:
          delta: {init: 3, max: 6, rule: alg1}
          chunk: {size_tokens: 64, candidates: [32, 64]}
    """)
    )
    cfg = C.load_yaml(str(path))
    assert (cfg.delta.init, cfg.delta.max, cfg.delta.rule) == (3, 6, "alg1")
    assert cfg.chunk.candidates == (32, 64)
    assert cfg.staleness == C.StalenessConfig()


def test_cli_flags_generated_from_fields_overlay_yaml():
    parser = argparse.ArgumentParser()
    C.add_cli_flags(parser)
    args = parser.parse_args(
        ["--oppo.delta.init", "8", "--oppo.chunk.candidates", "64", "128", "--oppo.streaming.critic", "true"]
    )
    base = C.from_dict({"delta": {"max": 10}})
    cfg = C.from_cli(args, base)
    assert cfg.delta.init == 8 and cfg.delta.max == 10
    assert cfg.chunk.candidates == (64, 128)
    assert cfg.streaming.critic is True
    # every leaf field has a flag
    flags = {a.dest for a in parser._actions}
    assert {f"oppo.{name}" for name in C.field_help()} <= flags


def test_cli_choice_flags_reject_bad_values():
    parser = argparse.ArgumentParser()
    C.add_cli_flags(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--oppo.delta.rule", "eq9"])


def test_to_dict_round_trips():
    cfg = C.from_dict({"delta": {"init": 1}, "chunk": {"candidates": [8, 16]}})
    assert C.from_dict(C.to_dict(cfg)) == cfg


def test_config_is_frozen():
    cfg = C.OppoConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.delta = C.DeltaConfig()  # type: ignore[misc]


def test_streaming_scorers_follow_flags():
    assert C.StreamingConfig().scorers() == ("reward",)
    assert C.StreamingConfig(reference=True).scorers() == ("reward", "reference")
    assert C.StreamingConfig(critic=True, reference=False).scorers() == ("reward", "critic")
    assert C.StreamingConfig(enable=False).scorers() == ()


def test_the_simulators_projections_are_not_settings_of_a_run():
    for projection in ("reference_actors", "experience_ahead"):
        with pytest.raises(ValueError, match=f"streaming.{projection}"):
            C.from_dict({"streaming": {projection: True}})


def test_bad_config_file_exits_with_one_line_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("oppo:\n  delta: {min: 4, max: 2, init: 2}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "openrlhf_oppo.cli.main", "config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--oppo.delta.min" in lines[0], proc.stderr


def test_config_command_prints_resolved_yaml(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("oppo:\n  delta: {init: 2}\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "openrlhf_oppo.cli.main",
            "config",
            "--config",
            str(path),
            "--oppo.chunk.size_tokens",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    import yaml

    doc = yaml.safe_load(proc.stdout)["oppo"]
    assert doc["delta"]["init"] == 2 and doc["chunk"]["size_tokens"] == 32


def test_unknown_yaml_key_exits_with_one_line_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("oppo:\n  chunk: {size: 3}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "openrlhf_oppo.cli.main", "config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "oppo.chunk.size" in proc.stderr


def test_docs_flags_md_is_generated_from_the_config():
    """docs/flags.md is what `openrlhf-oppo config --flags-md` prints today, and it lists
    every flag with its default."""
    path = Path(__file__).resolve().parents[1] / "docs" / "flags.md"
    assert path.read_text() == C.flags_markdown(), (
        "docs/flags.md is stale: run `openrlhf-oppo config --flags-md > docs/flags.md`"
    )
    for flag in C.field_help():
        assert f"| `--oppo.{flag}` |" in path.read_text()
