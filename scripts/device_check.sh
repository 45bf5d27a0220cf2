#!/usr/bin/env bash
# Issue 38's device check, in one call of the device tool on one H200 (about 8 minutes):
#   here:    bash scripts/device_wheels.sh
#   device:  run(command="bash scripts/device_check.sh", carry=[".whl"], timeout_s=590)
#   (with llama.cpp's CUDA build, the anchor: bash scripts/device_anchor.sh here first, and
#   carry=[".whl", ".anchor/llama-cuda.tar.xz"])
#   The main bench (step 3) may take most of the budget; a second call on the still-warm
#   machine, `bash scripts/device_check.sh ab` (timeout_s what is left), skips steps 2 and
#   3 and runs the A/Bs of step 4 on (the wheels and the build are still there).
# 1. installs the carried wheels (kinetic's dependencies the image lacks) and builds
#    kinetic's C++ CPU kernel in place with the image's compiler; runs each kernel that has
#    a fallback once (bench/gpu_preflight.py), turning off any that fails;
# 2. runs the pallas tests on the GPU, compiled through Triton (not interpreted);
# 3. runs bench/gpu.py: bitwise row invariance and decode / prompt speed on random-weight
#    models of SmolLM2-135M's, Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes, beside the
#    bandwidth bound, XLA's dense bf16 path and, when .anchor/llama-cuda.tar.xz is carried
#    too (scripts/device_anchor.sh builds it here), llama.cpp's CUDA backend on the same
#    files: run(..., carry=[".whl", ".anchor/llama-cuda.tar.xz"]) (the working tree, the
#    wheels and the tarball are about 50 MB of the tool's 64 MiB);
# 4. bench/gpu.py --quick under XLA_FLAGS that put while loops into command buffers (CUDA
#    graphs) too: the server's decode loop at Qwen2.5-1.5B's shape, beside bench.log's;
#    then with one-row decode dots (KINETIC_PALLAS_DECODE_ROWS=1), its speed and bits;
#    then with the norms as kernels of their own (KINETIC_GPU_NORM=kernel); then with
#    one program walking a row's keys (KINETIC_GPU_ATTENTION=whole); then
#    Qwen3.5-0.8B's shape with the delta rule's Pallas kernel and with XLA's loop; then
#    the sampling chain's cost a step at 1, 64 and 256 sampled rows, by how rows are
#    grouped into calls (bench/gpu_sampler.py), and again with conditionals in the CUDA
#    graphs, appended to graphs.log;
# 5. (issue 42) bench/gpu.py --split-check: Qwen2.5-1.5B's shape through the split's code
#    path over one device, its bytes and speed beside the unsplit path's;
# 6. if time is left, every family's tiny model on the pallas kernel, row-bucket bits.
# Eight files go to $OUT (the device tool brings back at most 8): gpu.txt (the device, the
# build's and the preflight's failures if any, the anchor's devices), tests.log, bench.log,
# gpu.json, gpu.md, graphs.log, split.log, families.log; their figures go into
# docs/performance.md, "GPU". Each step after the tests gets what is left of DEVICE_BUDGET
# seconds (560: the script ends inside the call's 590), and a step with under 30 s left is
# skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
# seconds left of the budget, at most $1 when given
left() { local n=$(( ${DEVICE_BUDGET:-560} - SECONDS )); echo $(( n > ${1:-n} ? ${1:-n} : n )); }
OUT=${OUT:-/tmp/kinetic-device-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1 || tail -5 /tmp/build.log | tee -a "$OUT/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
# the kernels with a fallback (the norm's, the attention's lanes, the delta rule's), each
# run once here (bench/gpu_preflight.py): one that fails is turned off for the rest of the
# run (KINETIC_GPU_NORM=xla, KINETIC_GPU_ATTENTION=whole, KINETIC_GPU_DELTA=xla), which
# gpu.txt says, with the error
eval "$(timeout 120 python3 bench/gpu_preflight.py 2>>"$OUT/gpu.txt" | tee -a "$OUT/gpu.txt")"
PART=${1:-all}   # all, or ab: the A/Bs and what follows them only
[ "$PART" = all ] && timeout 150 python3 -m pytest -q -n 0 -p no:cacheprovider -m "not real_model" \
    -k "not every_family" \
    tests/test_pallas_matmul.py tests/test_pallas_attention.py tests/test_pallas_norm.py \
    tests/test_pallas_greedy.py tests/test_pallas_route.py tests/test_pallas_lowering.py \
    tests/test_pallas_delta.py tests/test_pallas_model.py 2>&1 | tee "$OUT/tests.log" | tail -15
# the anchor: llama.cpp built for sm_90, its cuBLAS the image's (JAX's CUDA wheels)
ANCHOR=""
if [ -f .anchor/llama-cuda.tar.xz ]; then
    mkdir -p /tmp/anchor
    tar -xJf .anchor/llama-cuda.tar.xz -C /tmp/anchor 2>/dev/null || python3 -c "import tarfile
tarfile.open('.anchor/llama-cuda.tar.xz').extractall('/tmp/anchor', filter='data')"
    CUBLAS=$(python3 -c "import glob, os, site
found = [f for p in site.getsitepackages() for f in glob.glob(p + '/nvidia/**/libcublas.so.*', recursive=True)]
print(os.path.dirname(found[0]) if found else '')")
    # libcuda.so.1 is the driver's: on the loader's path, or in the driver's folder
    DRIVER=$([ -d /usr/local/nvidia/lib64 ] && echo /usr/local/nvidia/lib64)
    export LD_LIBRARY_PATH=${CUBLAS}${DRIVER:+:$DRIVER}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    ANCHOR="--llama-cpp /tmp/anchor/llama-cuda/bin"
    /tmp/anchor/llama-cuda/bin/llama-bench --list-devices 2>&1 | tail -4 | tee -a "$OUT/gpu.txt"
fi
step=$(left 330)
[ "$PART" = all ] && [ "$step" -ge 30 ] && timeout "$step" python3 bench/gpu.py --out "$OUT" $ANCHOR \
    --shape qwen25-1.5b --shape qwen25-0.5b --shape smollm2-135m --qtype Q4_0 --qtype Q4_K \
    2>&1 | tee "$OUT/bench.log" | tail -20
# XLA's command buffers (CUDA graphs) around while loops too: the server's 4-step decode
# loop at Qwen2.5-1.5B's shape, to set beside bench.log's loop figure under the defaults
GRAPHS=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE
step=$(left 80)
[ "$step" -ge 30 ] && XLA_FLAGS="--xla_gpu_enable_command_buffer=$GRAPHS" timeout "$step" \
    python3 bench/gpu.py --quick --shape qwen25-1.5b --qtype Q4_0 \
    --streams 1,16 --reps 5 2>&1 | tee "$OUT/graphs.log" | tail -3
# the decode dots of one row (kernels/pallas_matmul.py dot_rows; 16 rows by default): the
# same loop, and whether a row keeps its bits at 1, 2 and 16 rows, appended to graphs.log
step=$(left 60)
[ "$step" -ge 30 ] && KINETIC_PALLAS_DECODE_ROWS=1 timeout "$step" python3 bench/gpu.py --quick \
    --shape qwen25-1.5b --qtype Q4_0 --streams 1,2,16 --reps 5 2>&1 | tee -a "$OUT/graphs.log" \
    | tail -3
# the norms as kernels of their own (KINETIC_GPU_NORM=kernel, two launches a layer more
# than the default's, where the projections normalize their x): the same loop, appended
step=$(left 60)
[ "$step" -ge 30 ] && KINETIC_GPU_NORM=kernel timeout "$step" python3 bench/gpu.py --quick \
    --shape qwen25-1.5b --qtype Q4_0 --streams 1,16 --reps 5 2>&1 | tee -a "$OUT/graphs.log" \
    | tail -3
# a row's keys walked by one program a kv head (KINETIC_GPU_ATTENTION=whole) where the
# default takes them in 8 lanes, a program each, merged in a second kernel
# (kernels/pallas_attention.py _split_attention): the same loop at position 512, appended
step=$(left 60)
[ "$step" -ge 30 ] && KINETIC_GPU_ATTENTION=whole timeout "$step" python3 bench/gpu.py --quick \
    --shape qwen25-1.5b --qtype Q4_0 --streams 1,16 --reps 5 2>&1 | tee -a "$OUT/graphs.log" \
    | tail -3
# Qwen3.5-0.8B's shape (18 gated delta-rule layers): its decode, a 512-token prompt (the
# delta rule takes a prompt's tokens one after another) and a row's bits with the
# delta rule's Pallas kernel (kernels/pallas_delta.py), then with XLA's loop
# (KINETIC_GPU_DELTA=xla, about ten kernels a token a layer), appended to graphs.log
for delta in pallas xla; do
    step=$(left 60)
    [ "$step" -ge 30 ] && KINETIC_GPU_DELTA=$delta timeout "$step" python3 bench/gpu.py --quick \
        --shape qwen35-0.8b --qtype Q4_0 --streams 1,16 --reps 5 --prompt 2>&1 \
        | tee -a "$OUT/graphs.log" | tail -3
done
# the sampling chain at 1, 64 and 256 sampled rows of Qwen2.5's 151,936 tokens: a loop over
# 4 rows a call (sampler.sample_rows), all 4 at once (sample_batch), and a GPU's default, up
# to 64 rows at once (GPU_SAMPLE_CHUNK); the same tokens each way; then the same with
# conditionals in the CUDA graphs too (the chain's skipped stages are lax.cond: by default
# each reads its flag back to the host), appended to graphs.log
step=$(left 60)
[ "$step" -ge 30 ] && timeout "$step" python3 bench/gpu_sampler.py --streams 1,64,256 \
    2>&1 | tee -a "$OUT/graphs.log" | tail -6
step=$(left 45)
[ "$step" -ge 30 ] && XLA_FLAGS="--xla_gpu_enable_command_buffer=$GRAPHS" timeout "$step" \
    python3 bench/gpu_sampler.py --streams 1,64 --form loop4,batch64 2>&1 \
    | tee -a "$OUT/graphs.log" | tail -4
# issue 42: the split's code path over one device beside the unsplit path (its figures in
# the log: each model's JSON line and the table)
step=$(left 90)
[ "$step" -ge 30 ] && timeout "$step" python3 bench/gpu.py --shape qwen25-1.5b --qtype Q4_0 \
    --streams 1,16 --split-check 2>&1 | tee "$OUT/split.log" | tail -5
# last, if time is left: every family's tiny model, a row's bits in every bucket
step=$(left)
[ "$step" -ge 30 ] && timeout "$step" python3 -m pytest -q -n 0 -p no:cacheprovider \
    -k every_family tests/test_pallas_model.py 2>&1 | tee "$OUT/families.log" | tail -5
echo "device check: $SECONDS s" | tee -a "$OUT/gpu.txt"
