#!/usr/bin/env bash
# Session 31, call 1: the two-row-group kernel (working tree, uncommitted, with SD_EXP_* switches).
export SD_GPU_PHASES="build tests bench ncu sanitizer"
export SD_GPU_SKIP="bench_verify bench_draft_sampling"
export SD_GPU_BUDGET=400
export SD_GPU_SPLITS_ARGS="--trees 1,4,16,32,64"
export SD_GPU_NCU_CASES="tree_attention B=8 S=4096 T=64 bfloat16"
repo=$PWD
bash bench/gpu_session.sh
cd /tmp || exit 1
export PYTHONPATH=/tmp/site SPECDECODE_CUDA_EMU=OFF
x() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout "$lim" "$@" > "$OUT/x_$name.log" 2>&1; echo "x_$name: exit $? in $(($(date +%s)-t0)) s" >> "$OUT/x_summary.txt"; }
SW="--attention-splits --repeats 10 --dtypes bfloat16 --trees 16,32,64 --split-counts 1,2,3,4,6,8"
x sweep_new 60 python3 "$repo/bench/gpu_profile.py" $SW --out "$OUT/x_sweep_new.md"
x sweep_old 60 env SD_EXP_NO_TWO=1 python3 "$repo/bench/gpu_profile.py" $SW --out "$OUT/x_sweep_old.md"
x sweep_kh2 60 env SD_EXP_KH2=1 python3 "$repo/bench/gpu_profile.py" $SW --out "$OUT/x_sweep_kh2.md"
x sweep_fp16 40 python3 "$repo/bench/gpu_profile.py" --attention-splits --repeats 10 --dtypes float16 --trees 64 --batches 8 --split-counts 1,2,3,4 --out "$OUT/x_sweep_fp16.md"
NCU="ncu -k regex:attend --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis"
PYC="import sys; sys.path.insert(0, '$repo/bench'); import gpu_profile as g, torch
from specdecode._ops import attention as am
am._num_splits = lambda q, k: 2
fn = g.attention_case(8, 4096, 64, torch.bfloat16)
for _ in range(3): fn()
torch.cuda.synchronize()"
x ncu_new2 60 $NCU python3 -c "$PYC"
x ncu_old2 60 env SD_EXP_NO_TWO=1 $NCU python3 -c "$PYC"
x memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 7 python3 -m pytest -q -x -m cuda -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_ops_attention.py" -k "matches_cpu and (64-2000 or 256-33) and (128 or 64)"
x racecheck 60 compute-sanitizer --tool racecheck --error-exitcode 7 python3 -m pytest -q -x -m cuda -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_ops_attention.py" -k "matches_cpu and 64-2000 and 128"
cat "$OUT/x_summary.txt"
cd "$OUT" && tar czf xlogs.tgz x_* && rm -f x_*.log x_*.md
