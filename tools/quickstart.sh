#!/usr/bin/env bash
# Set up (CPU torch, megatron-core, this package) and train the tiny calculator agent with streaming GRPO.
#   bash tools/quickstart.sh                      # ~10 min on 2 CPU cores
#   bash tools/quickstart.sh --rl-mode sync       # extra flags override examples/tiny_agent/config.yaml
# Output: runs/tiny_agent/{model,ckpt,tb}; `tensorboard --logdir runs/tiny_agent/tb` shows the curves.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TSYNC_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q -e .
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
exec python -m megatron_tsync.train --config examples/tiny_agent/config.yaml \
  --tensorboard-dir runs/tiny_agent/tb --load runs/tiny_agent/ckpt "$@"
