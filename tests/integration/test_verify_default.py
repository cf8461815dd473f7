#!/usr/bin/env python3
"""Checksums verified by default: with no option given, a flipped byte in a
data file gives EIO on every read path of a mount (the tensor file, a pread
of a slice, a block file, the .npy and .safetensors views; SIGBUS for an
mmap of the tensor file and for the `safetensors` package, which mmaps the
view), and through them ckptfs.load and ckptfs.dcp.Reader fail; a data
file changed on disk after its chunks were verified and served (written in
place, or replaced by a rename) is verified again at the next open, and
its bytes served again once they are right; readers racing a process
that rewrites the data files (checks ahead of the reader, waits for a
chunk being hashed, resets) get EIO or the bytes, and the right bytes
once the files are put right (the ThreadSanitizer build runs this too);
-o verify=0 serves the bytes.

    python3 tests/integration/test_verify_default.py --bin build/bin/ckptfs
"""

import errno
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time

from ckpttest.util import CkptfsTestCase, commit, main, read_all, write_tensor
from ckpttest.pyenv import PACKAGE, require_torch, run_py
from test_integrity import flip
from test_passthrough import chunks_of

MiB = 1 << 20

# One process, in a gloo group of one (as a trainer would run it).
GROUP = r"""
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=0, world_size=1)
"""

# ... which ends without the interpreter's teardown: a gloo thread still
# freeing a finished collective's tensors can abort it ("terminate called
# without an active exception", torch 2.13)
END = r"""
import os
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""

SAVE = GROUP + r"""
import ckptfs, ckptfs.dcp
import torch.distributed.checkpoint as dcp
mnt = sys.argv[1]
g = torch.Generator().manual_seed(7)
sd = {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(1000, generator=g)}
ckptfs.save(sd, mnt, "c")
dcp.save(sd, checkpoint_id="d", storage_writer=ckptfs.dcp.Writer(mnt))
torch.save(sd, sys.argv[2])
""" + END

LOAD = GROUP + r"""
import errno, ckptfs, ckptfs.dcp
import torch.distributed.checkpoint as dcp
mnt, ref = sys.argv[1], torch.load(sys.argv[2])
try:
    got = ckptfs.load(None, mnt, "c")
    print("ckptfs.load:", "same" if torch.equal(got["w"], ref["w"]) else "wrong bytes")
except OSError as e:
    print("ckptfs.load:", errno.errorcode.get(e.errno, e.errno))
tgt = {"w": torch.zeros(512, 1024), "b": torch.zeros(1000)}
try:
    dcp.load(tgt, checkpoint_id="d", storage_reader=ckptfs.dcp.Reader(mnt))
    print("dcp.load:", "same" if torch.equal(tgt["w"], ref["w"]) else "wrong bytes")
except BaseException as e:  # DCP wraps the reader's OSError (in a BaseException)
    print("dcp.load:", "EIO" if "Input/output error" in str(e) or "EIO" in str(e)
          else repr(e)[:300])
""" + END

SAFE_OPEN = r"""
import sys
from safetensors import safe_open
with safe_open(sys.argv[1], framework="pt") as f:
    t = f.get_tensor("w")
print("read", t.shape)
"""

# rows [320, 448) of w, as a Shard (a load at another world size)
LOAD_PART = r"""
import errno, sys, numpy as np, ckptfs
a = np.zeros((128, 1024), np.float32)
try:
    ckptfs.load({sys.argv[3]: ckptfs.Shard(a, (320, 0), (512, 1024))}, sys.argv[1], sys.argv[2])
    print(a.tobytes()[:64].hex())
except OSError as e:
    print(errno.errorcode.get(e.errno, e.errno))
"""

MMAP = r"""
import mmap, sys
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, flags=getattr(mmap, sys.argv[2]), prot=mmap.PROT_READ)
    print(len(m[:]))
"""


def chunks(backing, name, fqn):
    """[(file, file_offset, length)] of fqn's chunks (fqn None: all)."""
    db = sqlite3.connect(f"file:{os.path.join(backing, name, '.metadata')}?mode=ro", uri=True)
    try:
        return db.execute("SELECT file, file_offset, length FROM chunks WHERE ? IS NULL OR "
                          "fqn = ?", (fqn, fqn)).fetchall()
    finally:
        db.close()


class VerifyDefault(CkptfsTestCase):
    def damage(self, name, fqn):
        for f, off, ln in chunks(self.backing, name, fqn):
            flip(self.bk(name, f), off + ln // 2)

    def child(self, py, code, *args):
        """Run code in py: (returncode, stdout + stderr)."""
        env = dict(os.environ, PYTHONPATH=PACKAGE, OMP_NUM_THREADS="1")
        r = subprocess.run([py, "-c", code, *args], capture_output=True, text=True,
                           timeout=300, env=env)
        return r.returncode, r.stdout + r.stderr

    def test_every_read_path_fails_on_a_flipped_byte(self):
        py = require_torch(self)
        self.mount()  # default options
        ref = os.path.join(self.dir, "ref.pt")
        run_py(self, py, SAVE, self.mnt, ref, os.path.join(self.dir, "pg1"))
        self.damage("c", "w")
        self.damage("d", "w")
        w = self.ck("c", "w")
        self.assertErrno(errno.EIO, read_all, w)
        fd = os.open(w, os.O_RDONLY)
        try:  # a slice of the first row: its chunk is damaged elsewhere
            self.assertErrno(errno.EIO, os.pread, fd, 64, 128)
        finally:
            os.close(fd)
        self.assertErrno(errno.EIO, read_all, self.ck("c", ".w[0:2]"))
        self.assertErrno(errno.EIO, read_all, self.ck("c", ".npy", "w.npy"))
        self.assertErrno(errno.EIO, read_all,
                         self.ck("d", ".safetensors", "model.safetensors"))
        # the undamaged tensor reads
        self.assertEqual(len(read_all(self.ck("c", "b"))), 4000)
        # mmap: the page cannot be read in: SIGBUS, never the flipped byte
        # (a shared mapping of a tensor file needs libfuse >= 3.16: ENODEV)
        rc, out = self.child(sys.executable, MMAP, self.ck("d", "w"), "MAP_PRIVATE")
        self.assertEqual(rc, -signal.SIGBUS, out)
        rc, out = self.child(sys.executable, MMAP, self.ck("d", "w"), "MAP_SHARED")
        if "No such device" not in out:
            self.assertEqual(rc, -signal.SIGBUS, out)
        out = run_py(self, py, LOAD, self.mnt, ref, os.path.join(self.dir, "pg2"))
        self.assertIn("ckptfs.load: EIO", out)
        self.assertIn("dcp.load: EIO", out)
        rc, out = self.child(py, "import safetensors")
        if rc != 0:
            self.skipTest("no safetensors package: " + out)
        rc, out = self.child(py, SAFE_OPEN, self.ck("c", ".safetensors", "model.safetensors"))
        self.assertEqual(rc, -signal.SIGBUS, out)
        self.assertIn("c: w: rank 0", self.daemon_log())

    def test_shard_block_file_verified(self):
        """A block file that is one shard of a tensor, whose data file
        holds just that shard (written once), is served straight from the
        data file (FUSE passthrough): verified first, at every open after
        the data file changed, as the tensor file is; and so is the
        package's read of part of that shard from the shard's file
        (ckptfs.blocks with the stored chunks, ckptfs.load of a Shard: a
        load at another world size)."""
        sys.path.insert(0, PACKAGE)
        from ckptfs import blocks
        py = require_torch(self)
        self.mount()
        os.mkdir(self.ck("s"))
        half = [os.urandom(1 * MiB), os.urandom(1 * MiB)]
        for i in range(2):  # rows [256 i, 256 (i + 1)) of w, each its own file
            write_tensor(self.ck("s", f"w{i}"), "float32", [512, 1024], half[i],
                         offsets=[256 * i, 0], sizes=[256, 1024])
            os.setxattr(self.ck("s", f"w{i}"), "user.ckpt.fqn", b"w")
        commit(self.ck("s"))
        name, = [n for n in os.listdir(self.ck("s")) if n.startswith("w")]
        block = [self.ck("s", f".{name}[{256 * i}:{256 * (i + 1)},0:1024]") for i in range(2)]
        self.assertEqual(read_all(block[1]), half[1])
        db = sqlite3.connect(f"file:{self.bk('s', '.metadata')}?mode=ro", uri=True)
        (f1, off1, ln1), = db.execute("SELECT file, file_offset, length FROM chunks "
                                      "WHERE offsets = '[256,0]'").fetchall()
        db.close()
        self.assertEqual((off1, os.path.getsize(self.bk("s", f1))), (0, ln1),
                         "the shard is not its data file's only bytes")
        chunks = chunks_of(blocks, self.bk("s"), name)
        want = half[1][64 * 4096:192 * 4096]               # rows [320, 448)

        def part():
            buf = bytearray(len(want))
            blocks.read_block(self.ck("s", name), 4, (512, 1024), (320, 0), (128, 1024),
                              memoryview(buf), chunks)
            return bytes(buf)

        def load_part():
            return run_py(self, py, LOAD_PART, self.mnt, "s", name).strip()

        self.assertEqual(part(), want)
        self.assertEqual(load_part(), want[:64].hex())
        flip(self.bk("s", f1), ln1 // 2)                 # after a clean read
        self.assertErrno(errno.EIO, read_all, block[1])
        self.assertErrno(errno.EIO, part)
        self.assertEqual(load_part(), "EIO")
        self.assertEqual(read_all(block[0]), half[0])    # the other shard reads
        flip(self.bk("s", f1), ln1 // 2)                 # put right: served again
        self.assertEqual(read_all(block[1]), half[1])
        self.assertEqual(part(), want)
        self.mounts[-1].stop()
        flip(self.bk("s", f1), ln1 // 2)                 # before any read
        self.mount()
        self.assertErrno(errno.EIO, part)
        self.assertErrno(errno.EIO, read_all, block[1])
        self.assertIn("s: w: rank 0", self.daemon_log())

    def save_one(self, name):
        os.mkdir(self.ck(name))
        data = write_tensor(self.ck(name, "w"), "float32", [512, 1024], os.urandom(2 * MiB))
        commit(self.ck(name))
        (f, off, ln), = chunks(self.backing, name, "w")
        return data, self.bk(name, f), off + ln // 2

    def test_data_file_changed_after_a_clean_read(self):
        """Verified, read, then changed on disk: EIO at the next open; put
        right again: served again."""
        self.mount()
        data, path, at = self.save_one("inplace")
        self.assertEqual(read_all(self.ck("inplace", "w")), data)
        flip(path, at)                                   # written in place
        self.assertErrno(errno.EIO, read_all, self.ck("inplace", "w"))
        flip(path, at)                                   # restored
        self.assertEqual(read_all(self.ck("inplace", "w")), data)

        data, path, at = self.save_one("renamed")
        held = os.open(self.ck("renamed", "w"), os.O_RDONLY)  # holds the old file
        self.addCleanup(os.close, held)
        self.assertEqual(os.pread(held, len(data), 0), data)
        tmp = path + ".tmp"
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            dst.write(src.read())
        flip(tmp, at)
        os.rename(tmp, path)                             # a new inode, same name
        self.assertErrno(errno.EIO, read_all, self.ck("renamed", "w"))
        self.assertIn("changed on disk since its chunks were checked", self.daemon_log())

    def test_readers_racing_changes(self):
        self.mount()
        os.mkdir(self.ck("r"))
        want = [write_tensor(self.ck("r", f"t{i}"), "float32", [512, 1024], os.urandom(2 * MiB))
                for i in range(6)]
        commit(self.ck("r"))
        self.mounts[-1].stop()
        self.mount()  # nothing checked yet
        rows = chunks(self.backing, "r", None)
        files = sorted({f for f, _, _ in rows})
        keep = os.path.join(self.dir, "pristine")
        os.mkdir(keep)
        for f in files:
            shutil.copy(self.bk("r", f), os.path.join(keep, f))
        # the changer starts once a read got through (a slow build under
        # load could otherwise see every chunk changed before its first
        # read), then races the readers for 5 s
        first_read, done = threading.Event(), threading.Event()
        seen = {"eio": 0, "read": 0}

        def reader(seed):
            rnd = random.Random(seed)
            while not done.is_set():
                i = rnd.randrange(len(want))
                off = rnd.randrange(len(want[i]))
                try:
                    fd = os.open(self.ck("r", f"t{i}"), os.O_RDONLY)
                    try:
                        got = os.pread(fd, 1 << 20, off)
                    finally:
                        os.close(fd)
                    self.assertEqual(len(got), min(1 << 20, len(want[i]) - off))
                    seen["read"] += 1
                    first_read.set()
                except OSError as e:
                    self.assertEqual(e.errno, errno.EIO)
                    seen["eio"] += 1

        def changer():
            rnd = random.Random(1)
            first_read.wait(60)
            stop = time.monotonic() + 5
            while time.monotonic() < stop:
                f, off, ln = rnd.choice(rows)
                if rnd.random() < 0.5:
                    flip(self.bk("r", f), off + rnd.randrange(ln))
                else:  # a copy of what it holds now, renamed over it
                    shutil.copy(self.bk("r", f), self.bk("r", f + ".tmp"))
                    os.rename(self.bk("r", f + ".tmp"), self.bk("r", f))
                time.sleep(0.01)

        readers = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
        change = threading.Thread(target=changer)
        for t in readers + [change]:
            t.start()
        change.join()
        done.set()
        for t in readers:
            t.join()
        for f in files:  # put right, by a rename
            shutil.copy(os.path.join(keep, f), self.bk("r", f + ".tmp"))
            os.rename(self.bk("r", f + ".tmp"), self.bk("r", f))
        for i, data in enumerate(want):
            self.assertEqual(read_all(self.ck("r", f"t{i}")), data, f"t{i}")
        self.assertGreater(seen["eio"], 0, seen)
        self.assertGreater(seen["read"], 0, seen)
        print(f"\n  racing reads: {seen}", file=sys.stderr)

    def test_verify_0_serves_the_bytes(self):
        self.mount("verify=0")
        data, path, at = self.save_one("n")
        flip(path, at)
        got = read_all(self.ck("n", "w"))
        self.assertEqual(len(got), len(data))
        self.assertNotEqual(got, data)


if __name__ == "__main__":
    main()
