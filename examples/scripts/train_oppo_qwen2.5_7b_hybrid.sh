#!/usr/bin/env bash
# OPPO on Qwen2.5-7B-Instruct with PPO and a 7B reward model, one 8-GPU node, hybrid engine
# (configs/cluster/qwen2.5-7b-hybrid-8gpu.yaml: OpenRLHF's hybrid engine, every model on
# all 8 GPUs in turn, vLLM asleep while they train; rewards streamed while vLLM decodes).
# Needs: 1 node x 8 GPUs of 80 GB or more, a running Ray cluster (`ray start --head
# --num-gpus 8` on the node) and the GPU stack (OPPO_STACK=gpu bash scripts/install.sh).
# Launch: bash examples/scripts/train_oppo_qwen2.5_7b_hybrid.sh [--dry-run] [flags...]
#   flags: any OpenRLHF or --oppo.* flag, overriding the preset (--oppo.delta.max 16)
#   --dry-run: print the `ray job submit` command on one line, run its checks here and exit
# Env vars (defaults): RAY_ADDRESS (http://127.0.0.1:8265), SAVE_PATH (./ckpt/<run>:
# model in SAVE_PATH, checkpoints in SAVE_PATH/ckpt), WANDB_API_KEY (unset: wandb offline),
# WANDB_PROJECT (openrlhf_oppo), WANDB_RUN_NAME (<run>); see _common.sh for the rest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source examples/scripts/_common.sh
oppo_split_args "$@"

RUN=oppo-qwen2.5-7b-hybrid
SAVE_PATH=${SAVE_PATH:-$PWD/ckpt/$RUN}
TRAIN=(python3 -m openrlhf_oppo.cli.train_ppo_ray --config configs/cluster/qwen2.5-7b-hybrid-8gpu.yaml
  --ckpt.output_dir "$SAVE_PATH" --ckpt.path "$SAVE_PATH/ckpt"
  --logger.wandb.project "$WANDB_PROJECT" --logger.wandb.run_name "${WANDB_RUN_NAME:-$RUN}"
  "${EXTRA[@]}")
oppo_runtime_env
oppo_submit "${TRAIN[@]}"
