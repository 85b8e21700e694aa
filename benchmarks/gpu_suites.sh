#!/usr/bin/env bash
# The multi-GPU `pytest -m gpu` suites on a device machine, in a fixed order, each test under its own time limit,
# with a JUnit file and a one-line summary per file, so a call cut short still reports what ran.
#
#   source benchmarks/device_env.sh
#   bash benchmarks/gpu_suites.sh OUT_DIR [PER_TEST_SECONDS] [FILE ...]
#
# Default files: the TP, CP, PP, engine, ZeRO, BPTT and fault suites. Per-test limit: 240 s (pytest-timeout;
# signal method, not pytest.ini's thread method, which would end the whole pytest process of the file: a test that
# runs over fails with its stack and the next test runs). The leftover ranks of a test that
# timed out are killed before the next file (GPU_SUITES_KILL=0 skips that, for several of these scripts run side by
# side on one machine, each with its own OUT_DIR and files).
# MEGASSM_TRITON_AUTOTUNE defaults to 0 here (the first config of each kernel: compiling every config of every
# variant costs minutes per test on a fresh machine); GPU_SUITES_K, when set, is passed to pytest as -k.
set -u
export MEGASSM_TRITON_AUTOTUNE=${MEGASSM_TRITON_AUTOTUNE:-0}
out=${1:?usage: gpu_suites.sh OUT_DIR [PER_TEST_SECONDS] [FILE ...]}
per=${2:-240}
shift $(( $# >= 2 ? 2 : $# ))
files=("$@")
[ ${#files[@]} -eq 0 ] && files=(tests/test_parallel_gpu.py tests/test_parallel_cp_gpu.py tests/test_parallel_pp_gpu.py
                                 tests/test_parallel_engines_gpu.py tests/test_zero.py tests/test_bptt_parallel.py
                                 tests/test_faults_gpu.py)
mkdir -p "$out"
for f in "${files[@]}"; do
    name=$(basename "$f" .py)
    start=$(date +%s)
    python3 -m pytest -m gpu ${GPU_SUITES_K:+-k "$GPU_SUITES_K"} -q -rfE -p no:cacheprovider --durations=0 --timeout "$per" --timeout-method=signal --junitxml="$out/$name.xml" "$f" \
        > "$out/$name.log" 2>&1
    rc=$?
    [ "${GPU_SUITES_KILL:-1}" = 0 ] || pkill -9 -f "[-]m megassm[.]train" 2>/dev/null || true
    echo "$name rc=$rc $(( $(date +%s) - start ))s $(tail -1 "$out/$name.log")" | tee -a "$out/summary.txt"
done
