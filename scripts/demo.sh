#!/usr/bin/env bash
# The main job, end to end on one machine: build ckptfs, mount 2 ranks
# with mpirun (mount-scripts/ckpt-mount), save a checkpoint sharded across
# them with plain shell and Python file calls, browse it with ls, cat,
# getfattr and sqlite3, unmount, then load it at another world size (one
# rank) and read a shard back with pread. Needs root (FUSE, mpirun as
# root) on Debian 12 or later.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$(nproc)" >/dev/null

work=$(mktemp -d /tmp/ckptfs-demo.XXXXXX)
backing=$work/backing
mnt=$work/mnt
cleanup() {
  mount-scripts/ckpt-umount -q "$mnt" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; }

step "mount-scripts/ckpt-mount -n 2 $backing $mnt     # 2 rank mounts under mpirun"
mount-scripts/ckpt-mount -n 2 "$backing" "$mnt"

step "mkdir on every rank: the checkpoint step-100"
mkdir "$mnt/rank0/step-100" "$mnt/rank1/step-100"

step "rank 0 and rank 1 each write their half (rows) of a float32 [4,3] tensor, from the shell"
for r in 0 1; do
  w=$mnt/rank$r/step-100/model/layer0/weight
  mkdir -p "$(dirname "$w")"
  python3 -c "import struct,sys; r=$r; sys.stdout.buffer.write(struct.pack('<6f', *[r*6+i for i in range(6)]))" > "$w"
  setfattr -n user.ckpt.dtype   -v float32 "$w"
  setfattr -n user.ckpt.shape   -v 4,3     "$w"
  setfattr -n user.ckpt.offsets -v $((2*r)),0 "$w"
  setfattr -n user.ckpt.sizes   -v 2,3     "$w"
done

step "both ranks write a replicated int64 tensor and the same bytes item, from Python"
python3 - "$mnt" <<'PY'
import json, os, struct, sys
for r in (0, 1):
    ckpt = os.path.join(sys.argv[1], f"rank{r}", "step-100")
    path = os.path.join(ckpt, "model/layer0/bias")
    with open(path, "wb") as f:
        f.write(struct.pack("<3q", 7, 8, 9))
    os.setxattr(path, "user.ckpt.dtype", b"int64")
    os.setxattr(path, "user.ckpt.shape", b"[3]")
    os.makedirs(os.path.join(ckpt, "train"), exist_ok=True)
    with open(os.path.join(ckpt, "train/state.json"), "w") as f:
        json.dump({"step": 100, "lr": 3e-4}, f)
PY

step "cat $mnt/rank0/step-100/.status"
cat "$mnt/rank0/step-100/.status"

step "echo sync > .commit on both ranks at once   # the collective save"
echo sync > "$mnt/rank0/step-100/.commit" &
echo sync > "$mnt/rank1/step-100/.commit"
wait
cat "$mnt/rank1/step-100/.status"

step "ls -lR $mnt/rank1/step-100                    # the global checkpoint, on every rank"
ls -lR "$mnt/rank1/step-100"

step "getfattr -d $mnt/rank1/step-100/model/layer0/weight"
getfattr -d "$mnt/rank1/step-100/model/layer0/weight"

step "cat $mnt/rank0/step-100/train/state.json"
cat "$mnt/rank0/step-100/train/state.json"; echo

step "sqlite3 -readonly $mnt/rank0/step-100/.metadata   # chunks of both ranks, the replica stored once"
sqlite3 -readonly -header -column "$mnt/rank0/step-100/.metadata" \
  "select key, value from checkpoint;
   select fqn, dtype, shape from tensors;
   select fqn, offsets, sizes, rank, file, file_offset, length, checksum from chunks;"

step "ls $backing/step-100                              # what is stored"
ls -la "$backing/step-100"

step "mount-scripts/ckpt-umount $mnt; ckpt-mount -n 1   # load at another world size"
mount-scripts/ckpt-umount "$mnt"
mount-scripts/ckpt-mount -n 1 "$backing" "$mnt"

step "pread of row 2 (rank 1's shard) through the 1-rank mount"
python3 - "$mnt/rank0/step-100/model/layer0/weight" <<'PY'
import os, struct, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
row = struct.unpack("<3f", os.pread(fd, 12, 2 * 12))
os.close(fd)
print("row 2 =", row)
assert row == (6.0, 7.0, 8.0), row
PY

step "rm -r $mnt/rank0/step-100                         # delete it everywhere"
rm -r "$mnt/rank0/step-100"
ls -la "$backing"
mount-scripts/ckpt-umount "$mnt"
echo; echo "demo finished"
