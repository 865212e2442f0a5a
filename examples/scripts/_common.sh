# Shared by examples/scripts/train_oppo_*.sh, sourced after they `cd` to the repository root
# (bash 4.4 or later). What it gives them:
#   oppo_split_args "$@"   DRY_RUN (0 or 1) and EXTRA: every argument but --dry-run, passed on
#                          after the preset so that any OpenRLHF or --oppo.* flag overrides it
#   oppo_runtime_env       RUNTIME_ENV: the Ray job's runtime env (JSON) - the repository as
#                          working_dir, and the env vars of PASS_ENV that are set
#   oppo_submit CMD...     SUBMIT=(ray job submit ... -- CMD...), printed on one line (secrets
#                          masked as ***), then run; with --dry-run, CMD --dry-run runs here
#                          instead (every check the job makes before Ray starts; on stderr)
# Env vars read: RAY_ADDRESS (http://127.0.0.1:8265), WANDB_PROJECT (openrlhf_oppo),
# NCCL_DEBUG (WARN), and passed into the job when set: WANDB_API_KEY (unset: wandb logs
# offline), WANDB_DIR, HF_TOKEN, HF_HOME.

RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
WANDB_PROJECT=${WANDB_PROJECT:-openrlhf_oppo}
PASS_ENV=(WANDB_API_KEY WANDB_DIR HF_TOKEN HF_HOME)
SECRETS=(WANDB_API_KEY HF_TOKEN)

oppo_split_args() {
  DRY_RUN=0
  EXTRA=()
  local arg
  for arg in "$@"; do
    if [[ $arg == --dry-run ]]; then DRY_RUN=1; else EXTRA+=("$arg"); fi
  done
}

_oppo_json_str() {
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  printf '"%s"' "$s"
}

oppo_runtime_env() {
  local vars=("\"NCCL_DEBUG\": $(_oppo_json_str "${NCCL_DEBUG:-WARN}")") shown name value
  shown=("${vars[@]}")
  for name in "${PASS_ENV[@]}"; do
    if [[ -z ${!name:-} ]]; then continue; fi
    vars+=("$(_oppo_json_str "$name"): $(_oppo_json_str "${!name}")")
    value=${!name}
    if [[ " ${SECRETS[*]} " == *" $name "* ]]; then value="***"; fi
    shown+=("$(_oppo_json_str "$name"): $(_oppo_json_str "$value")")
  done
  local IFS=,
  # checkpoints and run outputs written under the repository are not uploaded with it
  local head='{"working_dir": ".", "excludes": ["ckpt/", "runs/", ".git/"], "env_vars": {'
  RUNTIME_ENV="$head${vars[*]}}}"
  RUNTIME_ENV_SHOWN="$head${shown[*]}}}"  # what is printed: secrets as ***
}

# SUBMIT=(ray job submit ... -- "$@"): print it on one line as `printf '%q '` quotes it
# (secrets masked), then run it; with --dry-run run `"$@" --dry-run` here instead.
oppo_submit() {
  SUBMIT=(ray job submit --address "$RAY_ADDRESS" --runtime-env-json "$RUNTIME_ENV" -- "$@")
  local shown=(ray job submit --address "$RAY_ADDRESS" --runtime-env-json "$RUNTIME_ENV_SHOWN" -- "$@")
  printf '%q ' "${shown[@]}"
  echo
  if ((DRY_RUN)); then
    # every check the job runs before Ray starts, here (flags, inputs, the memory table): exit 2 on a refusal
    if python3 -c "import openrlhf_oppo" 2>/dev/null; then
      "$@" --dry-run >&2 || exit $?
    else
      echo "$0: openrlhf_oppo is not installed here: its checks did not run (bash scripts/install.sh)" >&2
    fi
    exit 0
  fi
  if ! command -v ray >/dev/null; then
    echo "$0: 'ray' not found: install the project (OPPO_STACK=gpu bash scripts/install.sh)" >&2
    exit 127
  fi
  "${SUBMIT[@]}"
}
