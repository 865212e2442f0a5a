"""`openrlhf-oppo config`: resolve and print the OPPO settings a run would use.

    openrlhf-oppo config --config configs/tiny-cpu.yaml --oppo.delta.init 8

Reads the YAML's `oppo:` section, overlays `--oppo.*` flags, validates, and prints
the result as YAML. A bad value exits 2 with one line naming the flag.
`openrlhf-oppo config --flags-md > docs/flags.md` writes the flag reference.
"""

from __future__ import annotations

import argparse

from openrlhf_oppo import config as oppo_config


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="openrlhf-oppo config", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML file with an `oppo:` section (optional)")
    parser.add_argument("--flags-md", action="store_true", help="print docs/flags.md (every --oppo.* flag) and exit")
    oppo_config.add_cli_flags(parser)
    args = parser.parse_args(argv)
    if args.flags_md:
        print(oppo_config.flags_markdown(), end="")
        return 0
    base = oppo_config.load_yaml(args.config) if args.config else oppo_config.OppoConfig()
    cfg = oppo_config.from_cli(args, base)
    import yaml

    print(yaml.safe_dump({"oppo": oppo_config.to_dict(cfg)}, sort_keys=False), end="")
    return 0
