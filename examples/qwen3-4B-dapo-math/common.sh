# shellcheck shell=bash
# Shared settings of the Qwen3-4B DAPO-Math launchers (sourced by run-h100.sh / run-mi300.sh).
# Modelled on slime's scripts/run-qwen3-4B.sh (THUDM/slime 624b824a8); the rollout, buffer and
# loss come from april_slime. Everything below can be overridden from the environment.
#
#   MODE       slime | sync | april | copris   (slime = slime's stock rollout, no plugin)
#   LOSS_HOOK  custom_loss | tis               (how the off-policy correction enters the loss)
#   VCPO_HOOK  0 | 1                           (ESS learning-rate scaling hook)
#   ROLLOUT_MAX_RESPONSE_LEN  16384 by default: the 16K budget of the benchmark's headline
#              (`april-slime bench dapo16k`), where the long tail that partial rollouts remove is
#              longest. slime's own Qwen3-4B script uses 8192; set 8192 to compare with it.
#   APRIL_CONFIG  the plugin's YAML (default configs/<MODE>.yaml)
#   HF_CHECKPOINT, REF_LOAD, PROMPT_DATA, ROLLOUT_BATCH_SIZE, N_SAMPLES_PER_PROMPT, NUM_ROLLOUT,
#   GLOBAL_BATCH_SIZE, SAVE_INTERVAL, EVAL_INTERVAL (none: no evaluation)  the recipe's values
#   RAY_ADDRESS  submit to this running cluster's dashboard (http://host:8265) instead of starting one
#
# A platform launcher (run-h100.sh, run-mi300.sh, run-cpu.sh) sources this file and sets the
# hardware block only: MODEL_ARGS (before sourcing: else slime's Qwen3-4B), PERF_ARGS, MISC_ARGS,
# SGLANG_ARGS, RAY_START_ARGS and the runtime environment.

MODE=${MODE:-copris}
LOSS_HOOK=${LOSS_HOOK:-custom_loss}
VCPO_HOOK=${VCPO_HOOK:-0}
# name of the VCPO hook; one place to change it
VCPO_HOOK_PATH=${VCPO_HOOK_PATH:-april_slime.vcpo.before_train_step}
ROLLOUT_MAX_RESPONSE_LEN=${ROLLOUT_MAX_RESPONSE_LEN:-16384}

SLIME_DIR=${SLIME_DIR:-/root/slime}
MODEL_DIR=${MODEL_DIR:-/root}
DATA_DIR=${DATA_DIR:-/root}
SAVE_DIR=${SAVE_DIR:-${MODEL_DIR}/Qwen3-4B_slime_${MODE}}
HERE="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"

case "$MODE" in
    slime|sync|april|copris) ;;
    *) echo "MODE must be slime, sync, april or copris (got '$MODE')" >&2; exit 2 ;;
esac

# the model architecture, from slime itself, unless the platform launcher set it
if ! declare -p MODEL_ARGS &>/dev/null; then
   source "${SLIME_DIR}/scripts/models/qwen3-4B.sh"
fi
APRIL_CONFIG=${APRIL_CONFIG:-${HERE}/configs/${MODE}.yaml}

CKPT_ARGS=(
   --hf-checkpoint "${HF_CHECKPOINT:-${MODEL_DIR}/Qwen3-4B}"
   --ref-load "${REF_LOAD:-${MODEL_DIR}/Qwen3-4B_torch_dist}"
   --load "${SAVE_DIR}"
   --save "${SAVE_DIR}"
   --save-interval "${SAVE_INTERVAL:-20}"
)

ROLLOUT_ARGS=(
   --prompt-data "${PROMPT_DATA:-${DATA_DIR}/dapo-math-17k/dapo-math-17k.jsonl}"
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout "${NUM_ROLLOUT:-3000}"
   --rollout-batch-size "${ROLLOUT_BATCH_SIZE:-32}"
   --n-samples-per-prompt "${N_SAMPLES_PER_PROMPT:-8}"
   --rollout-max-response-len "${ROLLOUT_MAX_RESPONSE_LEN}"
   --rollout-temperature 1

   --global-batch-size "${GLOBAL_BATCH_SIZE:-256}"
   --balance-data
)

EVAL_ARGS=(
   --eval-interval "${EVAL_INTERVAL:-20}"
   --eval-prompt-data aime "${DATA_DIR}/aime-2024/aime-2024.jsonl"
   --n-samples-per-eval-prompt 16
   --eval-max-response-len 16384
   --eval-top-p 1
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

if [ "${EVAL_INTERVAL:-20}" = "none" ]; then
   EVAL_ARGS=()
fi

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 2
   --sglang-mem-fraction-static 0.7
)

WANDB_ARGS=(
   # --use-wandb
   # --wandb-project april-slime
   # --wandb-group qwen3-4B-dapo-${MODE}
   # --wandb-key ${WANDB_KEY}
)

# ---------------------------------------------------------------- april_slime
APRIL_ARGS=()
if [ "$MODE" != "slime" ]; then
   APRIL_ARGS+=(
      --rollout-function-path april_slime.rollout.generate_rollout
      --data-source-path april_slime.rollout.AprilDataSource
      --custom-config-path "${APRIL_CONFIG}"
      # rollout log-probs of every stage are the behaviour policy of the correction
   )
   case "$LOSS_HOOK" in
      custom_loss)
         APRIL_ARGS+=(--loss-type custom_loss --custom-loss-function-path april_slime.loss.policy_loss) ;;
      tis)
         # slime's own PPO loss, reweighted by april_slime.loss.tis (set april_is_mode: decoupled)
         APRIL_ARGS+=(--use-tis --custom-tis-function-path april_slime.loss.tis) ;;
      *) echo "LOSS_HOOK must be custom_loss or tis (got '$LOSS_HOOK')" >&2; exit 2 ;;
   esac
   if [ "$VCPO_HOOK" = "1" ]; then
      APRIL_ARGS+=(--custom-megatron-before-train-step-hook-path "${VCPO_HOOK_PATH}")
   fi
fi

# ------------------------------------------------- april_slime loss side (owned by docs/loss.md, docs/vcpo.md)
# A custom loss in copris mode takes its ratio against the rollout log-probs, so slime's separate
# log-prob forward before each step is not needed; --use-rollout-logprobs skips it (slime runs it
# for every --loss-type but policy_loss otherwise). decoupled (the default configs) needs it.
loss_config="${APRIL_CONFIG}"
if [ "$VCPO_HOOK" = "1" ]; then
   loss_config="${HERE}/configs/${MODE}-vcpo.yaml"
fi
if [ "$LOSS_HOOK" = "custom_loss" ] && [ -f "$loss_config" ] \
      && grep -q '^april_is_mode: copris' "$loss_config"; then
   APRIL_ARGS+=(--use-rollout-logprobs)
fi
# VCPO_HOOK=1 runs VCPO whole: ESS learning-rate scaling and the off-policy optimal baseline
# (configs/<mode>-vcpo.yaml: sequence-level truncated IS). The baseline's advantages are the raw
# rewards, and it is defined for the pure policy-gradient loss, so --use-kl-loss is dropped.
# (The later --custom-config-path wins in slime's argument parser.)
if [ "$VCPO_HOOK" = "1" ] && [ "$MODE" != "slime" ]; then
   if [ "$MODE" = "sync" ] || [ "$LOSS_HOOK" != "custom_loss" ]; then
      echo "VCPO_HOOK=1 needs MODE=april or copris and LOSS_HOOK=custom_loss" >&2; exit 2
   fi
   APRIL_ARGS+=(
      --custom-config-path "${HERE}/configs/${MODE}-vcpo.yaml"
      --custom-advantage-function-path april_slime.vcpo.opob_advantages
   )
   without_kl=()
   for arg in "${GRPO_ARGS[@]}"; do
      [ "$arg" = "--use-kl-loss" ] || without_kl+=("$arg")
   done
   GRPO_ARGS=("${without_kl[@]}")
fi
# ------------------------------------------------- end of the loss-side block

# Per-token policy versions reach the loss only with patches/slime-forward-train-metadata.patch
# applied to the slime checkout; without it the loss still trains, without staleness metrics.
check_april_setup() {
   if [ "$MODE" = "slime" ]; then
      return
   fi
   python3 -c "import april_slime" || { echo "april_slime is not installed (pip install -e <repo>)" >&2; exit 1; }
   if [ -n "${APRIL_SLIME_DIR:-}" ]; then
      bash "${APRIL_SLIME_DIR}/patches/check.sh" "${SLIME_DIR}" || echo "warning: slime patches not applied" >&2
   fi
}

run_slime() {  # <num_gpus> <runtime_env_json> [extra slime args...]: start ray and submit the job
   local num_gpus="$1" runtime_env_json="$2"
   shift 2
   check_april_setup
   export MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
   if [ -z "${RAY_ADDRESS:-}" ]; then
      ray start --head --node-ip-address "${MASTER_ADDR}" --num-gpus "${num_gpus}" --disable-usage-stats \
         --dashboard-host=0.0.0.0 --dashboard-port=8265 "${RAY_START_ARGS[@]}"
   fi
   cd "${SLIME_DIR}" || exit 1
   ray job submit --address="${RAY_ADDRESS:-http://127.0.0.1:8265}" \
      --runtime-env-json="${runtime_env_json}" \
      -- python3 "${SLIME_DIR}/train.py" \
      --actor-num-nodes 1 \
      --actor-num-gpus-per-node "${num_gpus}" \
      --colocate \
      "${MODEL_ARGS[@]}" \
      "${CKPT_ARGS[@]}" \
      "${ROLLOUT_ARGS[@]}" \
      "${OPTIMIZER_ARGS[@]}" \
      "${GRPO_ARGS[@]}" \
      "${WANDB_ARGS[@]}" \
      "${PERF_ARGS[@]}" \
      "${EVAL_ARGS[@]}" \
      "${SGLANG_ARGS[@]}" \
      "${MISC_ARGS[@]}" \
      "${APRIL_ARGS[@]}" \
      "$@"
}

# parallelism and batching of slime's Qwen3-4B example (same on H100 and MI300X)
PERF_ARGS=(
   --tensor-model-parallel-size 2
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --expert-model-parallel-size 1
   --expert-tensor-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   # slime's value: a longer sample (a 16K response) gets a micro-batch of its own
   # (slime/utils/dp_schedule.py); not measured here on GPUs, so if that one runs out of memory,
   # lower ROLLOUT_MAX_RESPONSE_LEN
   --max-tokens-per-gpu 9216
)

# VCPO's group baseline folds each prompt group once its last sample's backward has run, so a
# micro-batch must hold no more than one group: static micro-batches instead of dynamic batching,
# of one sample as VCPO's own runs (its norm read off the gradient buffer, no per-layer work; the
# 8 samples of a group then lie two on each of the 4 data-parallel ranks, which agree on the
# group's baseline; docs/vcpo.md, "Limits").
if [ "$VCPO_HOOK" = "1" ]; then
   static=()
   skip_next=0
   for arg in "${PERF_ARGS[@]}"; do
      if [ "$skip_next" = "1" ]; then skip_next=0; continue; fi
      case "$arg" in
         --use-dynamic-batch-size) ;;
         --max-tokens-per-gpu) skip_next=1 ;;
         *) static+=("$arg") ;;
      esac
   done
   PERF_ARGS=("${static[@]}" --micro-batch-size 1)
fi

# extra `ray start` options of a platform (run-cpu.sh: CPU scheduling tokens for slime's actors)
RAY_START_ARGS=()

# numerics of slime's Qwen3-4B example; the platform launchers append to it
MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
)
