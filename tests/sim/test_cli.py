"""`openrlhf-oppo simulate`: error messages name the flag and what is allowed; a small run prints the table."""

from __future__ import annotations

import pytest

from openrlhf_oppo.cli.main import main


def run(capsys, *argv):
    rc = main(["simulate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--preset", "nope"], ["--preset", "unknown preset 'nope'", "paper-7b-h200", "cpu-longtail"]),
        (
            ["--preset", "cpu-longtail", "--set", "workload.nope=1"],
            ["--set workload.nope", "allowed", "workload.batch_groups"],
        ),
        (["--preset", "cpu-longtail", "--set", "nope=1"], ["--set nope", "allowed", "workload"]),
        (
            ["--preset", "cpu-longtail", "--set", "workload.batch_groups=abc"],
            ["--set workload.batch_groups", "integer"],
        ),
        (["--preset", "cpu-longtail", "--set", "delta.max=99"], ["--set delta.max", "workload.batch_groups (8)"]),
        (["--preset", "cpu-longtail", "--set", "delta.init=-1"], ["--oppo.delta.init", "integer >= 0"]),
        (["--preset", "paper-7b-h200", "--set", "hardware=tpu"], ["hardware", "unknown hardware 'tpu'", "h200"]),
        (["--preset", "cpu-longtail", "--set", "lengths.kind=normal"], ["--set lengths.kind", "lognormal"]),
        (["--preset", "cpu-longtail", "--schedules", "sync", "fast"], ["--schedules", "unknown fast", "oppo-async-bg"]),
        (["--preset", "cpu-longtail", "--sweep", "delta.max="], ["--sweep", "no values"]),
        (
            ["--preset", "cpu-longtail", "--sweep", "delta.max=0,4", "--sweep", "workload.steps=6"],
            ["--sweep", "as many values"],
        ),
        (["--preset", "cpu-longtail", "--set", "workload"], ["--set", "key=value"]),
    ],
)
def test_bad_input_is_an_error_naming_the_flag_and_what_is_allowed(capsys, argv, words):
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    for word in words:
        assert word in err, err


def test_a_small_simulation_prints_the_bench_table_and_writes_timelines(capsys, tmp_path):
    rc, out, _ = run(
        capsys,
        "--preset",
        "cpu-longtail",
        "--set",
        "workload.steps=6",
        "workload.seeds=2",
        "--no-plot",
        "--output",
        str(tmp_path),
    )
    assert rc == 0
    assert "x sync" in out and "oppo-async-bg" in out and "util rollout" in out
    assert (tmp_path / "oppo" / "timeline" / "sim-0.jsonl").exists() and (tmp_path / "summary.json").exists()


def test_a_sweep_prints_one_row_per_value(capsys, tmp_path):
    rc, out, _ = run(
        capsys,
        "--preset",
        "cpu-longtail",
        "--set",
        "workload.steps=6",
        "workload.seeds=1",
        "--sweep",
        "delta.max=0,8",
        "--no-plot",
        "--output",
        str(tmp_path),
    )
    assert rc == 0
    assert "note: delta.max=0 is below the preset's delta.init (4)" in out
    rows = [line for line in out.splitlines() if line.startswith(("0 ", "8 "))]
    assert len(rows) == 2
