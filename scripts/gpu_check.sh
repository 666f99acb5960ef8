#!/usr/bin/env bash
# One device call: install, run the GPU tests, then the named benchmark steps; every log and
# JSON goes to $OUT (default: out/). Usage on a GPU machine, from the repository root:
#   bash scripts/gpu_check.sh tests gemm attention loop
# Steps: tests (pytest -m gpu), gemm (GEMM tuning benchmark on a subset), attention (the
# attention tuning benchmark on one problem), loop (primus-tune loop on tiny and on
# llama3-8b with 2 layers), preflight (this machine's GPUs), enable (examples/llama_train.py
# under primus_perf.enable with an offline-tuned cache: routed-call check and the
# interleaved overhead benchmark), confirm (that cache's choices and a qwen3 MoE grouped
# cache confirmed in the step: primus-tune confirm), online (benchmarks/runtime/online_tuning.py), online-compile (the
# same with train.compile=true), online-moe (online grouped-GEMM tuning on an MoE preset, 100
# steps), moe (the grouped-GEMM backends and the tuned choice), moe-e2e (three MoE presets,
# tuned vs loop vs always-_grouped_mm), fsdp2 (llama3-8b full depth on 2 GPUs), multi-gpu
# (tuning on every GPU against one), loop-moe (primus-tune loop on an MoE preset); on 8 GPUs
# (benchmarks/trainer/eight_gpus.py, one call each: 10 minutes a call) eight-fsdp, eight-tp, eight-ep
# (llama3-70b FSDP2 / TP=8, deepseek-v3 EP=8: traces, report, losses, tuned vs default) and
# eight-checks (preflight and tuning with 8 workers); fp8-tests (the FP8 GPU tests), fp8
# (benchmarks/fp8/fp8_loop.py: llama3-8b and qwen2.5-7b), fp8-moe (its MoE FP8 grouped GEMMs),
# never-slower (benchmarks/runtime/never_slower.py: MoE cases, the dense loop, the example with the
# cache `confirm` left; never-slower-loop and never-slower-example alone; never-slower-quickstart[:CASE,..]:
# primus-tune loop as a user runs it on tiny, llama3-8b 2 layers and qwen3 2 layers, the cache it left
# against no cache, and the example under enable() with the dense loop's cache), routing
# (benchmarks/runtime/routing_overhead.py), hf-moe (the foreign grouped GEMM GPU tests and
# benchmarks/moe/hf_moe_e2e.py).
# recipe:PRESET:CONFIGS, recipe-equality and tests-trainer: the trainer's speed knobs at a fixed
# recipe (benchmarks/trainer/recipe_sweep.py) and the GPU tests of the trainer's paths.
# step:CASE,...[:MINUTES]: primus-tune step on benchmarks/trainer/step_tuner.py's cases (MINUTES, else
# STEP_BUDGET_MIN, each). step-script:CASE,...[:MINUTES]: primus-tune step -- SCRIPT on
# benchmarks/trainer/step_tuner_script.py's cases (STEP_SCRIPT_LEVERS: some levers; STEP_TUNE_ARGS: more
# options; STEP_SCRIPT_REPRODUCE:
# plan runs between default runs with launch --plan).
# On a machine of several GPUs, scripts/gpu_parallel.sh runs a list of steps on each GPU at once.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source scripts/device_env.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/device.txt"
python -c "import json, primus_perf.base.devices as d; print(json.dumps(d.library_versions()))" | tee -a "$OUT/device.txt"
for step in "$@"; do
  echo "=== $step"
  case "$step" in
    tests)
      TRITON_INTERPRET=0 python -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    gemm)
      python benchmarks/gemm/gemm_tuning.py --cache /tmp/gemm_cache.json --max-s "${GEMM_MAX_S:-90}" \
        --out "$OUT/gemm_tuning_subset.json" 2>&1 | tail -15 ;;
    attention)
      python benchmarks/attention/attention_tuning.py --problems "${ATTN_PROBLEM:-b16_h16_s1024_d64_causal}" \
        --out "$OUT/attention_tuning_one.json" 2>&1 | tail -15 ;;
    loop)
      primus-tune loop --config tiny --out /tmp/loop_tiny 2>&1 | tee "$OUT/loop_tiny.log" | tail -12
      primus-tune loop --config llama3-8b --out /tmp/loop_8b model.n_layers=2 train.seq_len=2048 2>&1 \
        | tee "$OUT/loop_llama3-8b.log" | tail -30 ;;
    recipe:*)  # recipe:PRESET:config,config,... (benchmarks/trainer/recipe_sweep.py)
      IFS=: read -r _ preset configs <<< "$step"
      python benchmarks/trainer/recipe_sweep.py --preset "$preset" --configs ${configs//,/ } \
        --budget-s "${RECIPE_BUDGET_S:-420}" --out "$OUT/recipe_sweep.json" 2>&1 | tee -a "$OUT/recipe_sweep.log" | tail -20 ;;
    step:*)  # step:CASE[,CASE...][:MINUTES] (benchmarks/trainer/step_tuner.py: primus-tune step, its plan against the default)
      IFS=: read -r _ cases minutes <<< "$step"
      python benchmarks/trainer/step_tuner.py --cases ${cases//,/ } --budget-min "${minutes:-${STEP_BUDGET_MIN:-18}}" \
        --tune-args="${STEP_TUNE_ARGS:-}" \
        --workdir "$OUT/step_tuner" --out "$OUT/step_tuner.json" 2>&1 | tee -a "$OUT/step_tuner.log" | tail -8 ;;
    step-script:*)  # step-script:CASE[,CASE...][:MINUTES] (benchmarks/trainer/step_tuner_script.py: primus-tune step
      # -- SCRIPT as a user runs it, then its plan reproduced by python -m primus_perf.launch --plan)
      IFS=: read -r _ cases minutes <<< "$step"
      python benchmarks/trainer/step_tuner_script.py --cases ${cases//,/ } --budget-min "${minutes:-${STEP_BUDGET_MIN:-18}}" \
        ${STEP_SCRIPT_LEVERS:+--levers $STEP_SCRIPT_LEVERS} --reproduce "${STEP_SCRIPT_REPRODUCE:-2}" \
        --tune-args="${STEP_TUNE_ARGS:-}" \
        --workdir "$OUT/step_script" --out "$OUT/step_tuner_script.json" 2>&1 | tee -a "$OUT/step_tuner_script.log" | tail -8 ;;
    recipe-equality)
      python benchmarks/trainer/recipe_sweep.py --equality --out "$OUT/recipe_sweep.json" 2>&1 | tail -3 ;;
    tests-trainer)
      TRITON_INTERPRET=0 python -m pytest -m gpu -q -p no:cacheprovider tests/trainer/test_trainer.py tests/trainer/test_moe.py \
        tests/kernels/test_grouped_default.py tests/kernels/test_grouped_gemm.py tests/tuner/test_fp8_gpu.py tests/trainer/test_recipe.py 2>&1 \
        | tee "$OUT/gpu_tests_trainer.log" | tail -8 ;;
    routing)
      python benchmarks/runtime/routing_overhead.py --result "$OUT/routing_overhead.json" 2>&1 | tail -4 ;;
    never-slower-loop)
      python benchmarks/runtime/never_slower.py --out "$OUT/never_slower.json" --blocks 6 --block-steps 6 loop 2>&1 \
        | tee "$OUT/never_slower_loop.log" | tail -4 ;;
    never-slower-quickstart*)  # never-slower-quickstart[:CASE,...]: primus-tune loop as a user runs it, then
      # the cache it left against no cache; then examples/llama_train.py under enable() with the dense loop's cache
      IFS=: read -r _ cases <<< "$step"
      python benchmarks/runtime/never_slower.py --out "$OUT/never_slower.json" --workdir /tmp/quickstart --blocks 6 \
        --block-steps 6 quickstart ${cases:+--cases ${cases//,/ }} 2>&1 | tee "$OUT/never_slower_quickstart.log" | tail -8
      cp /tmp/quickstart/*.log "$OUT/" 2>/dev/null
      if [ -f /tmp/quickstart/llama3-8b-2l/tuning_cache.json ]; then
        python benchmarks/runtime/never_slower.py --out "$OUT/never_slower.json" --pairs 5 example \
          --cache /tmp/quickstart/llama3-8b-2l/tuning_cache.json 2>&1 | tee -a "$OUT/never_slower_quickstart.log" | tail -2
      fi ;;
    never-slower-example)
      python benchmarks/runtime/never_slower.py --out "$OUT/never_slower.json" --pairs 5 example \
        --cache /tmp/enable_offline.json 2>&1 | tee "$OUT/never_slower_example.log" | tail -2 ;;
    preflight)
      primus-profile preflight --json "$OUT/preflight.json" -o "$OUT/preflight.html" 2>&1 | tail -40 ;;
    enable)
      # the example's problems: one online run writes them; then tuned offline like any problems file
      python -m primus_perf.launch --cache /tmp/enable_online.json --online -- examples/llama_train.py --steps 12 \
        2>&1 | tail -5
      python -c "import json, sys; from primus_perf.cache.store import TuningCache; \
json.dump([{'kind': e.kind, 'problem': e.problem} for e in TuningCache(sys.argv[1]).entries()], \
open(sys.argv[2], 'w'))" /tmp/enable_online.json /tmp/example_problems.json
      primus-tune gemm --problems /tmp/example_problems.json --cache /tmp/enable_offline.json --budget-s 2 2>&1 | tail -3
      python examples/llama_train.py --cache /tmp/enable_offline.json --steps 12 --check 2>&1 | tee "$OUT/example_check.log" | tail -15
      python benchmarks/runtime/enable_overhead.py --cache /tmp/enable_offline.json --result "$OUT/enable_overhead.json" 2>&1 | tail -8 ;;
    confirm)
      # the example's offline cache (as `enable` makes it), then each choice A/B timed against
      # torch's inside the example's steps; a qwen3 MoE's grouped cache, confirmed in primus-train
      if [ ! -f /tmp/enable_offline.json ]; then
        python -m primus_perf.launch --cache /tmp/enable_online.json --online -- examples/llama_train.py --steps 12 \
          2>&1 | tee "$OUT/confirm_online.log" | grep -E "online gemm|tuning cache" | tail -20
        python -c "import json, sys; from primus_perf.cache.store import TuningCache; \
json.dump([{'kind': e.kind, 'problem': e.problem} for e in TuningCache(sys.argv[1]).entries()], \
open(sys.argv[2], 'w'))" /tmp/enable_online.json /tmp/example_problems.json
        primus-tune gemm --problems /tmp/example_problems.json --cache /tmp/enable_offline.json --budget-s 2 2>&1 | tail -3
      fi
      cp /tmp/enable_offline.json "$OUT/confirm_llama_before.json"
      primus-tune confirm --cache /tmp/enable_offline.json -- examples/llama_train.py --steps 40 2>&1 \
        | tee "$OUT/confirm_llama.log" | tail -25
      cp /tmp/enable_offline.json "$OUT/confirm_llama_after.json"
      MOE="${MOE_PRESET:-qwen3-30b-a3b} ${MOE_OVERRIDES:-model.n_layers=2 model.vocab_size=32000 train.seq_len=4096 train.micro_batch=1}"
      primus-tune grouped-gemm --config $MOE --steps 2 --cache /tmp/confirm_moe.json --budget-s 2 2>&1 | tail -3
      cp /tmp/confirm_moe.json "$OUT/confirm_moe_before.json"
      primus-tune confirm --cache /tmp/confirm_moe.json --config $MOE --steps 30 2>&1 | tee "$OUT/confirm_moe.log" | tail -25
      cp /tmp/confirm_moe.json "$OUT/confirm_moe_after.json" ;;
    online)
      python benchmarks/runtime/online_tuning.py --out "$OUT/online_tuning.json" 2>&1 | tail -8 ;;
    loop-moe)
      primus-tune loop --config "${MOE_PRESET:-qwen3-30b-a3b}" --out /tmp/loop_moe \
        ${MOE_OVERRIDES:-model.n_layers=2 model.vocab_size=32000 train.seq_len=4096 train.micro_batch=1} 2>&1 \
        | tee "$OUT/loop_moe.log" | tail -30 ;;
    online-compile)
      python benchmarks/runtime/online_tuning.py --out "$OUT/online_tuning_compile.json" model.n_layers=4 \
        train.seq_len=4096 train.micro_batch=1 train.compile=true 2>&1 | tail -8 ;;
    online-moe)
      python benchmarks/runtime/online_tuning.py --config "${MOE_PRESET:-qwen3-30b-a3b}" --steps 100 \
        --out "$OUT/online_tuning_moe.json" ${MOE_OVERRIDES:-model.n_layers=2 model.vocab_size=32000 train.seq_len=4096 train.micro_batch=1} \
        2>&1 | tail -8 ;;
    moe)
      python benchmarks/moe/moe_grouped_gemm.py --tune --out "$OUT/moe_grouped_gemm_tuned.json" 2>&1 | tail -25 ;;
    moe-e2e)
      python benchmarks/moe/moe_e2e.py --out "$OUT/moe_e2e.json" 2>&1 | tail -25 ;;
    fsdp2)
      python benchmarks/trainer/fsdp2_llama3_8b.py --gpus 2 --out "$OUT/fsdp2_llama3_8b.json" 2>&1 | tail -25 ;;
    multi-gpu)
      python benchmarks/gemm/multi_gpu_tuning.py --gpus 2 --budget-s 2 --out "$OUT/multi_gpu_tuning.json" 2>&1 | tail -15 ;;
    eight-fsdp|eight-tp|eight-ep)
      python benchmarks/trainer/eight_gpus.py --layouts "${step#eight-}" --skip preflight multi-gpu \
        --out "$OUT/eight_gpus" 2>&1 | tail -12 ;;
    eight-checks)
      python benchmarks/trainer/eight_gpus.py --layouts --out "$OUT/eight_gpus" 2>&1 | tail -12 ;;
    fp8-tests)
      TRITON_INTERPRET=0 python -m pytest -m gpu -q -p no:cacheprovider tests/tuner/test_fp8_gpu.py 2>&1 \
        | tee "$OUT/fp8_gpu_tests.log" | tail -25 ;;
    fp8)
      python benchmarks/fp8/fp8_loop.py --out "$OUT/fp8_loop.json" 2>&1 | tee "$OUT/fp8_loop.log" | tail -40 ;;
    fp8-moe)
      python benchmarks/fp8/fp8_loop.py --configs --moe --out "$OUT/fp8_moe.json" 2>&1 | tee "$OUT/fp8_moe.log" | tail -20 ;;
    never-slower)
      # tuned and confirmed against every fixed choice: the MoE cases, the dense loop, and the
      # example under enable() with the cache `confirm` left in /tmp/enable_offline.json
      python benchmarks/runtime/never_slower.py --out "$OUT/never_slower.json" moe 2>&1 | grep -v "^  " | tail -8
      python benchmarks/runtime/never_slower.py --out "$OUT/never_slower.json" loop 2>&1 | tail -4
      if [ -f /tmp/enable_offline.json ]; then
        python benchmarks/runtime/never_slower.py --out "$OUT/never_slower.json" example --cache /tmp/enable_offline.json \
          2>&1 | tail -2
      fi ;;
    hf-moe)
      TRITON_INTERPRET=0 python -m pytest tests/runtime/test_grouped_intercept.py -m gpu -q -p no:cacheprovider 2>&1 | tail -3
      python benchmarks/moe/hf_moe_e2e.py --blocks 5 --out "$OUT/hf_moe_e2e.json" 2>&1 | grep -v "^ " | tail -6 ;;
    *) echo "unknown step $step" ;;
  esac
done
