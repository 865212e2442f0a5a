"""`openrlhf-oppo prepare [--assets DIR] [--force]`: build the tiny task's tokenizer,
models (actor/reference, reward, critic init) and prompt set locally (no hub)."""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="openrlhf-oppo prepare", description=__doc__.splitlines()[0])
    p.add_argument("--assets", default=None, help="output dir (default ~/.cache/openrlhf_oppo/tiny)")
    p.add_argument("--force", action="store_true", help="rebuild even if already built")
    args = p.parse_args(argv)
    from openrlhf_oppo.tasks import tiny

    assets = tiny.build(args.assets, force=args.force)
    print(f"openrlhf-oppo prepare: tiny task assets in {assets.root}")
    return 0
