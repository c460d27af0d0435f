#!/usr/bin/env bash
# The background jobs of a device session on a machine of 4 GPUs (benchmarks/gpu_x4_session.md), started by the call
# that brings the model they need; results under /tmp/res/JOB, logs in /tmp/bg (benchmarks/background.sh). Every
# eval process has its own KV pool (KV tokens), so jobs may share GPUs; never run benchmarks/gpu_tests.sh beside them.
#
#   benchmarks/gpu_x4_jobs.sh smollm2          # #27's SmolLM2 cells (this session's list below)
#   benchmarks/gpu_x4_jobs.sh qwen             # #27's Qwen2.5-Coder-0.5B cells
#   benchmarks/gpu_x4_jobs.sh more             # what ran after both, once SmolLM2's jobs had ended
#   benchmarks/gpu_x4_jobs.sh tests            # the GPU tests on GPUs 0-1 in the background (third session)
#   benchmarks/gpu_x4_jobs.sh third_smollm2 | third_qwen | third_after   # the third session's jobs (below)
#   benchmarks/gpu_x4_jobs.sh fourth_qwen      # what the third left of Qwen2.5's table: 8x whole, 16x
#   benchmarks/gpu_x4_jobs.sh tp_rest          # #32's remaining runs: QUEST and ReAttention over 3 GPUs
#   benchmarks/gpu_x4_jobs.sh tp_qwen          # #32 on a machine of 2 GPUs: Qwen2.5 (2 kv heads) over both
#   benchmarks/gpu_x4_jobs.sh tp_qwen_rest     # what tp_qwen's session left (results/tp_accuracy_qwen_h200.md)
#   benchmarks/gpu_x4_jobs.sh sixth_qwen       # #27 on 2 GPUs: Qwen2.5 at 32x, and the 4x/8x cells topped up to 20
#   benchmarks/gpu_x4_jobs.sh seventh_qwen     # #27 on 2 GPUs: what the sixth left (16x, QUEST and ReAttention at 8x)
#   benchmarks/gpu_x4_jobs.sh eighth_qwen      # #27 on GPUs 2-3: ReAttention's Qwen2.5 cells at 1x-8x (the issue's four
#                                              # policies there)
#   benchmarks/gpu_x4_jobs.sh smollm2_holes    # #27 on 2 GPUs (HOLES_GPU_FIRST, HOLES_GPUS): SmolLM2's table's cells
#                                              # under 20 samples, topped up
#   benchmarks/gpu_x4_jobs.sh theta07          # #27 on GPU THETA_GPU (default 0): TokenSelect at theta 0.7 on SmolLM2,
#                                              # the cells of the table's theta=0.8 column
#   benchmarks/gpu_x4_jobs.sh neighbours_smol  # #27: TokenSelect's runs of neighbours on the cells it loses and wins,
#   benchmarks/gpu_x4_jobs.sh neighbours_qwen  # SmolLM2's and Qwen2.5's (each once its model is carried)
#   benchmarks/gpu_x4_jobs.sh neighbours_smol_rest  # r = 16 on the SmolLM2 cells the eleventh session left
#   benchmarks/gpu_x4_jobs.sh eleventh_timings # #28 on GPU TIMINGS_GPU (default 1): ReAttention's radix top-k and
#                                              # TokenSelect's neighbours timed (below)
#   benchmarks/gpu_x4_jobs.sh fp8_keys_smol    # #28: TokenSelect with fp8 selection keys on SmolLM2's and Qwen2.5's
#   benchmarks/gpu_x4_jobs.sh fp8_keys_qwen    # tables' cells past the window (each once its model is carried)
#   benchmarks/gpu_x4_jobs.sh chunk_smol       # #28: TokenSelect with 512- and 2048-token prefill chunks on SmolLM2's
#                                              # cells past the window (GPU CHUNK_GPU, default 0)
#   benchmarks/gpu_x4_jobs.sh groups_smol      # #28: TokenSelect in 2048-token chunks of 512-query groups, chunk_smol's
#                                              # prompts (GPU CHUNK_GPU, default 0)
#   benchmarks/gpu_x4_jobs.sh timings          # #28 on GPU 0: the 128K before/after (both orders), the 32K batch sweep
#   benchmarks/gpu_x4_jobs.sh vote             # #27/#28 on GPU 2: ReAttention's vote kernel's tiles, a profiled prefill
#   benchmarks/gpu_x4_jobs.sh prompts GROUP    # here, before the session: build GROUP's prompts (to carry them)
#   benchmarks/gpu_x4_jobs.sh collect DEST     # every finished job's tarballs into DEST (a device call's $OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
bg=benchmarks/background.sh
smol=smollm2-135m-instruct
qwen=qwen2.5-coder-0.5b-instruct
qwen_tasks=niah_single_1,niah_single_2,number_string,niah_multikey_1  # Qwen2.5's table's four tasks
qwen_table=benchmarks/results/supporting/eval_qwen2.5_coder_0.5b_h200_predictions.jsonl.gz  # its answers so far
building=0  # 1: build the prompts of each job instead of starting it

copy_tree() {  # DEST [EXCLUDE...]: this tree (without .git and the EXCLUDEd paths) copied to DEST, for a background job
  # to run from: every device call re-syncs the working tree under a running process
  local dest=$1; shift
  mkdir -p "$dest" && tar cf - --exclude=.git "${@/#/--exclude=}" . | tar xf - -C "$dest"
}

job() {  # NAME VAR=VALUE... [-- PARTS]: benchmarks/gpu_real_eval.sh /tmp/res/NAME with those settings, in the background
  local name=$1; shift
  local vars=() parts=(eval)
  while (($#)); do if [[ $1 == -- ]]; then shift; parts=("$@"); break; fi; vars+=("$1"); shift; done
  if ((building)); then
    [[ " ${parts[*]} " == *" eval "* ]] || return 0
    env "${vars[@]}" bash -c 'python3 -m tokenselect.cli eval --model "$MODEL" --task "$TASKS" --lengths "$LENGTHS" \
      --samples "${SAMPLES:-20}" --chat "${CHAT:-off}" --prompts-only 2>&1 | tail -1'
  else
    env "${vars[@]}" "$bg" start "$name" benchmarks/gpu_real_eval.sh "/tmp/res/$name" "${parts[@]}"
  fi
}

smollm2() {
  # every selective policy inside the window with its new default (dense_until = the window): full attention's scores
  job smol_1x MODEL=$smol TASKS=passkey,number_string,niah_single_1,niah_single_2,niah_multikey_1,vt LENGTHS=1x \
    POLICIES="streaming infllm quest reattention" KV=20000 LIMIT=540
  # the within-window agreement (each selective policy with and without dense_until) and the Selection Cache on prose
  job smol_checks MODEL=$smol KV=40000 -- checks
  # the table's holes past the window
  job smol_quest MODEL=$smol TASKS=number_string,niah_single_1,niah_single_2 LENGTHS=2x,8x POLICIES=quest PER_TASK=1 \
    KV=70000 LIMIT=540
  job smol_reattention MODEL=$smol TASKS=number_string,niah_single_1,niah_single_2 LENGTHS=2x POLICIES=reattention \
    PER_TASK=1 KV=20000 LIMIT=540
  job smol_infllm8 MODEL=$smol TASKS=passkey,niah_multikey_1,vt LENGTHS=8x POLICIES=infllm PER_TASK=1 KV=70000 LIMIT=540
  job smol_dynamic MODEL=$smol TASKS=passkey,number_string,niah_single_1,niah_single_2 LENGTHS=1x,4x \
    POLICIES=full@dynamic:4 PER_TASK=1 KV=40000 LIMIT=540
}

qwen() {
  # full attention's missing cells, and InfLLM with its new default (it scored 30 at 1x without it)
  job qwen_niah MODEL=$qwen TASKS=niah_single_1,niah_single_2 LENGTHS=1x,2x,4x POLICIES="full infllm" PER_TASK=1 \
    KV=140000 LIMIT=${QWEN_LIMIT:-600}
  # two more tasks for the model that reads its window
  job qwen_tasks MODEL=$qwen TASKS=number_string,niah_multikey_1 LENGTHS=1x,2x,4x POLICIES="full tokenselect" \
    PER_TASK=1 KV=140000 LIMIT=${QWEN_LIMIT:-600}
}

more() {  # (2026-11-27, second session: started by hand with these settings, after the GPU tests)
  job qwen_infllm_tasks MODEL=$qwen TASKS=number_string,niah_multikey_1 LENGTHS=1x,2x,4x POLICIES=infllm PER_TASK=1 \
    KV=140000 LIMIT=330 GPUS=2
  job qwen_checks CUDA_VISIBLE_DEVICES=2 MODEL=$qwen KV=140000 -- checks
  job smol_16x MODEL=$smol TASKS=passkey,niah_multikey_1,vt LENGTHS=16x POLICIES="full infllm tokenselect streaming" \
    KV=140000 LIMIT=330 GPU_FIRST=3 GPUS=1
}

# The third session (2026-11-27): the GPU tests on GPUs 0-1 from the first call (`tests`), these beside them on
# GPUs 2-3, then `third_after` once the tests end (as it ran: on GPU 1, and the needle recall on GPUs 0 and 2).
third_smollm2() {  # full, TokenSelect and InfLLM's missing cells; streaming and YaRN's columns whole (cheap)
  local all=passkey,number_string,niah_single_1,niah_single_2,niah_multikey_1,vt,kv_retrieval,niah_single_3
  job smol_core MODEL=$smol TASKS=kv_retrieval,niah_single_3 LENGTHS=2x,8x,16x POLICIES="full tokenselect infllm" \
    PER_TASK=1 KV=140000 LIMIT=1300 GPU_FIRST=2 GPUS=2
  job smol_vt16 MODEL=$smol TASKS=vt LENGTHS=16x POLICIES="full infllm" KV=140000 LIMIT=1300 GPU_FIRST=2 GPUS=2
  job smol_cheap MODEL=$smol TASKS=$all LENGTHS=1x,2x,4x,8x,16x POLICIES="streaming full@yarn:4" PER_TASK=1 \
    KV=140000 LIMIT=1300 GPU_FIRST=2 GPUS=2
}

third_qwen() {  # Qwen2.5 at 8x its window (256K), and ReAttention with its default past the window
  job qwen_8x MODEL=$qwen TASKS=niah_single_1,niah_single_2,number_string,niah_multikey_1 LENGTHS=8x \
    POLICIES="full tokenselect infllm" PER_TASK=1 KV=270000 LIMIT=1300 GPU_FIRST=2 GPUS=2
  job qwen_reattention MODEL=$qwen TASKS=niah_single_1,niah_single_2 LENGTHS=2x,4x,8x POLICIES=reattention \
    PER_TASK=1 KV=270000 LIMIT=1300 GPU_FIRST=2 GPUS=2
}

third_after() {  # once the tests are done: QUEST, dynamic NTK and ReAttention's holes, needle recall at 8x and 16x
  local six=passkey,number_string,niah_single_1,niah_single_2,niah_multikey_1,vt
  local common=(MODEL=$smol PER_TASK=1 KV=140000 LIMIT=${AFTER_LIMIT:-300} GPU_FIRST=1 GPUS=1)
  job smol_quest "${common[@]}" TASKS=$six LENGTHS=2x,4x,8x,16x POLICIES=quest
  job smol_dynamic "${common[@]}" TASKS=$six LENGTHS=2x,8x,16x POLICIES=full@dynamic:4
  job smol_reattention "${common[@]}" TASKS=$six LENGTHS=4x,8x,16x POLICIES=reattention
  if ((building)); then return 0; fi
  local gpu_length gpu length
  for gpu_length in 0:8x 2:16x; do
    gpu=${gpu_length%:*} length=${gpu_length#*:}
    CUDA_VISIBLE_DEVICES=$gpu LIMIT=${RECALL_LIMIT:-250} "$bg" start "nr$length" \
      benchmarks/gpu_needle_recall.sh "/tmp/res/nr$length/run" "$length" 20 ruler_essay,prose default:
  done
}

# What the third session left for a fourth (each GPU its own share: a dense 256K prefill wants a GPU without
# neighbours; TokenSelect and InfLLM's processes share well)
fourth_qwen() {  # on 4 GPUs as listed; on 2: full attention and ReAttention on GPU 0, the others on GPU 1
  local common=(MODEL=$qwen PER_TASK=1 LIMIT=${FOURTH_LIMIT:-1300})
  local n; n=$(nvidia-smi -L | wc -l)
  # KV: 16x is 524,288 prompt tokens, 8x 262,144 (the pool holds a prompt and its answer)
  job qwen_full8 "${common[@]}" KV=280000 TASKS=$qwen_tasks LENGTHS=8x POLICIES=full GPU_FIRST=0 GPUS=$((n < 4 ? 1 : 2))
  job qwen_ts16 "${common[@]}" KV=540000 TASKS=$qwen_tasks LENGTHS=16x POLICIES=tokenselect GPU_FIRST=$((n < 4 ? 1 : 2)) GPUS=1
  job qwen_infllm8 "${common[@]}" KV=280000 TASKS=$qwen_tasks LENGTHS=8x POLICIES=infllm GPU_FIRST=$((n < 4 ? 1 : 3)) GPUS=1
  job qwen_reattention48 "${common[@]}" KV=280000 TASKS=$qwen_tasks LENGTHS=4x,8x POLICIES=reattention \
    GPU_FIRST=$((n < 4 ? 0 : 3)) GPUS=1
}

# The sixth session (2 GPUs): TokenSelect at 32x (1M tokens) alone on GPU 0; on GPU 1 the cells left under 20
# samples, each run starting from the table's answers (RESUME_FROM), and QUEST's three missing 4x tasks.
sixth_qwen() {
  local common=(MODEL=$qwen PER_TASK=1 LIMIT=${SIXTH_LIMIT:-1200} GPUS=1)
  job qwen_ts32 "${common[@]}" KV=1060000 TASKS=$qwen_tasks LENGTHS=32x POLICIES=tokenselect GPU_FIRST=0
  job qwen_topup "${common[@]}" KV=280000 TASKS=$qwen_tasks LENGTHS=4x,8x RESUME_FROM=$qwen_table \
    POLICIES="quest reattention infllm tokenselect" GPU_FIRST=1
}

# What the sixth session left of Qwen2.5's table (not yet run), each run starting from the table's answers. GPU 0:
# QUEST at 8x to 20 samples then 16x (QUEST records CUDA graphs since the sixth session: its 4x prefill took 22 s a
# sample beside 15 other runs before), InfLLM at 16x. GPU 1: ReAttention at 8x (the slow one: about 50 s a sample
# at 4x beside others), full attention at 16x (a dense 512K prefill; 0 on every task at 8x).
seventh_qwen() {
  local common=(MODEL=$qwen PER_TASK=1 LIMIT=${SEVENTH_LIMIT:-1200} GPUS=1 RESUME_FROM=$qwen_table)
  job qwen_quest_infllm "${common[@]}" KV=540000 TASKS=$qwen_tasks LENGTHS=8x,16x POLICIES="quest infllm" GPU_FIRST=0
  job qwen_reattention_full "${common[@]}" KV=540000 TASKS=$qwen_tasks LENGTHS=8x,16x POLICIES="reattention full" GPU_FIRST=1
}

# What the issue names for Qwen2.5 at 1x-8x (full, TokenSelect, ReAttention, InfLLM) and the table still lacks:
# ReAttention with its default at 1x, at 2x on number_string and niah_multikey_1, and at 8x (1-3 samples a cell)
eighth_qwen() {
  local common=(MODEL=$qwen POLICIES=reattention PER_TASK=1 LIMIT=${EIGHTH_LIMIT:-1200} RESUME_FROM=$qwen_table)
  job qwen_reattention_short "${common[@]}" KV=70000 TASKS=$qwen_tasks LENGTHS=1x,2x GPUS=1 GPU_FIRST=3
  job qwen_reattention_8x "${common[@]}" KV=280000 TASKS=$qwen_tasks LENGTHS=8x GPUS=2 GPU_FIRST=2
}

# The Selection Cache at theta 0.7 (the issue asks for 0.9, 0.8 and 0.7 with the accuracy each costs): the cells of the
# SmolLM2 table's theta=0.8 column (six tasks at 1x and 4x), one process a task
theta07() {
  job smol_theta07 MODEL=$smol TASKS=passkey,number_string,niah_single_1,niah_single_2,niah_multikey_1,vt LENGTHS=1x,4x \
    POLICIES="tokenselect:theta=0.7" PER_TASK=1 KV=40000 LIMIT=${THETA_LIMIT:-600} GPUS=1 GPU_FIRST=${THETA_GPU:-0}
}

# TokenSelect with runs of neighbours (``neighbours``: a token's vote is the best within r tokens) on the cells it loses
# to ReAttention's spans and InfLLM's blocks (supporting/needle_answers_qwen_multikey.md), and on the cells it wins
# (to see what the runs cost there): runs of 9 and of 33 tokens. The models come in different calls, so a group each:
# SmolLM2's on GPU NEIGHBOURS_GPU (default 0), Qwen2.5's on GPU QWEN_NEIGHBOURS_GPU (default 1), its cells
# QWEN_NEIGHBOURS_TASKS at QWEN_NEIGHBOURS_LENGTHS (default the table's four tasks at 4x and 8x)
neighbours_policies="tokenselect:neighbours=4 tokenselect:neighbours=16"
neighbours_smol() {
  job smol_neighbours MODEL=$smol TASKS=number_string,niah_single_1,niah_single_2,niah_multikey_1 LENGTHS=4x,16x \
    POLICIES="$neighbours_policies" PER_TASK=1 KV=140000 LIMIT=${NEIGHBOURS_LIMIT:-900} GPUS=1 \
    GPU_FIRST=${NEIGHBOURS_GPU:-0}
}
neighbours_smol_rest() {  # what SmolLM2's table lacks before r = 16 could be the default: its other four tasks at 4x
  # and 16x, and every task at 2x and 8x (16 processes, one a task and length group)
  local eight=passkey,number_string,kv_retrieval,niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,vt
  local common=(MODEL=$smol POLICIES=tokenselect:neighbours=16 PER_TASK=1 KV=140000 LIMIT=${NEIGHBOURS_LIMIT:-900}
                GPUS=1 GPU_FIRST=${NEIGHBOURS_GPU:-0})
  job smol_neighbours_rest "${common[@]}" TASKS=passkey,vt,kv_retrieval,niah_single_3 LENGTHS=4x,16x
  job smol_neighbours_2x8x "${common[@]}" TASKS=$eight LENGTHS=2x,8x
}
neighbours_qwen() {
  job qwen_neighbours MODEL=$qwen TASKS=${QWEN_NEIGHBOURS_TASKS:-$qwen_tasks} LENGTHS=${QWEN_NEIGHBOURS_LENGTHS:-4x,8x} \
    POLICIES="$neighbours_policies" PER_TASK=1 KV=280000 LIMIT=${NEIGHBOURS_LIMIT:-900} GPUS=1 \
    GPU_FIRST=${QWEN_NEIGHBOURS_GPU:-1}
}

# The eleventh session's timings (2 GPUs; #28), from a copy of the tree with .carry/before packed at 42abf56, the last
# commit before ReAttention's winners went through the kernels' radix top-k: the Qwen2.5-0.5B shape at 128K, that tree
# against this one in both orders (ReAttention's decode step; TokenSelect, its hit path and dense must not move), then
# what TokenSelect's neighbours cost a step (runs of 9 and 33 tokens) on the Qwen2.5 and the Llama-3-8B shapes
eleventh_timings() {
  copy_tree /tmp/repo_timings .carry/parts
  (cd /tmp/repo_timings && CUDA_VISIBLE_DEVICES=${TIMINGS_GPU:-1} "$bg" start timings bash -c '
    export out=/tmp/res/timings PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    mkdir -p $out
    export POLICIES=dense,reattention,tokenselect,tokenselect:theta=-1 E2E_ARGS="--config qwen2.5-0.5b"
    benchmarks/before_after_e2e.sh both $out/qwen
    spread=tokenselect,tokenselect:neighbours=4,tokenselect:neighbours=16
    python3 -m tokenselect.cli bench e2e --config qwen2.5-0.5b --lengths 128k --decode-steps 32 --policies $spread \
      --output $out/neighbours_qwen > $out/neighbours_qwen.log 2>&1
    python3 -m tokenselect.cli bench e2e --lengths 128k --decode-steps 32 --policies dense,$spread,tokenselect:theta=-1 \
      --output $out/neighbours_llama > $out/neighbours_llama.log 2>&1
    tar czf $out/timings.tgz -C $out qwen neighbours_qwen neighbours_qwen.log neighbours_llama neighbours_llama.log')
}

# SmolLM2's table (results/eval_smollm2_h100.md): the issue's eight policies over its eight tasks at 1x-16x, each
# run starting from the table's answers, so that only the cells under 20 samples run (as of the sixth session:
# dynamic NTK 620 samples in 32 cells, ReAttention 511 in 29, QUEST 435 in 23, YaRN 70, InfLLM 20, full 4; the
# others none: their runs build no engine). The three with most to do get a process per task.
smollm2_holes() {
  local eight=passkey,number_string,kv_retrieval,niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,vt
  local table=benchmarks/results/supporting/eval_smollm2_h100_predictions.jsonl.gz
  local common=(MODEL=$smol TASKS=$eight LENGTHS=1x,2x,4x,8x,16x KV=140000 LIMIT=${HOLES_LIMIT:-1200}
                GPU_FIRST=${HOLES_GPU_FIRST:-0} GPUS=${HOLES_GPUS:-2} RESUME_FROM=$table)
  job smol_holes_many "${common[@]}" PER_TASK=1 POLICIES="full@dynamic:4 reattention quest"
  job smol_holes_few "${common[@]}" POLICIES="full full@yarn:4 infllm streaming tokenselect"
}

# fp8 selection keys (--select-dtype fp8) may become TokenSelect's default only where the real models lose nothing
# (#28): TokenSelect's cells past the window, compared answer by answer (benchmarks/paired_answers.py) with the same
# cells run with bf16 keys on the same machine (KEYS=bf16: the control, job names *_bf16_keys). SmolLM2: the five
# tasks it scores above zero, 2x-16x; Qwen2.5: its four tasks at 2x and 4x (8x takes about 30 s a sample). One
# process a task, on GPU FP8_GPU (default 0).
keys=${KEYS:-fp8}
keys_flags=$([ "$keys" = fp8 ] && echo "--select-dtype fp8" || true)
fp8_keys_smol() {
  job smol_${keys}_keys MODEL=$smol TASKS=passkey,number_string,niah_single_1,niah_single_2,niah_multikey_1 \
    LENGTHS=2x,4x,8x,16x POLICIES=tokenselect FLAGS="$keys_flags" PER_TASK=1 KV=140000 \
    LIMIT=${FP8_LIMIT:-600} GPUS=1 GPU_FIRST=${FP8_GPU:-0}
}
fp8_keys_qwen() {
  job qwen_${keys}_keys MODEL=$qwen TASKS=$qwen_tasks LENGTHS=2x,4x POLICIES=tokenselect FLAGS="$keys_flags" \
    PER_TASK=1 KV=140000 LIMIT=${FP8_LIMIT:-600} GPUS=1 GPU_FIRST=${FP8_GPU:-0}
}
chunk_smol() {  # #28: TokenSelect's prefill chunk of 512 tokens (the default) against 2048, side by side on one GPU
  for chunk in 512 2048; do
    job smol_chunk$chunk MODEL=$smol TASKS=passkey,number_string,niah_single_1,niah_single_2,niah_multikey_1 \
      LENGTHS=2x,4x,8x,16x POLICIES=tokenselect FLAGS="--chunk-size $chunk" PER_TASK=1 KV=140000 \
      LIMIT=${CHUNK_LIMIT:-480} GPUS=1 GPU_FIRST=${CHUNK_GPU:-0}
  done
}
groups_smol() {  # #28: TokenSelect in 2048-token prefill chunks whose groups of 512 queries choose (prefill_group), on
  # chunk_smol's prompts: paired with its 512-token run (benchmarks/paired_answers.py)
  job smol_groups2048 MODEL=$smol TASKS=passkey,number_string,niah_single_1,niah_single_2,niah_multikey_1 \
    LENGTHS=2x,4x,8x,16x POLICIES=tokenselect FLAGS="--chunk-size 2048" PER_TASK=1 KV=140000 \
    LIMIT=${CHUNK_LIMIT:-480} GPUS=1 GPU_FIRST=${CHUNK_GPU:-0}
}

case "${1:-}" in
  sixth_qwen|seventh_qwen|eighth_qwen|smollm2_holes|theta07|neighbours_smol|neighbours_smol_rest|neighbours_qwen|eleventh_timings|fp8_keys_smol|fp8_keys_qwen|chunk_smol|groups_smol) "$1" ;;
  tests)  # the GPU tests on GPUs 0 and 1 (or TESTS_GPUS="2 3"), in the background, from a copy of the tree with the
    # embedded model
    copy_tree /tmp/repo_tests .carry
    (cd /tmp/repo_tests && GPU_TESTS_GPUS="${TESTS_GPUS:-0 1}" GRAPH_SHARDS=4 GPU_TESTS_LIMIT=900 \
      TREE_COMMIT=${TREE_COMMIT:-} "$bg" start tests benchmarks/gpu_tests.sh /tmp/res/tests/run 4) ;;
  timings)  # #28 on GPU TIMINGS_GPU (default 0), from a copy of the tree with .carry/before: the 128K before/after of
    # the packed tree against this one in both orders (a tree's difference, not the order's), then the 32K batch sweep
    copy_tree /tmp/repo_timings .carry/parts
    (cd /tmp/repo_timings && CUDA_VISIBLE_DEVICES=${TIMINGS_GPU:-0} "$bg" start timings bash -c '
      export POLICIES=dense,tokenselect,tokenselect:theta=-1 out=/tmp/res/timings PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
      mkdir -p $out
      benchmarks/before_after_e2e.sh both $out/before_after
      benchmarks/gpu_throughput.sh $out/throughput --kv-cache-tokens 430000 --batch-sizes 1,4,8 \
        --policies dense,full,tokenselect,tokenselect:theta=-1
      tar czf $out/timings.tgz -C $out before_after throughput') ;;
  vote)  # #27/#28 on GPU VOTE_GPU (default 2): ReAttention's vote kernel over tiles and splits (its table printed when
    # done), then a Qwen2.5-0.5B-shaped model's 128K prefill and decode under each selective policy, profiled
    copy_tree /tmp/repo_vote .carry
    (cd /tmp/repo_vote && CUDA_VISIBLE_DEVICES=${VOTE_GPU:-2} "$bg" start vote bash -c '
      out=/tmp/res/vote; mkdir -p $out; export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
      python3 benchmarks/reattention_vote_gpu.py --out $out/vote > $out.log 2>&1
      python3 -m tokenselect.cli bench e2e --config qwen2.5-0.5b --lengths 128k --decode-steps 16 --profile-steps 2 \
        --policies dense,tokenselect,reattention,quest --output $out/e2e
      tar czf $out/vote.tgz -C $out vote e2e') ;;
  third_smollm2|third_qwen|third_after|fourth_qwen) "$1" ;;
  smollm2) smollm2 ;;
  qwen) qwen ;;
  more) more ;;
  prompts) building=1; "${2:?smollm2, qwen, more, or a third_ or fourth_ group}" ;;
  tp_rest)  # what #32 still lacks: QUEST and ReAttention over 3 GPUs (their one-GPU runs again beside them)
    POLICIES="quest reattention" LIMIT=${LIMIT:-540} TP_LIMIT=${TP_LIMIT:-240} \
      $bg start tp_rest benchmarks/gpu_tp_accuracy.sh /tmp/res/tp_rest
    ;;
  tp_qwen)  # Qwen2.5-Coder-0.5B over 2 GPUs, one job of three rounds, most wanted first (each round's own tarball):
    # QUEST (never run over several GPUs) with the one-GPU runs of all three 4x policies first, side by side;
    # ReAttention (the slow one: about 20 s a sample at 2x alone, so one task at 2x; its one-GPU run is the eval
    # table's, on the same prompts); then TokenSelect and InfLLM, SmolLM2's finding on a second model.
    tp=(MODEL=$qwen TP=2 KV=140000)
    $bg start tp_qwen bash -c "
      env ${tp[*]} POLICIES=quest TP1_POLICIES='quest tokenselect infllm' LIMIT=${TP1_LIMIT:-200} \
        TP_LIMIT=${QUEST_LIMIT:-200} benchmarks/gpu_tp_accuracy.sh /tmp/res/tp_qwen/quest
      env ${tp[*]} POLICIES=reattention TP1_POLICIES= TASKS=niah_single_2 LENGTHS=2x \
        TP_LIMIT=${REATTENTION_LIMIT:-240} benchmarks/gpu_tp_accuracy.sh /tmp/res/tp_qwen/reattention
      env ${tp[*]} POLICIES='tokenselect infllm' TP1_POLICIES= TP_LIMIT=${REST_LIMIT:-150} \
        benchmarks/gpu_tp_accuracy.sh /tmp/res/tp_qwen/rest"
    ;;
  tp_qwen_rest)  # what the fifth session left of #32, in the order it is wanted, with the times it measured: an
    # engine starts in about 75 s; over 2 ranks ReAttention at 2x takes about 20 s a sample alone on one GPU, QUEST
    # at 4x 11-13 s, InfLLM at 4x about 5 s. The one-GPU runs of QUEST and InfLLM on niah_single_2 come first.
    tp=(MODEL=$qwen TP=2 KV=140000)
    $bg start tp_qwen_rest bash -c "
      env ${tp[*]} POLICIES=reattention TP1_POLICIES= TASKS=niah_single_2 LENGTHS=2x \
        TP_LIMIT=${REATTENTION_LIMIT:-500} benchmarks/gpu_tp_accuracy.sh /tmp/res/tp_qwen_rest/reattention
      env ${tp[*]} POLICIES='quest infllm' TP1_POLICIES='quest infllm' TASKS=niah_single_2 LIMIT=${TP1_LIMIT:-360} \
        TP_LIMIT=${REST_LIMIT:-360} benchmarks/gpu_tp_accuracy.sh /tmp/res/tp_qwen_rest/quest_infllm"
    ;;
  collect)
    dest=${2:?dest}
    $bg status
    for d in /tmp/res/*/; do
      job=$(basename "$d")
      [ -f "/tmp/bg/$job.rc" ] || { echo "$job still running: not collected"; continue; }
      for f in "$d"*.tgz; do if [ -e "$f" ]; then cp "$f" "$dest/${job}_$(basename "$f")"; fi; done
      # a job of rounds (tp_qwen, tp_qwen_rest) keeps a tarball a round
      for f in "$d"*/*.tgz; do if [ -e "$f" ]; then cp "$f" "$dest/${job}_$(basename "$(dirname "$f")")_$(basename "$f")"; fi; done
      # the checks part writes a folder, not a tarball
      if [ -d "$d/checks" ]; then tar czf "$dest/${job}_checks.tgz" -C "$d" checks; fi
      # the GPU tests write a folder too (the needle recall's folder comes with its own tarball)
      if [ -d "$d/run" ] && [ ! -e "$d/run.tgz" ]; then tar czf "$dest/${job}_run.tgz" -C "$d" run; fi
    done
    tar czf "$dest/bg_logs.tgz" -C /tmp bg
    ls -l "$dest" ;;
  *) sed -n '2,10p' "$0"; exit 2 ;;
esac
