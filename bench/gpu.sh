#!/usr/bin/env bash
# Run a command on a lent GPU machine, which has its own torch / triton / transformers and no
# network: lay the package out as it installs (sparse_fx, sparse_fx.lowering, sparse_fx.runtime)
# under /tmp and put it on PYTHONPATH. Usage: bash bench/gpu.sh python3 bench/kernel_step.py ...
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pkg=/tmp/sparse_fx_pkg
rm -rf "$pkg" && mkdir -p "$pkg"
cp -r "$root/sparse_fx" "$pkg/"
cp -r "$root/lowering" "$pkg/sparse_fx/lowering"
cp -r "$root/runtime" "$pkg/sparse_fx/runtime"
export PYTHONPATH="$pkg${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$@"
