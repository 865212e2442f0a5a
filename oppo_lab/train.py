"""`python -m oppo_lab train|schedules|simulate`: the product's `openrlhf-oppo train`, `bench schedules` and `simulate`
with the ablation schedules (`oppo_lab.schedules`) offered beside the product's."""

from __future__ import annotations

from oppo_lab import schedules  # noqa: F401 (registers the ablations)


def main(argv: list[str]) -> int:
    from openrlhf_oppo.cli import train

    return train.main(argv)


def bench_main(argv: list[str]) -> int:
    from openrlhf_oppo.bench import schedules as bench_schedules

    return bench_schedules.main(argv)


def simulate_main(argv: list[str]) -> int:
    from openrlhf_oppo.sim import cli

    return cli.main(argv)
