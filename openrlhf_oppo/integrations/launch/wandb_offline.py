"""wandb as OpenRLHF 0.11.2 users configure it, offline when no key is given.

OpenRLHF logs to wandb only when `--logger.wandb.key` is set (`PPOTrainer`:
`WandbLogger(args) if args.logger.wandb.key`) and then calls `wandb.login(key)` unless
wandb already has a key (WANDB_API_KEY). So a run that configures wandb
(`--logger.wandb.project …`) without `--logger.wandb.key` gets a placeholder key: with
WANDB_API_KEY set, wandb logs online with that key (the placeholder is never used);
without it, WANDB_MODE=offline and the run files stay under WANDB_DIR for `wandb sync`.
"""

from __future__ import annotations

from collections.abc import Mapping

PLACEHOLDER_KEY = "0" * 40  # wandb.login wants a 40-char key; it is never sent


def wandb_settings(flags: Mapping[str, object], env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """({flag: value} to add, {env var: value} to set) for a run with dotted OpenRLHF
    `flags`: nothing unless wandb is configured without `logger.wandb.key`."""
    configured = any(k.startswith("logger.wandb.") and v not in (None, False) for k, v in flags.items())
    if not configured or flags.get("logger.wandb.key"):
        return {}, {}
    return {"logger.wandb.key": PLACEHOLDER_KEY}, ({} if env.get("WANDB_API_KEY") else {"WANDB_MODE": "offline"})


def argv_flags(argv: list[str]) -> dict[str, object]:
    """The `--logger.wandb.*` flags of an argv as {dotted name: value or True}."""
    out: dict[str, object] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--logger.wandb."):
            name, _, inline = arg[2:].partition("=")
            nxt = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else True
            out[name] = inline or nxt
    return out
