#!/usr/bin/env bash
# Everything a GPU session measures, in stages that each fit one device call (< 10 minutes),
# writing their results under $OUT (at most 8 files come back per call). The device's image
# has torch, transformers, prometheus_client, psutil, nvidia-ml-py and pytest, and no network:
# hookprof runs from the checkout (PYTHONPATH), nothing is installed.
#
#   bash bench/gpu_session.sh tests      # python -m pytest -m cuda (issues 12, 13, 15, 18)
#   bash bench/gpu_session.sh measure    # host cost per step/leaf (13), NaN latency (12)
#   bash bench/gpu_session.sh overhead   # step-time ratios, four workloads, 16 rounds (13)
set -uo pipefail
stage=${1:?usage: gpu_session.sh tests|measure|overhead}
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
    git rev-parse HEAD 2>/dev/null || echo "checkout (no .git)"
} >"$OUT/$stage-machine.txt" 2>&1
case $stage in
    tests)
        timeout 560 python -m pytest -m cuda -q -rfEs -p no:cacheprovider \
            --junitxml="$OUT/cuda-tests.xml" 2>&1 | tail -150 >"$OUT/cuda-tests.txt"
        ;;
    measure)
        timeout 300 python bench/host_cost.py --full --json "$OUT/host_cost.json" \
            >"$OUT/host_cost.txt" 2>&1
        timeout 240 python bench/nonfinite_latency.py --full --out "$OUT/nonfinite_latency.json" \
            >"$OUT/nonfinite_latency.txt" 2>&1
        ;;
    overhead)
        timeout 560 python bench/overhead.py --gpu --out "$OUT/overhead.json" >"$OUT/overhead.txt" 2>&1
        ;;
    *)
        echo "unknown stage $stage" >&2
        exit 2
        ;;
esac
tail -40 "$OUT"/*.txt
