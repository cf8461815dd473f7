#!/usr/bin/env bash
# Install what ckptfs needs to build, run and test: the Debian packages,
# then the virtual environment .venv (Python 3.11) with torch 2.13.0 (CPU
# build), numpy, safetensors and the ckptfs package from python/ (editable).
# Run as root (or with sudo) on Debian 12 (bookworm) or later.
# CKPT_VENV=DIR puts the environment elsewhere; CKPT_NO_VENV=1 skips it.
set -euo pipefail
pkgs=(
  build-essential cmake pkg-config        # toolchain
  libfuse3-dev fuse3                      # FUSE library and fusermount3
  libopenmpi-dev openmpi-bin              # MPI (mpirun, mpicc)
  libsqlite3-dev sqlite3                  # metadata, and the sqlite3 CLI
  libxxhash-dev                           # XXH3-64 checksums
  libcmocka-dev                           # unit tests
  python3 attr                            # integration tests, getfattr
  python3-venv python3-pip                # the .venv below
  iproute2                                # multi-node tests: ip, ss (netns)
  clang libclang-rt-dev                    # libFuzzer and sanitizer runtimes
  python3-torch python3-numpy             # Python client and PyTorch example tests
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y --no-install-recommends "${missing[@]}"
fi

# ---- the Python environment: torch 2.13.0 is pinned (the CPU build; a newer
# or unpinned torch would pull a CUDA build of several GB).
[ "${CKPT_NO_VENV:-0}" = 1 ] && exit 0
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${CKPT_VENV:-$repo/.venv}
py=""
for c in python3.11 /usr/bin/python3.11 /usr/local/bin/python3.11; do
  if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import venv, ensurepip' 2>/dev/null; then
    py=$(command -v "$c"); break
  fi
done
if [ -z "$py" ]; then
  echo "install-deps: no Python 3.11 with venv (torch 2.13.0's CPU build is for 3.11)" >&2
  exit 1
fi
want="torch==2.13.0 numpy safetensors"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c \
    'import sys, torch, numpy, safetensors, ckptfs; assert sys.version_info[:2] == (3, 11); assert torch.__version__.startswith("2.13.0")' 2>/dev/null; then
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q $want
  "$venv/bin/python" -m pip install --disable-pip-version-check -q -e "$repo/python"
fi
"$venv/bin/python" -c 'import torch, numpy, safetensors, ckptfs
print("install-deps: %s: torch %s, numpy %s, safetensors %s" % (__import__("sys").prefix, torch.__version__, numpy.__version__, safetensors.__version__))'
