"""`bench scorer`: streamed vs one-shot prefill, the per-call records and the fitted prefill terms."""

from __future__ import annotations

import json

import pytest

from openrlhf_oppo.bench import scorer as bench

TINY = ["--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--intermediate", "128",
        "--vocab", "128", "--num-seqs", "6", "--min-len", "40", "--max-len", "90", "--prompt-len", "4", "12"]


def test_fit_recovers_the_terms_of_exact_calls():
    call, chunk, token, pair = 0.02, 0.001, 3e-5, 4e-9
    calls = [{"seqs": s, "new_tokens": n, "pairs": p, "seconds": call + chunk * s + token * n + pair * p}
             for s, n, p in [(1, 16, 900), (8, 128, 30_000), (32, 2048, 4_000_000), (4, 1024, 9_000_000),
                             (64, 4096, 1_000_000), (2, 64, 50_000)]]
    fit = bench.fit_prefill_terms(calls)
    assert fit["call_s"] == pytest.approx(call) and fit["per_chunk_s"] == pytest.approx(chunk)
    assert fit["per_token_s"] == pytest.approx(token) and fit["per_pair_s"] == pytest.approx(pair)
    assert fit["r2"] == pytest.approx(1.0)


def test_a_term_that_fits_negative_is_refitted_at_zero():
    # time falls with the number of sequences: no non-negative per-chunk cost explains that
    calls = [{"seqs": s, "new_tokens": n, "pairs": 0, "seconds": 0.01 + 1e-4 * n - 1e-3 * s}
             for s, n in [(1, 100), (2, 300), (4, 200), (8, 900), (3, 50)]]
    fit = bench.fit_prefill_terms(calls)
    assert fit["per_chunk_s"] == 0.0 and fit["per_token_s"] > 0
    assert all(fit[k] >= 0 for k in ("call_s", "per_chunk_s", "per_token_s", "per_pair_s"))


def test_run_writes_one_record_per_streamed_call_and_passes(tmp_path, capsys):
    out = tmp_path / "calls.jsonl"
    assert bench.main([*TINY, "--chunk-sizes", "16,64", "--calls-json", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    printed = capsys.readouterr().out
    for c in (16, 64):  # every sequence's response passes through its calls exactly once
        mine = [r for r in records if r["chunk_size_tokens"] == c]
        assert sum(r["seqs"] for r in mine if r["finish"]) == 6
        assert all(r["seconds"] > 0 and r["forwards"] >= 1 for r in mine)
    assert f"fitted on {len(records)} streamed calls" in printed
    assert "alone" in printed and "allowed 1.00e-03 (fp32" in printed


def test_streamed_results_that_differ_fail_the_run(monkeypatch, capsys):
    real = bench.score_streamed

    def off_by_a_little(*args, **kwargs):
        results, calls = real(*args, **kwargs)
        return [r + 0.01 for r in results], calls  # a reward 0.01 off: ten times the fp32 tolerance

    monkeypatch.setattr(bench, "score_streamed", off_by_a_little)
    assert bench.main([*TINY, "--chunk-sizes", "32"]) == 1
    assert "differ from one-shot by more than" in capsys.readouterr().err


def test_shape_comes_from_the_simulators_catalog_and_a_wrong_one_is_named(capsys):
    args = bench.parse_args(["--shape", "qwen2.5-7b"])
    assert (args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab) == (
        3584, 28, 28, 4, 18944, 152064)
    with pytest.raises(SystemExit):
        bench.parse_args(["--shape", "qwen9-1t"])
    assert "--shape: unknown 'qwen9-1t'; allowed" in capsys.readouterr().err


def test_cuda_without_a_gpu_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cuda"])
    assert "--device cuda" in capsys.readouterr().err
