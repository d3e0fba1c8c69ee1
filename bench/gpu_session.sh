#!/usr/bin/env bash
# Everything this project has never run on a GPU, in one command for a machine that has one
# (the device tool's H100 / H200: CUDA's compiler, PyTorch, pytest and pybind11 installed, no
# network). The machine starts bare and stays warm only briefly after a call, so one call should
# do all of it; each phase has its own time limit so that a slow one cannot eat the others, and
# every phase's log goes to $OUT (what comes back from the machine):
#
#   run(command="bash bench/gpu_session.sh", timeout_s=600)
#
#   1. build: the package with the CUDA kernels for this GPU's architecture (nvcc, -j all cores),
#      installed into /tmp/site (the image's own packages untouched);
#   2. tests: the `cuda`-marked tests (the kernels against the CPU path, token for token and to the
#      float64 reference);
#   3. benchmarks: bench_verify.py, bench_attention.py and draft_sampling.py with --device cuda
#      (quick tables), gpu_profile.py (each op's kernels against its host time, and the sweep
#      of tree attention's KV split count) and
#      `specdecode demo --device cuda` (the engine end to end on the GPU);
#   4. with the time left, compute-sanitizer's memcheck and racecheck over the small GPU tests
#      (phase "sanitizer").
#
# The logs and tables come back as $OUT/logs.tgz (at most 8 files return from the machine), with
# $OUT/summary.txt and $OUT/machine.txt beside it.
#
# Budget (SD_GPU_BUDGET, seconds; default 560 of the tool's 600-second limit per command) is
# shared out in that order. Set SD_GPU_PHASES (e.g. "tests bench") to skip a phase that an
# earlier call finished on the same warm machine, SD_GPU_BUILD_DIR for the build folder (default
# /tmp/sd_build), SD_GPU_FULL=1 for the full tables of bench_verify and bench_attention instead
# of --quick, SD_GPU_SKIP for single phases to leave out (e.g. "bench_verify demo_cuda", the
# names summary.txt uses). $OUT/summary.txt gets one line per phase: its exit status and seconds.
#
# The build phase leaves the compiled module in $OUT/_C.so.gz. A later call on a fresh machine
# whose change is Python only can skip the build: copy that file to .gpu/ (ignored by git), carry
# it, and leave "build" out of SD_GPU_PHASES; the package is then python/ plus that module. A
# call that builds with such a module carried takes it as the baseline of gpu_profile.py (the
# kernels before a change against after it, in one run).
#
# Two more baselines for one call:
#   SD_GPU_BASE_PYTHON=DIR (a folder holding a `specdecode` package's Python files, e.g. a copy
#     of an earlier commit's python/specdecode in an ignored folder that the call carries): the
#     baseline of gpu_profile.py is then that Python with this call's freshly built module, for
#     a change to the Python layer alone;
#   SD_GPU_VARIANT=DIR (an ignored folder, carried, whose files lie at their paths in the tree,
#     e.g. DIR/cuda/attention.cu): a copy of the tree with those files laid over it is built
#     beside the main build (the cores shared), its tree attention tests run ("tests_variant")
#     and gpu_profile.py's tree attention cases ("gpu_profile_variant"), so a kernel variant is
#     measured against the tree in the same run.
# SD_GPU_SPLITS_ARGS adds options to the split sweep (e.g. "--split-counts 1,2,3,4 --dtypes
# bfloat16"). The phase "ncu" (add it to SD_GPU_PHASES) runs Nsight Compute on the tree attention kernel of
# a few cases (SD_GPU_NCU_CASES, gpu_profile.py's case names) with the sections that say what
# bounds it: $OUT/ncu.log.
set -uo pipefail

out=${OUT:-/tmp/sd_gpu_out}
mkdir -p "$out"
budget=${SD_GPU_BUDGET:-560}
phases=${SD_GPU_PHASES:-"build tests bench sanitizer"}
py=${PYTHON:-python3}
site=/tmp/site
start=$(date +%s)
summary="$out/summary.txt"
: >"$summary"

left() { echo $((budget - ($(date +%s) - start))); }

# phase NAME LIMIT CMD...: runs CMD with at most LIMIT seconds (less if the budget is shorter),
# its output in $out/NAME.log, and records the result.
phase() {
  local name=$1 limit=$2
  shift 2
  if [[ " ${SD_GPU_SKIP:-} " == *" $name "* ]]; then
    echo "$name: skipped (SD_GPU_SKIP)" | tee -a "$summary"
    return 0
  fi
  local avail
  avail=$(left)
  ((avail < limit)) && limit=$avail
  if ((limit <= 10)); then
    echo "$name: skipped, budget spent" | tee -a "$summary"
    return 1
  fi
  local t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $(($(date +%s) - t0)) s (limit $limit s)" | tee -a "$summary"
  return $rc
}

wants() { [[ " $phases " == *" $1 "* ]]; }

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvcc --version | tail -n 2
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'
  nproc
} >"$out/machine.txt" 2>&1

arch=$("$py" -c 'import torch; a, b = torch.cuda.get_device_capability(0); print(f"{a}{b}")' \
  2>/dev/null || echo 90)
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
# The CUDA emulator's module is for machines without a GPU: not built here (its compile time is
# better spent on the real kernels), and the tests told so, or test_cuda_emu.py would take its
# absence for a broken build.
export SPECDECODE_CUDA_EMU=OFF
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}

# install_carried DEST: python/specdecode plus the module carried in .gpu/_C.so.gz, as a
# package under DEST.
install_carried() {
  mkdir -p "$1"
  cp -r python/specdecode "$1/"
  SITE=$1 "$py" - <<'PY'
import gzip, os, shutil, sysconfig
name = os.environ["SITE"] + "/specdecode/_C" + sysconfig.get_config_var("EXT_SUFFIX")
with gzip.open(".gpu/_C.so.gz") as src, open(name, "wb") as dst:
    shutil.copyfileobj(src, dst)
print("module from .gpu/_C.so.gz ->", name)
PY
}

# With a build and a carried module, the carried one is the baseline: gpu_profile.py runs on
# both in the bench phase (the same machine, one after the other).
base_site=
# build_into NAME SITE BUILD_DIR: the package with the CUDA kernels, from the current folder.
# The test extra is not installed: its packages (pytest, numpy, transformers) are in the image and
# nothing can be fetched there.
build_into() {
  phase "$1" 300 env SPECDECODE_CUDA=ON SPECDECODE_CUDA_ARCHS="$arch" \
    "$py" -m pip install --no-deps --no-build-isolation --no-index --target "$2" \
    -Cbuild-dir="$3" .
}

variant_site=
if wants build; then
  variant_pid=
  if [[ -n ${SD_GPU_VARIANT:-} ]]; then
    # Both builds at once on half the cores each: the longest translation unit bounds each.
    export CMAKE_BUILD_PARALLEL_LEVEL=$(((CMAKE_BUILD_PARALLEL_LEVEL + 1) / 2))
    rm -rf /tmp/variant_src && mkdir -p /tmp/variant_src &&
      tar --exclude=./.gpu --exclude=./.git -cf - . | tar -xf - -C /tmp/variant_src &&
      cp -r "$SD_GPU_VARIANT"/. /tmp/variant_src/ || exit 1
    (cd /tmp/variant_src && build_into build_variant /tmp/site_variant /tmp/sd_build_variant) &
    variant_pid=$!
  fi
  build_into build "$site" "${SD_GPU_BUILD_DIR:-/tmp/sd_build}" || {
    echo "build failed: see build.log" | tee -a "$summary"
    exit 1
  }
  if [[ -n $variant_pid ]] && wait "$variant_pid"; then
    variant_site=/tmp/site_variant
  fi
  gzip -c "$site"/specdecode/_C.*.so >"$out/_C.so.gz"
  if [[ -n ${SD_GPU_BASE_PYTHON:-} ]]; then
    mkdir -p /tmp/site_base && cp -r "$SD_GPU_BASE_PYTHON/specdecode" /tmp/site_base/ &&
      cp "$site"/specdecode/_C.*.so /tmp/site_base/specdecode/ && base_site=/tmp/site_base
  elif [[ -f .gpu/_C.so.gz ]] && install_carried /tmp/site_base; then
    base_site=/tmp/site_base
  fi
elif [[ -f .gpu/_C.so.gz ]]; then
  install_carried "$site" || exit 1
else
  echo "no build phase and no .gpu/_C.so.gz: nothing to test" | tee -a "$summary"
  exit 1
fi

# From outside the checkout, so that the installed package (not python/) is imported.
cd /tmp || exit 1
repo=$OLDPWD

if wants tests; then
  phase tests 150 "$py" -m pytest -v -m cuda -p no:cacheprovider --durations=10 \
    --rootdir "$repo" "$repo/tests"
  if [[ -n $variant_site ]]; then
    phase tests_variant 60 env PYTHONPATH="$variant_site" "$py" -m pytest -q -m cuda \
      -p no:cacheprovider --rootdir "$repo" "$repo/tests/test_ops_attention.py"
  fi
fi

if wants bench; then
  quick=--quick
  [[ ${SD_GPU_FULL:-0} == 1 ]] && quick=
  phase gpu_profile 60 "$py" "$repo/bench/gpu_profile.py" --out "$out/gpu_profile.md"
  if [[ -n $base_site ]]; then
    phase gpu_profile_base 60 env PYTHONPATH="$base_site" "$py" "$repo/bench/gpu_profile.py" \
      --out "$out/gpu_profile_base.md"
  fi
  if [[ -n $variant_site ]]; then
    phase gpu_profile_variant 40 env PYTHONPATH="$variant_site" "$py" \
      "$repo/bench/gpu_profile.py" --only tree_attention --out "$out/gpu_profile_variant.md"
  fi
  phase bench_attention 120 "$py" "$repo/bench/bench_attention.py" --device cuda $quick
  # shellcheck disable=SC2086  # SD_GPU_SPLITS_ARGS: more options of the sweep, word-split
  phase attention_splits 90 "$py" "$repo/bench/gpu_profile.py" --attention-splits --repeats 10 \
    ${SD_GPU_SPLITS_ARGS:-} --out "$out/attention_splits.md"
  phase bench_verify 150 "$py" "$repo/bench/bench_verify.py" --device cuda $quick \
    --out "$out/bench_verify.md"
  phase demo_cuda 60 "$py" -m specdecode demo --device cuda --repeats 2
  if [[ -n ${SD_GPU_BASE_PYTHON:-} && -n $base_site ]]; then
    phase demo_cuda_base 60 env PYTHONPATH="$base_site" "$py" -m specdecode demo --device cuda \
      --repeats 2
  fi
  phase bench_draft_sampling 40 "$py" "$repo/bench/draft_sampling.py" --device cuda \
    --skip-generation --repeats 20
fi

# Nsight Compute on the attention kernel of each case: one launch after two warm-up calls.
if wants ncu && command -v ncu >/dev/null; then
  phase ncu 90 bash -c '
    IFS=";" read -ra cases <<<"$1"
    for c in "${cases[@]}"; do
      echo "=== $c"
      ncu -k regex:attend --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats \
        "$2" -c "import sys; sys.path.insert(0, \"$3\"); import gpu_profile as g, torch
fn = dict(g.cases())[\"$c\"]()
for _ in range(3): fn()
torch.cuda.synchronize()"
    done' ncu "${SD_GPU_NCU_CASES:-tree_attention B=8 S=4096 T=1 bfloat16;tree_attention B=8 S=4096 T=64 bfloat16}" "$py" "$repo/bench"
fi

# Last, with what is left: the kernels under compute-sanitizer (out-of-bounds and shared-memory
# races), on the smallest cases of the GPU tests.
# racecheck is slow (13 tests in 60 s): it gets the attention kernels' shared-memory staging
# (both kernels, strided caches on and off 16-byte boundaries) and compact_kv.
if wants sanitizer && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    select="dtype0 and not 256 or tree or compact or strided_caches"
    [[ $tool == racecheck ]] && select="strided_caches or compact"
    phase "sanitizer_$tool" 60 compute-sanitizer --tool "$tool" --error-exitcode 7 \
      "$py" -m pytest -q -x -m cuda -p no:cacheprovider --rootdir "$repo" \
      "$repo/tests/test_ops_tree.py" "$repo/tests/test_ops_verify.py" \
      "$repo/tests/test_ops_attention.py" -k "$select"
  done
fi

echo "total: $(($(date +%s) - start)) s" | tee -a "$summary"
# At most 8 files come back from the machine: the logs and tables travel as one archive.
(cd "$out" && shopt -s nullglob && tar czf logs.tgz ./*.log ./*.md ./*.txt &&
  find . -maxdepth 1 \( -name '*.log' -o -name '*.md' \) -delete)
