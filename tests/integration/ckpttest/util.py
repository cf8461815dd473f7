"""One-rank mounts for the ckptfs tests: real FUSE mounts of a world of one
rank, driven with plain file calls; the test case every test of a mount
derives from (CkptfsTestCase), with its world fixture (start_world: a
world.World of N rank mounts); main(), the entry point of every test file.
Python standard library only.

    python3 tests/integration/test_x.py --bin build/bin/ckptfs [unittest args]

Every daemon's stderr goes to a log file in the test's temporary directory,
its environment is sanenv.env()'s; a test fails when the log shows a
sanitizer report (the ASan+UBSan and TSan builds). Mounts are always
unmounted in cleanup, lazily as a last resort.
"""

import argparse
import errno
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest

from . import REPO, sanenv

BIN = None  # absolute path of the ckptfs binary, set by main()
# the checkout's mount scripts
CKPT_MOUNT = os.path.join(REPO, "mount-scripts", "ckpt-mount")
CKPT_UMOUNT = os.path.join(REPO, "mount-scripts", "ckpt-umount")

SANITIZER_MARKS = ("ERROR: AddressSanitizer", "runtime error:", "LeakSanitizer",
                   "ERROR: ThreadSanitizer", "WARNING: ThreadSanitizer")

# dtype -> (struct code, itemsize); bfloat16 is the upper half of a float32,
# complex64 two float32 (real, imag), complex128 two float64.
DTYPES = {
    "bool": ("?", 1), "uint8": ("B", 1), "int8": ("b", 1), "int16": ("h", 2),
    "int32": ("i", 4), "int64": ("q", 8), "float16": ("e", 2),
    "bfloat16": ("f", 2), "float32": ("f", 4), "float64": ("d", 8),
    "complex64": ("f", 8), "complex128": ("d", 16),
}


# ---- mounts ----------------------------------------------------------------

def _unescape(field):
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")


def mountinfo_dev(path, pid="self"):
    """MAJOR:MINOR of the mount at path (the FUSE connection's superblock)
    in the mount namespace of pid, or None. Never stats path itself: a
    mount whose daemon stopped answering would hang the test."""
    path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            fields = line.split()
            if _unescape(fields[4]) == path:
                return fields[2]
    return None


def mountinfo_has(path):
    """Is path a mount point? Never stats path itself."""
    return mountinfo_dev(path) is not None


def foreign_copies(dev, source):
    """The copies of superblock dev (MAJOR:MINOR, alive while its daemon
    is; a FUSE mount of source, its BACKING_DIR) in mount namespaces other
    than ours: {ns: (pid, [mount points])},
    one process of each namespace (one whose root is its namespace's /,
    so that its mountinfo shows every mount). A namespace made while the
    mount was there (unshare -m of a test running beside, a service's
    PrivateTmp) holds a copy of it; its private (or, under a private /,
    slave) copy does not go with our unmount and keeps the connection
    alive: the daemon never learns of the unmount."""
    mine = os.readlink("/proc/self/ns/mnt")
    source = os.path.realpath(source)
    def ours(line):
        fields = line.split()
        tail = line.split(" - ", 1)[1].split()
        return (fields[2] == dev and tail[0].startswith("fuse")
                and _unescape(tail[1]) == source)
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            ns = os.readlink(f"/proc/{p}/ns/mnt")
            if ns == mine or ns in out or os.readlink(f"/proc/{p}/root") != "/":
                continue
            with open(f"/proc/{p}/mountinfo") as f:
                pts = [_unescape(line.split()[4]) for line in f if ours(line)]
        except OSError:  # gone, or a kernel thread
            continue
        if pts:
            out[ns] = (int(p), pts)
    return out


def cmdline(pid, limit=160):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:limit]
    except OSError:
        return "?"


def release_copies(dev, source, mnt):
    """Unmount (lazily) the copies of our mount dev in other mount
    namespaces (foreign_copies), so that the daemon sees its unmount. Says
    on stderr what it did; the copies it found (what diagnose reports)."""
    copies = foreign_copies(dev, source)
    notes = []
    for ns, (pid, pts) in copies.items():
        for mp in sorted(pts, key=len, reverse=True):
            try:
                r = subprocess.run(["nsenter", "-t", str(pid), "-m", "--", "umount", "-l", mp],
                                   capture_output=True, text=True, timeout=30)
                how = "ok" if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")
            except (OSError, subprocess.SubprocessError) as e:
                how = str(e)
            notes.append(f"a copy at {mp} in {ns} (pid {pid}: {cmdline(pid)}); "
                         f"umount -l there: {how}")
    for n in notes:
        print(f"\n  [ckpttest] {mnt} (dev {dev}) unmounted here, the daemon still "
              f"serving {n}", file=sys.stderr)
    return notes


def abort_connection(dev):
    """Abort FUSE connection dev (MAJOR:MINOR) through fusectl (mounted
    first if it is not: systemd does at boot): the daemon's reads get
    ENODEV, as on an unmount; whoever still has the mount gets ENOTCONN.
    What happened, in words."""
    major, minor = (int(x) for x in dev.split(":"))
    conns = "/sys/fs/fuse/connections"
    path = f"{conns}/{(major << 20) | minor}/abort"
    if not os.path.exists(path) and not os.listdir(conns):
        subprocess.run(["mount", "-t", "fusectl", "fusectl", conns], capture_output=True)
    try:
        with open(path, "w") as f:
            f.write("1")
        return f"aborted the connection ({path})"
    except OSError as e:
        return f"cannot abort the connection: {e}"


def holders_of(mnt):
    """Processes with a file, directory, mapping, cwd or root under mnt
    (what keeps it busy): ["PID (cmdline): what", ...]. readlink of /proc
    entries only, nothing under mnt is touched."""
    mnt = os.path.realpath(os.path.dirname(mnt)) + "/" + os.path.basename(mnt)
    under = lambda t: t == mnt or t.startswith(mnt + "/")
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        what = []
        try:
            for link in ("cwd", "root"):
                t = os.readlink(f"/proc/{p}/{link}")
                if under(t):
                    what.append(f"{link} {t}")
            for fd in os.listdir(f"/proc/{p}/fd"):
                t = os.readlink(f"/proc/{p}/fd/{fd}")
                if under(t):
                    what.append(f"fd {fd} {t}")
            with open(f"/proc/{p}/maps") as f:
                what += sorted({"mapped " + line.split(None, 5)[5].strip() for line in f
                                if len(line.split(None, 5)) == 6
                                and under(line.split(None, 5)[5].strip())})
        except OSError:
            continue
        if what:
            out.append(f"{p} ({cmdline(p, 80)}): {', '.join(what[:5])}")
    return out


def threads_of(pid):
    """What the threads of pid are doing: comm, state, wchan and kernel
    stack (root only), threads doing the same thing together."""
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError as e:
        return [f"no /proc/{pid}/task: {e}"]
    groups = {}
    for t in tids:
        d = f"/proc/{pid}/task/{t}"
        def rd(name):
            try:
                with open(f"{d}/{name}") as f:
                    return f.read().strip()
            except OSError as e:
                return f"({e.strerror})"
        st = rd("stat")
        state = st.rsplit(")", 1)[1].split()[0] if ")" in st else "?"
        stack = [line.split("] ", 1)[-1] for line in rd("stack").splitlines()[:8]]
        key = (f"{rd('comm')} state {state} wchan {rd('wchan')}", tuple(stack))
        groups.setdefault(key, []).append(t)
    return [f"{','.join(ts)} {head}" + "".join(f"\n        {line}" for line in stack)
            for (head, stack), ts in groups.items()]


class Mount:
    """One ckptfs daemon (world of one rank) on mnt over backing; env: more
    variables for it (sanenv.env(env) is its environment)."""

    def __init__(self, backing, mnt, log, opts=None, foreground=True, env=None):
        self.backing, self.mnt, self.log = backing, mnt, log
        self.opts = opts
        self.foreground = foreground
        self.env = env
        self.proc = None
        self.returncode = None
        self.daemon_pid = None  # the background daemon (no -f)
        self.dev = None         # MAJOR:MINOR of the mount, once mounted
        self.unmounted = ""     # how the last unmount went (for a report)
        self.copies = []        # copies of it release_copies found

    def argv(self):
        args = [BIN]
        if self.foreground:
            args.append("-f")
        # CKPTFS_TEST_OPTS: options for every mount of a run (say
        # passthrough=0, to run the suite on the daemon's path); a test's
        # own options come after, and win
        opts = ",".join(o for o in (os.environ.get("CKPTFS_TEST_OPTS"), self.opts) if o)
        if opts:
            args += ["-o", opts]
        return args + [self.backing, self.mnt]

    def start(self, timeout=60):
        os.makedirs(self.mnt, exist_ok=True)
        with open(self.log, "ab") as logf:
            logf.write(("=== " + " ".join(self.argv()) + "\n").encode())
            logf.flush()
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL,
                                         stdout=logf, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env=sanenv.env(self.env))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.dev = mountinfo_dev(self.mnt)
            if self.dev:
                if not self.foreground:
                    self.daemon_pid = find_daemon(self.mnt)
                return self
            rc = self.proc.poll()
            if rc is not None and (self.foreground or rc != 0):
                self.returncode = rc
                raise RuntimeError(f"ckptfs exited with {rc} before mounting:\n"
                                   f"{read_log(self.log)}")
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.mnt} not mounted in {timeout}s:\n{read_log(self.log)}")

    def mounted(self):
        return mountinfo_has(self.mnt)

    def unmount(self):
        """fusermount3 -u, retried while busy; lazy unmount as the last
        resort (then says on stderr who kept it busy)."""
        t0, err = time.monotonic(), ""
        for i in range(50):
            if not self.mounted():
                self.unmounted = f"gone after {i} fusermount3 -u"
                return True
            r = subprocess.run(["fusermount3", "-u", self.mnt], capture_output=True)
            if r.returncode == 0:
                self.unmounted = f"fusermount3 -u ok (try {i + 1})"
                return True
            err = r.stderr.decode(errors="replace").strip()
            time.sleep(0.1)
        holders = holders_of(self.mnt)
        subprocess.run(["fusermount3", "-uz", self.mnt], capture_output=True)
        self.unmounted = (f"busy for {time.monotonic() - t0:.1f} s ({err}), "
                          f"detached (fusermount3 -uz)")
        print(f"\n  [ckpttest] {self.mnt} {self.unmounted}; held by:"
              + "".join(f"\n    {h}" for h in holders or ["(no process found)"]),
              file=sys.stderr)
        return False

    def diagnose(self, pid, waited):
        """Say on stderr why daemon pid has not exited: the unmount, where
        the mount still is, its threads, its log's tail."""
        copies = foreign_copies(self.dev, self.backing) if self.dev else {}
        lines = [f"\n  [ckpttest] daemon {pid} on {self.mnt} (dev {self.dev}) still running "
                 f"{waited:.0f} s after the unmount ({self.unmounted}); mounted here: "
                 f"{'yes' if self.mounted() else 'no'}"]
        lines += [f"    released: {n}" for n in self.copies]
        for ns, (p, pts) in copies.items():
            lines.append(f"    still mounted in {ns} at {', '.join(pts)} "
                         f"(pid {p}: {cmdline(p)})")
        lines.append("    threads:")
        lines += ["      " + t for t in threads_of(pid)]
        lines.append("    log tail:")
        lines += ["      " + line for line in read_log(self.log, 3000).splitlines()[-25:]]
        print("\n".join(lines), file=sys.stderr, flush=True)

    def _wait_pid(self, pid, alive, timeout):
        """Wait until alive() is false, at most timeout s. A daemon that
        has not exited 1 s after its mount left our namespace may be
        serving a copy of it in another one: those are unmounted
        (release_copies), and if that was not enough (a copy busy there)
        5 s later, its connection is aborted. When it does not exit,
        diagnose before the caller kills it. Did it exit?"""
        t0 = time.monotonic()
        released = aborted = False
        self.copies = []
        while alive():
            waited = time.monotonic() - t0
            if waited >= timeout:
                self.diagnose(pid, waited)
                return False
            if not released and waited >= 1 and self.dev and not self.mounted():
                released = True
                self.copies = release_copies(self.dev, self.backing, self.mnt)
            if self.copies and not aborted and waited >= 6:
                aborted = True
                how = abort_connection(self.dev)
                self.copies.append(how)
                print(f"  [ckpttest] daemon {pid} still running: {how}", file=sys.stderr)
            time.sleep(0.02 if waited < 1 else 0.1)
        return True

    def wait(self, timeout=120):
        """Wait for the daemon's exit; its exit code, or None if killed
        (after saying why on stderr: diagnose)."""
        if self.proc is None:
            return self.returncode
        if not self.foreground:
            # The launcher exited when the daemon was ready; wait for the
            # daemon itself (not our child: poll /proc).
            self.proc.wait(timeout)
            pid, self.daemon_pid = self.daemon_pid, None
            if pid and not self._wait_pid(pid, lambda: os.path.exists(f"/proc/{pid}"), timeout):
                os.kill(pid, signal.SIGKILL)
            rc, self.proc = self.proc.returncode, None
            self.returncode = rc
            return rc
        if self._wait_pid(self.proc.pid, lambda: self.proc.poll() is None, timeout):
            rc = self.proc.returncode
        else:
            self.proc.kill()
            self.proc.wait()
            rc = None
        self.proc = None
        self.returncode = rc
        return rc

    def stop(self, timeout=120):
        """Unmount and wait for the daemon; return its exit code."""
        if self.proc is None and self.daemon_pid is None:
            if self.mounted():
                self.unmount()
            return self.returncode
        self.unmount()
        return self.wait(timeout)


def find_daemon(mnt):
    """Pid of the ckptfs process whose command line names mnt."""
    want = os.fsencode(mnt)
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"ckptfs" and want in argv:
            return int(p)
    return None


def rss_kib(pid):
    """Resident set size of process pid, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def read_log(path, limit=20000):
    try:
        with open(path, "rb") as f:
            return f.read()[-limit:].decode(errors="replace")
    except OSError:
        return ""


def wait_log(path, text, timeout=15, limit=1 << 24):
    """The log at path once it holds text (the daemons' stderr reaches a
    world's log through mpirun, a moment after the line was written), or
    as it is after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        log = read_log(path, limit)
        if text in log or time.monotonic() > deadline:
            return log
        time.sleep(0.05)


def wait_until(pred, timeout, what, interval=0.05):
    """Poll pred() until it returns something true, and return that: for
    a test that waits for a daemon to do something. TimeoutError naming
    what when it has not after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(interval)


def require_tools(test, *tools):
    """Fail test when one of tools is not on PATH."""
    for tool in tools:
        if not shutil.which(tool):
            test.fail(f"{tool} is missing")


def fuse_requests(metrics):
    """{op: count} of ckptfs_fuse_requests_total in a -o metrics= file."""
    out = {}
    with open(metrics) as f:
        for line in f:
            if line.startswith("ckptfs_fuse_requests_total{"):
                op = line.split('op="', 1)[1].split('"', 1)[0]
                out[op] = int(line.rsplit(" ", 1)[1])
    return out


def sanitizer_report(text):
    """The first sanitizer line in text, or None."""
    for line in text.splitlines():
        if any(m in line for m in SANITIZER_MARKS):
            return line
    return None


class CkptfsTestCase(unittest.TestCase):
    """A temporary directory per test with BACKING and MNT in it; mounts made
    with self.mount() and worlds started with self.start_world() are
    stopped in cleanup and their logs checked."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="ckptfs-it-", dir="/tmp")
        self.backing = os.path.join(self.dir, "backing")
        self.mnt = os.path.join(self.dir, "mnt")
        self.log = os.path.join(self.dir, "daemon.log")
        os.makedirs(self.mnt)
        self.mounts = []
        self.worlds = []      # started by start_world()
        self.extra_logs = []  # more files to check for sanitizer reports
        self.addCleanup(self._cleanup)

    def _cleanup(self):
        for m in self.mounts:
            try:
                m.stop()
            except Exception:  # keep cleaning up
                pass
        with open("/proc/self/mountinfo") as f:
            left = [line.split()[4] for line in f if line.split()[4].startswith(self.dir)]
        for p in left:
            subprocess.run(["fusermount3", "-uz", p], capture_output=True)
        text = read_log(self.log, limit=1 << 24)
        for extra in self.extra_logs:
            text += read_log(extra, limit=1 << 24)
        shutil.rmtree(self.dir, ignore_errors=True)
        bad = sanitizer_report(text)
        if bad:
            at = text.index(bad)
            self.fail(f"sanitizer report in the daemon's output: {bad}\n{text[at:at + 12000]}")

    def mount(self, opts=None, mnt=None, foreground=True, env=None, start=True):
        m = Mount(self.backing, mnt or self.mnt, self.log, opts=opts,
                  foreground=foreground, env=env)
        self.mounts.append(m)
        return m.start() if start else m

    def start_world(self, n, opts="", root=None, log=None, backing=None,
                    stop_timeout=120, **kw):
        """The test's world fixture: a started world.World of n rank mounts
        (mpirun) over backing (self.backing), root/rank<r> each (root:
        DIR/world<k>), its log (DIR/world<k>.log) checked for sanitizer
        reports with the daemon's; stopped in cleanup (before the check).
        kw: World's (transport, leak_check, env_extra, mpirun_args). Fails
        when mpirun or fusermount3 is missing."""
        from .world import World
        require_tools(self, "mpirun", "fusermount3")
        k = len(self.worlds)
        w = World(BIN, n, backing or self.backing,
                  root or os.path.join(self.dir, f"world{k}"),
                  log or os.path.join(self.dir, f"world{k}.log"), opts=opts, **kw)
        self.worlds.append(w)
        if w.log != self.log and w.log not in self.extra_logs:
            self.extra_logs.append(w.log)
        self.addCleanup(w.stop, stop_timeout)
        return w.start()

    def daemon_log(self):
        return read_log(self.log, limit=1 << 24)

    # paths
    def ck(self, name, *parts, mnt=None):
        return os.path.join(mnt or self.mnt, name, *parts)

    def bk(self, *parts):
        return os.path.join(self.backing, *parts)

    def assertErrno(self, err, fn, *args, **kwargs):
        with self.assertRaises(OSError, msg=f"{fn.__name__}{args!r}") as cm:
            fn(*args, **kwargs)
        self.assertEqual(cm.exception.errno, err,
                         f"{fn.__name__}{args!r}: {cm.exception!r}, "
                         f"expected {errno.errorcode[err]}")
        return cm.exception

    def assertNothingPublished(self, name):
        """A failed commit left no metadata and no data files of NAME."""
        d = self.bk(name)
        self.assertFalse(os.path.exists(os.path.join(d, ".metadata")), d)
        if os.path.isdir(d):
            left = [f for f in os.listdir(d) if f.endswith(".distcp") or f.startswith(".metadata")]
            self.assertEqual(left, [], f"left behind in {d}")


# ---- the trainer's side ----------------------------------------------------

def csv(xs):
    return ",".join(str(int(x)) for x in xs)


def xxh3_hex(data):
    """The XXH3-64 of data as .metadata stores a checksum (16 hex digits),
    from libxxhash (a dependency of ckptfs): for tests that write a
    checkpoint's rows themselves."""
    import ctypes
    lib = ctypes.CDLL("libxxhash.so.0")
    lib.XXH3_64bits.restype = ctypes.c_uint64
    lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return "%016x" % lib.XXH3_64bits(bytes(data), len(data))


def set_tensor_xattrs(path, dtype, shape, offsets=None, sizes=None):
    if dtype is not None:
        os.setxattr(path, "user.ckpt.dtype", dtype.encode())
    if shape is not None:
        os.setxattr(path, "user.ckpt.shape",
                    shape if isinstance(shape, bytes) else csv(shape).encode())
    if offsets is not None:
        os.setxattr(path, "user.ckpt.offsets",
                    offsets if isinstance(offsets, bytes) else csv(offsets).encode())
    if sizes is not None:
        os.setxattr(path, "user.ckpt.sizes",
                    sizes if isinstance(sizes, bytes) else csv(sizes).encode())


def write_file(path, data, chunk=None):
    """Write data with os.write (in pieces of chunk bytes); makes parents."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        step = chunk or len(data) or 1
        pos = 0
        while pos < len(data):
            n = os.write(fd, view[pos:pos + step])
            pos += n
    finally:
        os.close(fd)


def write_tensor(path, dtype, shape, data, offsets=None, sizes=None, xattrs_first=False):
    """A tensor chunk: the data and its user.ckpt.* xattrs."""
    if xattrs_first:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
        set_tensor_xattrs(path, dtype, shape, offsets, sizes)
        write_file(path, data)
    else:
        write_file(path, data)
        set_tensor_xattrs(path, dtype, shape, offsets, sizes)
    return data


def commit(ckdir, mode="sync"):
    """One commit write as `echo MODE > NAME/.commit` does it; raises OSError."""
    fd = os.open(os.path.join(ckdir, ".commit"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        data = mode if isinstance(mode, bytes) else (mode + "\n").encode()
        n = os.write(fd, data)
        if n != len(data):
            raise AssertionError(f"short commit write {n} of {len(data)}")
    finally:
        os.close(fd)


def status(ckdir):
    with open(os.path.join(ckdir, ".status")) as f:
        return f.read()


def leftovers(mounts):
    """{rank: {name: state}} of the checkpoints not committed on the rank
    mounts (a list): what a crash left (one abandoned meanwhile is gone)."""
    out = {}
    for r, mnt in enumerate(mounts):
        for name in os.listdir(mnt):
            try:
                st = status(os.path.join(mnt, name)).split("\n")[0]
            except OSError:
                continue
            if st != "committed":
                out.setdefault(r, {})[name] = st
    return out


def state(ckdir):
    return status(ckdir).split("\n", 1)[0].strip()


def wait_state(ckdir, want=("committed", "failed"), timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = status(ckdir)
        if s.split("\n", 1)[0].strip() in want:
            return s
        time.sleep(0.02)
    raise TimeoutError(f"{ckdir}: still {status(ckdir)!r}")


def read_all(path):
    with open(path, "rb") as f:
        return f.read()


def pread(path, length, offset):
    fd = os.open(path, os.O_RDONLY)
    try:
        out = bytearray()
        while len(out) < length:
            b = os.pread(fd, length - len(out), offset + len(out))
            if not b:
                break
            out += b
        return bytes(out)
    finally:
        os.close(fd)


# ---- tensor data -------------------------------------------------------------

def values(n, seed=0):
    """Deterministic values, exactly representable in every float dtype."""
    return [((i * 7 + seed * 13) % 256) * 0.5 - 64 for i in range(n)]


def encode(vals, dtype):
    """Little-endian bytes of vals as dtype."""
    code, size = DTYPES[dtype]
    if dtype == "bool":
        return struct.pack(f"<{len(vals)}?", *[v != 0 for v in vals])
    if dtype.startswith("complex"):
        flat = []
        for v in vals:
            flat += [v, -v / 2]
        return struct.pack(f"<{len(flat)}{code}", *flat)
    if dtype.startswith(("float", "bfloat")):
        raw = struct.pack(f"<{len(vals)}{code}", *vals)
        if dtype == "bfloat16":
            raw = b"".join(raw[i + 2:i + 4] for i in range(0, len(raw), 4))
        return raw
    bits = 8 * size
    lo = 0 if dtype.startswith("uint") else -(1 << (bits - 1))
    ints = [(int(v) - lo) % (1 << bits) + lo for v in vals]
    return struct.pack(f"<{len(ints)}{code}", *ints)


def tensor_bytes(dtype, shape, seed=0):
    return encode(values(math.prod(shape), seed), dtype)


def block_bytes(data, shape, itemsize, offsets, sizes):
    """The bytes of block (offsets, sizes) of a row-major tensor's bytes."""
    import itertools
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    out = bytearray()
    for idx in itertools.product(*[range(o, o + s) for o, s in zip(offsets, sizes)]):
        flat = sum(i * st for i, st in zip(idx, strides))
        out += data[flat * itemsize:(flat + 1) * itemsize]
    return bytes(out)


# ---- entry point --------------------------------------------------------------

def main():
    global BIN
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("CKPTFS_BIN", "build/bin/ckptfs"))
    args, rest = ap.parse_known_args()
    BIN = os.path.abspath(args.bin)
    if not os.access(BIN, os.X_OK):
        sys.exit(f"no ckptfs binary at {BIN}")
    unittest.main(module="__main__", argv=[sys.argv[0]] + rest, verbosity=2)
