#!/usr/bin/env bash
# One GPU machine's checks, prepared to run once inside a short lease (the device machine has
# no network; its image lacks DeepSpeed, webdataset, pydantic, ... and this transformers):
#
#   1. install the wheels in $WHEELS (built beforehand: make device-wheels; docs/gpu.md) and
#      this checkout;
#   2. on the device, the CUDA cases of the numerical tests (attention backends, one-call ViT,
#      Liger's kernels, host syncs, the memory model with the GPU's kernels, the peer's varlen
#      path, the fused LM loss) and whether torch's varlen kernel takes fewer K/V heads as they are
#      (benchmarks/varlen_gqa_probe.py); meanwhile, on the CPUs, gpu_bench.py --prepare-only
#      makes the bench's data, model, plans and shards (it holds no CUDA context);
#   3. gpu_bench.py --prepared, its phases in the order their results matter, its JSON written
#      after each (a run cut short keeps what it measured). Default: the balanced plan packed
#      up to the largest micro-batch the memory model lets the device hold recomputing no
#      layer whole, a full fine-tune, with a traced and a host-sampled step; the fair peer
#      (the packed Hugging Face Trainer on torch's varlen kernel) on the same recipe; the ViT's
#      and LLM's blocks compiled (--ab compiled: since 2026-12-04 the compiled attention's
#      backward is the kernel's own, untimed on a GPU); the recipe users run (--ab frozen_vit:
#      the vision tower frozen) for vlmshard, then the peer; that recipe compiled
#      (compiled_frozen_vit; the peer does not train it again). Arguments replace these
#      phases, not the sizes (--steps, ... given again win): e.g. --quick --ab cudnn for the
#      cuDNN A/B, whose 20 s steps (10.4% MFU on the H200) ate the 2026-12-04 lease.
#
# Device time, estimated (s) from the H200's second lease of 2026-12-04 (benchmarks/results/
# h200-2026-12-04b: 365 s for everything but compiled_frozen_vit; a run's launch 37 s, a step
# of 2 micro-batches 3.0 s (2.0 frozen), compiling 72 s on the first step):
#   install                     15  pip: the 16 wheels, then this checkout (that lease: 13)
#   prepare                     60  data, 2B model, plans, shards on the CPUs (that lease: 58);
#                                   beside it the CUDA tests (TESTS_S: 36 s of pytest then)
#   balanced                    60  37 launch + 8 first step + 8 traced + 2 x 3
#   hf_packed                   45  out of memory as it is (that lease), then its micro-batches
#                                   cut in two, no recompute: two loads of the 2B model in
#                                   fp32, 4 steps of ~4-5 s (that lease, checkpointed: 4.5-6.6);
#                                   ~10 more where halves do not fit (checkpointing then)
#   balanced_compiled          125  37 + 80 first step (72 compiling) + 3 x 3
#   balanced_frozen_vit         50  37 + 7 first step + 3 x 2
#   hf_packed_frozen_vit        40  as hf_packed, steps of 3.6 s
#   balanced_compiled_frozen_vit 80  37 + 37 (the LLM's blocks compiled again: a frozen
#                                   ViT's graphs have no backward) + 3 x 2 (a guess)
#   archive                      2
#   total                      477  of DEADLINE_S: the bench gets what is left of it, so the
#                                   session ends inside it, the last phase cut first
#
# Everything lands in $OUT (default build/gpu-session): install.log, nvidia-smi.txt,
# cuda-tests.log, prepare.log, bench.log, gpu.json, pipeline-balanced.json and runs.tgz (the
# runs' train logs, pipeline.json files, trace summaries and host samples, under $BUILD).
#
#   WHEELS=.device-wheels OUT=build/gpu-session bash benchmarks/gpu_session.sh [gpu_bench args]
#   bash benchmarks/gpu_session.sh --smoke     # (or SMOKE=1) here, on CPU, the venv's python3
#
# --smoke runs every step at the smallest sizes with no GPU: no install (this environment),
# instead the size a device run carries (the working tree git keeps and $WHEELS, at most 64
# MiB); the CUDA tests collected, not run; no probe (it needs CUDA); gpu_bench.py --smoke with
# the same phases; the same files in $OUT (tests/test_gpu_session.py runs it).
set -u
cd "$(dirname "$0")/.."
SMOKE=${SMOKE:-0}
[ "${1:-}" = --smoke ] && { SMOKE=1; shift; }
OUT=${OUT:-build/gpu-session}
BUILD=${BUILD:-build}
WHEELS=${WHEELS:-.device-wheels}
DEADLINE_S=${DEADLINE_S:-480}
INSTALL_S=${INSTALL_S:-90}
TESTS_S=${TESTS_S:-55}
CARRY_MIB=64
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$BUILD"
OUT=$(cd "$OUT" && pwd)
BUILD=$(cd "$BUILD" && pwd)
start=$SECONDS
stamp() { echo "[gpu_session +$((SECONDS - start))s] $*"; }
# seconds left before the deadline, less the archive's; at least 1 (timeout 0 would not stop)
left() { local s=$((DEADLINE_S - (SECONDS - start) - 5)); echo $((s > 0 ? s : 1)); }

if [ "$SMOKE" = 1 ]; then
    sizes=(--smoke --steps 3 --warmup 1 --micro-batches 2 --target-samples 2)
    # what a device run carries: the files git does not ignore, and the wheels
    bytes=$({ git ls-files -z --cached --others --exclude-standard |
              xargs -0 stat -c %s 2>/dev/null; stat -c %s "$WHEELS"/*.whl 2>/dev/null; } |
            awk '{s += $1} END {print s + 0}')
    wheels=$(ls "$WHEELS"/*.whl 2>/dev/null | wc -l)
    stamp "install skipped (--smoke: this environment); a device run carries" \
          "$((bytes >> 20)) MiB of $CARRY_MIB: the working tree and $wheels wheels in $WHEELS"
    [ "$wheels" -gt 0 ] || echo "no wheels in $WHEELS: make device-wheels before a lease"
    [ "$bytes" -le $((CARRY_MIB << 20)) ] || { echo "over the $CARRY_MIB MiB a run carries"
                                               exit 1; }
else
    sizes=(--steps 4 --warmup 2 --micro-batches 2)
    stamp install
    timeout "$INSTALL_S" sh -c 'python3 -m pip install -q --no-deps --no-index "$0"/*.whl &&
        python3 -m pip install -q --no-deps --no-build-isolation -e .' "$WHEELS" \
        >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
    nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
fi

args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--quick --ab compiled frozen_vit compiled_frozen_vit
                               --baseline hf_packed --trace "$BUILD/gpu-trace")
rm -rf "$BUILD/gpu-trace"
bench=(python3 benchmarks/gpu_bench.py "${sizes[@]}" --work "$BUILD/gpu_bench" "${args[@]}")

stamp "prepare (CPUs) beside the CUDA tests (device)"
timeout "$(left)" "${bench[@]}" --prepare-only >"$OUT/prepare.log" 2>&1 &
prepare=$!
tests=(tests/test_kernels.py tests/test_model.py tests/test_clock.py tests/test_model_inputs.py
       tests/test_loss.py -k "cuda or liger")
if [ "$SMOKE" = 1 ]; then
    timeout "$TESTS_S" python3 -m pytest -q --collect-only -p no:cacheprovider -p no:xdist \
        -o addopts="" \
        "${tests[@]}" 2>&1 | tee "$OUT/cuda-tests.log" | tail -1
    echo "varlen_gqa_probe skipped (--smoke: it needs CUDA)" | tee -a "$OUT/cuda-tests.log"
else
    timeout "$TESTS_S" python3 -m pytest -q -p no:cacheprovider -p no:xdist -o addopts="" \
        "${tests[@]}" 2>&1 | tee "$OUT/cuda-tests.log" | tail -15
    # whether this torch's varlen kernel takes fewer K/V heads as they are (the trainer repeats
    # them where varlen_attn has no enable_gqa), beside the tests' log
    timeout 30 python3 benchmarks/varlen_gqa_probe.py 2>&1 | tee -a "$OUT/cuda-tests.log"
fi
wait "$prepare" || { stamp "prepare failed"; tail -20 "$OUT/prepare.log"; exit 1; }

stamp "gpu_bench (up to $(left) s)"
timeout "$(left)" "${bench[@]}" --prepared --json "$OUT/gpu.json" 2>&1 |
    tee "$OUT/bench.log" | grep -v "^{" | tail -40
stamp "bench done (rc ${PIPESTATUS[0]})"
cp "$BUILD/gpu_bench/run-balanced/pipeline.json" "$OUT/pipeline-balanced.json" 2>/dev/null
# the train logs, pipeline.json files, trace summaries and host samples in one archive (a
# step's whole trace, ~20 MB gzipped, is over what a lease brings back)
(cd "$BUILD" && tar czf "$OUT/runs.tgz" $(ls -d gpu_bench/setup.json gpu_bench/run-*.log \
    gpu_bench/run-*/train_log.jsonl gpu_bench/run-*/pipeline.json gpu_bench/profile/profile.json \
    gpu-trace/*/*-summary.json gpu-trace/*/host-*.json 2>/dev/null))
ls -la "$OUT"
