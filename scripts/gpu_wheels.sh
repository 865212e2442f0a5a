#!/usr/bin/env bash
# The wheels scripts/gpu_checks.sh installs on a GPU machine that has torch, CUDA and
# transformers but no vLLM, Ray, DeepSpeed, megatron-core or OpenRLHF, and reaches no registry.
# Run it where a registry is reachable; it fills .gpu_wheels/ (ignored by git, about 10 MB),
# which travels with the checkout to the GPU machine:
#   bash scripts/gpu_wheels.sh                  # for Python 3.12 on x86-64 Linux
#   GPU_PYTHON=3.11 bash scripts/gpu_wheels.sh  # for another Python
# What it holds:
#   - OpenRLHF and megatron-core at this project's pins (scripts/install.sh, pyproject.toml);
#   - DeepSpeed at its pin, built here from its sdist (the only form it is published in) in pip's
#     isolated build env with DS_BUILD_OPS=0: without torch there it pre-compiles no op and the
#     wheel is pure Python, the same files the CPU install gets. Built on the GPU machine instead
#     (torch present, no isolated env without a registry), setup.py hands torch's BuildExtension
#     to the local setuptools, which some setuptools releases refuse ("unexpected keyword
#     argument 'use_ninja'");
#   - what those import that the GPU machine lacks (pydantic, hjson, msgpack, py-cpuinfo and psutil
#     for DeepSpeed; peft and accelerate, which `openrlhf.models` imports; pylatexenc for
#     `openrlhf.utils`; einops for the flash-attn stand-in), at the versions this project's CPU
#     install runs (each is installed there only where the GPU machine lacks it).
# No Ray or vLLM: their wheels alone pass the 64 MiB a device call carries; the tests that need
# them skip there.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_WHEELS:-.gpu_wheels}
PY_VERSION=${GPU_PYTHON:-3.12}
PYTHON=${PYTHON:-python}

PINNED=(openrlhf==0.11.2 megatron-core==0.16.1)
DEEPSPEED=deepspeed==0.19.6
IMPORTED=(hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  pylatexenc==2.11 peft==0.22.0 accelerate==1.16.0 msgpack==1.2.4 py-cpuinfo==9.0.0 psutil==7.2.2 einops==0.8.2)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
  manylinux2014_x86_64 manylinux1_x86_64)

rm -rf "$DEST"
mkdir -p "$DEST"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  "${PLATFORMS[@]/#/--platform=}" -d "$DEST" "${PINNED[@]}" "${IMPORTED[@]}"
sdist=$(mktemp -d)
trap 'rm -rf "$sdist"' EXIT
"$PYTHON" -m pip download -q --no-deps --no-binary=:all: -d "$sdist" "$DEEPSPEED"
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --use-pep517 -w "$DEST" "$sdist"/deepspeed-*.tar.gz
ls -l "$DEST"
echo "gpu_wheels: $(du -sh "$DEST" | cut -f1) in $DEST (for Python $PY_VERSION); carry it with the checkout" \
  "and run scripts/gpu_checks.sh there"
