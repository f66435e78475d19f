#!/usr/bin/env bash
# The one prepared GPU script: where the paper step's time goes, which switches win, how long a
# run takes to compile and to reach its first loss, real-data throughput and useful MFU as a user
# trains, and MINER's CSLS against its authors' GPU code; one short table last
# (bench/gpu_session_table.py), full logs and JSON in the output folder.
#
#   bash bench/gpu_session.sh --out DIR            # one GPU: the paper recipe, about 9 minutes
#   bash bench/gpu_session.sh --tiny --out DIR     # the same stages on a CPU in minutes (a test)
#
# On a lent GPU machine (no package index there), from the repository root, with .whl/ made by
# bench/gpu_wheels.sh and the MINER authors' files in .outside/ROCS (both carried):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && \
#       bash bench/gpu_session.sh --out $OUT
#
# Stages, each under its own share of --budget seconds (a stage past it is stopped and the
# table says so): profile (bench/gpu_profile.py), variants (bench/bench_step_variants.py: each
# switch of config.perf against the default, ordered by the profile), run
# (bench/bench_run_start.py: launch/train.py on the same records from a cold cache, stopped
# with SIGTERM after some steps, then the same command again, resuming on the warm cache, with
# the variants' winners: compile time, first loss, examples/s, MFU and useful MFU), miner
# (bench/bench_miner.py --resident: CSLS at 8,231 x 32,768 on the device), annotate
# (bench/bench_annotate_gpu.py: the stages of `data_prep annotate` at full size with random
# weights, GroundingDINO-base, SAM ViT-H and a 7B image-text-to-text model in bf16, on the demo's
# photographs: images/s per stage and batch, VLM tokens/s, each speed switch, the pipeline),
# index (bench/bench_miner_index.py: a MINER ANN index of 100,000 x (1 + 5) x 768 built and
# searched at its calibrated settings, the exact re-rank on the device; last, with what is left).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu_session}"
# the interpreter every stage runs: $SCLARO_PYTHON (a test passes its own), else python3 on PATH
py="${SCLARO_PYTHON:-python3}"
tiny=0
budget=540
# usage MESSAGE: the one-line usage error of every command (sclaro_jax.cli), exit 2
usage() { echo "error: $1 (see bash bench/gpu_session.sh --help)" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out|--budget) [[ $# -ge 2 && $2 != --* ]] || usage "argument $1: expected one value"
            [[ $1 == --out ]] && out="$2" || budget="$2"; shift 2 ;;
        --out=*) out="${1#*=}"; shift ;;
        --budget=*) budget="${1#*=}"; shift ;;
        --tiny) tiny=1; shift ;;
        -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) near=$("$py" -c 'import difflib, sys
m = difflib.get_close_matches(sys.argv[1].split("=")[0], ["--out", "--tiny", "--budget"], 1, 0.6)
print(f" (did you mean {m[0]}?)" if m else "")' "$1" 2>/dev/null)
            usage "unrecognized argument: $1$near" ;;
    esac
done
[[ $budget =~ ^[1-9][0-9]*$ ]] || usage "argument --budget: '$budget' is not a whole number of seconds"
mkdir -p "$out" 2>/dev/null && probe=$(mktemp -p "$out" .write-check-XXXXXX 2>/dev/null) \
    && rm -f "$probe" || { echo "error: cannot write $out: pass an --out folder you can write" >&2
                           exit 2; }
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
cores=$(nproc)
workers=$((cores > 1 ? cores - 1 : 0))
if [[ $tiny == 1 ]]; then
    recipe=(--config configs/scenarioclip.py:demo); variants=(--variants default,fused_qkv)
    samples=24; profile_steps=2; variant_steps=2; run_steps=16; log_every=2; stop_after=2
    workers=0
    caps=(profile=150 variants=200 run=240 miner=60 annotate=60 index=60)
    miner=(--queries 300 --authors-images 1024); annotate=(--tiny)
    index=(--n 3000 --crops 3 --dim 32 --queries 200 --bank 200)
else
    recipe=(--config configs/scenarioclip.py --override model.dtype=bfloat16); variants=()
    samples=512; profile_steps=5; variant_steps=10; run_steps=160; log_every=10; stop_after=6
    # annotate last, at least 60 s of the 540 whatever the others take
    # the index last, with what is left of the budget (at most 60 s)
    caps=(profile=110 variants=150 run=180 miner=40 annotate=100 index=60)
    miner=(--queries 8231 --authors-images 32768); annotate=()
    index=(--n 100000 --crops 5 --dim 768 --queries 1000 --bank 1000)
fi
data="$out/data"
start=$SECONDS

# stage NAME CMD...: runs CMD with at most min(its cap, what is left of the budget), logs to
# OUT/NAME.log, records its exit status and seconds in OUT/stages.jsonl
stage() {
    local name=$1; shift
    local cap left t0 rc
    for c in "${caps[@]}"; do [[ ${c%%=*} == "$name" ]] && cap=${c#*=}; done
    left=$((budget - (SECONDS - start)))
    (( left < cap )) && cap=$left
    t0=$SECONDS
    if (( cap < 10 )); then
        rc=skipped
    else
        echo "== $name (at most $cap s)" | tee -a "$out/session.log"
        timeout --signal=INT --kill-after=20 "$cap" "$@" > "$out/$name.log" 2>&1
        rc=$?
        tail -n 3 "$out/$name.log" | tee -a "$out/session.log"
    fi
    echo "{\"stage\": \"$name\", \"status\": \"$rc\", \"seconds\": $((SECONDS - t0))}" \
        >> "$out/stages.jsonl"
}

"$py" -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())" \
    | tee "$out/session.log"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null | tee -a "$out/session.log"
: > "$out/stages.jsonl"

# profile and variants share one compilation cache (the default step compiles once); the run
# starts from a cold one of its own, as a user's first run does
export JAX_COMPILATION_CACHE_DIR="$out/jax_cache"
stage profile "$py" bench/gpu_profile.py "${recipe[@]}" --samples "$samples" --data "$data" \
    --warmup 2 --steps "$profile_steps" --workers "$workers" --out "$out/profile"

stage variants "$py" bench/bench_step_variants.py "${recipe[@]}" "${variants[@]}" \
    --data "$data" --profile "$out/profile/profile.json" --steps "$variant_steps" \
    --json "$out/variants.json"
unset JAX_COMPILATION_CACHE_DIR

# the trainer's command line takes the recipe's overrides as --config.KEY=VALUE; the run trains
# only (--no-eval): what is timed is its start and its steps
train=("$py" launch/train.py "${recipe[0]}" "${recipe[1]}")
for ((i = 2; i < ${#recipe[@]}; i += 2)); do train+=("--config.${recipe[i + 1]}"); done
mapfile -t winners < <("$py" bench/bench_step_variants.py --overrides-of "$out/variants.json" \
    2>/dev/null)
# the run's useful FLOPs: the variants' line of the same recipe's default step (lowering the
# step three times again would only repeat it); without it, bench_run_start.py lowers its own
stage run "$py" bench/bench_run_start.py --out "$out" --stop-after "$stop_after" \
    --useful-flops-from "$out/variants.json" -- \
    "${train[@]}" --workdir "$out/run" --config.data.dir="$data" \
    --config.train.steps="$run_steps" --config.log_every="$log_every" \
    --config.checkpoint_every="$run_steps" --config.data.workers="$workers" \
    --config.progress_bar=false --no-eval "${winners[@]}"

authors=()  # the MINER authors' GPU code, where a GPU and their files are here
theirs=.outside/ROCS/appendix/optimization
if [[ $tiny == 0 ]]; then
    [[ -f $theirs/csls_gpu.py ]] && authors+=(--authors-gpu "$theirs/csls_gpu.py")
    [[ -f $theirs/csls.cu ]] && authors+=(--authors-cu "$theirs/csls.cu")
fi
stage miner "$py" bench/bench_miner.py --skip-csls --skip-rocs --resident "${miner[@]}" \
    "${authors[@]}" --repeats 5 --json "$out/miner.json"

stage annotate "$py" bench/bench_annotate_gpu.py "${annotate[@]}" --json "$out/annotate.json"

# the MINER ANN index: built by FAISS on the host's cores, then searched at the settings its
# build calibrated (recall@10 0.95), the exact re-rank on the device; its gallery (0.9 GB at
# 100,000 x 6 x 768) in a temporary folder, not in OUT
ann=$(mktemp -d)
stage index "$py" bench/bench_miner_index.py "${index[@]}" --dir "$ann" --calibrated \
    --shortlists "" --repeats 3 --json "$out/index.json"
rm -rf "$ann"

"$py" bench/gpu_session_table.py "$out" | tee "$out/summary.md"
