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
    # a real-size shape from the simulator's catalog, on a GPU, in bf16; every call's size and
    # time to a file, and the simulator's prefill terms fitted on them
    python -m openrlhf_oppo.bench.scorer --shape qwen2.5-7b --device cuda --dtype bf16 --calls-json calls.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from openrlhf_oppo.models.streaming import StreamingReferenceScorer, StreamingRewardScorer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPES = Path(__file__).resolve().parents[1] / "sim" / "presets" / "models.yaml"  # the simulator's model catalog
# Streamed results may differ from one-shot ones by this much, or by twice what the one-shot path
# itself moves when each sequence runs alone instead of in a padded batch (the "alone" row): the
# same sums rounded in another order. bf16's is 8 steps of its 8-bit mantissa at magnitude 1.
TOLERANCE = {"fp32": 1e-3, "bf16": 8 * 2**-7}


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
    p.add_argument("--shape", default="", help="a model shape of the simulator's catalog "
                   "(openrlhf_oppo/sim/presets/models.yaml, e.g. qwen2.5-7b); replaces the six size flags above")
    p.add_argument("--device", default="cpu", help="torch device: cpu or cuda")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="model dtype")
    p.add_argument("--calls-json", default="", help="write every streamed call's size and time here (JSON lines) "
                   "and print the simulator's prefill terms fitted on them")
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
    if args.shape:
        shapes = yaml.safe_load(SHAPES.read_text())
        if args.shape not in shapes:
            p.error(f"--shape: unknown '{args.shape}'; allowed (from {SHAPES.name}): {', '.join(shapes)}")
        for key in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"):
            setattr(args, key, shapes[args.shape][key])
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA device here")
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
        max_position_embeddings=max(4096, args.max_len),
        num_labels=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    cls = Qwen2ForSequenceClassification if args.scorer == "reward" else Qwen2ForCausalLM
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[args.dtype])  # built in place: a 7B model never exists in fp32
    try:
        with torch.device(args.device):
            return cls(config).eval()
    finally:
        torch.set_default_dtype(default)


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
    device = model.get_input_embeddings().weight.device
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
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device))
        for row, i in enumerate(batch):
            if scorer == "reward":
                results[i] = float(out.logits[row, 0])
            else:
                p, n = len(seqs[i].prompt_ids), len(seqs[i].response_ids)
                logp = torch.log_softmax(out.logits[row, p - 1 : p + n - 1].float(), dim=-1)
                target = torch.tensor(seqs[i].response_ids, device=device)[:, None]
                results[i] = logp.gather(-1, target).squeeze(-1).tolist()
        del out
        start = end
    return results


def _len(seq: BenchSequence) -> int:
    return len(seq.prompt_ids) + len(seq.response_ids)


def _sync(model) -> None:
    if model.get_input_embeddings().weight.is_cuda:
        torch.cuda.synchronize()


def score_streamed(model, seqs: list[BenchSequence], scorer_kind: str, chunk_size_tokens: int,
                   max_batch_tokens: int, calls: list[dict] | None = None) -> tuple[list, int]:
    """Open all, then rounds of `extend_many` / `finish_many` with C response tokens per sequence.
    With `calls`, each round's call is appended to it: sequences, new tokens, query-key pairs,
    cached tokens before it, forwards, seconds (the device synchronised at both ends)."""
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
            if offset + chunk_size_tokens >= len(seqs[i].response_ids):
                finish[i] = chunk
            else:
                extend[i] = chunk
        for chunks, finishing in ((extend, False), (finish, True)):
            if not chunks:
                continue
            # the prompt is prefilled with the first chunk: count it as new, with no past
            new = {i: len(c) + (len(seqs[i].prompt_ids) if offset == 0 else 0) for i, c in chunks.items()}
            past = {i: 0 if offset == 0 else len(seqs[i].prompt_ids) + offset for i in chunks}
            before = scorer.stats().forward_calls
            cached = scorer.cached_tokens
            call = scorer.finish_many if finishing else scorer.extend_many
            _sync(model)
            t0 = time.perf_counter()
            out = call(chunks)
            _sync(model)
            if calls is not None:
                calls.append({"chunk_size_tokens": chunk_size_tokens, "seqs": len(chunks),
                              "new_tokens": sum(new.values()), "cached_tokens": cached,
                              "pairs": sum(n * past[i] + n * (n + 1) // 2 for i, n in new.items()),
                              "forwards": scorer.stats().forward_calls - before, "finish": finishing,
                              "seconds": time.perf_counter() - t0})
            for i, r in out.items() if finishing else ():
                results[i] = r
                scorer.drop(i)
        active = list(extend)
        offset += chunk_size_tokens
    return results, scorer.stats().forward_calls


def fit_prefill_terms(calls: list[dict]) -> dict[str, float]:
    """The simulator's streamed prefill cost (`sim.costs.CostModel.prefill_s`, compute-bound):
    seconds = call + chunks x per_chunk + new tokens x per_token + query-key pairs x per_pair,
    least squares over the calls; a term that comes out negative is refitted at 0."""
    names = ["call_s", "per_chunk_s", "per_token_s", "per_pair_s"]
    x = np.array([[1.0, c["seqs"], c["new_tokens"], c["pairs"]] for c in calls])
    y = np.array([c["seconds"] for c in calls])
    keep = list(range(len(names)))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    out = dict.fromkeys(names, 0.0)
    out.update({names[k]: float(c) for k, c in zip(keep, coef)})
    pred = x[:, keep] @ coef
    out["r2"] = float(1 - ((y - pred) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-30))
    return out


def _values(results: list) -> list[float]:
    return [v for r in results for v in (r if isinstance(r, list) else [r])]


def _max_abs_diff(a: list, b: list) -> float:
    return max([0.0, *(abs(u - v) for u, v in zip(_values(a), _values(b)))])


def _print_row(row: BenchRow, base_s: float) -> None:
    calls = "" if row.forward_calls < 0 else str(row.forward_calls)
    print(f"{row.mode:>10} {row.time_s:8.2f} {calls:>9} {row.time_s / base_s:7.2f} {row.max_abs_diff:10.1e}",
          flush=True)


def _timed(model, fn, *args):
    _sync(model)
    t0 = time.perf_counter()
    out = fn(*args)
    _sync(model)
    return out, time.perf_counter() - t0


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
    cuda = args.device.startswith("cuda")
    where = torch.cuda.get_device_name() if cuda else f"torch threads={torch.get_num_threads()}"
    print(f"scorer={args.scorer}  model: Qwen2 {args.dtype} {args.shape} hidden={args.hidden} layers={args.layers}"
          f" heads={args.heads}/{args.kv_heads} params={n_params / 1e6:.1f}M  {args.device}: {where}")
    print(f"{len(seqs)} sequences, {args.min_len}-{args.max_len} tokens ({total_tokens} in all), "
          f"max_batch_tokens={args.max_batch_tokens}, repeats={args.repeats}", flush=True)

    # Warm-up: first forwards pay one-off allocation / kernel selection costs.
    score_one_shot(model, seqs[:2], args.scorer, args.max_batch_tokens)
    score_streamed(model, seqs[:2], args.scorer, 128, args.max_batch_tokens)

    modes = ["one-shot", *(f"C={c}" for c in chunk_sizes)]
    times: dict[str, list[float]] = {m: [] for m in modes}
    calls: dict[str, int] = {"one-shot": -1}
    diffs: dict[str, float] = {"one-shot": 0.0}
    records: list[dict] = []
    base: list = []
    header = f"{'mode':>10} {'time_s':>8} {'forwards':>9} {'ratio':>7} {'max|diff|':>10}"
    for rep in range(args.repeats):
        # Interleaved (one-shot, C=16, C=64, ...) per repeat: load from other processes hits all modes alike.
        if args.repeats > 1:
            print(f"repeat {rep + 1}/{args.repeats}:")
        print(header)
        print("-" * len(header), flush=True)
        base, seconds = _timed(model, score_one_shot, model, seqs, args.scorer, args.max_batch_tokens)
        times["one-shot"].append(seconds)
        _print_row(BenchRow("one-shot", seconds, -1, 0.0), seconds)
        if rep == 0:  # the one-shot path's own rounding: every sequence in a batch of its own
            alone, seconds = _timed(model, score_one_shot, model, seqs, args.scorer, 0)
            floor = _max_abs_diff(base, alone)
            _print_row(BenchRow("alone", seconds, len(seqs), floor), times["one-shot"][-1])
        for c in chunk_sizes:
            mode = f"C={c}"
            (res, calls[mode]), seconds = _timed(model, score_streamed, model, seqs, args.scorer, c,
                                                 args.max_batch_tokens, records if rep == args.repeats - 1 else None)
            times[mode].append(seconds)
            diffs[mode] = max(diffs.get(mode, 0.0), _max_abs_diff(base, res))
            _print_row(BenchRow(mode, seconds, calls[mode], diffs[mode]), times["one-shot"][-1])

    rows = [BenchRow(m, min(times[m]), calls[m], diffs[m]) for m in modes]
    if args.repeats > 1:
        print(f"best of {args.repeats}:")
        print(header)
        print("-" * len(header))
        for row in rows:
            _print_row(row, rows[0].time_s)
    pairs = sum(_len(s) * (_len(s) + 1) // 2 for s in seqs)
    flops = 2 * n_params * total_tokens + 4 * args.layers * args.hidden * pairs
    print(f"one-shot: {total_tokens / rows[0].time_s:,.0f} tokens/s, {flops / rows[0].time_s / 1e12:.1f} TFLOP/s "
          "(2 x params a token + 4 x layers x hidden a query-key pair)")
    if args.calls_json:
        with open(args.calls_json, "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        fit = fit_prefill_terms(records)
        print(f"fitted on {len(records)} streamed calls (R^2 {fit['r2']:.3f}): call {fit['call_s'] * 1e3:.2f} ms + "
              f"{fit['per_chunk_s'] * 1e3:.3f} ms a chunk + {fit['per_token_s'] * 1e6:.2f} us a new token + "
              f"{fit['per_pair_s'] * 1e9:.3f} ns a query-key pair; calls -> {args.calls_json}")
        if fit["per_token_s"] > 0:
            print(f"  per token: {2 * n_params / fit['per_token_s'] / 1e12:.1f} TFLOP/s achieved (2 x params)")
    tol = max(TOLERANCE[args.dtype], 2 * floor)
    ok = all(row.max_abs_diff <= tol for row in rows)
    print(f"streamed vs one-shot: at most {max(r.max_abs_diff for r in rows):.2e}, allowed {tol:.2e} "
          f"({args.dtype}; one-shot alone vs batched: {floor:.2e})")
    if not ok:
        print(f"streamed results differ from one-shot by more than {tol:.2e}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
