"""A slow shared store on this machine, for the tier tests and benchmarks
(issue 27; docs/tiers.md): an ext4 image on a loop device, mounted in a
temporary directory, its writes (and optionally reads) throttled by the
block layer. Python standard library only; needs root, losetup(8),
mkfs.ext4(8) and a block throttle:

  - cgroup v1 blkio: the limit is set in the ROOT blkio cgroup for that one
    device (blkio.throttle.write_bps_device), so it throttles every writer
    of the device: the processes, the kernel's writeback (kworker) and the
    journal (jbd2); a child cgroup would not (writeback runs outside it);
  - else cgroup v2 with the io controller: a child cgroup whose io.max
    limits the device; this process joins it, so every process it starts
    afterwards is in it (v2 charges writeback to the cgroup);
  - else Unavailable, with the reason (a test skips).

    with SlowStore(workdir, write_bps=25 << 20) as s:
        s.path                  the store's mount point (BACKING_DIR's parent)
        s.slowdown(tmpfs_dir)   its write speed against a tmpfs, measured
        s.down() / s.up()       ~4 KiB/s for a while, then the limit again
        s.fill() / s.unfill()   full (ENOSPC), then freed
        s.drop_cache()          its files' pages dropped (for restart timing)

Make it before the network namespaces of a cluster (ckpttest/netns.py): the nodes get a copy of this machine's mounts when they start,
so a store mounted later is not seen on them. For the same reason
drop_cache() drops the files' pages (syncfs, then fadvise DONTNEED on each
file) rather than remounting. Teardown (exit, also on errors): the limit
back to 0, the image unmounted (lazily if busy), the loop device detached,
the image removed.
"""

import os
import subprocess
import tempfile
import time

V1_ROOT = "/sys/fs/cgroup/blkio"
V2_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
DOWN_BPS = 4096
MiB = 1 << 20


class Unavailable(Exception):
    """No slow store here (a reason to skip)."""


def _run(argv):
    try:
        r = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise Unavailable(f"no {argv[0]} on PATH") from None
    if r.returncode != 0:
        raise Unavailable(f"`{' '.join(argv)}` failed: {(r.stderr or r.stdout).strip()}")
    return r.stdout.strip()


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


class _V1:
    """The root blkio cgroup's per-device limits."""

    name = "cgroup v1 blkio (root cgroup, per device)"

    @staticmethod
    def usable():
        return os.path.exists(os.path.join(V1_ROOT, "blkio.throttle.write_bps_device"))

    def __init__(self, dev):
        self.dev = dev

    def set(self, write_bps, read_bps):
        _write(os.path.join(V1_ROOT, "blkio.throttle.write_bps_device"),
               f"{self.dev} {write_bps}")
        _write(os.path.join(V1_ROOT, "blkio.throttle.read_bps_device"), f"{self.dev} {read_bps}")

    def close(self):
        self.set(0, 0)


class _V2:
    """A child cgroup with io.max; this process (and so what it starts
    later) in it until close()."""

    name = "cgroup v2 io.max (child cgroup)"

    @staticmethod
    def root():
        for r in V2_ROOTS:
            try:
                with open(os.path.join(r, "cgroup.controllers")) as f:
                    if "io" in f.read().split():
                        return r
            except OSError:
                pass
        return None

    def __init__(self, dev):
        self.dev = dev
        root = self.root()
        with open("/proc/self/cgroup") as f:
            line = next(ln for ln in f.read().splitlines() if ln.startswith("0::"))
        self.home = os.path.join(root, line[3:].lstrip("/"))
        self.cg = os.path.join(root, f"ckptfs-slow-{os.getpid()}")
        os.makedirs(self.cg, exist_ok=True)
        _write(os.path.join(root, "cgroup.subtree_control"), "+io")
        _write(os.path.join(self.cg, "cgroup.procs"), str(os.getpid()))

    def set(self, write_bps, read_bps):
        w = write_bps or "max"
        r = read_bps or "max"
        _write(os.path.join(self.cg, "io.max"), f"{self.dev} wbps={w} rbps={r}")

    def close(self):
        try:
            self.set(0, 0)
        finally:
            _write(os.path.join(self.home, "cgroup.procs"), str(os.getpid()))
            try:
                os.rmdir(self.cg)
            except OSError:
                pass  # a process started meanwhile still in it


class SlowStore:
    def __init__(self, workdir, size=2 << 30, write_bps=25 * MiB, read_bps=0):
        self.workdir = workdir
        self.size = size
        self.write_bps = write_bps
        self.read_bps = read_bps
        self.image = None
        self.loop = None
        self.dev = None          # "MAJ:MIN"
        self.path = None
        self.throttle = None
        self.filler = None

    # ---- set-up and tear-down
    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self):
        if os.geteuid() != 0:
            raise Unavailable("not root: a loop device and a block throttle need root")
        if not (_V1.usable() or _V2.root()):
            raise Unavailable("no block throttle: neither cgroup v1 blkio "
                              f"({V1_ROOT}) nor cgroup v2 with the io controller")
        os.makedirs(self.workdir, exist_ok=True)
        self.image = os.path.join(self.workdir, "slowstore.img")
        with open(self.image, "wb") as f:
            f.truncate(self.size)
        self.loop = _run(["losetup", "-f", "--show", self.image])
        # everything initialised now, unthrottled (no lazy init writing
        # inode tables in the background later, throttled, while timed);
        # no blocks reserved for root (the daemons run as root: fill()
        # must leave them nothing)
        _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E",
              "lazy_itable_init=0,lazy_journal_init=0", self.loop])
        self.path = tempfile.mkdtemp(prefix="slowstore-", dir=self.workdir)
        _run(["mount", self.loop, self.path])
        st = os.stat(self.loop)
        self.dev = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        try:
            self.throttle = _V1(self.dev) if _V1.usable() else _V2(self.dev)
        except (OSError, StopIteration) as e:
            raise Unavailable(f"cannot set up the io controller's cgroup: {e!r}") from None
        self.limit()
        return self

    def close(self):
        """Limit off, unmounted, detached, removed; each step tried even if
        an earlier one failed."""
        errors = []
        if self.throttle:
            try:
                self.throttle.close()
            except OSError as e:
                errors.append(f"limit reset: {e}")
            self.throttle = None
        if self.path:
            r = subprocess.run(["umount", self.path], capture_output=True, text=True)
            if r.returncode != 0:
                subprocess.run(["umount", "-l", self.path], capture_output=True)
            try:
                os.rmdir(self.path)
            except OSError:
                pass
            self.path = None
        if self.loop:
            subprocess.run(["losetup", "-d", self.loop], capture_output=True)
            self.loop = None
        if self.image:
            try:
                os.unlink(self.image)
            except OSError:
                pass
            self.image = None
        if errors:
            raise RuntimeError("; ".join(errors))

    # ---- the limit
    def limit(self, write_bps=None, read_bps=None):
        """Set the device's limit (bytes/s, 0: none); None keeps the store's
        own."""
        self.throttle.set(self.write_bps if write_bps is None else write_bps,
                          self.read_bps if read_bps is None else read_bps)

    def down(self):
        """The store nearly stops (~4 KiB/s): writes to it wait."""
        self.limit(DOWN_BPS, DOWN_BPS)

    def up(self):
        self.limit()

    # ---- full
    def fill(self, leave=0):
        """Allocate all free space but `leave` bytes: writes fail with
        ENOSPC. Returns the filler's size."""
        self.filler = os.path.join(self.path, "filler")
        st = os.statvfs(self.path)
        free = st.f_bavail * st.f_frsize - leave
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            # as much as fits: ext4's own reserve and metadata leave a
            # little less than f_bavail; allocation writes no data
            size = max(free, 0)
            while size > 0:
                try:
                    os.posix_fallocate(fd, 0, size)
                    break
                except OSError:
                    size -= 4 * MiB
        finally:
            os.close(fd)
        return size

    def unfill(self):
        if self.filler and os.path.exists(self.filler):
            os.unlink(self.filler)
        self.filler = None

    # ---- the page cache
    def drop_cache(self):
        """Every file's pages written back and dropped: the next reads come
        from the (throttled) device."""
        _run(["sync", "-f", self.path])  # syncfs(2)
        for dirpath, _, files in os.walk(self.path):
            for f in files:
                try:
                    fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

    # ---- how slow
    def slowdown(self, fast_dir, size=32 * MiB):
        """Seconds to write and fsync `size` bytes here, over the same into
        fast_dir (the tier's tmpfs): (factor, store bytes/s, fast bytes/s)."""
        data = os.urandom(size)
        t_slow = _timed_write(os.path.join(self.path, ".speed"), data)
        t_fast = _timed_write(os.path.join(fast_dir, ".speed"), data)
        return t_slow / t_fast, size / t_slow, size / t_fast

    def describe(self):
        return (f"{self.loop} ({self.dev}) ext4 {self.size >> 20} MiB at {self.path}, "
                f"{self.write_bps / MiB:g} MiB/s writes"
                + (f", {self.read_bps / MiB:g} MiB/s reads" if self.read_bps else "")
                + f" by {self.throttle.name}")


def _timed_write(path, data):
    t0 = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        for off in range(0, len(data), 8 * MiB):
            os.write(fd, view[off:off + 8 * MiB])
        os.fsync(fd)
    finally:
        os.close(fd)
    took = time.monotonic() - t0
    os.unlink(path)
    return took
