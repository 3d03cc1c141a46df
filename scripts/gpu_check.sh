#!/usr/bin/env bash
# One-GPU check (< 10 min on one H200-class GPU): FSDP2 bf16 trainer step on a random
# Qwen2.5-1.5B-shaped model, engine generation (vLLM if installed, else transformers), and the
# decode latency vs batch size (1..512) of a random Qwen2.5-7B-shaped bf16 model, saved as a
# `streamrl profile` JSON under profiles/. Needs torch + transformers; Ray and vLLM optional.
#   bash scripts/gpu_check.sh [extra args for scripts/gpu_check.py]
#   bash scripts/gpu_check.sh --tiny --device cpu     # the same flow on a CPU in seconds
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
else
  echo "nvidia-smi not found: running on whatever torch sees (pass --device cpu --tiny for a CPU smoke run)"
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
# 570 s: the script stays inside 10 minutes even if a section hangs.
exec timeout 570 "$PY" scripts/gpu_check.py "$@"
