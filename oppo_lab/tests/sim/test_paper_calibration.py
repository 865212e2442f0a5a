"""`openrlhf-oppo simulate` on a preset with the paper's ablation figures, the ablation schedules
registered: it prints the calibration table (sync, oppo-intra, oppo-inter, oppo against the paper's
speedups) and writes it to summary.json."""

from __future__ import annotations

import json

from openrlhf_oppo.cli.main import main
from oppo_lab import schedules  # noqa: F401 (registers the ablations)


def test_a_paper_preset_prints_the_calibration_table(capsys, tmp_path):
    rc = main([
        "simulate",
        "--preset",
        "paper-3b-a100",
        "--set",
        "workload.steps=6",
        "workload.seeds=1",
        "workload.batch_groups=32",
        "delta.max=16",
        "paper.intra=1.2",
        "--no-plot",
        "--output",
        str(tmp_path),
    ])
    out = capsys.readouterr().out
    assert rc == 0
    assert "calibration against the paper" in out and "verdict" in out and "2.06" in out
    # ±20 % of 1.20 holds 1.00 (no effect): that row gives no verdict; 2.06 and 2.50 decide
    rows = {r["ablation"]: r for r in json.loads((tmp_path / "summary.json").read_text())["calibration"]}
    assert rows["intra"]["ok"] is None and "no verdict" in out
    assert rows["inter"]["ok"] is not None and rows["both"]["ok"] is not None
