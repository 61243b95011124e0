#!/usr/bin/env bash
# Everything a GPU session runs, in two stages that each fit one device call (< 10 minutes)
# and write their results under $OUT (at most 8 files come back per call: JSON goes into one
# tarball). The device's image has torch, transformers, prometheus_client, psutil,
# nvidia-ml-py, pytest, pytest-xdist and pytest-timeout, and no network: hookprof runs from
# the checkout (PYTHONPATH), nothing is installed.
#
#   bash bench/gpu_session.sh tests     # pytest -m cuda; the rest of the suite beside it on
#                                       # the CPU cores; CUDA graphs under compile (issue 30)
#   bash bench/gpu_session.sh measure   # host cost, NaN latency, overhead, FLOPs/MFU/phases
#   RERUN="tests/gpu/x.py::t ..." bash bench/gpu_session.sh measure   # re-runs those first
set -uo pipefail
stage=${1:?usage: gpu_session.sh tests|measure}
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
json=$(mktemp -d)
started=$(date +%s)
say() { echo "[$(( $(date +%s) - started )) s] $*" | tee -a "$OUT/summary.txt"; }
{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
    python -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
    git rev-parse HEAD 2>/dev/null || echo "checkout (no .git)"
    nproc
} >>"$OUT/summary.txt" 2>&1
case $stage in
    tests)
        # the rest of the suite on the CPU cores while the cuda tests run: what a contributor
        # with a GPU sees (tests that take the GPU when there is one); one torch thread each
        say "suite (not cuda), -n 8, in the background"
        OMP_NUM_THREADS=1 timeout 250 python -m pytest -q -m "not cuda" -n 8 -p no:cacheprovider \
            --timeout 200 -rfEs >"$OUT/suite.txt" 2>&1 &
        suite=$!
        say "cuda tests"
        timeout 250 python -m pytest -m cuda -q -rfEs -p no:cacheprovider --timeout 120 \
            --junitxml="$json/cuda-tests.xml" >"$OUT/cuda-tests.txt" 2>&1
        say "cuda tests exit $?"
        wait $suite
        say "suite exit $?"
        timeout 150 python bench/cudagraphs.py --modes reduce-overhead,default --json "$json/cudagraphs.json" >"$OUT/cudagraphs.txt" 2>&1
        say "cudagraphs exit $?"
        ;;
    measure)
        if [ -n "${RERUN:-}" ]; then
            # shellcheck disable=SC2086  # node ids, one per word
            timeout 70 python -m pytest -q -rfEs -p no:cacheprovider --timeout 60 $RERUN >"$OUT/rerun.txt" 2>&1
            say "rerun exit $?"
            timeout 70 python bench/cudagraphs.py --quick --modes reduce-overhead,default \
                --json "$json/cudagraphs.json" >"$OUT/cudagraphs.txt" 2>&1
            say "cudagraphs exit $?"
        fi
        timeout 100 python bench/host_cost.py --full --steps 16 --profile resnet50,mlp \
            --json "$json/host_cost.json" >"$OUT/host_cost.txt" 2>&1
        say "host_cost exit $?"
        timeout 100 python bench/nonfinite_latency.py --full --after 30 --rounds 6 \
            --out "$json/nonfinite_latency.json" >"$OUT/nonfinite_latency.txt" 2>&1
        say "nonfinite_latency exit $?"
        timeout 170 python bench/overhead.py --gpu --rounds 10 \
            --configs "none again,floor,hookprof default,hookprof loss check,hookprof every step,torch.profiler" \
            --out "$json/overhead.json" >"$OUT/overhead.txt" 2>&1
        say "overhead exit $?"
        timeout 50 python bench/mfu.py --json "$json/mfu.json" >"$OUT/mfu.txt" 2>&1
        say "mfu exit $?"
        timeout 40 python bench/update_replay.py --device cuda --rounds 5 >"$OUT/update_replay.txt" 2>&1
        say "update_replay exit $?"
        ;;
    *)
        echo "unknown stage $stage" >&2
        exit 2
        ;;
esac
tar -czf "$OUT/$stage-json.tgz" -C "$json" . 2>/dev/null
tail -n 25 "$OUT"/*.txt
