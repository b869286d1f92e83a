#!/usr/bin/env bash
# Installs paratrain and everything its tests use. Idempotent; safe to run on every CI run.
# torch first and pinned: an unpinned torch (or one pulled in by another package) can be a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-python3 -m pip}"
$PIP install -q --disable-pip-version-check "torch==2.13.0"
# DS_BUILD_OPS=0: DeepSpeed's C++/CUDA ops are not built at install time (they JIT where needed; CPU needs none).
DS_BUILD_OPS=0 $PIP install -q --disable-pip-version-check -e ".[dev]"
