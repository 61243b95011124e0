#!/usr/bin/env bash
# Everything a GPU session runs, in stages sized for the device budget: 15 minutes of device
# time a session, the machine's start (a minute or two) included, at most 10 minutes a call,
# at most 8 files back a call. Each stage ends within ~280 s (every command under its own
# timeout), so one call runs two stages (timeout_s 590) and a second call has room for one or
# two more, or for a rerun. Each command's output is appended to $OUT/<stage>.txt as it runs
# and its JSON to $OUT/<stage>-json.tgz after it ends, so a call stopped at its limit still
# returns what finished. Two files a stage, plus $OUT/summary.txt.
#
# The device's image has torch, transformers, prometheus_client, psutil, nvidia-ml-py,
# pytest, pytest-xdist and pytest-timeout, and no network: hookprof runs from the checkout
# (PYTHONPATH), nothing is installed. It has no Prometheus either, which the GPU straggler
# test (tests/gpu/test_layer_stragglers_cuda.py, issue 42) needs: carry Debian's binary,
# compressed (14 MB of the 64 MiB a call may carry):
#   mkdir -p .bin && gzip -c /usr/bin/prometheus >.bin/prometheus.gz && echo /.bin/ >>.git/info/exclude
# and name `.bin` in the call's `carry`; this script unpacks it and puts it on PATH.
#
# Stages, in the order a session runs them (issue 37's GPU figures first, as the brief asks):
#   cost       issue 37 item 4: bench/overhead.py --gpu on the four workloads, with the A/A
#              pair (none again) and torch.profiler, 16 steps a round; bench/host_cost.py --full
#   tests      pytest -m cuda (with Prometheus carried: issue 42's straggler on device times);
#              bench/cudagraphs.py --quick (issue 30)
#   bound      issue 37 item 4: the device-bound variant of each workload (batch x4);
#              issue 43: bench/update_replay.py on CUDA
#   compiled   issue 37 item 4: the compiled GPT, inductor's default mode and reduce-overhead
#   integrity  issue 43: bench/replica_check.py on CUDA; NaN latency; FLOPs/MFU/phases
#   suite      the rest of the test suite on the CPU cores (-n 8), as a contributor with a GPU
#              runs it
#
#   bash bench/gpu_session.sh cost tests          # the first call (timeout_s 590)
#   bash bench/gpu_session.sh bound compiled      # the second, as the budget allows
#   RERUN="tests/gpu/x.py::t ..." bash bench/gpu_session.sh rerun   # those tests again
#   DRY=1 bash bench/gpu_session.sh cost bound compiled integrity
#       # every command on the CPU at the smallest sizes: a smoke run that CI runs (.ci/run),
#       # so that no script of a stage has rotted by the time a GPU is lent; exits 1 if any
#       # command failed (a GPU session goes on past a failure, and says so)
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: gpu_session.sh STAGE... (cost tests bound compiled integrity suite rerun)" >&2; exit 2; }
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
dry=${DRY:-}
json=$(mktemp -d)
started=$(date +%s)
failed=0
say() { echo "[$(( $(date +%s) - started )) s] $*" | tee -a "$OUT/summary.txt"; }

# run STAGE NAME SECONDS COMMAND...: COMMAND under a timeout, its output appended to
# $OUT/STAGE.txt, its exit status said; the stage's JSON folder packed after it
run() {
    local stage=$1 name=$2 seconds=$3
    shift 3
    {
        echo
        echo "==== $name: $*"
    } >>"$OUT/$stage.txt"
    timeout "$seconds" "$@" >>"$OUT/$stage.txt" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || failed=$((failed + 1))
    say "$stage: $name exit $rc"
    tar -czf "$OUT/$stage-json.tgz" -C "$json" . 2>/dev/null
}

if [ -f .bin/prometheus.gz ] && ! command -v prometheus >/dev/null 2>&1; then
    bin=$(mktemp -d)  # (not under $json, which is packed into what comes back)
    gunzip -c .bin/prometheus.gz >"$bin/prometheus" && chmod +x "$bin/prometheus" \
        && export PATH="$bin:$PATH"
fi
{
    date -u +%FT%TZ
    command -v prometheus || echo "no prometheus: tests/gpu/test_layer_stragglers_cuda.py skips"
    if [ -z "$dry" ]; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
    fi
    python -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
    git rev-parse HEAD 2>/dev/null || echo "checkout (no .git)"
    nproc
} >>"$OUT/summary.txt" 2>&1

# the sizes of each command: a GPU session's, or the smoke run's (DRY)
if [ -z "$dry" ]; then
    gpu=(--gpu)
    cost_rounds=(--rounds 6 --steps 16 --warmup 5)
    bound_rounds=(--rounds 5 --steps 8 --warmup 3)
    compiled_rounds=(--rounds 5 --steps 16 --warmup 5)
    backend=(--compile-backend inductor)
    host_cost=(--full --steps 16 --profile resnet50)
    cuda_tests=(-m cuda -q -rfEs -p no:cacheprovider --timeout 120)
    cudagraphs=(--quick --modes reduce-overhead,default)
    device=(--device cuda)
    replica=(--device cuda --rounds 5)
    update_replay=(--device cuda --rounds 5)
    latency=(--full --after 30 --rounds 4)
    mfu=()
else
    gpu=(--gpu --device cpu)
    cost_rounds=(--rounds 1 --steps 1 --warmup 1)
    bound_rounds=(--rounds 1 --steps 1 --warmup 1)
    compiled_rounds=(--rounds 1 --steps 1 --warmup 1)
    backend=(--compile-backend aot_eager)
    host_cost=(--device cpu --steps 2 --workloads resnet50,mlp --profile mlp)
    cuda_tests=(-m cuda -q -p no:cacheprovider --collect-only)
    cudagraphs=(--quick --modes default --device cpu)
    device=(--device cpu)
    replica=(--device cpu --small --rounds 1)
    update_replay=(--device cpu --rounds 1 --steps 1)
    latency=(--after 3 --rounds 1 --steps 1 --deadline 2)
    mfu=(--device cpu --rounds 1 --steps 2 --workloads mlp)
fi

for stage in "$@"; do
    say "stage $stage${dry:+ (dry: on the CPU, smallest sizes)}"
    case $stage in
        cost)
            run cost overhead 200 python bench/overhead.py "${gpu[@]}" "${cost_rounds[@]}" \
                --configs "none again,hookprof default,hookprof every step,torch.profiler" \
                --out "$json/overhead.json"
            run cost host_cost 75 python bench/host_cost.py "${host_cost[@]}" \
                --json "$json/host_cost.json"
            ;;
        tests)
            # (with Prometheus carried, the GPU straggler test among them: ~60-90 s of it)
            run tests cuda-tests 220 python -m pytest "${cuda_tests[@]}" \
                --junitxml="$json/cuda-tests.xml"
            run tests cudagraphs 60 python bench/cudagraphs.py "${cudagraphs[@]}" \
                --json "$json/cudagraphs.json"
            ;;
        bound)
            run bound overhead-batch-x4 200 python bench/overhead.py "${gpu[@]}" "${bound_rounds[@]}" \
                --batch-times 4 --configs "none again,hookprof default,hookprof every step" \
                --out "$json/overhead-batch-x4.json"
            run bound update_replay 45 python bench/update_replay.py "${update_replay[@]}"
            ;;
        compiled)
            for mode in default reduce-overhead; do
                [ -n "$dry" ] && [ "$mode" = reduce-overhead ] && continue  # (CUDA graphs: a GPU's)
                run compiled "overhead-compiled-$mode" 135 python bench/overhead.py "${gpu[@]}" \
                    "${compiled_rounds[@]}" --workloads gpt --compile "$mode" "${backend[@]}" \
                    --configs "none again,hookprof default,hookprof every step" \
                    --out "$json/overhead-compiled-$mode.json"
            done
            ;;
        integrity)
            run integrity replica_check 60 python bench/replica_check.py "${replica[@]}"
            run integrity nonfinite_latency 120 python bench/nonfinite_latency.py "${latency[@]}" \
                --out "$json/nonfinite_latency.json"
            run integrity mfu 60 python bench/mfu.py "${mfu[@]}" --json "$json/mfu.json"
            ;;
        suite)
            # the rest of the suite on the CPU cores: what a contributor with a GPU sees (tests
            # that take the GPU when there is one); one torch thread each
            OMP_NUM_THREADS=1 run suite not-cuda 270 python -m pytest -q -m "not cuda" -n 8 \
                -p no:cacheprovider --timeout 200 -rfEs
            ;;
        rerun)
            # shellcheck disable=SC2086  # node ids, one per word
            run rerun tests 200 python -m pytest -q -rfEs -p no:cacheprovider --timeout 120 ${RERUN:?RERUN=node ids}
            ;;
        *)
            echo "unknown stage $stage" >&2
            exit 2
            ;;
    esac
done
say "done: $failed command(s) failed"
for stage in "$@"; do tail -n 30 "$OUT/$stage.txt" 2>/dev/null; done
# a GPU session goes on past a failure (every figure that can come back, comes back); the
# smoke run fails so that CI says which script broke
[ -z "$dry" ] || [ "$failed" -eq 0 ]
