#!/usr/bin/env python3
"""FUSE passthrough, on by default: a staged file created write-only is
written and read by the kernel in a backing file of its own (an unnamed
file of BACKING_DIR/.staging the daemon holds read-only; the daemon sees
no data request), hashed there after its last close, and at commit it is
its data file (the same inode: no copy) when it holds 64 KiB or more;
smaller ones move into staging memory. Checks that the bytes, sizes and
times are right staged and committed (verified by checksum); that a
commit finding a passthrough file still writable (a handle open for
writing in any process or thread, a writable shared mapping left after
the close, a read-only shared mapping of a file opened O_RDWR) fails at
once with EBUSY naming the file and the process, and
succeeds once it is closed or unmapped; that a failed commit leaves the
files writable in place; and that -o passthrough=0 makes no backing file.

Skipped only when the binary's libfuse has no passthrough API (< 3.16) or
the kernel is older than 6.9; where both have it, passthrough must be
granted (else the test fails).

    python3 tests/integration/test_passthrough.py --bin build/bin/ckptfs
"""

import ctypes
import errno
import mmap
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

from ckpttest import util
from ckpttest.pyenv import PACKAGE
from ckpttest.util import (CkptfsTestCase, commit, main, read_all, set_tensor_xattrs, state,
                           wait_state, write_file)

MiB = 1 << 20
KiB = 1 << 10
IO_THREADS = 4  # the default: data files __R_0..3 hold the packed files


def backing_files(pid):
    """{inode: size} of the daemon's staged backing files: the unnamed
    files of BACKING_DIR/.staging it holds read-only (its write-behind
    streams and spill file, there too, it holds read-write), not linked
    anywhere yet (a committed one is a data file: st_nlink 1), and not
    pooled (emptied ones kept for the next new file carry O_NOATIME)."""
    out = {}
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        try:
            if "/.staging/" not in os.readlink(os.path.join(fds, fd)):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = next(int(x.split()[1], 8) for x in f if x.startswith("flags:"))
            st = os.stat(os.path.join(fds, fd))
            if flags & os.O_ACCMODE == os.O_RDONLY and st.st_nlink == 0 and \
                    not flags & os.O_NOATIME:
                out[st.st_ino] = st.st_size
        except OSError:
            pass
    return out


def status_of(ckdir):
    try:
        with open(os.path.join(ckdir, ".status")) as f:
            return f.read()
    except OSError as e:
        return repr(e)


def rchar(pid, key="rchar"):
    """Bytes the daemon has read by read(2) and friends: every FUSE request
    it serves (a write's data included), and what it hashes; with
    key="wchar", what it has written (its replies, its copies)."""
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise AssertionError("no " + key)


def version(text):
    m = re.search(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def punch(fd, off, length):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, 0x01 | 0x02, off, length):  # KEEP_SIZE | PUNCH_HOLE
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def data_files(ckdir):
    """{K: stat} of the data files __0_K.distcp in a checkpoint's backing
    directory."""
    out = {}
    for f in os.listdir(ckdir):
        m = re.fullmatch(r"__0_(\d+)\.distcp", f)
        if m:
            out[int(m.group(1))] = os.stat(os.path.join(ckdir, f))
    return out


class Mapping:
    """A shared writable mapping of fd made by mmap(2) itself: Python's
    mmap.mmap keeps a dup of the descriptor, so closing the file would not
    close it while mapped."""

    def __init__(self, fd, length):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.length = length
        self.addr = self.libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE,
                                   mmap.MAP_SHARED, fd, 0)
        if self.addr in (None, ctypes.c_void_p(-1).value):
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))

    def write(self, off, data):
        ctypes.memmove(self.addr + off, data, len(data))

    def close(self):
        """msync(MS_SYNC), then munmap."""
        if self.libc.msync(self.addr, self.length, 4) or \
                self.libc.munmap(self.addr, self.length):
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))


def chunks_of(blocks, ckdir, name):
    """The stored chunks of tensor file name of the checkpoint at ckdir
    (ckptfs.blocks.StoredChunks)."""
    stored = blocks.StoredChunks(ckdir)
    try:
        return stored.of_path(name)
    finally:
        stored.close()


def skip_without_passthrough(case):
    """Skip case where the binary's libfuse (< 3.16) or the kernel (< 6.9)
    has no FUSE passthrough."""
    out = subprocess.run([util.BIN, "--version"], capture_output=True,
                         text=True).stdout
    fuse = version(out.split("FUSE", 1)[1]) if "FUSE" in out else (0, 0)
    if fuse < (3, 16):
        case.skipTest(f"libfuse {fuse} has no passthrough API (>= 3.16)")
    if version(os.uname().release) < (6, 9):
        case.skipTest("kernel older than 6.9: no FUSE passthrough")


class PassthroughCase(CkptfsTestCase):
    """Mounts with passthrough, and the helpers of the three classes below
    (three ctests: the sanitizer stages run them side by side)."""

    def setUp(self):
        super().setUp()
        skip_without_passthrough(self)

    def mount_pt(self, opts=None):
        """A mount with passthrough as it is by default (no option)."""
        m = self.mount(opts)
        self.assertNotIn("not available", self.daemon_log())
        return m

    def commit_two_shards(self, ck):
        """Checkpoint ck committed with one float32 tensor w [512, 1024]
        staged as two shards of 256 rows, each a file written once (its
        own data file): (the tensor file's name, [each shard's bytes])."""
        os.mkdir(self.ck(ck))
        half = [os.urandom(MiB), os.urandom(MiB)]
        for i in range(2):
            path = self.ck(ck, f"w{i}")
            write_file(path, half[i])
            set_tensor_xattrs(path, "float32", [512, 1024], [256 * i, 0], [256, 1024])
            os.setxattr(path, "user.ckpt.fqn", b"w")
        commit(self.ck(ck))
        name, = [n for n in os.listdir(self.ck(ck)) if n.startswith("w")]
        return name, half

    def wait_for(self, what, cond, timeout=20):
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                self.fail(f"not in {timeout}s: {what}")
            time.sleep(0.02)

    def new_backing(self, pid, path, data):
        """Create path write-only and write data: the inode of the backing
        file it got (asserted to be one of its own), and the open fd. A
        backing file that goes meanwhile may leave its inode number to the
        new one: new is an inode not seen before or seen with another size."""
        before = backing_files(pid)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, data)
        new = [ino for ino, size in backing_files(pid).items()
               if before.get(ino) != size]
        self.assertEqual(len(new), 1, f"{path}: new backing files {new}")
        return new[0], fd

    def assert_busy(self, ckdir, path, how, pid, mode="sync"):
        """A commit of ckdir fails at once with EBUSY, its .status naming
        path (in the checkpoint) and the process pid."""
        t0 = time.monotonic()
        self.assertErrno(errno.EBUSY, commit, ckdir, mode)
        self.assertLess(time.monotonic() - t0, 10, "EBUSY is not at once")
        st = status_of(ckdir)
        self.assertEqual(st.split("\n")[0], "failed", st)
        self.assertRegex(st, rf"rank 0: {re.escape(path)} is still {how} by "
                             rf"process {pid} \(", st)


class Passthrough(PassthroughCase):
    """The data path: staged and committed bytes, data files without a
    copy, block files, reopens, hashing in place."""

    def test_bytes_sizes_and_times_staged_and_committed(self):
        m = self.mount_pt()
        os.mkdir(self.ck("c"))
        big = os.urandom(3 * MiB + 4)                  # 786433 float32
        fd = os.open(self.ck("c", "w"), os.O_WRONLY | os.O_CREAT, 0o644)
        before = rchar(m.proc.pid)
        os.write(fd, big[:MiB])
        self.assertEqual(sorted(backing_files(m.proc.pid).values()), [MiB],
                         "passthrough is on by default: the file is written "
                         "into a backing file of its own")
        (ino,) = backing_files(m.proc.pid)
        os.write(fd, big[MiB:])
        self.assertLess(rchar(m.proc.pid) - before, MiB // 4,
                        "the written bytes went through the daemon")
        os.close(fd)
        set_tensor_xattrs(self.ck("c", "w"), "float32", [len(big) // 4])
        odd = os.urandom(12345)
        write_file(self.ck("c", "blob"), odd, chunk=1000)
        write_file(self.ck("c", "empty"), b"")
        self.assertIn(ino, backing_files(m.proc.pid),
                      "closed, a large file stays in its backing file")
        self.assertEqual(os.stat(self.ck("c", "w")).st_size, len(big))
        self.assertEqual(os.stat(self.ck("c", "blob")).st_size, len(odd))
        self.assertEqual(read_all(self.ck("c", "w")), big)   # read passed through
        with open(self.ck("c", "blob"), "rb") as f:           # and mapped
            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                self.assertEqual(mm[:], odd)
        for name in ("w", "blob"):
            os.utime(self.ck("c", name), ns=(10**18, 10**18))
            self.assertEqual(os.stat(self.ck("c", name)).st_mtime_ns, 10**18)
        # two handles at once, write-only appending and read-write: both
        # passed through to the one backing file
        # (blob's and empty's backing files may still be held: the drain
        # takes small files in after their RELEASE, asynchronously)
        held = set(backing_files(m.proc.pid))
        fd = os.open(self.ck("c", "w"), os.O_WRONLY | os.O_APPEND)
        fd2 = os.open(self.ck("c", "w"), os.O_RDWR)
        os.write(fd, b"tail")
        self.assertEqual(os.pread(fd2, 4, len(big)), b"tail")
        os.pwrite(fd2, b"HEAD", 0)
        now = set(backing_files(m.proc.pid))
        self.assertIn(ino, now)
        self.assertLessEqual(now, held, "a new backing file for the two handles")
        os.close(fd)
        os.close(fd2)
        big = b"HEAD" + big[4:] + b"tail"
        set_tensor_xattrs(self.ck("c", "w"), "uint8", [len(big)])
        self.assertGreater(os.stat(self.ck("c", "w")).st_mtime_ns, 10**18,
                           "the kernel's writes move the mtime")
        with open(self.ck("c", "blob"), "ab") as f:
            f.write(b"more")
        odd += b"more"
        self.assertNotEqual(os.stat(self.ck("c", "blob")).st_mtime_ns, 10**18)
        os.utime(self.ck("c", "w"), ns=(10**18 + 1, 10**18 + 1))
        os.utime(self.ck("c", "blob"), ns=(10**18, 10**18))
        commit(self.ck("c"))
        self.assertEqual(state(self.ck("c")), "committed")
        self.assertEqual(read_all(self.ck("c", "w")), big)
        self.assertEqual(read_all(self.ck("c", "blob")), odd)
        self.assertEqual(read_all(self.ck("c", "empty")), b"")
        self.assertEqual(os.stat(self.ck("c", "w")).st_mtime_ns, 10**18 + 1)
        self.assertEqual(os.stat(self.ck("c", "blob")).st_mtime_ns, 10**18)
        self.wait_for("the backing files go with the commit",
                      lambda: backing_files(m.proc.pid) == {})
        m.stop()
        self.mount("verify=1")                               # every checksum right
        self.assertEqual(read_all(self.ck("c", "w")), big)
        self.assertEqual(read_all(self.ck("c", "blob")), odd)
        self.assertEqual(os.stat(self.ck("c", "w")).st_mtime_ns, 10**18 + 1)

    def test_large_file_becomes_its_data_file_without_a_copy(self):
        """A file of 64 KiB or more is linked as a data file of its own,
        __0_K with K >= io_threads: the inode the kernel wrote. Smaller
        ones are packed into __0_0..3."""
        m = self.mount_pt()
        os.mkdir(self.ck("i"))
        datas = {"a": os.urandom(3 * MiB + 1), "b": os.urandom(64 * KiB),
                 "c": os.urandom(64 * KiB - 1), "d": os.urandom(5000)}
        inos = {}
        for name, d in datas.items():
            inos[name], fd = self.new_backing(m.proc.pid, self.ck("i", name), d)
            os.close(fd)
        staged = {}                                  # inode: device
        fds = f"/proc/{m.proc.pid}/fd"
        for fd in os.listdir(fds):
            try:
                st = os.stat(os.path.join(fds, fd))
                if "/.staging/" in os.readlink(os.path.join(fds, fd)) and \
                        st.st_ino in (inos["a"], inos["b"]):
                    staged[st.st_ino] = st.st_dev
            except OSError:
                pass
        self.assertEqual(set(staged), {inos["a"], inos["b"]})
        commit(self.ck("i"))
        files = data_files(self.bk("i"))
        own = {k: st for k, st in files.items() if k >= IO_THREADS}
        self.assertEqual(sorted((st.st_ino, st.st_dev) for st in own.values()),
                         sorted((inos[n], staged[inos[n]]) for n in ("a", "b")),
                         f"data files {sorted(files)}: the large files' own are "
                         f"their backing files")
        for name in ("a", "b"):
            st = next(st for st in own.values() if st.st_ino == inos[name])
            self.assertEqual(st.st_size, len(datas[name]))
        self.assertLessEqual(set(files) - set(own), set(range(IO_THREADS)))
        for name, d in datas.items():
            self.assertEqual(read_all(self.ck("i", name)), d)
        m.stop()
        self.mount("verify=1")
        for name, d in datas.items():
            self.assertEqual(read_all(self.ck("i", name)), d)

    def test_shard_block_file_read_without_the_daemon(self):
        """A block file that is one shard of a tensor, written once into a
        data file of its own (a rank's shard at the world size it was
        saved with), is read straight from that data file: once verified,
        its reads cost the daemon nothing; a block spanning two shards is
        served by the daemon, byte for byte."""
        m = self.mount_pt()
        name, half = self.commit_two_shards("s")
        shard = self.ck("s", f".{name}[256:512,0:1024]")
        self.assertEqual(read_all(shard), half[1])      # verified here, once
        # opened, its reads need no daemon: they are served with it stopped
        fd = os.open(shard, os.O_RDONLY)
        self.addCleanup(os.close, fd)
        got = []
        reader = threading.Thread(target=lambda: got.append(os.pread(fd, MiB, 0)),
                                  daemon=True)
        os.kill(m.proc.pid, signal.SIGSTOP)
        try:
            reader.start()
            reader.join(5)
            served = not reader.is_alive()
        finally:
            os.kill(m.proc.pid, signal.SIGCONT)
        reader.join(10)
        self.assertTrue(served, "the shard's read waited for the stopped daemon")
        self.assertEqual(got, [half[1]])
        across = self.ck("s", f".{name}[128:384,0:1024]")
        self.assertEqual(read_all(across), half[0][MiB // 2:] + half[1][:MiB // 2])

    def test_part_of_a_shard_read_from_the_shard_file(self):
        """A block that is part of one stored chunk (a load at another
        world size: rows [320, 448) of a tensor saved as two shards of 256
        rows) is read by the package's loaders from that chunk's own file,
        which the mount serves by passthrough: no READ request reaches the
        daemon; the same block through its own block file (the loaders'
        path without the chunks) is read by the daemon."""
        sys.path.insert(0, PACKAGE)
        from ckptfs import blocks
        mfile = [os.path.join(self.dir, f"metrics{i}.prom") for i in range(2)]
        m = self.mount_pt("metrics=" + mfile[0])
        name, half = self.commit_two_shards("s")
        # from BACKING_DIR's copy of .metadata: its reads through the
        # mount would count (the mount's copy: below, on the second mount)
        chunks = chunks_of(blocks, self.bk("s"), name)
        self.assertEqual(sorted(chunks), [((0, 0), (256, 1024)), ((256, 0), (256, 1024))])
        want = half[1][64 * 4096:192 * 4096]

        def read(with_chunks):
            buf = bytearray(len(want))
            blocks.read_block(self.ck("s", name), 4, (512, 1024), (320, 0), (128, 1024),
                              memoryview(buf), chunks if with_chunks else None)
            return bytes(buf)

        for _ in range(10):
            self.assertEqual(read(True), want)
        self.assertEqual(m.stop(), 0)
        self.assertEqual(requests(mfile[0], "read"), 0,
                         "the part of a shard was read through the daemon")
        m = self.mount_pt("metrics=" + mfile[1])
        self.assertEqual(chunks_of(blocks, self.ck("s"), name), chunks)
        for _ in range(10):
            self.assertEqual(read(False), want)
        self.assertEqual(m.stop(), 0)
        self.assertGreaterEqual(requests(mfile[1], "read"), 10,
                                "this test no longer tells the two paths apart")

    def test_reopen_after_data_file_replaced_and_old_one_changed(self):
        """A committed file open (its data file X the inode's passthrough
        backing file); X is then written in place and a good copy renamed
        over it: a new open meanwhile is not served X's changed bytes (it
        fails with EIO, as the kernel fails an open of another mode while
        the inode has a backing file); once the first handle is closed, an
        open reads the committed bytes from the new file."""
        self.mount_pt()
        os.mkdir(self.ck("r"))
        data = os.urandom(3 * MiB)
        write_file(self.ck("r", "a"), data)
        commit(self.ck("r"))
        fd = os.open(self.ck("r", "a"), os.O_RDONLY)
        try:
            self.assertEqual(os.pread(fd, 4096, 0), data[:4096])
            own = [k for k in data_files(self.bk("r")) if k >= IO_THREADS]
            self.assertEqual(len(own), 1)
            path = self.bk("r", f"__0_{own[0]}.distcp")
            with open(path, "rb") as f:
                good = f.read()
            with open(path + ".new", "wb") as f:
                f.write(good)
            time.sleep(0.01)
            with open(path, "r+b") as f:  # X changed after its check
                f.seek(100)
                f.write(bytes([good[100] ^ 0xFF]))
            os.rename(path + ".new", path)
            try:
                got = read_all(self.ck("r", "a"))
            except OSError as e:
                self.assertEqual(e.errno, errno.EIO)
            else:
                self.assertEqual(got, data, "a new open was served the changed "
                                 "old data file")
        finally:
            os.close(fd)
        self.assertEqual(read_all(self.ck("r", "a")), data)

    def test_closed_files_hashed_in_place_or_moved_into_memory(self):
        """After the last close the drain hashes a file of 64 KiB or more
        where it is (reads it once, copies nothing, keeps its backing
        file) and moves a smaller one into staging memory (its backing
        file closed). A drain that runs before the kernel has let go of
        the closed handle's writable backing file gives up (the commit
        does that work then): a few may be left, not more. The hash reads
        a mapping of the file: the mount's metric counts its bytes."""
        mfile = os.path.join(self.dir, "metrics.prom")
        m = self.mount_pt("metrics=" + mfile)
        pid = m.proc.pid
        os.mkdir(self.ck("h"))
        large, datas = {}, {}
        read0, wrote0 = rchar(pid), rchar(pid, "wchar")
        for i in range(20):
            datas[f"L{i}"] = os.urandom(256 * KiB + i)
            ino, fd = self.new_backing(pid, self.ck("h", f"L{i}"), datas[f"L{i}"])
            os.close(fd)
            large[ino] = 256 * KiB + i
        for i in range(40):
            datas[f"s{i}"] = os.urandom(8192 + i)
            write_file(self.ck("h", f"s{i}"), datas[f"s{i}"])
        self.wait_for("the small files move into memory (all but 4 at most)",
                      lambda: len(set(backing_files(pid)) - set(large)) <= 4)
        self.assertEqual({i: n for i, n in backing_files(pid).items() if i in large},
                         large, "the large files stay in their backing files")
        self.wait_for("the large files are hashed (all but 4 at most)",
                      lambda: metric(mfile, "ckptfs_drain_hashed_bytes_total")
                      >= 16 * 256 * KiB)
        # hashed from mappings: the large files were not read (a read would
        # count them in rchar, as the small files moved into memory are)
        self.assertLess(rchar(pid) - read0, 2 * MiB, "the drain read the large files")
        self.assertLess(rchar(pid, "wchar") - wrote0, 2 * MiB,
                        "the daemon copied the written files")
        commit(self.ck("h"))
        for name, d in datas.items():
            self.assertEqual(read_all(self.ck("h", name)), d)
        m.stop()
        self.mount("verify=1")
        for name, d in datas.items():
            self.assertEqual(read_all(self.ck("h", name)), d)


class Handles(PassthroughCase):
    """Handles and mappings open for writing at a commit."""

    def test_handle_open_for_writing_fails_the_commit(self):
        """The test's own handle, sync and async commits: EBUSY at once,
        nothing frozen (the handle still writes), and the commit after the
        close saves the bytes as they are then."""
        m = self.mount_pt()
        for mode in ("sync", "async"):
            name = "h" + mode
            os.mkdir(self.ck(name))
            data = bytearray(os.urandom(2 * MiB))
            ino, fd = self.new_backing(m.proc.pid, self.ck(name, "t"), data)
            set_tensor_xattrs(self.ck(name, "t"), "uint8", [len(data)])
            self.assert_busy(self.ck(name), "t", "open for writing", os.getpid(), mode)
            os.pwrite(fd, b"x" * 4096, 0)
            data[:4096] = b"x" * 4096
            os.close(fd)
            self.assertEqual(list(backing_files(m.proc.pid)), [ino],
                             "the failed commit left the file in place")
            commit(self.ck(name), mode)
            self.assertEqual(wait_state(self.ck(name)).split("\n")[0], "committed")
            self.assertEqual(read_all(self.ck(name, "t")), data)

    def test_handle_open_for_writing_in_another_process(self):
        m = self.mount_pt()
        os.mkdir(self.ck("p"))
        data = bytearray(os.urandom(MiB))
        write_file(self.ck("p", "t"), bytes(data))
        child = subprocess.Popen(
            [sys.executable, "-c",
             "import os, sys\n"
             "fd = os.open(sys.argv[1], os.O_WRONLY)\n"
             "os.pwrite(fd, b'C' * 4096, 8192)\n"
             "print('ready', flush=True)\n"
             "sys.stdin.read()\n"
             "os.close(fd)\n", self.ck("p", "t")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.addCleanup(child.kill)
        self.assertEqual(child.stdout.readline(), "ready\n")
        data[8192:12288] = b"C" * 4096
        self.assertEqual(len(backing_files(m.proc.pid)), 1, "one backing file")
        self.assert_busy(self.ck("p"), "t", "open for writing", child.pid)
        with open(f"/proc/{child.pid}/comm") as f:
            self.assertIn(f"({f.read().strip()})", status_of(self.ck("p")))
        child.communicate("")                   # closes and exits
        self.assertEqual(child.returncode, 0)
        commit(self.ck("p"))
        self.assertEqual(read_all(self.ck("p", "t")), data)

    def test_handle_open_for_writing_in_a_thread(self):
        """A trainer's checkpoint thread still writing: the process named
        is the test's (a thread is no process of its own)."""
        m = self.mount_pt()
        os.mkdir(self.ck("t"))
        data = bytearray(os.urandom(MiB))
        write_file(self.ck("t", "x"), bytes(data))
        ready, done = threading.Event(), threading.Event()

        def writer():
            fd = os.open(self.ck("t", "x"), os.O_WRONLY)
            os.pwrite(fd, b"T" * 4096, 0)
            ready.set()
            done.wait(60)
            os.close(fd)
        th = threading.Thread(target=writer)
        th.start()
        self.addCleanup(th.join)
        self.addCleanup(done.set)
        self.assertTrue(ready.wait(20))
        data[:4096] = b"T" * 4096
        self.assertEqual(len(backing_files(m.proc.pid)), 1)
        self.assert_busy(self.ck("t"), "x", "open for writing", os.getpid())
        done.set()
        th.join()
        commit(self.ck("t"))
        self.assertEqual(read_all(self.ck("t", "x")), data)

    def test_writable_mapping_after_close_fails_the_commit(self):
        """A writable shared mapping that outlived its file's close: EBUSY
        naming the mapping process; after the munmap the commit succeeds
        with the bytes written through the mapping."""
        m = self.mount_pt()
        os.mkdir(self.ck("m"))
        a, b = os.urandom(256 * KiB), bytearray(os.urandom(256 * KiB))
        write_file(self.ck("m", "a"), a)
        write_file(self.ck("m", "b"), bytes(b))
        fd = os.open(self.ck("m", "b"), os.O_RDWR)
        mm = Mapping(fd, len(b))
        os.close(fd)
        self.addCleanup(lambda: mm.addr and mm.close())
        mm.write(0, b"MMAP")
        b[:4] = b"MMAP"
        self.assert_busy(self.ck("m"), "b", "mapped writable and shared", os.getpid())
        mm.write(100000, b"after the failed commit")
        b[100000:100023] = b"after the failed commit"
        mm.close()
        mm.addr = None
        commit(self.ck("m"))
        self.assertEqual(read_all(self.ck("m", "a")), a)
        self.assertEqual(read_all(self.ck("m", "b")), b)
        m.stop()
        self.mount("verify=1")
        self.assertEqual(read_all(self.ck("m", "b")), b)

    def test_read_only_mapping_of_a_writable_file_names_its_process(self):
        """A read-only shared mapping (PROT_READ, MAP_SHARED) of a file
        opened O_RDWR, left after the close, in another process: its file
        description can still write (mprotect makes the mapping writable),
        so the commit fails with EBUSY naming that process (issue 33, case
        5: it said "a process not found"); a read-only mapping of a file
        opened O_RDONLY does not hold the commit back; after the munmap the
        commit succeeds."""
        m = self.mount_pt()
        os.mkdir(self.ck("r"))
        data = os.urandom(256 * KiB)
        write_file(self.ck("r", "b"), data)
        mapper = (
            "import ctypes, mmap, os, sys\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.mmap.restype = ctypes.c_void_p\n"
            "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,\n"
            "                      ctypes.c_int, ctypes.c_int, ctypes.c_long]\n"
            "libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]\n"
            "fd = os.open(sys.argv[1], int(sys.argv[2]))\n"
            "n = os.fstat(fd).st_size\n"
            "addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)\n"
            "assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()\n"
            "os.close(fd)\n"
            "print(ctypes.string_at(addr, 16).hex(), flush=True)\n"
            "sys.stdin.read()\n"
            "libc.munmap(addr, n)\n")

        def start(flags):
            child = subprocess.Popen([sys.executable, "-c", mapper, self.ck("r", "b"),
                                      str(flags)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
            self.addCleanup(lambda: child.poll() is None and (child.kill(), child.wait()))
            self.addCleanup(child.stdout.close)
            self.addCleanup(child.stdin.close)
            self.assertEqual(child.stdout.readline(), data[:16].hex() + "\n")
            return child
        reader = start(os.O_RDONLY)     # a reader only: no writer
        writer = start(os.O_RDWR)
        self.assert_busy(self.ck("r"), "b", "mapped shared from a descriptor open for "
                         "writing", writer.pid)
        with open(f"/proc/{writer.pid}/comm") as f:
            self.assertIn(f"({f.read().strip()})", status_of(self.ck("r")))
        writer.communicate("")                  # unmaps and exits
        self.assertEqual(writer.returncode, 0)
        commit(self.ck("r"))                    # the read-only mapping stays
        reader.communicate("")
        self.assertEqual(reader.returncode, 0)
        self.assertEqual(read_all(self.ck("r", "b")), data)

    def test_failed_commit_leaves_the_files_writable(self):
        """Failed for its sizes (a tensor 8 bytes short), then for a writer:
        the files stay in their backing files, writable; changes after
        each failure (grown, shrunk below 64 KiB, holes) are committed."""
        m = self.mount_pt()
        os.mkdir(self.ck("f"))
        good = os.urandom(128 * KiB)
        ino, fd = self.new_backing(m.proc.pid, self.ck("f", "w"), good[:-8])
        set_tensor_xattrs(self.ck("f", "w"), "float64", [len(good) // 8])
        os.close(fd)
        others = {f"o{i}": os.urandom(200 * KiB + i) for i in range(3)}
        for name, d in others.items():
            write_file(self.ck("f", name), d)
        with self.assertRaises(OSError):
            commit(self.ck("f"))
        st = wait_state(self.ck("f"))
        self.assertEqual(st.split("\n")[0], "failed")
        self.assertIn(str(len(good) - 8), st)
        self.assertIn(ino, backing_files(m.proc.pid), "left in place")
        fd = os.open(self.ck("f", "w"), os.O_WRONLY)     # writable again
        os.pwrite(fd, good[-8:], len(good) - 8)
        punch(fd, 4096, 8192)
        os.close(fd)
        want = good[:4096] + b"\0" * 8192 + good[12288:]
        self.assertEqual(read_all(self.ck("f", "w")), want)
        os.truncate(self.ck("f", "w"), len(good) + 1000)
        os.truncate(self.ck("f", "w"), len(good))
        self.assertEqual(read_all(self.ck("f", "w")), want)
        self.assertIn(ino, backing_files(m.proc.pid), "still in place")
        # now a writer fails it: the freeze visits the newest files first,
        # so the o* files were frozen (given their data files) before
        hold = os.open(self.ck("f", "w"), os.O_WRONLY)
        self.assert_busy(self.ck("f"), "w", "open for writing", os.getpid())
        others["o0"] = others["o0"][:1000]               # shrunk below 64 KiB
        os.truncate(self.ck("f", "o0"), 1000)
        others["o1"] += b"grown"
        with open(self.ck("f", "o1"), "ab") as f:
            f.write(b"grown")
        with open(self.ck("f", "o2"), "r+b") as f:
            f.write(b"changed")
        others["o2"] = b"changed" + others["o2"][7:]
        os.close(hold)
        commit(self.ck("f"))
        self.assertEqual(read_all(self.ck("f", "w")), want)
        for name, d in others.items():
            self.assertEqual(read_all(self.ck("f", name)), d, name)
        m.stop()
        self.mount("verify=1")
        self.assertEqual(read_all(self.ck("f", "w")), want)
        for name, d in others.items():
            self.assertEqual(read_all(self.ck("f", name)), d, name)


class Drain(PassthroughCase):
    """The drain, descriptor limits, sparse files, passthrough off."""

    def test_many_files_drained_renamed_and_discarded(self):
        m = self.mount_pt()
        os.mkdir(self.ck("d"))
        datas = [os.urandom(1000 + 9973 * i) for i in range(40)]
        for i, d in enumerate(datas):
            write_file(self.ck("d", f"b{i}"), d)
        large = {len(d) for d in datas if len(d) >= 64 * KiB}
        self.assertTrue(0 < len(large) < 40)
        self.assertLessEqual(large, set(backing_files(m.proc.pid).values()))
        for i in range(0, 40, 2):
            os.unlink(self.ck("d", f"b{i}"))
        # the removed files' backing files go (sizes tell the files apart)
        gone = {len(datas[i]) for i in range(0, 40, 2)}
        self.wait_for("the removed files' backing files go", lambda: not (
            gone & set(backing_files(m.proc.pid).values())))
        self.assertLessEqual(large - gone, set(backing_files(m.proc.pid).values()))
        os.rename(self.ck("d", "b39"), self.ck("d", "r39"))
        os.rename(self.ck("d", "b1"), self.ck("d", "r1"))
        for i in range(3, 39, 2):
            self.assertEqual(read_all(self.ck("d", f"b{i}")), datas[i])
        commit(self.ck("d"))
        self.assertEqual(read_all(self.ck("d", "r1")), datas[1])
        self.assertEqual(read_all(self.ck("d", "r39")), datas[39])
        for i in range(3, 39, 2):
            self.assertEqual(read_all(self.ck("d", f"b{i}")), datas[i])
        os.mkdir(self.ck("gone"))
        _, fd = self.new_backing(m.proc.pid, self.ck("gone", "x"), b"y" * 500000)
        subprocess.run(["rm", "-rf", self.ck("gone")], check=True)
        os.close(fd)
        self.wait_for("the removed file's backing file goes",
                      lambda: backing_files(m.proc.pid) == {})
        m.stop()
        self.mount("verify=1")
        self.assertEqual(read_all(self.ck("d", "r39")), datas[39])
        for i in range(3, 39, 2):
            self.assertEqual(read_all(self.ck("d", f"b{i}")), datas[i])

    def test_reopened_while_draining(self):
        """A file written again right after its close, while the drain may
        be hashing it: the same backing file takes the writes, the hash is
        dropped or redone, and the last bytes written are what is saved."""
        m = self.mount_pt()
        os.mkdir(self.ck("r"))
        want, inos = {}, set()
        for i in range(12):
            p = self.ck("r", f"t{i}")
            d = bytearray(os.urandom(2 * MiB))
            ino, fd = self.new_backing(m.proc.pid, p, bytes(d))
            os.close(fd)
            inos.add(ino)
            for k in range(6):                       # at once, then later
                patch = os.urandom(4096)
                off = (k * 700001) % (len(d) - 4096)
                fd = os.open(p, os.O_WRONLY)
                os.pwrite(fd, patch, off)
                os.close(fd)
                d[off:off + 4096] = patch
                if k == 3:
                    time.sleep(0.01 * (i % 4))
            set_tensor_xattrs(p, "uint8", [len(d)])
            want[p] = bytes(d)
        self.assertEqual(set(backing_files(m.proc.pid)), inos,
                         "reopened files keep their backing file")
        for p, d in want.items():
            self.assertEqual(read_all(p), d)
        commit(self.ck("r"))
        for p, d in want.items():
            self.assertEqual(read_all(p), d)
        m.stop()
        self.mount("verify=1")
        for p, d in want.items():
            self.assertEqual(read_all(p), d)

    def test_opens_racing_the_drain_never_fail(self):
        """Open right after close, again and again, for reading or writing:
        an open that meets the drain hashing the file, or moving a small
        one into memory, works (never EIO), and the bytes are right."""
        self.mount_pt()
        os.mkdir(self.ck("o"))
        rng = random.Random(7)
        datas = {}
        t0, i = time.monotonic(), 0
        while time.monotonic() - t0 < 3:
            p = self.ck("o", f"f{i}")
            d = bytearray(os.urandom(256 * KiB if i % 2 else 32 * KiB))
            write_file(p, bytes(d))
            time.sleep(rng.uniform(0, 0.002))
            at = 4096 * (i % 8)
            if i % 3 == 0:
                fd = os.open(p, os.O_WRONLY)
                os.pwrite(fd, b"W" * 4096, at)
                os.close(fd)
                d[at:at + 4096] = b"W" * 4096
            r = os.open(p, os.O_RDONLY)
            self.assertEqual(os.pread(r, 4096, at), d[at:at + 4096])
            os.close(r)
            datas[p] = bytes(d)
            if i >= 40:
                os.unlink(self.ck("o", f"f{i - 40}"))
                del datas[self.ck("o", f"f{i - 40}")]
            i += 1
        self.assertGreater(i, 60)
        commit(self.ck("o"))
        for p, d in datas.items():
            self.assertEqual(read_all(p), d)

    def test_read_write_creates_and_readers_while_committing(self):
        m = self.mount_pt()
        os.mkdir(self.ck("k"))
        rw = os.urandom(MiB)
        with open(self.ck("k", "rw"), "w+b") as f:   # created O_RDWR: passed
            f.write(rw)                              # through too (issue 38)
        self.assertEqual(sorted(backing_files(m.proc.pid).values()), [MiB])
        big = os.urandom(32 * MiB)
        ino, fd = self.new_backing(m.proc.pid, self.ck("k", "big"), big)
        r = os.open(self.ck("k", "big"), os.O_RDONLY)  # a reader: no writer
        os.close(fd)
        commit(self.ck("k"), "async")
        # readers as the commit goes (it may be done: it copies nothing),
        # passed through; a create elsewhere
        self.assertEqual(os.pread(r, 4096, 12345), big[12345:12345 + 4096])
        self.assertEqual(read_all(self.ck("k", "big"))[:MiB], big[:MiB])
        os.mkdir(self.ck("k2"))
        new = os.urandom(MiB)
        _, fd = self.new_backing(m.proc.pid, self.ck("k2", "n"), new)
        os.close(fd)
        self.assertEqual(wait_state(self.ck("k")).split("\n")[0], "committed",
                         status_of(self.ck("k")))
        self.assertEqual(os.pread(r, 4096, 12345), big[12345:12345 + 4096])
        os.close(r)
        self.assertEqual(read_all(self.ck("k", "big")), big)
        self.assertEqual(read_all(self.ck("k", "rw")), rw)
        self.assertIn(ino, {st.st_ino for st in data_files(self.bk("k")).values()})
        commit(self.ck("k2"))
        self.assertEqual(read_all(self.ck("k2", "n")), new)

    def test_writes_through_a_mapping_after_close_are_kept(self):
        """Issue 23 case 5: a writable shared mapping outlives the file's
        descriptors; unmapped before the commit, its writes are saved (the
        drain must not move a small file away from the backing file the
        mapping writes into)."""
        m = self.mount_pt()
        for delay in (0.05, 0.3):
            name = f"map{int(delay * 1000)}"
            os.mkdir(self.ck(name))
            want = {}
            for fname, size in (("big", 256 * KiB), ("small", 8192)):
                p = self.ck(name, fname)
                d = bytearray(os.urandom(size))
                write_file(p, bytes(d))                # write-only: a backing file
                fd = os.open(p, os.O_RDWR)
                mm = Mapping(fd, size)                 # shared, writable
                os.close(fd)                           # RELEASE: the drain may go
                want[p] = (mm, d)
            time.sleep(delay)
            for p, (mm, d) in want.items():
                patch = os.urandom(4096)
                mm.write(4096, patch)
                d[4096:8192] = patch
                mm.close()                             # msync, munmap
            for p, (mm, d) in want.items():
                self.assertEqual(read_all(p), bytes(d), f"{p}: read after munmap")
            commit(self.ck(name))
            for p, (mm, d) in want.items():
                self.assertEqual(read_all(p), bytes(d), f"{p}: committed")
        self.wait_for("the backing files go with the commits",
                      lambda: backing_files(m.proc.pid) == {})
        m.stop()
        self.mount("verify=1")
        for delay in (0.05, 0.3):
            name = f"map{int(delay * 1000)}"
            for fname in ("big", "small"):
                self.assertEqual(os.stat(self.ck(name, fname)).st_size,
                                 256 * KiB if fname == "big" else 8192)
                read_all(self.ck(name, fname))         # checksums verified

    def low_fd_mount(self, soft, hard, opts=None):
        """A passthrough mount whose daemon starts with RLIMIT_NOFILE
        soft:hard (the default soft limit is 1024)."""
        m = self.mount(opts, start=False)
        argv = m.argv
        m.argv = lambda: ["prlimit", f"--nofile={soft}:{hard}", "--"] + argv()
        m.start()
        self.assertNotIn("not available", self.daemon_log())
        return m

    def test_small_files_beyond_the_fd_limit_commit(self):
        """Issue 23 case 6: 1,500 staged 4 KiB files under a 1024 fd limit
        (soft and hard): the commits succeed, an async commit in flight
        while the next checkpoint is staged too, and the daemon exits 0."""
        m = self.low_fd_mount(1024, 1024)
        datas, held = {}, 0
        t0 = time.monotonic()
        for ck in ("a", "b"):
            os.mkdir(self.ck(ck))
            for i in range(1500):
                d = os.urandom(4096)
                write_file(self.ck(ck, f"f{i}"), d)
                datas[(ck, i)] = d
                if i % 100 == 0:
                    held = max(held, len(backing_files(m.proc.pid)))
            if ck == "a":
                commit(self.ck("a"), "async")         # in flight while b is staged
        self.assertEqual(wait_state(self.ck("a")).split("\n")[0], "committed",
                         status_of(self.ck("a")))
        commit(self.ck("b"))
        elapsed = time.monotonic() - t0
        self.assertLessEqual(held, 1024 // 2, "backing files held beyond the budget")
        for (ck, i), d in datas.items():
            if i % 50 == 0:
                self.assertEqual(read_all(self.ck(ck, f"f{i}")), d)
        self.assertEqual(m.stop(), 0, self.daemon_log()[-3000:])
        print(f"\n  3000 files of 4 KiB under nofile 1024:1024: staged and "
              f"committed in {elapsed:.2f}s", file=sys.stderr)
        self.mount("verify=1")
        for (ck, i), d in datas.items():
            if i % 10 == 0:
                self.assertEqual(read_all(self.ck(ck, f"f{i}")), d)

    def test_many_committed_large_files_under_the_fd_limit(self):
        """Issue 23 case 6, large files: 6 checkpoints of 200 files of
        64 KiB (each its own data file) under a 1024 fd limit all commit:
        a committed checkpoint keeps no descriptor per file."""
        m = self.low_fd_mount(1024, 1024)
        for c in range(6):
            os.mkdir(self.ck(f"c{c}"))
            for i in range(200):
                write_file(self.ck(f"c{c}", f"f{i}"), bytes([c, i % 256]) * (32 * KiB))
            commit(self.ck(f"c{c}"))
            own = [k for k in data_files(self.bk(f"c{c}")) if k >= IO_THREADS]
            self.assertEqual(len(own), 200)
        fds = len(os.listdir(f"/proc/{m.proc.pid}/fd"))
        self.assertLess(fds, 512, f"the daemon holds {fds} descriptors")
        for c in range(6):
            self.assertEqual(read_all(self.ck(f"c{c}", "f199")), bytes([c, 199]) * (32 * KiB))
        self.assertEqual(m.stop(), 0, self.daemon_log()[-3000:])

    def test_files_open_at_once_beyond_the_backing_file_budget(self):
        """Issue 23 case 6: 900 staged files open at once under a 1024 fd
        limit: half the limit hold a backing file, the others go through
        the daemon (said once in the log); all commit once closed."""
        m = self.low_fd_mount(1024, 1024)
        os.mkdir(self.ck("a"))
        fds, datas = [], {}
        for i in range(900):
            p = self.ck("a", f"f{i}")
            fds.append(os.open(p, os.O_WRONLY | os.O_CREAT, 0o644))
            datas[p] = os.urandom(4096 + i)
            os.write(fds[-1], datas[p])
        self.assertEqual(len(backing_files(m.proc.pid)), 512)
        for fd in fds:
            os.close(fd)
        commit(self.ck("a"))
        for p, d in datas.items():
            self.assertEqual(read_all(p), d)
        self.assertEqual(m.stop(), 0)
        self.assertEqual(self.daemon_log().count("hold a backing file each"), 1)

    def test_soft_fd_limit_raised_to_the_hard_one(self):
        """Issue 23 case 6: the daemon raises its soft limit of open
        files to the hard one, and says so."""
        m = self.low_fd_mount(1024, 4096)
        with open(f"/proc/{m.proc.pid}/limits") as f:
            line = next(x for x in f if x.startswith("Max open files"))
        self.assertEqual(line.split()[3:5], ["4096", "4096"], line)
        self.assertIn("raised the limit of open files", self.daemon_log())

    def tmpfs_backing(self, size):
        """BACKING_DIR on a tmpfs of its own, size bytes."""
        os.makedirs(self.backing)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                        self.backing], check=True)

        def unmount():                  # the daemons first
            for m in self.mounts:
                m.stop()
            subprocess.run(["umount", self.backing], check=True)
        self.addCleanup(unmount)

    def assert_sparse_copy(self, path, size, pieces):
        """path reads as zeros but for pieces {offset: bytes}."""
        with open(path, "rb", buffering=0) as f:
            pos, step = 0, 8 * MiB
            while pos < size:
                got = f.read(step)
                self.assertEqual(len(got), min(step, size - pos))
                want = bytearray(len(got))
                for off, d in pieces.items():
                    if pos <= off < pos + len(got):
                        want[off - pos:off - pos + len(d)] = d
                self.assertEqual(got, bytes(want), f"at {pos}")
                pos += len(got)

    def data_blocks(self, name):
        return sum(st.st_blocks * 512 for st in data_files(self.bk(name)).values())

    SPARSE = {0: os.urandom(4096), 700 * MiB + 8192: os.urandom(4096)}

    def write_sparse(self, path, size):
        """A file of size bytes holding the 8 KiB of SPARSE; its fd."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        for off, d in self.SPARSE.items():
            os.pwrite(fd, d, off)
        os.ftruncate(fd, size)
        return fd

    def test_sparse_file_commits_on_a_small_backing(self):
        """Issue 23 case 7: a 1 GiB file holding 8 KiB, backing on a
        256 MiB tmpfs: committed in a few MiB (the hash and the data file
        skip the holes)."""
        self.tmpfs_backing("256m")
        m = self.mount_pt()
        os.mkdir(self.ck("s"))
        os.close(self.write_sparse(self.ck("s", "sparse"), 1 << 30))
        t0 = time.monotonic()
        commit(self.ck("s"))
        print(f"\n  1 GiB sparse, closed: committed in {time.monotonic() - t0:.2f}s, "
              f"data file {self.data_blocks('s') / MiB:.2f} MiB", file=sys.stderr)
        self.assertLess(self.data_blocks("s"), 4 * MiB)
        self.assert_sparse_copy(self.ck("s", "sparse"), 1 << 30, self.SPARSE)
        m.stop()
        self.mount("verify=1")                   # the checksum is right
        self.assert_sparse_copy(self.ck("s", "sparse"), 1 << 30, self.SPARSE)

    def test_sparse_file_open_across_the_commit(self):
        """Issue 23 case 7: a 2 GiB sparse file still open for writing at
        the commit: EBUSY at once. After the close the commit hashes its
        data only (the holes are not read) and writes no copy."""
        m = self.mount_pt()
        os.mkdir(self.ck("o"))
        fd = self.write_sparse(self.ck("o", "sparse"), 2 << 30)
        self.assert_busy(self.ck("o"), "sparse", "open for writing", os.getpid())
        os.close(fd)
        read0 = rchar(m.proc.pid)
        t0 = time.monotonic()
        commit(self.ck("o"))
        t = time.monotonic() - t0
        read = rchar(m.proc.pid) - read0
        print(f"\n  2 GiB sparse, closed after an EBUSY commit: committed in "
              f"{t:.2f}s, daemon read {read / MiB:.1f} MiB, data file "
              f"{self.data_blocks('o') / MiB:.2f} MiB", file=sys.stderr)
        self.assertLess(read, 64 * MiB, "the holes were read")
        self.assertLess(t, 30)
        self.assertLess(self.data_blocks("o"), 4 * MiB)
        self.assertEqual(os.stat(self.ck("o", "sparse")).st_size, 2 << 30)
        m.stop()
        self.mount("verify=1")
        self.assert_sparse_copy(self.ck("o", "sparse"), 2 << 30, self.SPARSE)

    def test_off_makes_no_backing_file(self):
        """-o passthrough=0: a write-only create goes through the daemon."""
        m = self.mount("passthrough=0")
        os.mkdir(self.ck("n"))
        d = os.urandom(2 * MiB)
        fd = os.open(self.ck("n", "x"), os.O_WRONLY | os.O_CREAT, 0o644)
        before = rchar(m.proc.pid)
        os.write(fd, d)
        self.assertEqual(backing_files(m.proc.pid), {})
        self.assertGreaterEqual(rchar(m.proc.pid) - before, len(d),
                                "the daemon saw the written bytes")
        os.close(fd)
        commit(self.ck("n"))
        self.assertEqual(read_all(self.ck("n", "x")), d)


def metric(metrics_file, name):
    """Counter name (one sample: the mount's rank and mount labels) from
    the mount's metrics file (rewritten every 2 s; 0 before its first
    write)."""
    try:
        with open(metrics_file) as f:
            m = re.search(rf"^{name}(?:{{[^}}]*}})? (\d+)$", f.read(), re.M)
    except FileNotFoundError:
        return 0
    return int(m.group(1)) if m else 0


def requests(metrics_file, op):
    """The mount's count of FUSE requests op, from its metrics file."""
    with open(metrics_file) as f:
        m = re.search(rf'^ckptfs_fuse_requests_total{{[^}}]*op="{op}"}} (\d+)$',
                      f.read(), re.M)
    return int(m.group(1))


def without_fsetid(*argv):
    """argv run as root without CAP_FSETID (as in a container that drops
    it): the VFS would clear set-ID bits on its writes."""
    subprocess.run(["setpriv", "--bounding-set", "-fsetid", "--", *argv],
                   check=True, capture_output=True)


class KillPriv(CkptfsTestCase):
    """With passthrough the kernel is told the filesystem clears set-ID
    bits itself (FUSE_CAP_HANDLE_KILLPRIV_V2), so that it stops asking a
    GETXATTR of security.capability before every passed-through write;
    ckptfs then clears them as the VFS would."""

    def setUp(self):
        super().setUp()
        skip_without_passthrough(self)

    def test_no_request_per_passed_through_write(self):
        mfile = os.path.join(self.dir, "metrics.prom")
        m = self.mount("metrics=" + mfile)
        os.mkdir(self.ck("c"))
        fd = os.open(self.ck("c", "w"), os.O_WRONLY | os.O_CREAT, 0o644)
        before = rchar(m.proc.pid)
        d = os.urandom(MiB)
        for k in range(64):
            os.write(fd, d)
        self.assertLess(rchar(m.proc.pid) - before, MiB, "not passed through")
        os.close(fd)
        self.assertEqual(m.stop(), 0)
        # one lookup of security.capability per file at most, not per write
        self.assertLess(requests(mfile, "getxattr"), 8)
        self.assertLess(requests(mfile, "setattr"), 8)

    def test_set_id_bits_cleared_as_the_vfs_does(self):
        self.mount()
        os.mkdir(self.ck("c"))

        def staged(name, pt, mode=0o6775):
            p = self.ck("c", name)
            fd = os.open(p, (os.O_WRONLY if pt else os.O_RDWR) | os.O_CREAT, 0o644)
            os.write(fd, b"x" * (128 * KiB))
            os.close(fd)
            os.chmod(p, mode)
            self.assertEqual(os.stat(p).st_mode & 0o7777, mode)
            return p

        def bits(p):
            return os.stat(p).st_mode & 0o7777

        dd = ["dd", "if=/dev/zero", "bs=4096", "count=1", "conv=notrunc", "status=none"]
        for pt in (True, False):   # passed through, the daemon's path
            with self.subTest(passthrough=pt):
                # a writer with CAP_FSETID (root as usual) keeps them
                p = staged(f"keep{pt}", pt)
                subprocess.run(dd + ["of=" + p], check=True)
                self.assertEqual(bits(p), 0o6775)
                # a write without it clears both (group-executable)
                p = staged(f"write{pt}", pt)
                without_fsetid(*dd, "of=" + p)
                self.assertEqual(bits(p), 0o0775)
                # set-group-ID without group execute stays
                p = staged(f"sgid{pt}", pt, 0o6745)
                without_fsetid(*dd, "of=" + p)
                self.assertEqual(bits(p), 0o2745)
                # a truncation without it
                p = staged(f"trunc{pt}", pt)
                without_fsetid("truncate", "-s", "4096", p)
                self.assertEqual(bits(p), 0o0775)
                # a chown, by anyone
                p = staged(f"chown{pt}", pt)
                os.chown(p, 0, 0)
                self.assertEqual(bits(p), 0o0775)
        # a new file created with them (umask 022: 6755) and written passed
        # through: cleared at the create (its writes are not seen)
        p = self.ck("c", "new")
        without_fsetid("python3", "-c", "import os; fd = os.open(%r, os.O_WRONLY | "
                       "os.O_CREAT, 0o6775); os.write(fd, bytes(1 << 20))" % p)
        self.assertEqual(bits(p), 0o0755)
        # ... by a process with CAP_FSETID: kept
        p = self.ck("c", "new2")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o6775)
        os.write(fd, bytes(MiB))
        os.close(fd)
        self.assertEqual(bits(p), 0o6755)
        commit(self.ck("c"))
        self.assertEqual(state(self.ck("c")), "committed")


if __name__ == "__main__":
    main()
