#!/usr/bin/env bash
# tether on one NVIDIA GPU at 0.5B: PPO with LoRA in bf16 and DPO, one summary line each.
#
#   bash bench/gpu.sh                      # needs CUDA; at most 8 minutes (hard limit below)
#   bash bench/gpu.sh --tiny --device cpu  # the same code path on a 2-layer model, on the CPU
#   PYTHON=/path/to/python bash bench/gpu.sh --no-chunked-lm-head   # any bench/gpu.py flag
#
# Builds a Qwen2-style ~0.5B model from its config with a local tokenizer (no download), then
# runs bench/gpu.py (see its docstring for what is measured and how). Fails loudly: any error,
# a missing GPU, or the time limit gives a non-zero exit and the reason on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error

if [[ " $* " != *" --tiny "* ]]; then
    "$PYTHON" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("bench/gpu.sh: no CUDA device visible to torch (torch %s); run on a GPU machine "
             "or pass --tiny --device cpu" % torch.__version__)
print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
PY
fi

status=0
timeout --signal=TERM --kill-after=10 480 "$PYTHON" bench/gpu.py "$@" || status=$?
if [[ $status -eq 124 || $status -eq 137 ]]; then
    echo "bench/gpu.sh: FAILED: over the 8-minute limit (exit $status)" >&2
elif [[ $status -ne 0 ]]; then
    echo "bench/gpu.sh: FAILED (exit $status); see the traceback above" >&2
fi
exit $status
