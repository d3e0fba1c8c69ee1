#!/usr/bin/env bash
# Session 31, call 2: + whole prefix tiles unmasked, rescale skipped when no row max moved.
export SD_GPU_PHASES="build"
repo=$PWD
bash bench/gpu_session.sh
cd /tmp || exit 1
export PYTHONPATH=/tmp/site SPECDECODE_CUDA_EMU=OFF
x() { local name=$1 lim=$2; shift 2; local t0=$(date +%s); timeout "$lim" "$@" > "$OUT/x_$name.log" 2>&1; echo "x_$name: exit $? in $(($(date +%s)-t0)) s" >> "$OUT/x_summary.txt"; }
x tests 60 python3 -m pytest -q -m cuda -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_ops_attention.py"
SW="--attention-splits --repeats 10 --dtypes bfloat16 --trees 1,16,64 --split-counts 1,2,3,4,8,16"
x sweep_new 60 python3 "$repo/bench/gpu_profile.py" $SW --out "$OUT/x_sweep_new.md"
x sweep_one 60 env SD_EXP_NO_TWO=1 python3 "$repo/bench/gpu_profile.py" $SW --out "$OUT/x_sweep_one.md"
x bench_attention 60 python3 "$repo/bench/bench_attention.py" --device cuda --quick
x gpu_profile 40 python3 "$repo/bench/gpu_profile.py" --only tree_attention --out "$OUT/x_gpu_profile.md"
NCU="ncu -k regex:attend --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis --metrics sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum"
PYC="import sys; sys.path.insert(0, '$repo/bench'); import gpu_profile as g, torch
from specdecode._ops import attention as am
am._num_splits = lambda q, k: 2
fn = g.attention_case(8, 4096, 64, torch.bfloat16)
for _ in range(3): fn()
torch.cuda.synchronize()"
x ncu_new2 40 $NCU python3 -c "$PYC"
x ncu_one2 40 env SD_EXP_NO_TWO=1 $NCU python3 -c "$PYC"
x memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 7 python3 -m pytest -q -x -m cuda -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_ops_attention.py" -k "matches_cpu and (64-2000 or 1-4000 or 7-300) and (128 or 64) or non_finite"
cat "$OUT/x_summary.txt"
cd "$OUT" && tar czf xlogs.tgz x_* && rm -f x_*.log x_*.md
