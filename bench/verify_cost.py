#!/usr/bin/env python3
"""What checking checksums costs a warm load: 1 GiB in 16 tensors of 64 MiB
(one chunk each), read through a one-rank mount with -o verify=0 and with
verify=1 (the default), (a) the first read after the mount (every chunk
hashed once) and (b) a second read (already verified), against reading the
data files directly; interleaved rounds, medians and ratios.

    python3 bench/verify_cost.py --bin build/bin/ckptfs --backing /dev/shm/vbench [--rounds 5]

Reads as the loaders do: 16 MiB preadv's into one preallocated buffer.
Warm: the data files stay in the page cache (a tmpfs BACKING keeps them
there). Run as root; the mount point is BACKING/mnt (BACKING is emptied)."""
import argparse
import os
import shutil
import statistics
import subprocess
import time

MiB = 1 << 20
N, SIZE, RCHUNK = 16, 64 * MiB, 16 * MiB


def read_files(paths, buf):
    mv, at = memoryview(buf), 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            off = 0
            while True:
                k = os.preadv(fd, [mv[at:at + RCHUNK]], off)
                if k <= 0:
                    break
                off += k
                at += k
        finally:
            os.close(fd)
    return at


def daemon_cpu(mnt):
    """CPU seconds (user + system) the daemon serving mnt has used."""
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if mnt.encode() in argv and any(a.endswith(b"ckptfs") for a in argv[:1]):
                with open(f"/proc/{pid}/stat") as f:
                    st = f.read().rsplit(")", 1)[1].split()
                return (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            continue
    return float("nan")


def timed(paths, buf, mnt=None):
    c = daemon_cpu(mnt) if mnt else 0.0
    t = time.perf_counter()
    n = read_files(paths, buf)
    t = time.perf_counter() - t
    return t, n, (daemon_cpu(mnt) - c if mnt else 0.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/bin/ckptfs")
    ap.add_argument("--backing", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    back, mnt = os.path.join(a.backing, "b"), os.path.join(a.backing, "mnt")
    shutil.rmtree(back, ignore_errors=True)
    os.makedirs(back)
    os.makedirs(mnt, exist_ok=True)

    def mount(verify):
        subprocess.check_call([a.bin, back, mnt, "-o", f"verify={verify}"])

    def unmount():
        subprocess.check_call(["fusermount3", "-u", mnt])

    mount(0)
    try:
        os.mkdir(f"{mnt}/c")
        chunk = os.urandom(MiB)
        for i in range(N):
            p = f"{mnt}/c/t{i}"
            with open(p, "wb") as f:
                for _ in range(SIZE // MiB):
                    f.write(chunk)
            os.setxattr(p, "user.ckpt.dtype", b"float32")
            os.setxattr(p, "user.ckpt.shape", f"{SIZE // 4 // 4096},4096".encode())
        with open(f"{mnt}/c/.commit", "w") as f:
            f.write("sync")
    finally:
        unmount()
    tensors = [f"{mnt}/c/t{i}" for i in range(N)]
    data = sorted(os.path.join(back, "c", f) for f in os.listdir(os.path.join(back, "c"))
                  if f.endswith(".distcp"))
    buf = bytearray(N * SIZE + RCHUNK)
    for i in range(0, len(buf), 4096):
        buf[i] = 1
    res = {k: [] for k in ("direct", "v0_first", "v0_again", "v1_first", "v1_again")}
    cpu = {k: [] for k in ("v0_first", "v1_first")}
    for r in range(a.rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        res["direct"].append(timed(data, buf)[0])
        for v in order:
            mount(v)
            try:
                t1, n1, c1 = timed(tensors, buf, mnt)
                t2, n2, _ = timed(tensors, buf)
                assert n1 == n2 == N * SIZE, (n1, n2)
            finally:
                unmount()
            res[f"v{v}_first"].append(t1)
            cpu[f"v{v}_first"].append(c1)
            res[f"v{v}_again"].append(t2)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in res.items()), flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print("medians (s per GiB): " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    print("daemon CPU, first read (s): " + ", ".join(
        f"{k} {statistics.median(v):.3f}" for k, v in cpu.items()))
    def paired(k):  # the median of each round's ratio (drift cancels)
        return statistics.median(a / b for a, b in zip(res[f"v1_{k}"], res[f"v0_{k}"]))
    print(f"verify=1 / verify=0, first read after mount: {med['v1_first'] / med['v0_first']:.3f}x "
          f"(paired rounds: {paired('first'):.3f}x)")
    print(f"verify=1 / verify=0, read again:             {med['v1_again'] / med['v0_again']:.3f}x "
          f"(paired rounds: {paired('again'):.3f}x)")
    print(f"direct / mount (verify=1, first): {med['direct'] / med['v1_first']:.2f}x, "
          f"(again): {med['direct'] / med['v1_again']:.2f}x")


if __name__ == "__main__":
    main()
