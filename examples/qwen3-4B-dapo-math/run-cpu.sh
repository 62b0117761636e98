#!/bin/bash
# The same recipe on a CPU-only machine: slime's own train.py under Ray with the plugin's flags
# (common.sh), a small Qwen3, NUM_ENGINES SGLang 0.5.15.post1 engines on the CPU (default 1, one
# fake GPU each: a cluster given by RAY_ADDRESS needs `ray start --num-gpus N`), --debug-rollout-only
# (slime's trainer needs a GPU: see examples/README.md). The real test tier runs this script.
#
#   bash scripts/real-stack/setup.sh          # builds .venv/slime-launcher (SGLang 0.5.15.post1)
#   PATH=$PWD/.venv/slime-launcher/bin:$PATH SLIME_DIR=<slime checkout> HF_CHECKPOINT=<small Qwen3> \
#       PROMPT_DATA=<jsonl> SAVE_DIR=<dir> MODE=copris bash examples/qwen3-4B-dapo-math/run-cpu.sh
#
# Any further argument goes to train.py. Only the hardware block below differs from run-h100.sh.
# Stop an earlier run first (ray stop --force); this script does not kill other processes.
set -euxo pipefail
export PYTHONUNBUFFERED=1
HERE_CPU="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
REPO="$(cd -- "${HERE_CPU}/../.." && pwd)"

# ---------------------------------------------------------------- hardware block: CPU
# The model's shape, read from the checkpoint's HF config (slime's model scripts spell it out by
# hand for the released models).
HF_CHECKPOINT=${HF_CHECKPOINT:?HF_CHECKPOINT must name a small Qwen3 (april_workbench.tiny_qwen3.build_tiny_qwen3 builds one)}
mapfile -t MODEL_ARGS < <(python3 - "${HF_CHECKPOINT}/config.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
args = {
    "--num-layers": c["num_hidden_layers"], "--hidden-size": c["hidden_size"],
    "--ffn-hidden-size": c["intermediate_size"], "--num-attention-heads": c["num_attention_heads"],
    "--num-query-groups": c["num_key_value_heads"], "--kv-channels": c["head_dim"],
    "--vocab-size": c["vocab_size"], "--max-position-embeddings": c["max_position_embeddings"],
    "--norm-epsilon": c["rms_norm_eps"], "--normalization": "RMSNorm", "--position-embedding-type": "rope",
    "--rotary-base": int((c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000))),
}
print("\n".join(f"{k}\n{v}" for k, v in args.items()))
for flag in ("--swiglu", "--group-query-attention", "--qk-layernorm", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights"):
    print(flag)
EOF
)

# sizes a CPU serves in seconds; every one can still be set from the environment
: "${ROLLOUT_BATCH_SIZE:=4}" "${N_SAMPLES_PER_PROMPT:=2}" "${ROLLOUT_MAX_RESPONSE_LEN:=32}"
: "${NUM_ROLLOUT:=3}" "${SAVE_INTERVAL:=1}" "${EVAL_INTERVAL:=none}" "${REF_LOAD:=${HF_CHECKPOINT}}"
: "${GLOBAL_BATCH_SIZE:=$((ROLLOUT_BATCH_SIZE * N_SAMPLES_PER_PROMPT))}"
export ROLLOUT_BATCH_SIZE N_SAMPLES_PER_PROMPT ROLLOUT_MAX_RESPONSE_LEN NUM_ROLLOUT SAVE_INTERVAL \
   EVAL_INTERVAL REF_LOAD GLOBAL_BATCH_SIZE

# shellcheck source-path=SCRIPTDIR source=common.sh
source "${HERE_CPU}/common.sh"

PERF_ARGS=(
   --tensor-model-parallel-size 1
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --micro-batch-size 1
)
SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 1
   # SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1 below)
   --sglang-device cpu
   --sglang-attention-backend torch_native
   --sglang-sampling-backend pytorch
   --sglang-disable-cuda-graph
   --sglang-dtype float32
   # an idle scheduler otherwise busy-polls about half a core
   --sglang-sleep-on-idle
   # on a CPU the KV pool is sized from the host's memory, all of it shared with the job: a small one
   --sglang-max-total-tokens "${SGLANG_MAX_TOTAL_TOKENS:-32768}"
   --sglang-max-running-requests 16
)
MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   # slime's Megatron trainer cannot start on a CPU; the rollout side runs whole
   --debug-rollout-only
)
# slime's actors each ask Ray for CPUs: scheduling tokens, not cores, on a 2-core machine
RAY_START_ARGS+=(--num-cpus "${RAY_NUM_CPUS:-8}")
# Ray runs its workers at nice 15 so the raylet stays responsive; on CPUs shared with other work that
# starves the job's own actors (slime's RolloutManager, its SGLang engine) behind any busy process
export RAY_worker_niceness="${RAY_worker_niceness:-0}"

# scripts/real-stack/sglang_cpu_site: slime's CPU accelerator, SGLang's CPU workarounds, in every
# process of the job (Ray's workers and the engines they start); EXTRA_PYTHONPATH: the folders of
# the job's own functions (a custom generate function, a reward)
RUNTIME_ENV_JSON="{
  \"env_vars\": {
    \"PYTHONPATH\": \"${REPO}/scripts/real-stack/sglang_cpu_site${EXTRA_PYTHONPATH:+:${EXTRA_PYTHONPATH}}\",
    \"SGLANG_USE_CPU_ENGINE\": \"1\",
    \"SLIME_HOST_IP\": \"${MASTER_ADDR:-127.0.0.1}\",
    \"OMP_NUM_THREADS\": \"${OMP_NUM_THREADS:-1}\"
  }
}"

# one fake GPU per engine: the engines' slots in slime's placement group (--colocate under
# --debug-rollout-only: slime starts one engine per GPU of the "actor", --rollout-num-gpus-per-engine 1)
run_slime "${NUM_ENGINES:-1}" "${RUNTIME_ENV_JSON}" "$@"
