#!/usr/bin/env bash
# ScenarioCLIP training throughput and MFU on one GPU (paper config: ViT-B/32, batch 128, here
# with 8 objects + 8 relations per image), bf16 compute (fp32 params and losses) and fp32.
# Run from the repository root on a machine with jax[cuda] installed:
#   pip install -c constraints.txt -e ".[cuda]" && bash bench/gpu_train.sh
#
#   bash bench/gpu_train.sh --real-data [bench_gpu_real_data.py options]
# trains the same bf16 step from real Grain batches (version-2 records written by the bench,
# photometric augmentation in the step) with Grain worker processes on all of the machine's
# cores (one fewer, and all), and reports examples/s against the device-batch rate and
# data_wait_fraction (target: >= 90% of the device-batch rate).
#
#   bash bench/gpu_train.sh --layouts
# the paper config from real Grain batches whose records carry the demo photographs' own
# object / relation counts, caps (8 + 8 slots per image) against packed, one after the other
# in one run: examples/s, data_wait_fraction, MFU and useful MFU (FLOPs of real crops only).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null || true
if [[ "${1:-}" == "--layouts" ]]; then
    shift
    cores=$(nproc)
    python3 bench/bench_gpu_real_data.py --preset ViT-B/32 --batch 128 --objects 8 \
        --relations 8 --dtype bfloat16 --counts demo --layout caps --layout packed \
        --workers $((cores > 1 ? cores - 1 : 1)) "$@"
    exit 0
fi
if [[ "${1:-}" == "--real-data" ]]; then
    shift
    cores=$(nproc)
    python3 bench/bench_gpu_real_data.py --preset ViT-B/32 --batch 128 --objects 8 \
        --relations 8 --dtype bfloat16 --workers $((cores > 1 ? cores - 1 : 1)) \
        --workers "$cores" "$@"
    exit 0
fi
python3 bench/bench_gpu_train.py --preset ViT-B/32 --batch 128 --objects 8 --relations 8 \
    --dtype bfloat16 --breakdown "$@"
for layout in caps packed; do  # slots left empty as real data leaves them: MFU and useful MFU
    python3 bench/bench_gpu_train.py --preset ViT-B/32 --batch 128 --objects 8 --relations 8 \
        --dtype bfloat16 --counts demo --layout "$layout" "$@"
done
python3 bench/bench_gpu_train.py --preset ViT-B/32 --batch 128 --objects 8 --relations 8 \
    --dtype float32 "$@"
