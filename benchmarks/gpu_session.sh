#!/usr/bin/env bash
# One GPU machine's checks, prepared to run once inside a short lease (the device machine has
# no network; its image lacks DeepSpeed, webdataset, pydantic, ... and this transformers):
#
#   1. install the wheels in $WHEELS (built beforehand; see docs/gpu.md) and this checkout;
#   2. the CUDA cases of the numerical tests (attention backends, one-call ViT, Liger's
#      kernels, host syncs, the memory model with the GPU's kernels, the peer's varlen path),
#      and whether torch's varlen kernel takes fewer K/V heads as they are
#      (benchmarks/varlen_gqa_probe.py);
#   3. gpu_bench.py with the given arguments (default: the balanced plan packed up to the
#      largest micro-batch the memory model lets the device hold recomputing no layer whole,
#      with a trace and a host-sampled step; again with every layer on cuDNN's attention;
#      again with the ViT's blocks compiled; the packed Hugging Face Trainer peer on torch's
#      varlen kernel; the profile and its replay), its JSON written after each phase.
#
# Everything lands in $OUT (default build/gpu-session): logs, nvidia-smi, the bench's JSON, and
# the runs' logs with the trace summaries, gzipped. Each step is bounded by `timeout`, so a hang
# leaves the rest's time.
#
#   WHEELS=.device-wheels OUT=build/gpu-session bash benchmarks/gpu_session.sh [gpu_bench args]
set -u
OUT=${OUT:-build/gpu-session}
WHEELS=${WHEELS:-.device-wheels}
BENCH_S=${BENCH_S:-460}
TESTS_S=${TESTS_S:-90}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
start=$SECONDS
stamp() { echo "[gpu_session +$((SECONDS - start))s] $*"; }

stamp install
python3 -m pip install -q --no-deps --no-index "$WHEELS"/*.whl >"$OUT/install.log" 2>&1 &&
    python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/install.log" 2>&1 ||
    { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1

stamp "CUDA tests"
timeout "$TESTS_S" python3 -m pytest -q -p no:cacheprovider -p no:xdist -o addopts="" \
    tests/test_kernels.py tests/test_model.py tests/test_clock.py tests/test_model_inputs.py \
    -k "cuda or liger" 2>&1 |
    tee "$OUT/cuda-tests.log" | tail -15
# whether this torch's varlen kernel takes fewer K/V heads as they are (the trainer repeats them
# where varlen_attn has no enable_gqa), beside the tests' log
timeout 60 python3 benchmarks/varlen_gqa_probe.py 2>&1 | tee -a "$OUT/cuda-tests.log"

stamp gpu_bench
args=("$@")
# default: where the step's time goes (the traced step by layer and kernel class, the
# host-sampled step), every layer on SDPA with cuDNN's attention first (the run's parts say
# what it does to the ViT and to the LLM), the ViT's blocks compiled,
# the packed peer (on torch's varlen kernel), then the profile and the simulator's replay
[ ${#args[@]} -eq 0 ] && args=(--steps 6 --warmup 2 --plans balanced --ab cudnn compiled_vit
                              --baseline hf_packed --trace build/gpu-trace)
timeout "$BENCH_S" python3 benchmarks/gpu_bench.py --json "$OUT/gpu.json" "${args[@]}" 2>&1 |
    tee "$OUT/bench.log" | grep -v "^{" | tail -40
stamp "bench done (rc ${PIPESTATUS[0]})"
cp build/gpu_bench/run-balanced/pipeline.json "$OUT/pipeline-balanced.json" 2>/dev/null
# the train logs, pipeline.json files, trace summaries and host samples in one archive (the
# device tool takes back 8 files at most, each of limited size: a step's whole trace, ~20 MB
# gzipped, is not)
tar czf "$OUT/runs.tgz" build/gpu_bench/run-*/train_log.jsonl build/gpu_bench/run-*.log \
    build/gpu_bench/run-*/pipeline.json build/gpu_bench/profile/profile.json \
    build/gpu-trace/*/*-summary.json build/gpu-trace/*/host-*.json 2>/dev/null
ls -la "$OUT"
