# Shared part of every TailSieve recipe (sourced, not run): one sampling configuration per
# workload, Dr. GRPO, data/model paths, the replica layout, and the launch. A recipe sets its model
# and layout, picks one variant and calls `launch "$@"`; extra Hydra overrides given to the recipe
# are appended last, so they win.
#
# Environment (all optional):
#   MODEL_PATH          HF model directory or hub id (each recipe has a default)
#   WORKLOAD            math | code                                       (default: math)
#   DATA_DIR            output of scripts/prepare_data.py: $DATA_DIR/$WORKLOAD/{train,test}.parquet
#                                                                         (default: $HOME/data/tailsieve)
#   TRAIN_FILES, VAL_FILES  parquet files, overriding DATA_DIR
#   N_GPUS, NNODES      GPUs per node and nodes                           (default: 8, 1)
#   LOGGER              verl tracker list                                 (default: '["console","file"]')
#   PROJECT_NAME, EXPERIMENT_NAME  tracker names                          (default: tailsieve, <recipe>-<workload>)
#   VERL_FILE_LOGGER_ROOT  where verl's `file` tracker writes $PROJECT_NAME/$EXPERIMENT_NAME.jsonl
#                       (verl's own variable; exported absolute so the TaskRunner actor finds it)
#                                                                         (default: $PWD/logs)
#   TOTAL_STEPS, TRAIN_BATCH_SIZE  training steps and prompt groups per step (default: 30, 64)
#   MAX_PROMPT_LENGTH, MAX_RESPONSE_LENGTH, ROLLOUT_N  sizes of the workload's matched sampling
#                       (default: 1024, 8192 for math / 4096 for code, 8), the same in every variant
#   TEST_FREQ           validate on VAL_FILES every TEST_FREQ steps and before training, with the
#                       workload's stop strings in every arm (default: 10; -1 turns validation off)
#   ROLLOUT_DATA_DIR    if set, verl dumps every step's rollouts there (input of `tailsieve trace`)
#   TAILSIEVE_Q0, TAILSIEVE_M0  initial (q, m) of the adaptive variants   (default: 0, 0: one shared pool;
#                       with TAILSIEVE_M0 > 0, q0 = B/8)
#   PERF_MODEL          controller's concurrency-throughput model        (default: the recipe's model's rows of
#                       the bundled H200 tables, e.g. table:h200-dense:qwen3-8b; the recipe says which it borrows)
#   MTP_BULK_TOKENS, MTP_TAIL_TOKENS  MTP depth on bulk and tail replicas (default: 1 on every replica of the
#                       All-MTP variants; the TailSieve MTP recipes: the plan's, which they name); MTP_BULK_TOKENS
#                       may be a batch-size schedule [[b_lo,b_hi,k],...] there
#   MTP_SCHEDULE        dynamic-SD variants: vLLM's batch-size schedule [[b_lo,b_hi,k],...] on every replica
#                       (default: vLLM's documented [[1,64,3],[65,128,1],[129,256,0]]; its deepest k is the depth)
#   DFLASH_DRAFT_PATH, DFLASH_TOKENS  DFlash drafter for the target model, its block size (default: 8)
#   PYTHON              interpreter with verl and tailsieve-verl          (default: python3)
#   TAILSIEVE_DRY_RUN=1     compose and validate the full config against the installed verl, print
#                           the resolved sections, exit; no GPU, no download
#   TAILSIEVE_PRINT_ARGS=1  print the command the recipe would run, one argument per line, exit

RECIPE_NAME=$(basename "${0}" .sh)
PYTHON=${PYTHON:-python3}
WORKLOAD=${WORKLOAD:-math}
DATA_DIR=${DATA_DIR:-$HOME/data/tailsieve}
N_GPUS=${N_GPUS:-8}
NNODES=${NNODES:-1}
LOGGER=${LOGGER:-'["console","file"]'}
PROJECT_NAME=${PROJECT_NAME:-tailsieve}
EXPERIMENT_NAME=${EXPERIMENT_NAME:-${RECIPE_NAME}-${WORKLOAD}}
export VERL_FILE_LOGGER_ROOT=${VERL_FILE_LOGGER_ROOT:-$PWD/logs}
TOTAL_STEPS=${TOTAL_STEPS:-30}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-64}
MTP_SCHEDULE=${MTP_SCHEDULE:-[[1,64,3],[65,128,1],[129,256,0]]}
DFLASH_TOKENS=${DFLASH_TOKENS:-8}

# The code workload's reward runs model-written code in a sandbox (tailsieve_verl/code_sandbox.py):
# stop before launch, with one line, where this node cannot isolate it (docs/usage.md, "Code reward
# isolation"; TAILSIEVE_UNISOLATED_CODE_REWARD=1 opts into the unisolated runner).
require_code_isolation() {
  if [[ "${TAILSIEVE_PRINT_ARGS:-0}" != "1" ]]; then
    "${PYTHON}" -m tailsieve_verl.code_sandbox --check-isolation || exit 1
  fi
}

# One sampling configuration per workload, shared by every recipe, baseline and variant alike
# (matched sampling). n = 8 responses per prompt group.
case "${WORKLOAD}" in
  math) MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-1024}; MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-8192}; STOP="['<END>']" ;;
  code) MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-1024}; MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-4096}; STOP="[]"; require_code_isolation ;;
  *) echo "${RECIPE_NAME}: WORKLOAD must be math or code, got '${WORKLOAD}'" >&2; exit 2 ;;
esac
ROLLOUT_N=${ROLLOUT_N:-8}
TEST_FREQ=${TEST_FREQ:-10}
TEMPERATURE=1.0
TOP_P=1.0
TRAIN_FILES=${TRAIN_FILES:-${DATA_DIR}/${WORKLOAD}/train.parquet}
VAL_FILES=${VAL_FILES:-${DATA_DIR}/${WORKLOAD}/test.parquet}

ARGS=(
  # data: parquet from scripts/prepare_data.py; reward from tailsieve_verl/rewards.py
  "data.train_files=${TRAIN_FILES}"
  "data.val_files=${VAL_FILES}"
  "data.train_batch_size=${TRAIN_BATCH_SIZE}"
  "data.max_prompt_length=${MAX_PROMPT_LENGTH}"
  "data.max_response_length=${MAX_RESPONSE_LENGTH}"
  data.filter_overlong_prompts=True
  data.truncation=error
  reward.custom_reward_function.path=pkg://tailsieve_verl.rewards
  reward.custom_reward_function.name=compute_score

  # Dr. GRPO: group mean-centred advantages, no std division, sequence-sum loss normalised by a
  # constant (the max response length), no KL, no entropy bonus
  algorithm.adv_estimator=grpo
  algorithm.norm_adv_by_std_in_grpo=False
  algorithm.use_kl_in_reward=False
  actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm
  "actor_rollout_ref.actor.loss_scale_factor=${MAX_RESPONSE_LENGTH}"
  actor_rollout_ref.actor.use_kl_loss=False
  actor_rollout_ref.actor.entropy_coeff=0

  # policy update
  actor_rollout_ref.actor.optim.lr=1e-6
  "actor_rollout_ref.actor.ppo_mini_batch_size=${TRAIN_BATCH_SIZE}"
  actor_rollout_ref.actor.use_dynamic_bsz=True
  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$(( 2 * (MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH) ))"
  actor_rollout_ref.model.use_remove_padding=True
  actor_rollout_ref.model.enable_gradient_checkpointing=True

  # rollout: vLLM, matched sampling
  actor_rollout_ref.rollout.name=vllm
  "actor_rollout_ref.rollout.n=${ROLLOUT_N}"
  "actor_rollout_ref.rollout.temperature=${TEMPERATURE}"
  "actor_rollout_ref.rollout.top_p=${TOP_P}"
  actor_rollout_ref.rollout.top_k=-1
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
  "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$(( 2 * (MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH) ))"

  # trainer: verl's V1 trainer; each variant below picks its mode (stock `sync`, or `tailsieve`)
  trainer.use_v1=True
  # the workload's stop strings on every request, baselines and validation included (verl has no
  # rollout option for them: the plugin's agent-loop wrapper adds them in every trainer mode)
  "+tailsieve.stop=${STOP}"
  "trainer.logger=${LOGGER}"
  "trainer.project_name=${PROJECT_NAME}"
  "trainer.experiment_name=${EXPERIMENT_NAME}"
  "trainer.n_gpus_per_node=${N_GPUS}"
  "trainer.nnodes=${NNODES}"
  "trainer.total_training_steps=${TOTAL_STEPS}"
  # held-out score of every arm: before training and every TEST_FREQ steps
  "trainer.val_before_train=$([[ "${TEST_FREQ}" == "-1" ]] && echo False || echo True)"
  "trainer.test_freq=${TEST_FREQ}"
  trainer.save_freq=-1
)
if [[ -n "${ROLLOUT_DATA_DIR:-}" ]]; then
  ARGS+=("trainer.rollout_data_dir=${ROLLOUT_DATA_DIR}")
fi

# --- model and layout ---------------------------------------------------------------------------

# model PATH: the policy (and its MTP head, if any).
model() {
  MODEL_PATH=${MODEL_PATH:-$1}
  ARGS+=("actor_rollout_ref.model.path=${MODEL_PATH}")
}

# layout TP GPU_MEMORY_UTILIZATION PERF: replicas of TP GPUs each (R = N_GPUS * NNODES / TP);
# PERF is the controller's default concurrency-throughput model: the model's own bundled table rows
# (table:h200-dense:qwen3-8b), or the nearest ones, which the recipe names.
layout() {
  ROLLOUT_TP=$1
  PERF_MODEL=${PERF_MODEL:-$3}
  ARGS+=(
    "actor_rollout_ref.rollout.tensor_model_parallel_size=${ROLLOUT_TP}"
    "actor_rollout_ref.rollout.gpu_memory_utilization=$2"
  )
}

# Offload the FSDP actor's parameters and optimizer state to CPU between updates: the MoE models'
# full weights, gradients and Adam state do not fit next to the colocated vLLM engines otherwise.
offload_actor() {
  ARGS+=(
    actor_rollout_ref.actor.fsdp_config.param_offload=True
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
  )
}

# --- variants -----------------------------------------------------------------------------------

# Stock verl (the baseline that matters): verl's own sync trainer and router, every sample to the
# least-loaded replica. Only the workload's stop strings come from the plugin (its agent-loop wrapper,
# which it puts around verl's default agent loop at launch: verl 0.9.1 has no rollout option for
# them), so sampling, validation included, matches every TailSieve variant.
stock_verl() {
  ARGS+=(trainer.v1.trainer_mode=sync)
}

# All-MTP stock verl: MTP at the bulk depth on every replica, stock routing.
stock_verl_mtp() {
  stock_verl
  mtp_everywhere
}

# Stock verl with MTP on vLLM's batch-size schedule ("dynamic SD") on every replica: k falls by
# itself as a replica's running batch grows. The strongest stock configuration `tailsieve simulate`
# measures next to All-MTP (verl-dynsd); verl passes rollout.engine_kwargs.vllm.speculative_config
# into the MTP speculative config.
stock_verl_dynsd() {
  stock_verl
  mtp_schedule_everywhere "${MTP_SCHEDULE}"
}

# schedule_depth NAME SCHEDULE: the deepest k of a batch-size schedule [[b_lo,b_hi,k],...], or one
# error line naming the variable NAME that gave it.
schedule_depth() {
  "${PYTHON}" -c "import json, sys; print(max(k for _, _, k in json.loads(sys.argv[1])))" "$2" 2>/dev/null || {
    echo "${RECIPE_NAME}: $1 must be a JSON list of [batch_lo, batch_hi, k], got '$2'" >&2
    exit 2
  }
}

# MTP on vLLM's batch-size schedule $1 on every replica, at the schedule's deepest k.
mtp_schedule_everywhere() {
  local depth
  depth=$(schedule_depth MTP_SCHEDULE "$1")
  ARGS+=(
    actor_rollout_ref.model.mtp.enable=True
    actor_rollout_ref.model.mtp.enable_rollout=True
    actor_rollout_ref.model.mtp.method=mtp
    "actor_rollout_ref.model.mtp.num_speculative_tokens=${depth}"
    "+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.num_speculative_tokens_per_batch_size=$1"
  )
}

# The same-path control: TailSieve off, (q, m) = (0, 0) on the plugin's trainer mode, so every sample
# goes to the least-loaded replica of one pool, as stock verl routes, through the plugin's code path
# (its trainer, router and agent loop). Against stock verl (stock_verl) it isolates the plugin's
# overhead; the A/B baseline is stock verl. (+tailsieve.group_atomic=true would route whole groups,
# the paper's uniform group routing: no recipe does.)
same_path() {
  ARGS+=(trainer.v1.trainer_mode=tailsieve +tailsieve.enable=false)
}

# TailSieve on, in mode $1 (adaptive | fixed) starting from $2 tail replicas and q0 = $3 (default B/8; 0 at
# one shared pool, $2 = 0, which carries nothing).
tailsieve_on() {
  ARGS+=(
    trainer.v1.trainer_mode=tailsieve
    +tailsieve.enable=true
    "+tailsieve.mode=$1"
    "+tailsieve.q0=${TAILSIEVE_Q0:-${3:-$(( $2 > 0 ? TRAIN_BATCH_SIZE / 8 : 0 ))}}"
    "+tailsieve.tail_replicas=$2"
    "+tailsieve.perf_model=${PERF_MODEL}"
  )
}

# TailSieve routing-only: the controller adapts q (tail groups) and m (tail replicas).
tailsieve_adaptive() {
  tailsieve_on adaptive "${TAILSIEVE_M0:-0}"
}

# The model's native MTP head drafts on every replica at the bulk depth.
mtp_everywhere() {
  ARGS+=(
    actor_rollout_ref.model.mtp.enable=True
    actor_rollout_ref.model.mtp.enable_rollout=True
    actor_rollout_ref.model.mtp.method=mtp
    "actor_rollout_ref.model.mtp.num_speculative_tokens=${MTP_BULK_TOKENS:-1}"
  )
}

# The same-path control of the MTP variants: MTP at the bulk depth on every replica, stock verl's
# per-sample routing through the plugin's code path (its stock twin: stock_verl_mtp).
same_path_mtp() {
  same_path
  mtp_everywhere
}

# TailSieve with MTP per pool, the engines `tailsieve plan` ranks best among TailSieve's for the
# recipe's bundled profile (each MTP recipe names the plan's command and its pick):
#   tailsieve_mtp_tail M Q TAIL_K BULK: the split held at M tail replicas (engines are configured at
#     launch) while the controller adapts q from Q; the tail pool at depth TAIL_K, the bulk pool at a
#     depth or on a batch-size schedule [[b_lo,b_hi,k],...] (the plan's tailsieve-spec)
# TAILSIEVE_M0, TAILSIEVE_Q0, MTP_TAIL_TOKENS and MTP_BULK_TOKENS override the plan's values.
tailsieve_mtp_tail() {
  tailsieve_on fixed "${TAILSIEVE_M0:-$1}" "$2"
  local tail=${MTP_TAIL_TOKENS:-$3} bulk=${MTP_BULK_TOKENS:-$4} bulk_depth=${MTP_BULK_TOKENS:-$4}
  if [[ "${bulk}" == \[* ]]; then
    bulk_depth=$(schedule_depth MTP_BULK_TOKENS "${bulk}")
    ARGS+=("+tailsieve.bulk.spec_schedule=${bulk}")
  fi
  MTP_BULK_TOKENS=${bulk_depth} mtp_everywhere
  ARGS+=(
    +tailsieve.tail.mtp_enable=true
    "+tailsieve.tail.num_speculative_tokens=${tail}"
    "+tailsieve.bulk.num_speculative_tokens=${bulk_depth}"
  )
}

# tailsieve_mtp_dynsd M Q: adaptive TailSieve from (Q, M) with MTP on vLLM's batch-size schedule
# MTP_SCHEDULE on every replica: the tail pool's small batch picks the deep k by itself and the split
# stays free (the plan's tailsieve-dynsd).
tailsieve_mtp_dynsd() {
  tailsieve_on adaptive "${TAILSIEVE_M0:-$1}" "$2"
  mtp_schedule_everywhere "${MTP_SCHEDULE}"
}

# TailSieve with a DFlash drafter on the tail route only (vLLM >= 0.24 `method: dflash`; the bulk
# pool decodes without speculation). verl never updates the drafter's weights: it drafts for the
# initial policy, which lowers acceptance, not correctness, as the policy drifts.
tailsieve_dflash_tail() {
  if [[ -z "${DFLASH_DRAFT_PATH:-}" ]]; then
    echo "${RECIPE_NAME}: set DFLASH_DRAFT_PATH to a DFlash drafter trained for ${MODEL_PATH}" >&2
    exit 2
  fi
  tailsieve_on adaptive "${TAILSIEVE_M0:-1}"  # the tail engine is set at launch: a tail pool from the start
  ARGS+=("+tailsieve.tail.engine_kwargs={speculative_config:{method:dflash,model:'${DFLASH_DRAFT_PATH}',num_speculative_tokens:${DFLASH_TOKENS}}}")
}

# --- launch -------------------------------------------------------------------------------------

launch() {
  local entry=verl.trainer.main_ppo
  if [[ "${TAILSIEVE_DRY_RUN:-0}" == "1" ]]; then
    entry=tailsieve_verl.integration.dry_run
  fi
  local cmd=("${PYTHON}" -m "${entry}" "${ARGS[@]}" "$@")
  if [[ "${TAILSIEVE_PRINT_ARGS:-0}" == "1" ]]; then
    printf '%s\n' "${cmd[@]}"
    return 0
  fi
  exec "${cmd[@]}"
}
