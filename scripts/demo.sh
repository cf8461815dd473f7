#!/usr/bin/env bash
# The main job, end to end on one machine: build ckptfs, mount a rank,
# save a small checkpoint written with plain shell and Python file calls,
# browse it with ls, cat, getfattr and sqlite3, unmount, mount again and
# read it back. Needs root (FUSE) on Debian 12 or later.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" >/dev/null

work=$(mktemp -d /tmp/ckptfs-demo.XXXXXX)
backing=$work/backing
mnt=$work/mnt
mkdir -p "$backing" "$mnt"
cleanup() {
  mountpoint -q "$mnt" 2>/dev/null && fusermount3 -u "$mnt" || true
  rm -rf "$work"
}
trap cleanup EXIT
step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; }

step "ckptfs $backing $mnt            # mount (daemonizes when ready)"
build/bin/ckptfs "$backing" "$mnt"

step "mkdir $mnt/step-100             # start a checkpoint"
mkdir "$mnt/step-100"

step "write a float32 [2,3] tensor from the shell"
mkdir -p "$mnt/step-100/model/layer0"
python3 -c 'import struct,sys; sys.stdout.buffer.write(struct.pack("<6f",1,2,3,4,5,6))' \
  > "$mnt/step-100/model/layer0/weight"
setfattr -n user.ckpt.dtype -v float32 "$mnt/step-100/model/layer0/weight"
setfattr -n user.ckpt.shape -v 2,3 "$mnt/step-100/model/layer0/weight"

step "write an int64 tensor and a bytes item from Python"
python3 - "$mnt/step-100" <<'PY'
import json, os, struct, sys
ckpt = sys.argv[1]
path = os.path.join(ckpt, "model/layer0/bias")
with open(path, "wb") as f:
    f.write(struct.pack("<3q", 7, 8, 9))
os.setxattr(path, "user.ckpt.dtype", b"int64")
os.setxattr(path, "user.ckpt.shape", b"[3]")
os.makedirs(os.path.join(ckpt, "train"), exist_ok=True)
with open(os.path.join(ckpt, "train/state.json"), "w") as f:
    json.dump({"step": 100, "lr": 3e-4}, f)
PY

step "cat $mnt/step-100/.status"
cat "$mnt/step-100/.status"

step "echo sync > $mnt/step-100/.commit   # commit (returns when durable)"
echo sync > "$mnt/step-100/.commit"
cat "$mnt/step-100/.status"

step "ls -lR $mnt/step-100"
ls -lR "$mnt/step-100"

step "getfattr -d $mnt/step-100/model/layer0/weight"
getfattr -d "$mnt/step-100/model/layer0/weight"

step "cat $mnt/step-100/train/state.json"
cat "$mnt/step-100/train/state.json"; echo

step "sqlite3 -readonly $mnt/step-100/.metadata 'select fqn, dtype, shape from tensors'"
sqlite3 -readonly -header -column "$mnt/step-100/.metadata" \
  "select fqn, dtype, shape from tensors;
   select fqn, offsets, sizes, rank, file, file_offset, length, checksum from chunks;"

step "ls $backing/step-100            # what is stored"
ls -la "$backing/step-100"

step "fusermount3 -u $mnt; ckptfs $backing $mnt   # remount: the checkpoint is still there"
fusermount3 -u "$mnt"
while mountpoint -q "$mnt"; do sleep 0.1; done
build/bin/ckptfs "$backing" "$mnt"

step "read the weight back with pread (second row)"
python3 - "$mnt/step-100/model/layer0/weight" <<'PY'
import os, struct, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
row = struct.unpack("<3f", os.pread(fd, 12, 12))
os.close(fd)
print("row 1 =", row)
assert row == (4.0, 5.0, 6.0), row
PY

step "rm -r $mnt/step-100             # delete it everywhere"
rm -r "$mnt/step-100"
ls -la "$backing"
fusermount3 -u "$mnt"
echo; echo "demo finished"
