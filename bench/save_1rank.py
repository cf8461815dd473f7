#!/usr/bin/env python3
"""Single-rank save benchmark: seconds to write and sync-commit SIZE of
float32 tensors through a ckptfs mount, next to the physical limit measured
in the same run: the same bytes written straight into the backing
directory with fsync (same number of files per writer, same disk).

    bench/save_1rank.py --bin build/bin/ckptfs --backing /var/tmp/bench --size 1G
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHUNK = 1 << 20


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s)


def mounted(path):
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def drop_caches():
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    except OSError:
        pass


def write_tensors(dirpath, sizes, payload, mount_xattrs):
    for i, n in enumerate(sizes):
        p = os.path.join(dirpath, f"layer{i}.weight")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        done = 0
        while done < n:
            done += os.write(fd, payload[: min(CHUNK, n - done)])
        if not mount_xattrs:
            os.fsync(fd)
        os.close(fd)
        if mount_xattrs:
            os.setxattr(p, "user.ckpt.dtype", b"float32")
            os.setxattr(p, "user.ckpt.shape", str(n // 4).encode())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/bin/ckptfs")
    ap.add_argument("--backing", required=True, help="backing directory (on the disk under test)")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--opts", default="")
    args = ap.parse_args()
    total = parse_size(args.size)
    per = (total // args.tensors) // 4 * 4
    sizes = [per] * args.tensors
    payload = os.urandom(CHUNK)

    os.makedirs(args.backing, exist_ok=True)
    limit_dir = os.path.join(args.backing, "limit")
    backing = os.path.join(args.backing, "ckptfs")
    mnt = tempfile.mkdtemp(prefix="ckptfs-bench-mnt-")
    shutil.rmtree(limit_dir, ignore_errors=True)
    shutil.rmtree(backing, ignore_errors=True)
    os.makedirs(limit_dir)

    # 1. the limit: the same bytes straight into the backing directory
    drop_caches()
    t0 = time.perf_counter()
    write_tensors(limit_dir, sizes, payload, mount_xattrs=False)
    dfd = os.open(limit_dir, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    t_limit = time.perf_counter() - t0
    shutil.rmtree(limit_dir)

    # 2. ckptfs: writes through the mount + sync commit until committed
    cmd = [args.bin, "-f"] + (["-o", args.opts] if args.opts else []) + [backing, mnt]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 30
        while not mounted(mnt):
            if proc.poll() is not None or time.time() > deadline:
                sys.exit("ckptfs did not mount: " + proc.stderr.read().decode())
            time.sleep(0.02)
        drop_caches()
        ck = os.path.join(mnt, "bench")
        t0 = time.perf_counter()
        os.mkdir(ck)
        write_tensors(ck, sizes, payload, mount_xattrs=True)
        t_write = time.perf_counter() - t0
        fd = os.open(os.path.join(ck, ".commit"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.write(fd, b"sync\n")
        os.close(fd)
        t_total = time.perf_counter() - t0
    finally:
        subprocess.run(["fusermount3", "-u", mnt])
        proc.wait(60)
        os.rmdir(mnt)
    shutil.rmtree(backing, ignore_errors=True)

    gib = total / (1 << 30)
    print(f"{'what':<44} {'seconds':>8} {'GiB/s':>7} {'vs limit':>9}")
    print(f"{'limit: write + fsync into backing dir':<44} {t_limit:8.3f} {gib / t_limit:7.2f} {1.0:9.2f}")
    print(f"{'ckptfs: writes through the mount':<44} {t_write:8.3f} {gib / t_write:7.2f} {t_limit / t_write:9.2f}")
    print(f"{'ckptfs: writes + sync commit (committed)':<44} {t_total:8.3f} {gib / t_total:7.2f} {t_limit / t_total:9.2f}")
    print(f"({total / (1 << 20):.0f} MiB in {args.tensors} float32 tensors; "
          f"'vs limit' is throughput relative to the limit)")


if __name__ == "__main__":
    main()
