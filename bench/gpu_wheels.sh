#!/usr/bin/env bash
# The packages the lent GPU machine's image lacks, as wheels for its Python 3.12, into .whl/ at
# the repository root (kept out of git: .git/info/exclude). The GPU machine reaches no package
# index; the session carries .whl/ and installs from it:
#   bash bench/gpu_wheels.sh          # here, once per checkout (downloads about 25 MB)
#   # there, before bench/gpu_session.sh:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# Versions are constraints.txt's pins. The image already holds jax, flax, optax, orbax, numpy,
# numba, tokenizers, safetensors, msgpack, absl, etils, chex, protobuf, cloudpickle, PyYAML and
# torch (for the MINER authors' GPU CSLS, which the session compares against), torchvision and
# transformers (the annotate stage's models; segment-anything is carried). faiss-cpu (19 MB) is
# the index stage's.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
mkdir -p .whl
for name in grain array_record ml_collections tensorboardX dm-pix simplejpeg portpicker \
        segment-anything faiss-cpu; do
    pin=$(grep -i "^${name}==" constraints.txt)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp -d .whl "$pin" \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64
done
ls -la .whl
