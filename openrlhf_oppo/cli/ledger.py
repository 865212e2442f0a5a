"""`openrlhf-oppo ledger check RUN_DIR...`: prove that every prompt group a run admitted
was trained exactly once or is still held, across its crashes and restarts.

Reads ``RUN_DIR/ledger.jsonl`` (written by the OPPO schedules) and replays it: steps
rolled back by a restart from a checkpoint leave the history, the groups held at each
restart must be those the log held at that checkpoint's step. Exit 0 when the ledger
holds, 1 when it does not (each problem printed), 2 on a missing or unreadable file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from openrlhf_oppo.core import ledger


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="openrlhf-oppo ledger", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="check RUN_DIR/ledger.jsonl (or a ledger file)")
    check.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    args = parser.parse_args(argv)
    worst = 0
    for run in args.runs:
        try:
            report = ledger.check_run(run)
        except (FileNotFoundError, ValueError) as exc:
            print(f"{run}: {exc}")
            worst = max(worst, 2)
            continue
        print(f"{run}: {report.summary()}")
        worst = max(worst, 0 if report.ok else 1)
    return worst
