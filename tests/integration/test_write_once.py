#!/usr/bin/env python3
"""Write once, by default: with no option given, large staged files created
write-only are written by the kernel (FUSE passthrough) straight into the
files that become their data files. While 1 GiB is staged and committed
the daemon writes almost nothing itself (/proc/PID/io wchar: no daemon
copy, no drain copy) and reads it once (rchar: the hash after the close);
each data file of a large file is the very inode the kernel wrote; the
daemon's peak memory (VmHWM, mapped pages included) stays within
staging_mem + 64 MiB through staging, commit and a full read back; the
bytes read back after a remount are the bytes written. The control: with
-o passthrough=0 the same measure sees the daemon's copy (so the test
fails if a copy comes back).

Skipped only where the binary's libfuse has no passthrough (< 3.16) or the
kernel is older than 6.9.

    python3 tests/integration/test_write_once.py --bin build/bin/ckptfs
"""

import hashlib
import os
import sqlite3
import sys

from ckpttest.util import CkptfsTestCase, commit, main, state
from test_passthrough import backing_files, skip_without_passthrough

MiB = 1 << 20


def io_of(pid):
    """rchar and wchar of /proc/PID/io: bytes read and written by read(2),
    write(2), copy_file_range and friends."""
    out = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            key, val = line.split(":")
            out[key] = int(val)
    return out


def vm_hwm(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def write_big(path, size, seed):
    """size bytes, 1 MiB writes, each MiB distinct; their sha256."""
    block = bytearray(hashlib.sha256(seed.encode()).digest() * (MiB // 32))
    h = hashlib.sha256()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(size // MiB):
            block[:8] = i.to_bytes(8, "little")
            os.write(fd, block)
            h.update(block)
    finally:
        os.close(fd)
    return h.hexdigest()


def sha_of(path):
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


class WriteOnce(CkptfsTestCase):
    FILES, SIZE = 8, 128 * MiB    # 1 GiB staged

    def setUp(self):
        super().setUp()
        skip_without_passthrough(self)

    def stage(self, name, files, size):
        os.mkdir(self.ck(name))
        return {f"t{i}": write_big(self.ck(name, f"t{i}"), size, f"{name}{i}")
                for i in range(files)}

    def test_bytes_written_once(self):
        m = self.mount("staging_mem=64M")
        self.assertNotIn("not available", self.daemon_log())
        pid = m.proc.pid
        before = io_of(pid)
        want = self.stage("c", self.FILES, self.SIZE)
        total = self.FILES * self.SIZE
        # every large file in a backing file of its own, the kernel's
        staged = backing_files(pid)
        self.assertEqual(sorted(staged.values()), [self.SIZE] * self.FILES, staged)
        commit(self.ck("c"))
        self.assertEqual(state(self.ck("c")), "committed")
        after = io_of(pid)
        wrote, read = after["wchar"] - before["wchar"], after["rchar"] - before["rchar"]
        print(f"\n  1 GiB staged and committed: the daemon wrote {wrote / MiB:.1f} MiB, "
              f"read {read / MiB:.1f} MiB (its hash)", file=sys.stderr)
        self.assertLess(wrote, total // 100, "the daemon copied staged bytes")
        self.assertLess(read, total * 11 // 10, "the daemon read the bytes more than once")
        # the data files are the inodes the kernel wrote
        data = {os.stat(self.bk("c", f)).st_ino: os.stat(self.bk("c", f)).st_size
                for f in os.listdir(self.bk("c")) if f.endswith(".distcp")}
        for ino, size in staged.items():
            self.assertEqual(data.get(ino), size, f"inode {ino} is not a data file")
        # numbered in the order of their names (a load's order, which the
        # checks ahead of the reader follow), not the order of creation
        db = sqlite3.connect(f"file:{self.bk('c', '.metadata')}?mode=ro", uri=True)
        files = [int(f.rsplit("_", 1)[1].split(".")[0]) for _, f in
                 db.execute("SELECT fqn, file FROM chunks UNION ALL "
                            "SELECT fqn, file FROM blobs ORDER BY fqn")]
        db.close()
        self.assertEqual(len(files), self.FILES)
        self.assertEqual(files, sorted(files), "data files not in the order of names")
        # read back in full: verified, the same bytes
        for f, digest in want.items():
            self.assertEqual(sha_of(self.ck("c", f)), digest, f)
        hwm = vm_hwm(pid)
        print(f"  daemon VmHWM {hwm / MiB:.0f} MiB (staging_mem 64 MiB)", file=sys.stderr)
        self.assertLess(hwm, (64 + 64) * MiB)
        self.assertEqual(m.stop(), 0)
        self.mount()
        for f, digest in want.items():
            self.assertEqual(sha_of(self.ck("c", f)), digest, f)

    def test_o_direct_goes_through_the_daemon(self):
        """An O_DIRECT open of a passed-through file is served by the
        daemon (into the same backing file): unaligned writes work, as
        through the daemon everywhere, instead of the backing
        filesystem's EINVAL."""
        self.mount()
        os.mkdir(self.ck("d"))
        base = os.urandom(MiB)
        with open(self.ck("d", "f"), "wb") as f:   # write-only: passed through
            f.write(base)
        fd = os.open(self.ck("d", "f"), os.O_RDWR | os.O_DIRECT)
        try:
            self.assertEqual(os.pwrite(fd, b"odd bytes", 4097), 9)
        finally:
            os.close(fd)
        want = base[:4097] + b"odd bytes" + base[4097 + 9:]
        commit(self.ck("d"))
        self.assertEqual(sha_of(self.ck("d", "f")), hashlib.sha256(want).hexdigest())

    def test_control_the_daemon_path_copies(self):
        """-o passthrough=0: the daemon writes every staged byte itself
        (what the measure above would see if a copy came back)."""
        m = self.mount("passthrough=0")
        pid = m.proc.pid
        before = io_of(pid)
        self.stage("c", 2, 64 * MiB)
        commit(self.ck("c"))
        wrote = io_of(pid)["wchar"] - before["wchar"]
        self.assertGreater(wrote, 2 * 64 * MiB * 9 // 10)


if __name__ == "__main__":
    main()
