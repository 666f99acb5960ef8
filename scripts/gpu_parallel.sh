#!/usr/bin/env bash
# Several GPUs at once: one list of scripts/gpu_check.sh steps per GPU, run detached (they
# outlive a device call's time limit) with each GPU's logs and JSON under $LANES/gpu<i>. From
# the repository root of a GPU machine:
#   bash scripts/gpu_parallel.sh start "tests routing" "never-slower-loop" "loop-moe" "enable confirm"
#   bash scripts/gpu_parallel.sh start "0,1=step:llama3-8b-1gpu:16" "2,3=step:llama3-8b-fsdp2-2gpu:10"
#   bash scripts/gpu_parallel.sh collect 540    # wait up to 540 s for every lane, pack them into $OUT
# In the call that starts the lanes, collect for less (about 450 s): the install and the native build
# take a minute of the call's 600 s, and a call cut off by its limit brings nothing back. Call collect
# again at once: an idle machine is given back after 30 s, and its lanes with it.
# `start` installs the environment once (scripts/device_env.sh) and builds the native GEMM
# dispatch before the lanes start; `collect` prints each lane's last lines and packs every
# lane's files into $OUT/gpus.tgz (a device call brings back a few files, not folders of them), the
# traces of the step tuner's cases beside it (rank 0's, up to 7).
set -uo pipefail
LANES=${LANES:-/tmp/lanes}
OUT=${OUT:-out}
mode=${1:?start or collect}
shift
if [ "$mode" = collect ] && ! compgen -G "$LANES/gpu*" >/dev/null; then  # the lanes went with the machine
  echo "no lanes in $LANES: this machine did not start them (a machine idle past its release is a fresh one)" >&2
  exit 3
fi
mkdir -p "$OUT" "$LANES"
source scripts/device_env.sh
if [ "$mode" = start ]; then
  python -c "from primus_perf.runtime import native; native.load(print)"  # built once, shared by every lane
  i=0
  for steps in "$@"; do
    gpus=$i  # "2,3=steps" gives a lane several GPUs (a torchrun case, or the step tuner's own lanes)
    if [[ "$steps" =~ ^([0-9,]+)=(.*)$ ]]; then gpus=${BASH_REMATCH[1]}; steps=${BASH_REMATCH[2]}; fi
    mkdir -p "$LANES/gpu$i"
    CUDA_VISIBLE_DEVICES=$gpus OUT="$LANES/gpu$i" setsid bash -c \
      "bash scripts/gpu_check.sh $steps > $LANES/gpu$i/console.log 2>&1; touch $LANES/gpu$i/DONE" &
    echo "lane $i: GPUs $gpus: $steps"
    i=$((i + 1))
  done
  echo "started $i lanes in $LANES"
  exit 0
fi
deadline=$((SECONDS + ${1:-540}))
while [ $SECONDS -lt $deadline ]; do
  left=0
  for d in "$LANES"/gpu*; do [ -f "$d/DONE" ] || left=$((left + 1)); done
  [ $left -eq 0 ] && break
  sleep 10
done
for d in "$LANES"/gpu*; do
  echo "=== $d $([ -f "$d/DONE" ] && echo done || echo running)"
  tail -12 "$d/console.log"
done
tar czf "$OUT/gpus.tgz" --exclude='*.pt.trace.json*' -C "$LANES" .  # traces apart: one can pass 16 MiB
# rank 0's trace of each step-tuner case as its own file (the analyzer's advice checked again here), at most 7
n=0
for t in "$LANES"/gpu*/step_tuner/*/rank0*.json.gz; do
  [ -f "$t" ] && [ $n -lt 7 ] && [ "$(stat -c %s "$t")" -lt 16000000 ] || continue
  case_dir=$(dirname "$t")
  lane=$(basename "$(dirname "$(dirname "$case_dir")")")
  cp "$t" "$OUT/${lane}_$(basename "$case_dir")_$(basename "$t")"
  n=$((n + 1))
done
