#!/usr/bin/env bash
# The checks one CUDA GPU can run without vLLM or Ray, in phases, each under its own time limit
# and all within TOTAL_S (450 s), so that the script ends inside 8 minutes on one H100:
#   install          the wheels of scripts/gpu_wheels.sh ($GPU_WHEELS, .gpu_wheels/) whose packages
#                    are not installed: OpenRLHF, megatron-core, DeepSpeed and what they import,
#                    with pip --no-index --no-deps into $GPU_SITE, put on PYTHONPATH after the checkout
#   megatron         pytest -m gpu tests/megatron: the Megatron actor at TP = 1 on CUDA (forward, a
#                    PPO step, the export)
#   models           pytest -m gpu tests/models: the streaming scorers in bf16, the reward loader's
#                    rewards against OpenRLHF's reward model at 4K tokens
#   zero3            pytest -m gpu tests/compat tests/integrations/launch: a ZeRO-3 step of real-size
#                    layers, its peak memory against the memory check's count
#   runtime          pytest -m gpu tests/integrations/runtime: the rest of the gpu tier (the test
#                    files that import Ray skip where it is not installed)
#   bench-reward-1k, bench-reference-1k, bench-reward-16k
#                    `bench scorer` at Qwen2.5-7B's shape (bf16, random weights built in code):
#                    streamed vs one-shot prefill at 1K-token sequences, the reward scorer at 8-16K
# Each pytest phase runs the test files of its folders that hold gpu-marked tests. Every phase
# logs to $OUT/<phase>.log (the tests' figures go to $OUT too, through OPPO_GPU_OUT; each
# streamed call of a bench to $OUT/calls-<bench>.jsonl); the output ends with one line per
# phase (passed / failed / skipped, with pytest's counts), also in $OUT/summary.txt.
#
#   bash scripts/gpu_wheels.sh                  # once, where a registry is reachable
#   OUT=runs/gpu bash scripts/gpu_checks.sh     # on the GPU machine, from the checkout
#   OUT=runs/gpu PHASES="install megatron" bash scripts/gpu_checks.sh
#
# Env vars (defaults): OUT (runs/gpu), PHASES (all, in the order above; a name is a phase, `bench`
# all three benches), TOTAL_S (450), GPU_WHEELS (.gpu_wheels), GPU_SITE
# (${TMPDIR:-/tmp}/openrlhf-oppo-gpu-site), PYTHON (python3), BENCH_MODEL (--shape qwen2.5-7b
# --device cuda --dtype bf16), GPU_CHECKS_PACK (unset; 1: the logs are packed into
# $OUT/gpu-checks.tar.gz beside summary.txt, for a transfer that takes few files).
# Needs torch with CUDA and transformers (pinned: 5.15.0).
set -u
set -o pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$SELF")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WHEELS=${GPU_WHEELS:-.gpu_wheels}
SITE=${GPU_SITE:-${TMPDIR:-/tmp}/openrlhf-oppo-gpu-site}
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-450}
PHASES=" ${PHASES:-install megatron models zero3 runtime bench} "
BENCH_MODEL=${BENCH_MODEL:---shape qwen2.5-7b --device cuda --dtype bf16}
export PYTHONUNBUFFERED=1 OPPO_GPU_OUT="$OUT" PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"

install_wheels() {  # the wheels whose distribution is not installed yet, into $SITE
  shopt -s nullglob
  local wheels=("$WHEELS"/*.whl) todo=() wheel dist have
  for wheel in "${wheels[@]}"; do
    dist=$(basename "$wheel")
    dist=${dist%%-*}
    if have=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$dist" 2>/dev/null); then
      echo "installed already: $dist $have ($(basename "$wheel") left out)"
    else
      todo+=("$wheel")
    fi
  done
  if ((${#todo[@]})); then
    echo "installing into $SITE: ${todo[*]##*/}"
    DS_BUILD_OPS=0 "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$SITE" "${todo[@]}" || return 1
    # OpenRLHF's wheel ships its own test suite as a top-level `tests` package
    if [[ -f $SITE/tests/test_ppo_trainer.py ]]; then rm -rf "$SITE/tests"; fi
  fi
  "$PY" - <<'PY'
import importlib
import importlib.metadata as metadata

from openrlhf_oppo.compat import flash_attn_standin

flash_attn_standin.install()  # OpenRLHF's models import flash_attn; the tests stand in for it where it is absent
modules = {"deepspeed": ["deepspeed"], "megatron-core": ["megatron.core"], "openrlhf": ["openrlhf.models",
                                                                                      "openrlhf.utils"]}
for dist, names in modules.items():
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        print(f"{dist}: not installed")
        continue
    for name in names:
        importlib.import_module(name)
    print(f"{dist} {version}: {', '.join(names)} import")
PY
}

if [[ ${1:-} == --install-wheels ]]; then  # the install phase's body, run under its time limit
  install_wheels
  exit
fi

START=$SECONDS
SUMMARY=()

phase_limit() {  # the phase's own limit, or what is left of TOTAL_S when that is less
  local cap=$1 left=$((TOTAL_S - (SECONDS - START)))
  echo $((left < cap ? left : cap))
}

count() {  # count, line: pytest's number of tests with that outcome in its closing line (0 if none)
  grep -oE "[0-9]+ $1" <<<"$2" | grep -oE "^[0-9]+" || echo 0
}

record() {  # name, outcome: one summary line
  SUMMARY+=("$(printf '%-20s %s' "$1:" "$2")")
}

run_phase() {  # name, limit (s), kind (pytest|run), command...: under timeout, logged to $OUT/<name>.log
  local name=$1 cap=$2 kind=$3 limit t0 rc outcome
  shift 3
  if [[ $PHASES != *" $name "* && ! ($name == bench-* && $PHASES == *" bench "*) ]]; then
    record "$name" "skipped (not in PHASES)"
    return
  fi
  limit=$(phase_limit "$cap")
  if ((limit < 10)); then
    record "$name" "skipped (the $TOTAL_S s of TOTAL_S are spent)"
    return
  fi
  echo "== $name (limit $limit s): $*"
  t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  if [[ $kind == pytest ]]; then
    local line passed failed skipped errors
    line=$(grep -E "[0-9]+ (passed|failed|skipped|errors?|deselected)" "$OUT/$name.log" | tail -n 1)
    passed=$(count passed "$line") failed=$(count failed "$line") skipped=$(count skipped "$line")
    errors=$(count "errors?" "$line")
    outcome="$passed passed, $failed failed, $skipped skipped, $errors errors"
    if ((rc == 124 || rc == 137)); then outcome="failed: timed out at $limit s ($outcome so far)"
    elif ((rc == 5)); then outcome="skipped: no test selected"
    elif ((rc == 0 && passed == 0)); then outcome="skipped: $outcome"
    elif ((rc == 0)); then outcome="passed: $outcome"
    else outcome="failed: $outcome"
    fi
  elif ((rc == 124 || rc == 137)); then outcome="failed: timed out at $limit s"
  elif ((rc == 0)); then outcome="passed"
  else outcome="failed (exit $rc)"
  fi
  record "$name" "$outcome ($((SECONDS - t0)) s; $OUT/$name.log)"
}

gpu_pytest() {  # name, limit, folders...: the folders' test files that hold gpu-marked tests
  local name=$1 cap=$2 files
  shift 2
  mapfile -t files < <(grep -rlE "pytest\.mark\.gpu" "$@" --include='test_*.py' 2>/dev/null | sort)
  if ((${#files[@]} == 0)); then
    record "$name" "skipped (no gpu-marked tests under $*)"
    return
  fi
  run_phase "$name" "$cap" pytest "$PY" -m pytest -m gpu -p no:cacheprovider -q -rA --continue-on-collection-errors \
    "${files[@]}"
}

bench() {  # name, limit, flags...
  local name=$1 cap=$2
  shift 2
  # BENCH_MODEL holds several flags: split on purpose
  # shellcheck disable=SC2086
  run_phase "$name" "$cap" run "$PY" -m openrlhf_oppo.bench.scorer $BENCH_MODEL --max-batch-tokens 32768 \
    --calls-json "$OUT/calls-$name.jsonl" "$@"
}

{
  timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "nvidia-smi: none here"
  timeout 60 "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/host.log"

if [[ $PHASES == *" install "* ]] && ! compgen -G "$WHEELS/*.whl" >/dev/null; then
  record install "skipped (no wheels in $WHEELS: the packages are the environment's; scripts/gpu_wheels.sh makes them)"
else
  run_phase install 60 run "$BASH" "$SELF" --install-wheels
fi
gpu_pytest megatron 75 tests/megatron
gpu_pytest models 75 tests/models
gpu_pytest zero3 75 tests/compat tests/integrations/launch
gpu_pytest runtime 75 tests/integrations/runtime
bench bench-reward-1k 55 --scorer reward --num-seqs 64 --min-len 512 --max-len 1536 --prompt-len 128 256 \
  --chunk-sizes 64,256,1024
bench bench-reference-1k 50 --scorer reference --num-seqs 64 --min-len 512 --max-len 1536 --prompt-len 128 256 \
  --chunk-sizes 64,256
bench bench-reward-16k 55 --scorer reward --num-seqs 8 --min-len 8192 --max-len 16384 --prompt-len 256 512 \
  --chunk-sizes 1024,4096

printf '%s\n' "gpu_checks: $((SECONDS - START)) s in all (TOTAL_S $TOTAL_S)" "${SUMMARY[@]}" | tee "$OUT/summary.txt"
if [[ ${GPU_CHECKS_PACK:-} == 1 ]]; then
  (cd "$OUT" && find . -maxdepth 1 -type f ! -name summary.txt ! -name gpu-checks.tar.gz -printf '%P\n' \
    | tar -czf gpu-checks.tar.gz -T - --remove-files)
fi
