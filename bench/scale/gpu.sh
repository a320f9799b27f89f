#!/usr/bin/env bash
# tether on NVIDIA GPUs at 0.5B: PPO with LoRA in bf16 and DPO on one GPU, one summary line
# each; then, with 2 or more GPUs visible, DDP versus FSDP2 (full fine-tuning SFT and DPO under
# torchrun, bench/scale/gpu_fsdp.py), one `FSDP2:` line per stage.
#
#   bash bench/scale/gpu.sh                      # needs CUDA; at most 8 + 5 minutes (hard limits below)
#   bash bench/scale/gpu.sh --tiny --device cpu  # the same code path on a 2-layer model, on the CPU
#   PYTHON=/path/to/python bash bench/scale/gpu.sh --no-chunked-lm-head   # any bench/scale/gpu.py flag
#
# Builds a Qwen2-style ~0.5B model from its config with a local tokenizer (no download), then
# runs bench/scale/gpu.py (see its docstring for what is measured and how). Fails loudly: any error,
# a missing GPU, or the time limit gives a non-zero exit and the reason on stderr.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error

if [[ " $* " != *" --tiny "* ]]; then
    "$PYTHON" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("bench/scale/gpu.sh: no CUDA device visible to torch (torch %s); run on a GPU machine "
             "or pass --tiny --device cpu" % torch.__version__)
print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
PY
fi

status=0
timeout --signal=TERM --kill-after=10 480 "$PYTHON" bench/scale/gpu.py "$@" || status=$?
if [[ $status -eq 124 || $status -eq 137 ]]; then
    echo "bench/scale/gpu.sh: FAILED: over the 8-minute limit (exit $status)" >&2
elif [[ $status -ne 0 ]]; then
    echo "bench/scale/gpu.sh: FAILED (exit $status); see the traceback above" >&2
fi
[[ $status -ne 0 ]] && exit $status

# DDP versus FSDP2: every visible GPU (at most 8) as one rank; the CPU path with --tiny.
if [[ " $* " == *" --tiny "* ]]; then
    nproc=2; fsdp_args=(--tiny --device cpu)
else
    nproc=$("$PYTHON" -c "import torch; print(min(torch.cuda.device_count(), 8))")
    fsdp_args=()
fi
if [[ $nproc -lt 2 ]]; then
    echo "FSDP2: skipped, it needs 2 or more GPUs (found $nproc)"
    exit 0
fi
timeout --signal=TERM --kill-after=10 300 "$PYTHON" -m torch.distributed.run \
    --nproc-per-node "$nproc" --master-addr 127.0.0.1 --master-port "${FSDP_PORT:-29517}" \
    bench/scale/gpu_fsdp.py "${fsdp_args[@]}" || status=$?
if [[ $status -eq 124 || $status -eq 137 ]]; then
    echo "bench/scale/gpu.sh: FSDP2 part FAILED: over the 5-minute limit (exit $status)" >&2
elif [[ $status -ne 0 ]]; then
    echo "bench/scale/gpu.sh: FSDP2 part FAILED (exit $status); see the traceback above" >&2
fi
exit $status
