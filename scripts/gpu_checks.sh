#!/usr/bin/env bash
# The checks a single CUDA GPU can run without OpenRLHF's cluster stack: the `gpu` test tier,
# then `bench scorer` at a real size (Qwen2.5-7B's shape, bf16, weights random, built in code):
# streamed vs one-shot prefill for the reward and reference scorers at 1K-token sequences, and
# the reward scorer at 8-16K. Logs and every streamed call's size and time go to $OUT.
#
#   OUT=runs/gpu bash scripts/gpu_checks.sh
#
# Needs torch with CUDA and transformers (pinned: 5.15.0); the tests that start vLLM or
# OpenRLHF's modules also need those installed (scripts/install.sh gpu).
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

timeout "${TESTS_S:-150}" python3 -m pytest -m gpu -p no:cacheprovider -q -rA tests/models \
  tests/integrations/runtime/test_sleep_gpu.py tests/integrations/runtime/test_reference_stream.py \
  tests/integrations/runtime/test_background_sync.py tests/integrations/runtime/test_micro_batches.py \
  2>&1 | tee "$OUT/gpu-tests.log"

bench() {  # name, timeout, flags...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m openrlhf_oppo.bench.scorer ${BENCH_MODEL:---shape qwen2.5-7b --device cuda --dtype bf16} \
    --max-batch-tokens 32768 --calls-json "$OUT/calls-$name.jsonl" "$@" 2>&1 | tee "$OUT/bench-$name.log"
}
bench reward-1k "${BENCH_S:-150}" --scorer reward --num-seqs 64 --min-len 512 --max-len 1536 --prompt-len 128 256 \
  --chunk-sizes 16,64,256,1024 --repeats 2
bench reference-1k "${BENCH_S:-150}" --scorer reference --num-seqs 64 --min-len 512 --max-len 1536 \
  --prompt-len 128 256 --chunk-sizes 64,256
bench reward-16k "${BENCH_S:-150}" --scorer reward --num-seqs 8 --min-len 8192 --max-len 16384 --prompt-len 256 512 \
  --chunk-sizes 256,1024,4096
