"""The learn task's tokenizer: one token a word, so a response is one token per word plus EOS."""

from __future__ import annotations

from pathlib import Path

from openrlhf_oppo.tasks import tiny
from openrlhf_oppo.tasks.learn.task import WORDS, prompt_records


def build_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0):
    """Byte-level BPE (tiny.build_tokenizer's recipe) trained on task text, so that every
    word, after a space, is one token. Saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=tiny.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [r["input"] + " " + r["label"] for r in prompt_records(2000, seed)]
    tok.train_from_iterator(corpus, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>"
    )
    hf_tok.padding_side = "left"
    split = [w for w in WORDS if len(hf_tok.encode(" " + w)) != 1]
    if split:
        raise RuntimeError(f"tokenizer splits words {split}: raise vocab_size")
    hf_tok.save_pretrained(out_dir)
    return hf_tok
