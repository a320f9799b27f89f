#!/usr/bin/env bash
# Rollout engines on one NVIDIA GPU: bench/engine.py --device cuda, with GPU-sized settings.
# It prints tether's native sampler against vLLM (tokens/s, vLLM start-up and weight-sync times)
# on the GRPO bench's tiny GPT-2 (32 rows x 32 tokens) and on a 494M Llama-shaped model with random
# weights in bf16 (128 rows x 256 tokens), then whole GRPO runs with --engine native and
# --engine vllm (256 episodes each, 3 interleaved runs), plus TRL's GRPOTrainer when trl imports.
#
#   bash bench/gpu.sh                            # about 5-8 minutes once installed; killed at 12
#   OUT=/some/dir bash bench/gpu.sh --repeats 5  # extra flags go to bench/engine.py (later wins)
#   VENV=.venv-vllm bash bench/gpu.sh --device cpu --dtype float32 --skip-large --episodes 0
#                                                # the same commands on the CPU, no GPU needed
#                                                # (tests/bench/test_bench_vllm.py, in CI)
#
# Most of the time is vLLM starting 5 engines (2 rollout benches + 3 GRPO runs; tether runs them
# eager, without CUDA graphs: docs/engine.md).
# The venv ($VENV, default .venv-gpu) is created if absent; torch (PyPI's Linux wheel, the CUDA
# build), vllm ($VLLM, the version whose CPU build tether's engine was tested with) and tether's
# other dependencies (`pip install -e .`) are installed only where they do not import. With no
# internet, set WHEELS to a directory of wheels (pip --no-index --find-links), or use a venv that
# has them. The output goes to the terminal and to ${OUT:-bench-out}/engine-gpu.txt; any error,
# no GPU, or the time limit ($TIMEOUT seconds) exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-gpu}"
VLLM="${VLLM:-vllm==0.32.0}"
OUT="${OUT:-bench-out}"
TIMEOUT="${TIMEOUT:-720}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
# `--device cpu` among the flags: no GPU is required, and torch stays the build the venv has.
[[ " $* " == *" --device cpu "* ]] && DEVICE=cpu || DEVICE=cuda

[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
has() { "$PY" -c "$1" >/dev/null 2>&1; }
pip_install() {
    if [[ -n "${WHEELS:-}" ]]; then
        "$PY" -m pip install --no-index --find-links "$WHEELS" "$@"
    else
        "$PY" -m pip install "$@"
    fi
}
[[ $DEVICE == cpu ]] || has "import torch; assert torch.cuda.is_available()" || pip_install torch
has "import vllm" || pip_install "$VLLM"  # it pins the torch it was built against
has "import tether.train.ppo, peft, datasets" || pip_install -e .

mkdir -p "$OUT"
log="$OUT/engine-gpu.txt"
"$PY" - "$DEVICE" <<'PY' | tee "$log"
import sys, torch, vllm
if sys.argv[1] == "cpu":
    print("CPU (--device cpu) | torch", torch.__version__, "| vllm", vllm.__version__)
    sys.exit()
if not torch.cuda.is_available():
    sys.exit("bench/gpu.sh: no CUDA device visible to torch %s" % torch.__version__)
print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA",
      torch.version.cuda, "| vllm", vllm.__version__)
PY

status=0
timeout --signal=TERM --kill-after=30 "$TIMEOUT" "$PY" bench/engine.py --device cuda \
    --threads 0 --repeats 3 --dtype bfloat16 --large-rows 128 --max-new-tokens 256 \
    --kv-cache-mb 8192 --episodes 256 --trl "$@" 2>&1 | tee -a "$log" || status=$?
if [[ $status -eq 124 || $status -eq 137 ]]; then
    echo "bench/gpu.sh: FAILED: over the ${TIMEOUT}-second limit (exit $status); see $log" >&2
elif [[ $status -ne 0 ]]; then
    echo "bench/gpu.sh: FAILED (exit $status); see the traceback in $log" >&2
fi
exit $status
