#!/usr/bin/env bash
# Install what ckptfs needs to build, run and test: the Debian packages;
# where the system's libfuse3 is older than 3.16 (Debian 12 has 3.14), a
# libfuse 3.17 built from Debian 13's source package fuse3 into .deps/fuse3
# (for FUSE passthrough; CMake uses it when present); then the virtual
# environment .venv (Python 3.11) with torch 2.13.0 (CPU build), numpy,
# safetensors, transformers, accelerate, lightning and h5py (the writers the
# integration tests save with), prometheus-client (its parser reads the
# metrics file in the metrics test) and the ckptfs package from python/ (editable).
# Run as root (or with sudo) on Debian 12 (bookworm) or later.
# CKPT_VENV=DIR puts the environment elsewhere; CKPT_NO_VENV=1 skips it.
# CKPT_NO_FUSE_BUILD=1 skips the libfuse build (the build then uses the
# system's libfuse3, without passthrough); CKPT_DEBIAN_MIRROR=URL overrides
# the Debian mirror its source comes from (default: the one apt uses here).
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
  rsync                                   # integration_names: rsync -a into a mount
  git zip unzip                           # integration_links: git clone, unzip of links
  clang libclang-rt-dev                    # libFuzzer and sanitizer runtimes
  python3-torch python3-numpy             # Python client and PyTorch example tests
  dpkg-dev file                           # cpack -G DEB: dpkg-shlibdeps, file
  debootstrap                             # test_package: the .deb in a fresh chroot
)
# Only where the system's libfuse3 is older than 3.16: to fetch, unpack and
# build Debian 13's fuse3 source package (the build also uses the toolchain
# and pkg-config above).
fuse_build_pkgs=(meson ninja-build dpkg-dev)
fuse_min=3.16
install_missing() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update
    apt-get install -y --no-install-recommends "${missing[@]}"
  fi
}
install_missing "${pkgs[@]}"
repo=$(cd "$(dirname "$0")/.." && pwd)

# ---- libfuse >= 3.16 (FUSE passthrough: FUSE_CAP_PASSTHROUGH,
# fuse_passthrough_open) where the system's is older: Debian 13 (trixie)'s
# source package fuse3, fetched by apt through a private source list and
# state directory (the system's apt configuration is neither read for
# sources nor changed, and no system package is upgraded), unpacked and
# checked by dpkg-source, built with meson and installed into .deps/fuse3
# (the library and headers only: mounting still uses the system's
# fusermount3). Skipped when .deps/fuse3 already holds one.
fuse_prefix=$repo/.deps/fuse3
fuse_local_version() {   # the version .deps/fuse3 holds, or nothing
  [ -f "$fuse_prefix/lib/pkgconfig/fuse3.pc" ] && [ -e "$fuse_prefix/lib/libfuse3.so" ] || return 0
  env -u PKG_CONFIG_PATH PKG_CONFIG_LIBDIR="$fuse_prefix/lib/pkgconfig" \
    pkg-config --modversion fuse3 2>/dev/null || true
}
debian_mirror() {        # the Debian mirror apt uses here (not -security)
  { cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
        /etc/apt/sources.list.d/*.sources 2>/dev/null || true; } | awk '
    /^[ \t]*deb(-src)?[ \t]/ { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                              u[n++] = $i }
    /^[ \t]*URIs:/          { for (i = 2; i <= NF; i++) u[n++] = $i }
    END { for (i = 0; i < n; i++) if (u[i] ~ /^(https?|file):\/\/.*\/debian\/?$/) { sub(/\/$/, "", u[i]); print u[i]; exit }
          print "http://deb.debian.org/debian" }'
}
build_fuse3() (
  set -euo pipefail
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/ckpt-fuse3.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  mirror=${CKPT_DEBIAN_MIRROR:-$(debian_mirror)}
  keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  mkdir -p "$tmp/lists/partial" "$tmp/parts" "$tmp/cache/archives/partial" "$tmp/src"
  {
    echo "Types: deb-src"
    echo "URIs: $mirror"
    echo "Suites: trixie"
    echo "Components: main"
    [ -f "$keyring" ] && echo "Signed-By: $keyring"
  } >"$tmp/trixie.sources"
  # Everything apt reads or writes for this lives in $tmp: the source list
  # (and an empty parts directory instead of /etc/apt/sources.list.d), the
  # package lists and the caches.
  apt=(apt-get -q -o Dir::Etc::sourcelist="$tmp/trixie.sources"
       -o Dir::Etc::sourceparts="$tmp/parts" -o Dir::State::Lists="$tmp/lists"
       -o Dir::Cache="$tmp/cache" -o APT::Sandbox::User=root)
  echo "install-deps: fetching libfuse source (fuse3, trixie) from $mirror"
  "${apt[@]}" update
  (cd "$tmp/src" && "${apt[@]}" source --download-only fuse3/trixie)
  dsc=$(ls "$tmp"/src/fuse3_*.dsc)
  # apt checked the downloaded files against the signed archive index;
  # dpkg-source checks them against the .dsc and applies Debian's patches
  # (its "cannot verify inline signature" warning only means the uploader
  # keyring, package debian-keyring, is not installed).
  dpkg-source -x "$dsc" "$tmp/fuse3"
  # Debian's meson and ninja, not whatever else PATH finds first.
  meson=meson; [ -x /usr/bin/meson ] && meson=/usr/bin/meson
  ninja=ninja; [ -x /usr/bin/ninja ] && ninja=/usr/bin/ninja
  export NINJA=$ninja
  "$meson" setup "$tmp/build" "$tmp/fuse3" --prefix="$fuse_prefix" --libdir=lib \
    --buildtype=release -Dexamples=false -Dutils=false -Dtests=false -Duseroot=false
  "$ninja" -C "$tmp/build"
  # Stage, then move into place: .deps/fuse3 is complete or absent.
  DESTDIR="$tmp/stage" "$ninja" -C "$tmp/build" install
  rm -rf "$fuse_prefix"
  mkdir -p "$(dirname "$fuse_prefix")"
  mv "$tmp/stage$fuse_prefix" "$fuse_prefix"
)
if [ "${CKPT_NO_FUSE_BUILD:-0}" != 1 ]; then
  sys_fuse=$(pkg-config --modversion fuse3 2>/dev/null || echo 0)
  local_fuse=$(fuse_local_version)
  if dpkg --compare-versions "$sys_fuse" ge "$fuse_min"; then
    echo "install-deps: system libfuse3 $sys_fuse (>= $fuse_min): no local build needed"
  elif [ -n "$local_fuse" ] && dpkg --compare-versions "$local_fuse" ge "$fuse_min"; then
    echo "install-deps: $fuse_prefix: libfuse3 $local_fuse (system: $sys_fuse)"
  else
    install_missing "${fuse_build_pkgs[@]}"
    start=$SECONDS
    build_fuse3
    local_fuse=$(fuse_local_version)
    if [ -z "$local_fuse" ] || ! dpkg --compare-versions "$local_fuse" ge "$fuse_min"; then
      echo "install-deps: libfuse build did not leave libfuse3 >= $fuse_min in $fuse_prefix" >&2
      exit 1
    fi
    echo "install-deps: built libfuse3 $local_fuse into $fuse_prefix in $((SECONDS - start)) s (system: $sys_fuse)"
  fi
fi

# ---- the Python environment: torch 2.13.0 is pinned (the CPU build; a newer
# or unpinned torch would pull a CUDA build of several GB). transformers,
# accelerate (its Trainer needs it) and lightning are pinned to releases
# that work with it and leave it as it is (tests/integration/test_writers.py).
[ "${CKPT_NO_VENV:-0}" = 1 ] && exit 0
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
want="torch==2.13.0 numpy==2.4.6 safetensors==0.8.0 transformers==5.18.0 accelerate==1.15.0 lightning==2.6.6 prometheus-client==0.26.0 h5py==3.12.1 zarr==3.1.6 atomicwrites==1.4.1 tensorstore==0.1.86"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c \
    'import sys, torch, numpy, safetensors, transformers, accelerate, lightning, prometheus_client, h5py, ckptfs
from importlib.metadata import version
assert sys.version_info[:2] == (3, 11); assert torch.__version__.startswith("2.13.0")
assert (transformers.__version__, accelerate.__version__, lightning.__version__) == ("5.18.0", "1.15.0", "2.6.6")
assert (numpy.__version__, safetensors.__version__, h5py.__version__) == ("2.4.6", "0.8.0", "3.12.1")
assert version("prometheus-client") == "0.26.0"
assert (version("zarr"), version("atomicwrites"), version("tensorstore")) == ("3.1.6", "1.4.1", "0.1.86")' 2>/dev/null; then
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q $want
  "$venv/bin/python" -m pip install --disable-pip-version-check -q -e "$repo/python"
fi
"$venv/bin/python" -c 'import torch, numpy, safetensors, transformers, accelerate, lightning, ckptfs
from importlib.metadata import version
print("install-deps: %s: torch %s, numpy %s, safetensors %s, transformers %s, accelerate %s, lightning %s, prometheus-client %s, h5py %s"
      % (__import__("sys").prefix, torch.__version__, numpy.__version__, safetensors.__version__,
         transformers.__version__, accelerate.__version__, lightning.__version__,
         version("prometheus-client"), version("h5py")))'
