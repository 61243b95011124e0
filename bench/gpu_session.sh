#!/usr/bin/env bash
# Everything a GPU session runs, in stages sized for the device budget: 15 minutes of device
# time a session in all, the machine's start (a minute or two) included, at most 10 minutes
# a call, at most 8 files back a call, and no machine started with under 4 minutes left. So
# a session is one full call and one short one:
#   call 1 (timeout_s 590): cost tests     ~460 s of limits (issue 37's figures, the cuda tests)
#   call 2 (timeout_s 230): one of bound, compiled, integrity (~200 s each), or a rerun
# Every command runs under its own timeout. Each command's output is appended to
# $OUT/<stage>.txt as it runs (tests: the CPU suite beside it in $OUT/tests-suite.txt) and its
# JSON packed into $OUT/<stage>-json.tgz after it ends, so a call stopped at its limit still
# returns what finished. Two or three files a stage, plus $OUT/summary.txt.
#
# The device's image has torch, transformers, prometheus_client, psutil, nvidia-ml-py,
# pytest, pytest-xdist and pytest-timeout, and no network: hookprof runs from the checkout
# (PYTHONPATH), nothing is installed. It has no Prometheus either, which the GPU straggler
# test (tests/gpu/test_layer_stragglers_cuda.py, issue 42) needs: carry Debian's binary,
# compressed (14 MB of the 64 MiB a call may carry), in the first call:
#   mkdir -p .bin && gzip -c /usr/bin/prometheus >.bin/prometheus.gz && echo /.bin/ >>.git/info/exclude
# and name `.bin` in the call's `carry`; this script unpacks it and puts it on PATH.
#
# Stages, in the order a session runs them (issue 37's GPU figures first, as the brief asks):
#   cost       issue 37 item 4: bench/overhead.py --gpu on the four workloads with the A/A
#              pair (none again) and torch.profiler; bench/host_cost.py --full
#   tests      pytest -m cuda, each test's outcome as it ends (with Prometheus carried: issue
#              42's straggler on device times); the rest of the suite on the CPU cores beside it
#   bound      issue 37 item 4: the device-bound variant of each workload (batch x4);
#              issue 43: bench/update_replay.py on CUDA
#   compiled   issue 37 item 4: the compiled GPT, inductor's default mode (with an A/A pair)
#              and reduce-overhead
#   integrity  issue 43: bench/replica_check.py on CUDA, the spike replay's overhead; NaN latency
#   extra      FLOPs/MFU/phases (bench/mfu.py), compiled models under CUDA graphs
#              (bench/cudagraphs.py): measured on 2026-11-27, for a session with time left
#
#   bash bench/gpu_session.sh cost tests
#   bash bench/gpu_session.sh bound
#   RERUN="tests/gpu/x.py::t ..." bash bench/gpu_session.sh rerun   # those tests again
#   DRY=1 bash bench/gpu_session.sh cost tests bound compiled integrity
#       # every command on the CPU at the smallest sizes (the cuda tests collected, not run;
#       # no CPU suite): a smoke run that CI runs (.ci/run), so that no script of a stage has
#       # rotted by the time a GPU is lent; exits 1 if any command failed (a GPU session goes
#       # on past a failure, and says so)
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: gpu_session.sh STAGE... (cost tests bound compiled integrity extra rerun)" >&2; exit 2; }
if [ -z "${DRY:-}" ] && [ $# -gt 2 ]; then
    echo "at most two stages a call: a call has 10 minutes and returns 8 files" >&2
    exit 2
fi
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
    timeout -k 10 "$seconds" "$@" >>"$OUT/$stage.txt" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || failed=$((failed + 1))
    say "$stage: $name exit $rc"
    pack "$stage"
}

# pack STAGE: the JSON so far, written apart and then moved (a call killed mid-write keeps
# the last whole archive)
pack() {
    tar -czf "$OUT/.$1-json.tgz" -C "$json" . 2>/dev/null && mv "$OUT/.$1-json.tgz" "$OUT/$1-json.tgz"
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
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,compute_mode --format=csv,noheader
    fi
    python -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
    git rev-parse HEAD 2>/dev/null || echo "checkout (no .git)"
    nproc
} >>"$OUT/summary.txt" 2>&1

# the sizes of each command: a GPU session's, or the smoke run's (DRY)
if [ -z "$dry" ]; then
    gpu=(--gpu)
    cost_rounds=(--rounds 5 --steps 12 --warmup 4)
    bound_rounds=(--rounds 4 --steps 6 --warmup 3)
    compiled_rounds=(--rounds 5 --steps 12 --warmup 5)
    replay_rounds=(--rounds 4 --steps 12 --warmup 3)
    backend=(--compile-backend inductor)
    host_cost=(--full --steps 16 --profile resnet50)
    cuda_tests=(-m cuda -v -rfEs -p no:cacheprovider --timeout 150)
    replica=(--device cuda --rounds 5)
    update_replay=(--device cuda --rounds 5)
    latency=(--full --after 30 --rounds 4)
    mfu=()
    cudagraphs=(--quick --modes reduce-overhead,default)
else
    gpu=(--gpu --device cpu)
    cost_rounds=(--rounds 1 --steps 1 --warmup 1)
    bound_rounds=(--rounds 1 --steps 1 --warmup 1)
    compiled_rounds=(--rounds 1 --steps 1 --warmup 1)
    replay_rounds=(--rounds 1 --steps 1 --warmup 1)
    backend=(--compile-backend aot_eager)
    host_cost=(--device cpu --steps 2 --profile mlp)
    cuda_tests=(-m cuda -q -p no:cacheprovider --collect-only)
    replica=(--device cpu --small --rounds 1)
    update_replay=(--device cpu --rounds 1 --steps 1)
    latency=(--after 3 --rounds 1 --steps 1 --deadline 2)
    mfu=(--device cpu --rounds 1 --steps 2)
    cudagraphs=(--quick --modes default --device cpu)
fi

for stage in "$@"; do
    say "stage $stage${dry:+ (dry: on the CPU, smallest sizes)}"
    case $stage in
        cost)
            run cost overhead 190 python bench/overhead.py "${gpu[@]}" "${cost_rounds[@]}" \
                --configs "none again,hookprof default,hookprof every step,torch.profiler" \
                --out "$json/overhead.json"
            run cost host_cost 70 python bench/host_cost.py "${host_cost[@]}" \
                --json "$json/host_cost.json"
            ;;
        tests)
            suite=
            if [ -z "$dry" ]; then
                # the rest of the quick suite on the CPU cores: what a contributor with a GPU
                # sees (tests that take the GPU when there is one); one torch thread each; each
                # outcome as it ends (-v), since a kill at the limit loses pytest's summary
                OMP_NUM_THREADS=1 timeout -k 10 240 python -m pytest -v -m "not cuda and not slow" \
                    -n 6 -p no:cacheprovider --timeout 200 -rfEs >"$OUT/tests-suite.txt" 2>&1 &
                suite=$!
            fi
            # (with Prometheus carried, the GPU straggler test among them: ~60-90 s of it)
            run tests cuda-tests 250 python -m pytest "${cuda_tests[@]}" \
                --junitxml="$json/cuda-tests.xml"
            if [ -n "$suite" ]; then
                wait "$suite"
                say "tests: quick suite (not cuda, -n 6) exit $?"
            fi
            ;;
        bound)
            run bound overhead-batch-x4 150 python bench/overhead.py "${gpu[@]}" "${bound_rounds[@]}" \
                --batch-times 4 --configs "none again,hookprof default,hookprof every step" \
                --out "$json/overhead-batch-x4.json"
            run bound update_replay 40 python bench/update_replay.py "${update_replay[@]}"
            ;;
        compiled)
            # (each configuration is its own copy, compiled on its own: the A/A pair in the
            # default mode only, so that both modes fit)
            run compiled overhead-compiled-default 110 python bench/overhead.py "${gpu[@]}" \
                "${compiled_rounds[@]}" --workloads gpt --compile default "${backend[@]}" \
                --configs "none again,hookprof default" --out "$json/overhead-compiled-default.json"
            if [ -z "$dry" ]; then  # (CUDA graphs: a GPU's)
                run compiled overhead-compiled-reduce-overhead 90 python bench/overhead.py \
                    "${gpu[@]}" "${compiled_rounds[@]}" --workloads gpt --compile reduce-overhead \
                    "${backend[@]}" --configs "hookprof default" \
                    --out "$json/overhead-compiled-reduce-overhead.json"
            fi
            ;;
        integrity)
            run integrity replica_check 40 python bench/replica_check.py "${replica[@]}"
            # the spike replay armed (issue 43): its copies, checksums and gate, per step
            run integrity overhead-spike-replay 70 python bench/overhead.py "${gpu[@]}" \
                "${replay_rounds[@]}" --workloads gpt,mlp \
                --configs "hookprof default,hookprof spike replay" \
                --out "$json/overhead-spike-replay.json"
            run integrity nonfinite_latency 90 python bench/nonfinite_latency.py "${latency[@]}" \
                --out "$json/nonfinite_latency.json"
            ;;
        extra)
            run extra mfu 60 python bench/mfu.py "${mfu[@]}" --json "$json/mfu.json"
            run extra cudagraphs 120 python bench/cudagraphs.py "${cudagraphs[@]}" \
                --json "$json/cudagraphs.json"
            ;;
        rerun)
            # shellcheck disable=SC2086  # node ids, one per word
            run rerun tests 200 python -m pytest -v -rfEs -p no:cacheprovider --timeout 120 ${RERUN:?RERUN=node ids}
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
