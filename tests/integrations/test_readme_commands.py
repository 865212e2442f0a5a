"""The README's GPU cluster example is a command a user can paste: it parses with OpenRLHF
0.11.2's real flags plus OPPO's, and names no flag OPPO refuses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
ENTRY = "openrlhf_oppo.cli.train_ppo_ray"


def _cluster_example() -> list[str]:
    text = README.read_text()
    section = text[text.index("## On a GPU cluster"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    argv = shlex.split(block.replace("\\\n", " ").replace('"$WANDB_API_KEY"', "key"))
    return argv[argv.index(ENTRY) + 1:]


def test_readme_gpu_example_parses_with_openrlhfs_and_oppos_parsers_and_is_not_refused():
    from openrlhf_oppo.cli import train_ppo_ray
    from openrlhf_oppo.integrations import openrlhf_flags

    argv = _cluster_example()
    assert "--reward.model_name_or_path" in argv and "--oppo.delta.init" in argv
    cfg, rest = train_ppo_ray.parse(argv)
    train_ppo_ray.check_flags(rest, cfg)
    values, unknown = openrlhf_flags.resolve(train_ppo_ray.openrlhf_argv(rest, cfg))
    assert unknown == [], f"flags OpenRLHF 0.11.2 does not know: {unknown}"
    assert values["reward.model_name_or_path"] == "OpenRLHF/Llama-3-8b-rm-700k"  # a hub id: resolved as OpenRLHF does
    assert train_ppo_ray.streams_rewards(rest, cfg)
