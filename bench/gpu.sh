#!/usr/bin/env bash
# The prepared GPU benchmark (bench/gpu.py): tokens/s, MFU and peak memory of a 1B-class Llama, bf16 vs fp32,
# activation checkpointing none vs selective, DDP vs ZeRO-3 where 2+ GPUs are visible; under 10 minutes on one GPU.
#   bash bench/gpu.sh             writes bench/results/gpu.json
#   bash bench/gpu.sh --dry-run   the same variants on a tiny model on the CPU (what the test suite runs)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="$root/.venv/bin/python"
if [[ ! -x "$python" ]]; then
  echo "gpu.sh: no $python: run 'bash scripts/setup.sh' first" >&2
  exit 2
fi
cd "$root/bench"  # bench scripts import their helpers from here
exec "$python" gpu.py "$@"
