"""`openrlhf-oppo bench scorer`: streamed (chunked) vs one-shot scoring time.

Scores N sequences (prompt + response, 256-1024 tokens by default) with a
randomly initialised fp32 model built from a config in code (no hub):

- one-shot: the model's own batched forward over whole sequences (sorted by
  length, micro-batches of at most `--max-batch-tokens` padded tokens);
- streamed at chunk size C: every sequence is opened, then each round hands
  the next C response tokens of every unfinished sequence to `extend_many`
  (or `finish_many` for the last chunk), as the actor's decode loop would.

It prints one row per mode and the ratio streamed / one-shot. The ratio is the
prefill overhead streaming adds (smaller forwards, padding, cache copies); in
OPPO that work overlaps with decoding, so only the last chunk is on the
critical path. Also checks streamed results equal one-shot ones.

    python -m openrlhf_oppo.bench.scorer            # or: openrlhf-oppo bench scorer
    python -m openrlhf_oppo.bench.scorer --hidden 256 --layers 2 --num-seqs 16
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from openrlhf_oppo.models.streaming import StreamingReferenceScorer, StreamingRewardScorer


@dataclass(frozen=True)
class BenchSequence:
    """One scored sequence: prompt then response token ids."""

    prompt_ids: list[int]
    response_ids: list[int]


@dataclass(frozen=True)
class BenchRow:
    """One measured mode."""

    mode: str  # "one-shot" or "C=<chunk_size_tokens>"
    time_s: float  # fastest of the repeats
    forward_calls: int
    max_abs_diff: float  # vs the one-shot results (0 for one-shot itself)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="openrlhf-oppo bench scorer", description=__doc__.split("\n\n")[0])
    p.add_argument("--scorer", choices=("reward", "reference"), default="reward", help="which scorer to time")
    p.add_argument("--num-seqs", type=int, default=64, help="sequences scored per mode")
    p.add_argument("--min-len", type=int, default=256, help="shortest sequence (prompt + response), tokens")
    p.add_argument("--max-len", type=int, default=1024, help="longest sequence (prompt + response), tokens")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"),
                   help="prompt length range, tokens")
    p.add_argument("--chunk-sizes", type=str, default="16,64,128,256,512", help="comma-separated C values, tokens")
    p.add_argument("--hidden", type=int, default=512, help="model hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--heads", type=int, default=8, help="attention heads (head_dim = hidden / heads)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA, as Qwen2)")
    p.add_argument("--intermediate", type=int, default=1408, help="MLP intermediate size")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    # On CPU one forward of 4 x 1024 tokens is as fast per token as 32 x 1024, and masked
    # attention over big padded batches is slower: 8192 is the better setting for both modes.
    p.add_argument("--max-batch-tokens", type=int, default=8192,
                   help="most padded tokens (batch x padded length) in one forward, both modes")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per mode, interleaved across modes (the fastest is reported: on a shared "
                        "machine other processes only ever add time)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 1 <= args.prompt_len[0] <= args.prompt_len[1] < args.min_len <= args.max_len:
        p.error("need 1 <= prompt MIN <= prompt MAX < --min-len <= --max-len")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("--hidden must divide by --heads and --heads by --kv-heads")
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=max(2048, args.max_len),
        num_labels=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    cls = Qwen2ForSequenceClassification if args.scorer == "reward" else Qwen2ForCausalLM
    return cls(config).float().eval()


def make_sequences(args: argparse.Namespace) -> list[BenchSequence]:
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.num_seqs):
        total = rng.randint(args.min_len, args.max_len)
        prompt = rng.randint(*args.prompt_len)
        # ids from 1: 0 is the pad id, which transformers' reward pooling skips
        out.append(BenchSequence([rng.randrange(1, args.vocab) for _ in range(prompt)],
                                 [rng.randrange(1, args.vocab) for _ in range(total - prompt)]))
    return out


@torch.inference_mode()
def score_one_shot(model, seqs: list[BenchSequence], scorer: str, max_batch_tokens: int) -> list:
    """The model's own batched forward (right padding + attention mask), micro-batched by length."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].prompt_ids) + len(seqs[i].response_ids))
    results: list = [None] * len(seqs)
    start = 0
    while start < len(order):
        end = start + 1
        # sorted ascending: the batch's padded length is its last sequence's length
        while end < len(order) and (end - start + 1) * _len(seqs[order[end]]) <= max_batch_tokens:
            end += 1
        batch = order[start:end]
        width = _len(seqs[batch[-1]])
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            toks = seqs[i].prompt_ids + seqs[i].response_ids
            ids[row, : len(toks)] = torch.tensor(toks)
            mask[row, : len(toks)] = 1
        out = model(input_ids=ids, attention_mask=mask)
        for row, i in enumerate(batch):
            if scorer == "reward":
                results[i] = float(out.logits[row, 0])
            else:
                p, n = len(seqs[i].prompt_ids), len(seqs[i].response_ids)
                logp = torch.log_softmax(out.logits[row, p - 1 : p + n - 1].float(), dim=-1)
                results[i] = logp.gather(-1, torch.tensor(seqs[i].response_ids)[:, None]).squeeze(-1).tolist()
        start = end
    return results


def _len(seq: BenchSequence) -> int:
    return len(seq.prompt_ids) + len(seq.response_ids)


def score_streamed(model, seqs: list[BenchSequence], scorer_kind: str, chunk_size_tokens: int,
                   max_batch_tokens: int) -> tuple[list, int]:
    """Open all, then rounds of `extend_many` / `finish_many` with C response tokens per sequence."""
    cls = StreamingRewardScorer if scorer_kind == "reward" else StreamingReferenceScorer
    scorer = cls(model, max_batch_tokens=max_batch_tokens)
    for i, s in enumerate(seqs):
        scorer.open(i, s.prompt_ids)
    results: list = [None] * len(seqs)
    offset = 0
    active = list(range(len(seqs)))
    while active:
        extend, finish = {}, {}
        for i in active:
            chunk = seqs[i].response_ids[offset : offset + chunk_size_tokens]
            (finish if offset + chunk_size_tokens >= len(seqs[i].response_ids) else extend)[i] = chunk
        if extend:
            scorer.extend_many(extend)
        if finish:
            for i, r in scorer.finish_many(finish).items():
                results[i] = r
                scorer.drop(i)
        active = list(extend)
        offset += chunk_size_tokens
    return results, scorer.stats().forward_calls


def _max_abs_diff(a: list, b: list) -> float:
    diffs = [0.0]
    for x, y in zip(a, b):
        if isinstance(x, list):
            diffs.extend(abs(u - v) for u, v in zip(x, y))
        else:
            diffs.append(abs(x - y))
    return max(diffs)


def _print_row(row: BenchRow, base_s: float) -> None:
    calls = "" if row.forward_calls < 0 else str(row.forward_calls)
    print(f"{row.mode:>10} {row.time_s:8.2f} {calls:>9} {row.time_s / base_s:7.2f} {row.max_abs_diff:10.1e}",
          flush=True)


def main(argv: list[str]) -> int:
    """Run the benchmark; print the table; return 0 (1 if streamed results differ from one-shot)."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    chunk_sizes = [int(c) for c in args.chunk_sizes.split(",") if c.strip()]
    model = build_model(args)
    seqs = make_sequences(args)
    n_params = sum(p.numel() for p in model.parameters())
    total_tokens = sum(_len(s) for s in seqs)
    print(f"scorer={args.scorer}  model: Qwen2 fp32 hidden={args.hidden} layers={args.layers} heads={args.heads}"
          f"/{args.kv_heads} params={n_params / 1e6:.1f}M  torch threads={torch.get_num_threads()}")
    print(f"{len(seqs)} sequences, {args.min_len}-{args.max_len} tokens ({total_tokens} in all), "
          f"max_batch_tokens={args.max_batch_tokens}, repeats={args.repeats}", flush=True)

    # Warm-up: first forwards pay one-off allocation / kernel selection costs.
    score_one_shot(model, seqs[:2], args.scorer, args.max_batch_tokens)
    score_streamed(model, seqs[:2], args.scorer, 128, args.max_batch_tokens)

    modes = ["one-shot", *(f"C={c}" for c in chunk_sizes)]
    times: dict[str, list[float]] = {m: [] for m in modes}
    calls: dict[str, int] = {"one-shot": -1}
    diffs: dict[str, float] = {"one-shot": 0.0}
    base: list = []
    header = f"{'mode':>10} {'time_s':>8} {'forwards':>9} {'ratio':>7} {'max|diff|':>10}"
    for rep in range(args.repeats):
        # Interleaved (one-shot, C=16, C=64, ...) per repeat: load from other processes hits all modes alike.
        if args.repeats > 1:
            print(f"repeat {rep + 1}/{args.repeats}:")
        print(header)
        print("-" * len(header), flush=True)
        t0 = time.perf_counter()
        base = score_one_shot(model, seqs, args.scorer, args.max_batch_tokens)
        times["one-shot"].append(time.perf_counter() - t0)
        _print_row(BenchRow("one-shot", times["one-shot"][-1], -1, 0.0), times["one-shot"][-1])
        for c in chunk_sizes:
            mode = f"C={c}"
            t0 = time.perf_counter()
            res, calls[mode] = score_streamed(model, seqs, args.scorer, c, args.max_batch_tokens)
            times[mode].append(time.perf_counter() - t0)
            diffs[mode] = max(diffs.get(mode, 0.0), _max_abs_diff(base, res))
            _print_row(BenchRow(mode, times[mode][-1], calls[mode], diffs[mode]), times["one-shot"][-1])

    rows = [BenchRow(m, min(times[m]), calls[m], diffs[m]) for m in modes]
    if args.repeats > 1:
        print(f"best of {args.repeats}:")
        print(header)
        print("-" * len(header))
        for row in rows:
            _print_row(row, rows[0].time_s)
    ok = all(row.max_abs_diff <= 1e-3 for row in rows)
    if not ok:
        print("streamed results differ from one-shot by more than 1e-3", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
