#!/usr/bin/env bash
# Several GPUs at once, one list of scripts/gpu_check.sh steps per GPU, each GPU's logs and
# JSON under $OUT/gpu<i>; the environment is installed once first. From the repository root:
#   bash scripts/gpu_parallel.sh "tests routing" "never-slower-loop" "loop-moe" "enable confirm online"
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
source scripts/device_env.sh
python -c "from primus_perf.runtime import native; native.load(print)"  # built once, shared by every job
pids=()
i=0
for steps in "$@"; do
  mkdir -p "$OUT/gpu$i"
  CUDA_VISIBLE_DEVICES=$i OUT="$OUT/gpu$i" bash scripts/gpu_check.sh $steps > "$OUT/gpu$i/console.log" 2>&1 &
  pids+=($!)
  i=$((i + 1))
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for d in "$OUT"/gpu*; do echo "=== $d"; tail -15 "$d/console.log"; done
# one archive of every GPU's files (a device call brings a few files back, not folders of them)
tar czf "$OUT/gpus.tgz" -C "$OUT" $(cd "$OUT" && ls -d gpu*) && rm -rf "$OUT"/gpu*
exit $status
