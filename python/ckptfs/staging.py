"""ckptfs.staging - writing a checkpoint's files into a ckptfs mount: the
staged directories held open (StagingDirs: a file is created relative to
its directory, with its user.ckpt.* xattrs in one setxattr), the writes on
a few threads (Stager), IO_STEP bytes per write call. ckptfs.save and
ckptfs.dcp's Writer and import stage through it."""

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from .blocks import IO_STEP
from .errors import CkptfsIOError

META_XATTR = "user.ckpt.meta"  # several user.ckpt.* xattrs in one setxattr
METAS_XATTR = "user.ckpt.metas"  # several files' user.ckpt.meta in one setxattr
MKDIRS_XATTR = "user.ckpt.mkdirs"  # mkdir -p of several directories in one setxattr


def umask():
    """This process's umask, read without changing it (Linux >= 4.7)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def meta_value(xattrs):
    """xattrs [(user.ckpt.KEY, bytes)] as one user.ckpt.meta value:
    b"KEY=VALUE;...", fqn last (its value runs to the end)."""
    fields = sorted(xattrs, key=lambda kv: kv[0] == "user.ckpt.fqn")
    return b";".join(k[len("user.ckpt."):].encode() + b"=" + bytes(v) for k, v in fields)


def dims_csv(xs):
    """A shape, offsets or sizes as an xattr value: b"4,8"."""
    return ",".join(str(int(v)) for v in xs).encode()


def write_fd(fd, mv, path):
    """Write all of memoryview mv to fd, IO_STEP bytes per call."""
    pos = 0
    while pos < len(mv):
        try:
            pos += os.write(fd, mv[pos:pos + IO_STEP])
        except OSError as e:
            raise CkptfsIOError(e.errno, f"writing {path}: {e.strerror}") from e


class StagingDirs:
    """The directories of a checkpoint being staged, held open (O_PATH) by
    path relative to it, so that a file is created relative to its
    directory: the kernel caches no staged entry, so a full path costs
    one FUSE LOOKUP per component, a name under a held directory one.
    write_file() makes its file's directory (mkdir -p) on the thread it
    runs on, so that a model's hundreds of directories are made by the
    staging threads side by side, not one after another by the thread that
    plans the writes (at 2 ranks on 2 CPUs that chain of MKDIRs took 14%
    of a GPT save). A directory is made once: a thread that needs one
    another thread is making waits for it. At most HELD directories stay
    open (the least recently used ones that no thread is using are
    closed: a model has thousands). close() at the end.

    batch=True: the files' user.ckpt.* xattrs are kept until the end and
    set together, in as few setxattrs of user.ckpt.metas on the checkpoint
    directory as 64 KiB values allow, instead of one SETXATTR per file (a
    round trip of ~80 us on a 2-CPU VM, 400 in a GPT save). Leaving a
    `with` block without an exception sends them (flush_meta()); files
    staged since are described when their batch is sent, before any
    commit."""

    _FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
    HELD = 64

    BATCH_BYTES = 60000  # a user.ckpt.metas value: under the kernel's 64 KiB

    def __init__(self, ckdir, batch=False):
        self.ckdir = ckdir
        self.pending = [] if batch else None  # [(rel, [(xattr, value)])]
        self.made = set()  # rel_dirs make_all made: opened, not made, on first use
        self.lock = threading.Lock()
        self.fds = {"": os.open(ckdir, self._FLAGS)}  # least recently used first
        self.holds = {}   # rel_dir: threads using its descriptor now
        self.making = {}  # rel_dir: Event set once the thread making it is done
        self.closed = False
        self.meta = True  # the mount takes user.ckpt.meta (until it says ENOTSUP)

    def make(self, rel_dir):
        """mkdir -p of rel_dir (relative to the checkpoint), now."""
        self._acquire(rel_dir)
        self._release(rel_dir)

    def _acquire(self, rel_dir):
        """rel_dir's descriptor (the directory made if missing), held until
        _release(rel_dir)."""
        while True:
            with self.lock:
                fd = self.fds.pop(rel_dir, None)
                if fd is not None:
                    self.fds[rel_dir] = fd  # the most recent now
                    self.holds[rel_dir] = self.holds.get(rel_dir, 0) + 1
                    return fd
                if not rel_dir or self.closed:
                    raise ValueError(f"StagingDirs of {self.ckdir} used after close()")
                made = self.making.get(rel_dir)
                if made is None:
                    made = self.making[rel_dir] = threading.Event()
                    break
            made.wait()  # then take it (or, if making it failed, try it here)
        try:
            parent, base = os.path.split(rel_dir)
            if not base:  # "/": an absolute path's top
                raise ValueError(f"{rel_dir!r}: not a relative path of directories")
            pfd = self._acquire(parent)
            try:
                if rel_dir not in self.made:
                    try:
                        os.mkdir(base, dir_fd=pfd)
                    except FileExistsError:
                        pass
                fd = os.open(base, self._FLAGS, dir_fd=pfd)
            finally:
                self._release(parent)
            with self.lock:
                if self.closed:  # close() came meanwhile: nothing is kept
                    os.close(fd)
                    raise ValueError(f"StagingDirs of {self.ckdir} used after close()")
                self.fds[rel_dir] = fd
                self.holds[rel_dir] = self.holds.get(rel_dir, 0) + 1
            return fd
        finally:
            with self.lock:
                del self.making[rel_dir]
            made.set()

    def _release(self, rel_dir):
        with self.lock:
            self.holds[rel_dir] -= 1
            if not self.holds[rel_dir]:
                del self.holds[rel_dir]
            idle = [d for d in self.fds if d and d not in self.holds]
            for d in idle[:max(0, len(self.fds) - self.HELD)]:
                os.close(self.fds.pop(d))

    def write_file(self, rel, buf, xattrs=(), flags=os.O_TRUNC):
        """Create rel (its directory made if missing), set xattrs on the
        open file, write buf, close: LOOKUP, CREATE, one SETXATTR, WRITEs
        (then RELEASE, which close does not wait for; a mount that passes
        the writes through asks no FLUSH)."""
        d, base = os.path.split(rel)
        dfd = self._acquire(d)
        try:
            fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | flags, 0o644,
                         dir_fd=dfd)
        finally:
            self._release(d)
        try:
            if self.pending is not None:
                if xattrs:
                    with self.lock:
                        self.pending.append((rel, list(xattrs)))
            else:
                self._set_xattrs(fd, xattrs)
            mv = memoryview(buf)
            if mv.format != "B" or mv.ndim != 1:
                mv = mv.cast("B")
            write_fd(fd, mv, os.path.join(self.ckdir, rel))
            return len(mv)
        finally:
            os.close(fd)

    def _set_xattrs(self, fd, xattrs):
        """xattrs [(user.ckpt.KEY, bytes)] set on fd (or a path) in one
        user.ckpt.meta ("KEY=VALUE;...", fqn last: its value runs to the
        end), else (a mount older than it) one by one."""
        if len(xattrs) > 1 and self.meta:
            try:
                os.setxattr(fd, META_XATTR, meta_value(xattrs))
                return
            except OSError as e:
                if e.errno != errno.ENOTSUP:
                    raise
                self.meta = False
        for k, v in xattrs:
            os.setxattr(fd, k, v)

    def make_all(self, rel_dirs):
        """mkdir -p of every directory in rel_dirs at once, in
        user.ckpt.mkdirs values on the checkpoint directory: a directory
        then costs one LOOKUP when a file needs it, not a LOOKUP, a MKDIR
        and a LOOKUP (~200 us on a 2-CPU VM, 258 in a GPT save). Where the
        mount refuses a value, its directories are made one by one as
        their files need them."""
        want = sorted({d for d in rel_dirs if d})
        head = b"%o\0" % (0o777 & ~umask())
        for i, j, value in self._batches([os.fsencode(d) + b"\0" for d in want], head):
            try:
                os.setxattr(self.ckdir, MKDIRS_XATTR, value)
            except OSError:
                return  # made as files need them: the errors show there
            with self.lock:
                for d in want[i:j]:
                    while d and d not in self.made:
                        self.made.add(d)
                        d = os.path.dirname(d)

    def _batches(self, records, head=b""):
        """(i, j, head + records[i:j]) for runs of records whose values
        stay within BATCH_BYTES (one record at least)."""
        i = 0
        while i < len(records):
            value, j = head, i
            while j < len(records) and (j == i or len(value) + len(records[j])
                                        <= self.BATCH_BYTES):
                value += records[j]
                j += 1
            yield i, j, value
            i = j

    def flush_meta(self):
        """Set the xattrs of the files written so far (batch=True), in
        user.ckpt.metas values of records PATH NUL META NUL; where the
        mount refuses one, each of its files by its own setxattr, which
        names the file at fault."""
        if self.pending is None:
            return
        with self.lock:
            pending, self.pending = self.pending, []
        records = [os.fsencode(rel) + b"\0" + meta_value(xattrs) + b"\0"
                   for rel, xattrs in pending]
        for i, j, value in self._batches(records):
            try:
                if not self.meta:  # a mount older than user.ckpt.meta
                    raise OSError(errno.ENOTSUP, "user.ckpt.meta unknown")
                os.setxattr(self.ckdir, METAS_XATTR, value)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.E2BIG, errno.ERANGE,
                                   errno.EACCES, errno.EPERM):
                    raise CkptfsIOError(e.errno, f"describing the files of {self.ckdir}: "
                                                 f"{e.strerror}") from e
                for rel, xattrs in pending[i:j]:
                    path = os.path.join(self.ckdir, rel)
                    try:
                        self._set_xattrs(path, xattrs)
                    except OSError as e:
                        raise CkptfsIOError(e.errno, f"setting the xattrs of {path} "
                                                     f"({meta_value(xattrs)!r}): "
                                                     f"{e.strerror}") from e

    def close(self):
        with self.lock:
            self.closed = True
            for fd in self.fds.values():
                os.close(fd)
            self.fds = {}

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        try:
            if exc_type is None:
                self.flush_meta()
        finally:
            self.close()


def local_ranks():
    """Ranks of this job on this node, from the launcher's environment
    (torchrun, Open MPI, MPICH/Hydra); 1 where none says."""
    for var in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        try:
            n = int(os.environ.get(var, ""))
        except ValueError:
            continue
        if n >= 1:
            return n
    return 1


def default_threads():
    """Files staged at once when the caller does not say: 4, but no more
    than this rank's share of the CPUs it may run on (the node's ranks
    share them), at least 1. Staging threads past that only take turns on
    the CPUs, and every FUSE request of each one costs the daemon a
    wakeup: on 2 CPUs with 2 ranks, 4 threads a rank made a DCP save of
    400 tensors ~9% slower than 1 (docs/benchmark.md)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus // local_ranks()))


def check_threads(threads):
    """threads as given (an int >= 1), or default_threads() for None."""
    if threads is None:
        return default_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads={threads!r}: threads must be an int >= 1, or None for the default")
    return threads


class Stager:
    """Runs staging writes on `threads` threads (write(2) releases the GIL,
    and the daemon serves each file on its own thread and stream: one
    writer leaves the mount's daemon waiting between requests). At most
    2 x threads writes are queued or running: submit waits for room, so
    that buffers made for them (copies of GPU or strided tensors) are not
    all held at once. The first error is raised by done(), after every
    started write has ended."""

    def __init__(self, threads=None):
        threads = check_threads(threads)
        self.pool = ThreadPoolExecutor(threads) if threads > 1 else None
        self.room = threading.BoundedSemaphore(2 * threads)
        self.futures = []
        self.failed = None  # the first error of a write, once one failed

    def _run(self, fn, args):
        try:
            return fn(*args)
        except BaseException as e:  # noqa: B036 (kept, and re-raised)
            if self.failed is None:
                self.failed = e
            raise
        finally:
            self.room.release()

    def submit(self, fn, *args):
        """Run fn(*args) on a staging thread; raises the first failed
        write's error instead once one failed (staging stops early)."""
        if self.pool is None:
            return fn(*args)
        self.room.acquire()
        if self.failed is not None:
            self.room.release()
            raise self.failed
        try:
            self.futures.append(self.pool.submit(self._run, fn, args))
        except BaseException:
            self.room.release()
            raise
        return None

    def done(self):
        """Wait for every submitted write; raise the first error."""
        if self.pool is None:
            return
        try:
            for f in self.futures:
                f.exception()  # waits
            if self.failed is not None:
                raise self.failed
        finally:
            self.pool.shutdown()

    def abandon(self):
        """After an error in the caller: wait for what was started."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


