#!/usr/bin/env bash
# Builds the project's own environment, .venv/ inside the clone, and installs paratrain and everything its tests
# use into it. Never touches the system Python: an install there is refused on Debian 12+ / Ubuntu 24.04
# (PEP 668), and a package someone installed there by hand would hide a missing declaration.
# Idempotent: creates .venv when absent, then brings it up to date. Safe to run on every CI run.
#
#   scripts/setup.sh      then: .venv/bin/paratrain ..., .venv/bin/python -m pytest
#
# uv builds the environment: from its cache (~/.cache/uv) a warm set-up hard-links the several GB of torch in
# seconds where pip would unpack them again. torch is pinned and installed first: an unpinned torch (or one pulled
# in by another package) can be a different multi-GB build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
TORCH="torch==2.13.0"
UV_VERSION="uv==0.13.8"

start=$SECONDS
if [[ ! -x "$VENV/bin/python" ]]; then
  if ! python3 -m venv "$VENV"; then
    rm -rf "$VENV"
    echo "setup: 'python3 -m venv' failed; on Debian/Ubuntu install it with 'apt-get install python3-venv'." >&2
    exit 2
  fi
fi
if [[ ! -x "$VENV/bin/uv" ]]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$UV_VERSION"
fi
# --compile-bytecode: every process (each rank of every run) then reads torch's bytecode instead of compiling it
# again, which halves a rank's start-up (5.1 s to 2.0 s measured here); it matters most where
# PYTHONDONTWRITEBYTECODE is set, since Python then never caches what it compiles.
uv=("$VENV/bin/uv" pip install --quiet --compile-bytecode --python "$VENV/bin/python")
"${uv[@]}" "$TORCH"
# DS_BUILD_OPS=0: DeepSpeed's C++/CUDA ops are not built at install time (they JIT where needed; CPU needs none).
# The constraint keeps the torch just installed: no later requirement may swap it for another build.
DS_BUILD_OPS=0 "${uv[@]}" --constraint <(echo "$TORCH") -e ".[dev]"
"$VENV/bin/python" -m compileall -q trainer operator >/dev/null  # the editable packages' own bytecode, likewise
echo "setup: $VENV ready in $((SECONDS - start)) s (python: $VENV/bin/python)" >&2
