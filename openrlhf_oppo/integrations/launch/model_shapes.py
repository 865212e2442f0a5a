"""The shape of each model the memory check counts: its local `config.json` where there is one,
else the copy of it in Hugging Face's local cache, else the shipped table below (no download).

The table holds the models the shipped presets and docs name (`configs/cluster/*.yaml`, the
README's GPU example), copied from each model's published `config.json` on the Hugging Face hub:
`hidden_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `head_dim`
(hidden / heads where the file has none), `intermediate_size`, `vocab_size`,
`tie_word_embeddings`, `max_position_embeddings`. A reward model or critic built on a base keeps
the base's shape (its one-wide score head is left out of the count).

A model that is in none of the three cannot be counted: the memory check then says the layout is
uncounted (`memory_check`), and pointing the flag at a local checkpoint (or adding a row here)
counts it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrlhf_oppo import footprint

TABLE = "the shipped table (openrlhf_oppo/integrations/launch/model_shapes.py)"


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer (GQA attention, SwiGLU MLP: the Qwen2 and Llama families)."""

    hidden: int  # hidden_size
    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int  # per attention head
    intermediate: int  # the MLP's width (intermediate_size)
    vocab: int  # vocab_size
    tied: bool  # tie_word_embeddings: the LM head is the embedding
    max_positions: int | None  # max_position_embeddings (None: not stated)

    def params(self, lm_head: bool = True) -> int:
        """Parameters (`footprint.decoder_params`); `lm_head` False: a critic's or reward model's
        one-wide head in place of the LM head (a tied model never counts one)."""
        return footprint.decoder_params(self.layers, self.hidden, self.heads, self.kv_heads, self.intermediate,
                                        self.vocab, lm_head and not self.tied, self.head_dim)

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention and MLP; norms left out)."""
        return footprint.decoder_params(1, self.hidden, self.heads, self.kv_heads, self.intermediate, 0,
                                        False, self.head_dim)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token takes over all layers."""
        return footprint.kv_bytes(self.layers, self.kv_heads, self.head_dim, dtype_bytes)


def _qwen2_5(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int, tied: bool,
             max_positions: int) -> Shape:
    return Shape(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=hidden // heads,
                 intermediate=intermediate, vocab=vocab, tied=tied, max_positions=max_positions)


LLAMA_3_8B = Shape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256,
                   tied=False, max_positions=8192)
QWEN2_5_MATH_7B = _qwen2_5(3584, 28, 28, 4, 18944, 152064, False, 4096)
QWEN2_5_MATH_72B = _qwen2_5(8192, 80, 64, 8, 29568, 152064, False, 4096)

SHAPES: dict[str, Shape] = {
    "Qwen/Qwen2.5-1.5B-Instruct": _qwen2_5(1536, 28, 12, 2, 8960, 151936, True, 32768),
    "Qwen/Qwen2.5-3B-Instruct": _qwen2_5(2048, 36, 16, 2, 11008, 151936, True, 32768),
    "Qwen/Qwen2.5-7B-Instruct": _qwen2_5(3584, 28, 28, 4, 18944, 152064, False, 32768),
    "Qwen/Qwen2.5-72B-Instruct": _qwen2_5(8192, 80, 64, 8, 29568, 152064, False, 32768),
    # AceMath reward models: Qwen2.5-Math-7B / -72B-Instruct with a score head
    "nvidia/AceMath-7B-RM": QWEN2_5_MATH_7B,
    "nvidia/AceMath-72B-RM": QWEN2_5_MATH_72B,
    # OpenRLHF's Llama-3-8B SFT policy and reward model (Meta-Llama-3-8B's shape)
    "OpenRLHF/Llama-3-8b-sft-mixture": LLAMA_3_8B,
    "OpenRLHF/Llama-3-8b-rm-700k": LLAMA_3_8B,
}


def from_config(config: dict[str, Any]) -> Shape:
    """The shape a `config.json` states (its `text_config` for a multimodal model). KeyError names a
    field it lacks."""
    config = config.get("text_config") or config
    heads = config["num_attention_heads"]
    return Shape(hidden=config["hidden_size"], layers=config["num_hidden_layers"], heads=heads,
                 kv_heads=config.get("num_key_value_heads") or heads,
                 head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                 intermediate=config["intermediate_size"], vocab=config["vocab_size"],
                 tied=bool(config.get("tie_word_embeddings", False)),
                 max_positions=config.get("max_position_embeddings"))


def _cached_config(repo_id: str) -> Path | None:
    """The hub model's config.json in Hugging Face's local cache, if a run downloaded it before."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # not a repository id (a path, a typo): nothing cached under it
        return None
    return Path(found) if isinstance(found, str) else None


def find(name: str) -> tuple[Shape | None, str]:
    """(shape, where it came from) of a `--*.model_name_or_path`; (None, why) when nothing states it."""
    local = Path(os.path.expanduser(name)) / "config.json"
    where = None
    if local.is_file():
        where = local
    elif not os.path.isdir(os.path.expanduser(name)):
        where = _cached_config(name)
    if where is not None:
        try:
            return from_config(json.loads(where.read_text())), str(where)
        except (KeyError, ValueError, TypeError) as exc:
            return None, f"{where} states no decoder shape ({exc!r} missing or malformed)"
    if name in SHAPES:
        return SHAPES[name], TABLE
    if os.path.isdir(os.path.expanduser(name)):
        return None, f"{name} has no config.json"
    return None, f"not a local checkpoint, not in Hugging Face's local cache, not in {TABLE}"
