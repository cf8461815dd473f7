#!/usr/bin/env python3
"""The data path's kernel settings: write-only staged files bypass the
mount's page cache (one copy into staging) while O_RDWR keeps shared
mmap; committed tensors are read without the mount's cache by default
(direct_reads=1) or through it (direct_reads=0, shared mmap works); the
mount's readahead window is raised as -o readahead says."""

import errno
import mmap
import os
import re
import subprocess
import time

from ckpttest import util
from ckpttest.util import (CkptfsTestCase, commit, main, pread, read_all, state, write_file,
                           write_tensor)

MiB = 1 << 20


def bdi_readahead_kb(mnt, want, timeout=10):
    """The mount's readahead in KiB, once it is want (the daemon sets it
    just after the mount is up) or timeout seconds passed."""
    st = os.stat(mnt)
    path = f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb"
    deadline = time.time() + timeout
    while True:
        with open(path) as f:
            kb = int(f.read())
        if kb == want or time.time() > deadline:
            return kb
        time.sleep(0.02)


def libfuse_version():
    """(major, minor) of the libfuse the binary runs with (--version)."""
    out = subprocess.run([util.BIN, "--version"], capture_output=True,
                         text=True).stdout
    m = re.search(r"FUSE (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


class DataPath(CkptfsTestCase):
    def save_one(self, name, data):
        os.mkdir(self.ck(name))
        write_tensor(self.ck(name, "w"), "float32", [len(data) // 4096, 1024], data)
        commit(self.ck(name))
        self.assertEqual(state(self.ck(name)), "committed")

    def test_direct_reads_by_default(self):
        self.mount()
        data = os.urandom(3 * MiB + 4096 * 5)
        self.save_one("d", data)
        p = self.ck("d", "w")
        self.assertEqual(read_all(p), data)
        # odd sizes and offsets, across request boundaries
        for off, ln in [(1, 1), (MiB - 3, 7), (2 * MiB + 11, MiB + 5), (len(data) - 9, 100)]:
            self.assertEqual(pread(p, ln, off), data[off:off + ln], (off, ln))
        # a private mapping works; a shared one needs libfuse >= 3.16
        # (FUSE_CAP_DIRECT_IO_ALLOW_MMAP) or direct_reads=0
        with open(p, "rb") as f:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
                self.assertEqual(mm[MiB:MiB + 4096], data[MiB:MiB + 4096])
            if libfuse_version() >= (3, 16):
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    self.assertEqual(mm[:], data)
            else:
                self.assertErrno(errno.ENODEV, mmap.mmap, f.fileno(), 0,
                                 access=mmap.ACCESS_READ)

    def test_cached_reads_allow_shared_mmap(self):
        self.mount("direct_reads=0")
        data = os.urandom(2 * MiB)
        self.save_one("c", data)
        with open(self.ck("c", "w"), "rb") as f:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                self.assertEqual(mm[:], data)

    def test_shared_writable_mmap_of_a_staged_file(self):
        """np.memmap(mode="w+") opens O_RDWR and maps it shared: staged
        files opened so keep the page cache, and the mapped writes reach
        the checkpoint."""
        self.mount()
        os.mkdir(self.ck("m"))
        p = self.ck("m", "mm")
        data = os.urandom(MiB + 4096)
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, len(data))
            with mmap.mmap(fd, len(data), access=mmap.ACCESS_WRITE) as mm:
                mm[:] = data
                mm.flush()
        finally:
            os.close(fd)
        commit(self.ck("m"))
        self.assertEqual(read_all(p), data)

    def test_write_only_files_any_pattern(self):
        """Write-only handles go around the page cache: sizes, rewrites,
        holes and appends still read back exactly, before and after the
        commit."""
        self.mount()
        os.mkdir(self.ck("w"))
        p = self.ck("w", "f")
        want = bytearray(os.urandom(5 * MiB + 123))
        write_file(p, bytes(want), chunk=MiB + 17)
        fd = os.open(p, os.O_WRONLY)
        try:
            os.pwrite(fd, b"x" * 10, 7)
            want[7:17] = b"x" * 10
            os.pwrite(fd, b"tail", len(want) + 4096)
            want += bytes(4096) + b"tail"
        finally:
            os.close(fd)
        self.assertEqual(os.stat(p).st_size, len(want))
        self.assertEqual(read_all(p), bytes(want))
        commit(self.ck("w"))
        self.assertEqual(read_all(p), bytes(want))

    def test_readahead_window(self):
        if os.geteuid() != 0:
            self.skipTest("the readahead window is set as root only")
        self.mount("readahead=4M")
        self.assertEqual(bdi_readahead_kb(self.mnt, 4096), 4096)
        self.mounts[-1].stop()
        self.mount()
        self.assertEqual(bdi_readahead_kb(self.mnt, 16384), 16384)


if __name__ == "__main__":
    main()
