#!/usr/bin/env bash
# ScenarioCLIP training throughput and MFU on one GPU (paper config: ViT-B/32, batch 128).
# Run from the repository root on a machine with jax[cuda] installed:
#   pip install -c constraints.txt -e ".[cuda]" && bash bench/gpu_train.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import jax; print(jax.devices())"
for dtype in bfloat16 float32; do
  python bench/bench_gpu_train.py --preset ViT-B/32 --batch 128 --objects 8 --relations 8 \
      --dtype "$dtype" --steps 20 "$@"
done
