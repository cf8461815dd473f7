#!/usr/bin/env python3
"""What a mount, ckptctl and ckptfs-fsck trust in BACKING_DIR: an attacker
who can write BACKING_DIR (the daemon runs as root, the mount is shared with
-o allow_other) must get refused checkpoints and error messages, never
another file's bytes, uninitialised memory, a hung or crashed daemon, or
memory and descriptors that grow without bound. Also: a backing filesystem
that filled up and was freed again takes the retry without a remount.

    python3 tests/integration/test_trust.py --bin build/bin/ckptfs [Class ...]

Classes:
  SymlinkedMetadata  .metadata replaced by a symlink (to a root-only file, to
                     a root-only SQLite database): never read through the
                     mount, by another user or by root; after a remount the
                     checkpoint is not shown, is reported by ckptctl ls and
                     ckptfs-fsck, and is not deleted; a symlinked NAME is not
                     shown
  Coverage           chunks that leave a gap in a tensor, or overlap (also
                     overlaps whose element count hides a gap): refused at
                     load (never uninitialised or ambiguous bytes), reported
                     by ckptctl ls and ckptfs-fsck, kept by the mount and by
                     ckptctl prune; other checkpoints read back exactly
  RecursiveView      `tensors` replaced by an endless recursive view: the
                     mount comes up, ckptctl and ckptfs-fsck return, all
                     within 30 s, and report it
  HugeNumbers        world_size 200000000, a data file numbered 268435455,
                     a blob length of INT64_MAX: bounded memory (VmHWM), no
                     crash (notably UBSan in the ASan+UBSan build), exact
                     bytes or an error
  ManyCheckpoints    1,100 checkpoints: the daemon's open descriptors stay
                     bounded, and a remount under RLIMIT_NOFILE 64 serves
                     and commits them all
  SpaceFreed         ENOSPC at commit, then space freed (rm -r of an older
                     checkpoint, unlink of staged files): the retry commits
                     in the same mount
Needs root (another uid, tmpfs mounts). Python standard library only.
"""

import errno
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
import unittest

from ckpttest import sanenv, util as cu
from ckpttest.util import (CkptfsTestCase, Mount, commit, read_all, read_log, status, tensor_bytes,
                           write_file, write_tensor)

MiB = 1 << 20
NOBODY = 65534
INT64_MAX = (1 << 63) - 1


# ---- helpers -----------------------------------------------------------------

def tool(name, *args, timeout=120):
    """Run ckptctl or ckptfs-fsck (beside ckptfs); raises TimeoutExpired."""
    exe = os.path.join(os.path.dirname(cu.BIN), name)
    r = subprocess.run([exe] + [str(a) for a in args], capture_output=True, text=True,
                       errors="replace", timeout=timeout)
    bad = cu.sanitizer_report(r.stderr)
    if bad:  # the ASan+UBSan build
        raise AssertionError(f"{name} {args}: sanitizer report: {bad}\n{r.stderr[-6000:]}")
    return r


def fsck(*args, timeout=120):
    return tool("ckptfs-fsck", *args, timeout=timeout)


def ctl(*args, timeout=120):
    return tool("ckptctl", *args, timeout=timeout)


def ls_entries(test, backing, timeout=120):
    """{name: entry} of `ckptctl ls BACKING_DIR --json`."""
    r = ctl("ls", backing, "--json", timeout=timeout)
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        test.fail(f"ckptctl ls --json printed no JSON (exit {r.returncode}): "
                  f"{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return {e["name"]: e for e in doc["checkpoints"]}


def edit_metadata(path, *sql):
    """Change a .metadata by hand, as the attacker does."""
    con = sqlite3.connect(path)
    try:
        for s in sql:
            con.execute(s)
        con.commit()
    finally:
        con.close()


def as_nobody():
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)


def cat_as(path, nobody):
    """(exit status, stdout bytes) of `cat path` as uid 65534 or as root."""
    r = subprocess.run(["cat", path], capture_output=True, timeout=60, cwd="/",
                       preexec_fn=as_nobody if nobody else None)
    return r.returncode, r.stdout


def proc_status(pid, key):
    """A field of /proc/PID/status in KiB (VmHWM, VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {key} for {pid}")


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def run(*argv):
    return subprocess.run(list(argv), capture_output=True, text=True)


class LimitedMount(Mount):
    """A Mount whose daemon runs under `prlimit --nofile=N:N` (prlimit
    execs it: the same pid)."""

    nofile = None

    def argv(self):
        args = super().argv()
        if self.nofile:
            args = ["prlimit", f"--nofile={self.nofile}:{self.nofile}"] + args
        return args


class TrustCase(CkptfsTestCase):

    def setUp(self):
        if os.geteuid() != 0:
            self.skipTest("needs root (the daemon as root, another uid, tmpfs)")
        super().setUp()

    def daemon_pid(self, m):
        return m.proc.pid if m.proc is not None else m.daemon_pid

    def stage(self, name, tensors=(), blobs=()):
        """Stage and commit NAME: tensors (path, dtype, shape, seed), blobs
        (path, bytes). Returns {path: bytes}."""
        os.mkdir(self.ck(name))
        out = {}
        for path, dtype, shape, seed in tensors:
            out[path] = write_tensor(self.ck(name, path), dtype, shape,
                                     tensor_bytes(dtype, shape, seed))
        for path, data in blobs:
            write_file(self.ck(name, path), data)
            out[path] = data
        commit(self.ck(name))
        st = status(self.ck(name))
        self.assertEqual(st.split("\n")[0], "committed", st)
        return out

    def assertReadsBack(self, name, files, mnt=None):
        for path, data in files.items():
            got = read_all(self.ck(name, path, mnt=mnt))
            self.assertTrue(got == data, f"{name}/{path}: not the bytes written "
                                         f"({len(got)} bytes, {len(data)} expected)")

    def assertNotShown(self, name, why):
        with self.assertRaises(OSError, msg=f"{why}: MOUNT/{name} is shown "
                               f"(listing: {sorted(os.listdir(self.mnt))})") as cm:
            os.stat(self.ck(name))
        self.assertEqual(cm.exception.errno, errno.ENOENT,
                         f"{why}: stat MOUNT/{name}: {cm.exception!r}")
        self.assertNotIn(name, os.listdir(self.mnt), f"{why}: listed")

    def assertReported(self, name, why, backing=None, timeout=120, reason=None,
                       fsck_words=None):
        """ckptctl ls lists NAME as not committed (with an error matching
        the regex reason, if given), and ckptfs-fsck NAME exits non-zero
        (its output matching fsck_words, if given); each within timeout."""
        backing = backing or self.backing
        with self.subTest(name=name, check="ckptctl ls"):
            try:
                entries = ls_entries(self, backing, timeout=timeout)
            except subprocess.TimeoutExpired:
                entries = None
            if entries is None:
                self.fail(f"{why}: ckptctl ls must return within {timeout} s")
            self.assertIn(name, entries, f"{why}: ckptctl ls must still list it")
            e = entries[name]
            self.assertNotEqual(e["state"], "committed",
                                f"{why}: ckptctl ls must not call it committed: {e}")
            if reason:
                self.assertRegex(str(e.get("error") or ""), reason,
                                 f"{why}: ckptctl ls must say why: {e}")
        with self.subTest(name=name, check="ckptfs-fsck"):
            try:
                r = fsck(backing, name, timeout=timeout)
            except subprocess.TimeoutExpired:
                r = None
            if r is None:
                self.fail(f"{why}: ckptfs-fsck must return within {timeout} s")
            self.assertNotEqual(r.returncode, 0, f"{why}: ckptfs-fsck must exit non-zero:\n"
                                                 f"{r.stdout}{r.stderr}")
            if fsck_words:
                self.assertRegex(r.stdout + r.stderr, fsck_words,
                                 f"{why}: ckptfs-fsck must name the problem")

    def assertAlive(self, m, why):
        self.assertIsNone(m.proc.poll() if m.proc else None,
                          f"{why}: the daemon exited:\n{read_log(self.log)[-4000:]}")
        self.assertTrue(m.mounted(), f"{why}: the mount is gone")


# ---- 1. symlinked .metadata -----------------------------------------------------

class SymlinkedMetadata(TrustCase):
    """BACKING_DIR/NAME/.metadata replaced by a symlink to a root-only file
    outside BACKING_DIR: the daemon (root) must never open it for a reader
    of MOUNT/NAME/.metadata, nor load a checkpoint through it."""

    def test_symlinked_metadata_never_followed(self):
        os.chmod(self.dir, 0o755)  # others may walk to the mountpoint
        m = self.mount("allow_other")
        good = self.stage("good", [("w", "float32", [64, 16], 1)], [("cfg", b"config")])
        self.stage("plain", [("w", "float32", [256], 2)])
        self.stage("db", [("w", "float32", [256], 3)])
        outside = os.path.join(self.dir, "outside")
        os.makedirs(outside)
        os.chmod(outside, 0o755)
        token = b"TOPSECRET-" + os.urandom(12).hex().encode()
        # a root-only secret, and a root-only SQLite database that is a valid
        # checkpoint .metadata with the secret in one more table
        secret = os.path.join(outside, "secret")
        write_file(secret, token + b"\n")
        os.chmod(secret, 0o600)
        secret_db = os.path.join(outside, "secret.db")
        shutil.copyfile(self.bk("db", ".metadata"), secret_db)
        edit_metadata(secret_db, "create table secret(v blob)",
                      f"insert into secret values (x'{token.hex()}')")
        os.chmod(secret_db, 0o600)
        rc, out = cat_as(secret, nobody=True)
        self.assertNotEqual(rc, 0, "the premise: uid 65534 cannot read the secret")
        os.unlink(self.bk("plain", ".metadata"))
        os.symlink(secret, self.bk("plain", ".metadata"))
        os.unlink(self.bk("db", ".metadata"))
        os.symlink(secret_db, self.bk("db", ".metadata"))
        # a symlinked NAME: a copy of a committed checkpoint elsewhere
        shutil.copytree(self.bk("good"), os.path.join(outside, "ck"))
        os.symlink(os.path.join(outside, "ck"), self.bk("linked"))

        for name in ("plain", "db"):
            for nobody in (True, False):
                who = "uid 65534" if nobody else "root"
                with self.subTest(mount="running", name=name, who=who):
                    rc, out = cat_as(self.ck(name, ".metadata"), nobody)
                    self.assertFalse(token in out,
                                     f"reading MOUNT/{name}/.metadata as {who} must never "
                                     f"return the file the symlink points to (got {len(out)} "
                                     f"bytes, the secret among them; exit {rc})")
        self.assertAlive(m, "symlinked .metadata")
        self.assertReadsBack("good", good)

        self.assertEqual(m.stop(), 0)
        m = self.mount("allow_other")
        for name in ("plain", "db"):
            with self.subTest(remount=True, name=name):
                self.assertNotShown(name, "a checkpoint whose .metadata is a symlink must "
                                          "not be shown after a remount")
            for nobody in (True, False):
                with self.subTest(remount=True, name=name, nobody=nobody):
                    rc, out = cat_as(self.ck(name, ".metadata"), nobody)
                    self.assertFalse(token in out, f"MOUNT/{name}/.metadata after a remount "
                                                   "returned the symlink target's bytes "
                                                   f"({len(out)} bytes, the secret among them)")
            self.assertReported(name, f"{name}: a symlinked .metadata",
                                reason=re.compile(r"(?i)link|loop|regular file|refus"))
            with self.subTest(kept=True, name=name):
                self.assertTrue(os.path.islink(self.bk(name, ".metadata")),
                                f"BACKING_DIR/{name} must not be deleted or changed")
        with self.subTest(linked_name=True):
            self.assertNotShown("linked", "a symlinked checkpoint directory must not be shown")
            self.assertTrue(os.path.islink(self.bk("linked")))
        self.assertEqual(sorted(os.listdir(self.mnt)), ["good"])
        self.assertReadsBack("good", good)
        self.assertAlive(m, "after the remount")
        for f in (secret, secret_db):
            self.assertIn(token, read_all(f), "the secret files are left as they were")


# ---- 2./3. chunks that do not tile the tensor ------------------------------------

class Coverage(TrustCase):
    """Every element of a tensor must be covered by exactly one chunk;
    a .metadata that says otherwise is refused at load: a gap would serve
    bytes nobody stored, an overlap two different answers."""

    def check_refused(self, names, what, fsck_words=None):
        good = self.good
        m = self.mount()
        for name in names:
            with self.subTest(name=name, check="mount"):
                self.assertNotShown(name, f"{what} ({name}) must be refused by the mount")
            with self.subTest(name=name, check="w"):
                try:
                    got = read_all(self.ck(name, "w"))
                except OSError:
                    pass
                else:
                    self.fail(f"{what} ({name}): MOUNT/{name}/w must not be readable; it read "
                              f"{len(got)} bytes (from byte 4096: {got[4096:4096 + 16].hex()}"
                              f"...)")
            for view in ((".npy", "w.npy"), (".safetensors", "model.safetensors")):
                with self.subTest(name=name, check=view[0]):
                    with self.assertRaises(OSError, msg=f"{what} ({name}): MOUNT/{name}/"
                                           f"{'/'.join(view)} must not be readable"):
                        read_all(self.ck(name, *view))
            with self.subTest(name=name, check="kept by the mount"):
                self.assertTrue(os.path.isfile(self.bk(name, ".metadata")),
                                f"{what} ({name}): the mount must not delete it")
        self.assertReadsBack("good", good)
        self.assertAlive(m, what)
        self.assertEqual(m.stop(), 0)
        for name in names:
            self.assertReported(name, f"{what} ({name})", fsck_words=fsck_words)
        r = ctl("prune", self.backing, "--keep", "1")
        for name in names:
            with self.subTest(name=name, check="prune"):
                self.assertTrue(os.path.isfile(self.bk(name, ".metadata")),
                                f"{what} ({name}): ckptctl prune --keep 1 must not remove "
                                f"a refused checkpoint (it is not a committed one):\n"
                                f"{r.stdout}{r.stderr}")
        self.assertTrue(os.path.isdir(self.bk("good")), r.stdout + r.stderr)

    def setup_checkpoints(self, *names):
        """Commit each of names (float32 [1024] tensors w and v, one chunk
        each) and then good; the names get created_at 2001 (the oldest, for
        ckptctl prune) before the caller edits them further."""
        m = self.mount()
        for n in names:
            self.stage(n, [("w", "float32", [1024], 7), ("v", "float32", [1024], 8)])
        self.good = self.stage("good", [("w", "float32", [64, 16], 1)], [("cfg", b"config")])
        self.assertEqual(m.stop(), 0)
        for n in names:
            edit_metadata(self.bk(n, ".metadata"), "update checkpoint set value="
                          "'2001-01-01T00:00:00Z' where key='created_at'")

    def test_gap_is_refused(self):
        self.setup_checkpoints("gap")
        # one chunk of 1024 elements; the tensor now claims 4096
        edit_metadata(self.bk("gap", ".metadata"),
                      "update tensors set shape='[4096]' where fqn='w'")
        self.check_refused(["gap"], "the gap must be refused (w [4096] covered by one chunk "
                           "of 1024 elements)", re.compile(r"(?i)gap|cover"))

    def test_overlap_is_refused(self):
        self.setup_checkpoints("dup", "overlap")
        md = self.bk("dup", ".metadata")
        # the same chunk row twice: w's elements covered twice (identical bytes,
        # correct checksum)
        edit_metadata(md, "insert into chunks select * from chunks where fqn='w'")
        # w [1536] from two stored chunks with different bytes: w's own [0,1024)
        # and v's bytes as [512,1536): [512,1024) covered twice
        md = self.bk("overlap", ".metadata")
        edit_metadata(md, "update tensors set shape='[1536]' where fqn='w'",
                      "update chunks set fqn='w', offsets='[512]' where fqn='v'",
                      "delete from tensors where fqn='v'")
        self.check_refused(["dup", "overlap"], "overlapping chunks must be refused",
                           re.compile(r"(?i)overlap|twice|cover"))

    def test_overlap_hiding_a_gap_is_refused(self):
        self.setup_checkpoints("hidden")
        # w [2048] from [0,1024) and [512,1536): 2048 elements stored, as many
        # as the shape has, but [512,1024) twice and [1536,2048) never
        md = self.bk("hidden", ".metadata")
        edit_metadata(md, "update tensors set shape='[2048]' where fqn='w'",
                      "update chunks set fqn='w', offsets='[512]' where fqn='v'",
                      "delete from tensors where fqn='v'")
        self.check_refused(["hidden"], "chunks whose element count equals the shape's but "
                           "that overlap and leave a gap must be refused",
                           re.compile(r"(?i)gap|overlap|cover"))


# ---- 4. a recursive view -------------------------------------------------------

class RecursiveView(TrustCase):
    """`tensors` renamed away and replaced by an endless recursive view with
    the same columns: loading must stop (a bound on rows or SQLite steps, or
    refusing views), within 30 s."""

    def test_endless_view_is_refused_in_time(self):
        m = self.mount()
        good = self.stage("good", [("w", "float32", [64, 16], 1)], [("cfg", b"config")])
        self.stage("endless", [("w", "float32", [256], 2)])
        self.assertEqual(m.stop(), 0)
        edit_metadata(self.bk("endless", ".metadata"),
                      "alter table tensors rename to tensors_real",
                      "create view tensors as with recursive r(x) as "
                      "(select 1 union all select x + 1 from r) "
                      "select 'w' || x as fqn, 'w' || x as path, 'float32' as dtype, "
                      "'[1]' as shape from r")
        # the tools first (each must return within 30 s), then the mount
        self.assertReported("endless", "an endless view", timeout=30)
        m = self.mount(start=False)
        t0 = time.monotonic()
        self.start_within(m, 30)
        took = time.monotonic() - t0
        print(f"\n  mount with an endless view came up in {took:.1f} s", file=sys.stderr)
        self.assertNotShown("endless", "a .metadata whose tensors is an endless view "
                                       "must be refused")
        self.assertReadsBack("good", good)
        self.assertTrue(os.path.isfile(self.bk("endless", ".metadata")),
                        "the mount must not delete it")
        self.assertAlive(m, "an endless view")

    def start_within(self, m, secs):
        """Start m; fail (and kill it) unless it is mounted within secs."""
        os.makedirs(m.mnt, exist_ok=True)
        with open(m.log, "ab") as logf:
            m.proc = subprocess.Popen(m.argv(), stdin=subprocess.DEVNULL, stdout=logf,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      env=sanenv.env(m.env))
        deadline = time.monotonic() + secs
        while time.monotonic() < deadline:
            if m.mounted():
                return
            if m.proc.poll() is not None:
                self.fail(f"ckptfs exited with {m.proc.returncode} before mounting:\n"
                          f"{read_log(m.log)[-4000:]}")
            time.sleep(0.05)
        cpu = ""
        try:
            with open(f"/proc/{m.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu = f" (it used {(int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK'):.1f} s of CPU)"
        except (OSError, IndexError, ValueError):
            pass
        m.proc.kill()
        m.proc.wait()
        m.proc = None
        self.fail(f"a .metadata whose tensors is an endless view: the mount must come up "
                  f"within {secs} s and serve the other checkpoints; it did not{cpu}")


# ---- 5./6. huge numbers in .metadata -------------------------------------------

class HugeNumbers(TrustCase):

    def read_everything(self, name, files):
        """Each file of NAME reads back exactly or fails with an error;
        returns how many read back."""
        ok = 0
        for path, data in files.items():
            try:
                got = read_all(self.ck(name, path))
            except OSError:
                continue
            self.assertTrue(got == data, f"{name}/{path}: wrong bytes ({len(got)} bytes)")
            ok += 1
        for view in (("", ".metadata"), (".npy", "w.npy"), (".safetensors", "model.safetensors")):
            try:
                read_all(self.ck(name, *[v for v in view if v]))
            except OSError:
                pass
        return ok

    def test_huge_world_size_and_file_index_bounded_memory(self):
        m = self.mount("io_threads=1")
        good = self.stage("good", [("w", "float32", [64, 16], 1)], [("cfg", b"config")])
        files = {
            "world": self.stage("world", [("w", "float32", [256], 2)], [("cfg", b"world cfg")]),
            "index": self.stage("index", [("w", "float32", [256], 3)], [("cfg", b"index cfg")]),
        }
        self.assertEqual(m.stop(), 0)
        big = "__0_268435455.distcp"
        edits = {
            "world": ("world_size 200000000", lambda: edit_metadata(
                self.bk("world", ".metadata"),
                "update checkpoint set value='200000000' where key='world_size'")),
            "index": (f"data file {big}", lambda: (
                os.rename(self.bk("index", "__0_0.distcp"), self.bk("index", big)),
                edit_metadata(self.bk("index", ".metadata"),
                              f"update chunks set file='{big}' where file='__0_0.distcp'",
                              f"update blobs set file='{big}' where file='__0_0.distcp'"))),
        }
        self.assertEqual(os.listdir(self.bk("index")).count("__0_0.distcp"), 1)
        shutil.copyfile(self.bk("world", ".metadata"), self.dir + "/world.metadata")
        # one at a time, then both: each remount's peak memory
        for step in ("world", "index", "both"):
            names = ["world", "index"] if step == "both" else [step]
            what = " and ".join(edits[n][0] for n in names)
            if step == "index":  # world as committed again
                shutil.copyfile(self.dir + "/world.metadata", self.bk("world", ".metadata"))
            edits["world" if step == "both" else step][1]()
            m = self.mount()
            pid = self.daemon_pid(m)
            shown = {}
            for name in names:
                if os.path.exists(self.ck(name)):
                    shown[name] = self.read_everything(name, files[name])
                self.assertAlive(m, what)
            self.assertReadsBack("good", good)
            hwm = proc_status(pid, "VmHWM")
            print(f"\n  {what}: daemon VmHWM {hwm / 1024:.1f} MiB; shown: {shown}",
                  file=sys.stderr)
            with self.subTest(step=step, check="VmHWM"):
                self.assertLess(hwm, 256 * 1024,
                                f"{what}: the daemon's peak memory must stay under 256 MiB, "
                                f"it reached {hwm // 1024} MiB")
            for name in names:
                if name in shown:
                    with self.subTest(step=step, name=name):
                        self.assertEqual(shown[name], len(files[name]),
                                         f"{name} is shown: every file must read back exactly")
                else:
                    self.assertReported(name, f"{edits[name][0]}: not shown")
            self.assertAlive(m, what)
            self.assertEqual(m.stop(), 0)

    def test_int64_max_blob_length_no_crash(self):
        m = self.mount()
        good = self.stage("good", [("w", "float32", [64, 16], 1)], [("cfg", b"config")])
        files = self.stage("long", [("w", "float32", [256], 2)],
                           [("train/state.json", b'{"step": 100}')])
        self.assertEqual(m.stop(), 0)
        edit_metadata(self.bk("long", ".metadata"),
                      f"update blobs set length={INT64_MAX}")
        m = self.mount()
        shown = os.path.exists(self.ck("long"))
        if shown:
            p = self.ck("long", "train", "state.json")
            try:
                st = os.stat(p)
            except OSError as e:
                st = e
            self.assertAlive(m, f"stat of a blob of length INT64_MAX ({st!r})")
            if not isinstance(st, OSError):
                self.assertGreaterEqual(st.st_blocks, 0,
                                        f"stat of a blob of length INT64_MAX: st_blocks "
                                        f"{st.st_blocks} (st_size {st.st_size}): a signed "
                                        f"overflow")
            with self.assertRaises(OSError, msg="a blob of length INT64_MAX is shown: its "
                                   "reads must fail (EIO)") as cm:
                with open(p, "rb") as f:
                    f.read(4096)
            self.assertEqual(cm.exception.errno, errno.EIO, repr(cm.exception))
            self.assertAlive(m, "a read of a blob of length INT64_MAX")
            self.assertEqual(read_all(self.ck("long", "w")), files["w"])
            for d, _, fs in os.walk(self.ck("long")):
                for f in fs:
                    try:
                        os.stat(os.path.join(d, f))
                    except OSError:
                        pass
        else:
            self.assertReported("long", "a blob of length INT64_MAX, not shown")
        self.assertReadsBack("good", good)
        self.assertAlive(m, "a blob of length INT64_MAX")
        r = fsck(self.backing, "long")
        self.assertNotEqual(r.returncode, 0, "a blob of length INT64_MAX: ckptfs-fsck must "
                                             f"exit non-zero:\n{r.stdout}{r.stderr}")
        r = ctl("ls", self.backing)  # must not crash either (sizes summed)
        self.assertIn("long", r.stdout + r.stderr)
        self.assertEqual(m.stop(), 0, "the daemon must exit 0 at unmount")


# ---- 7. many checkpoints --------------------------------------------------------

N_MANY = 1100
FD_BOUND = 64           # RLIMIT_NOFILE of the second mount
FD_CACHE_BOUND = 256 + 64  # the store's fd cache (CKPT_FDCACHE_MAX) + the rest


class ManyCheckpoints(TrustCase):
    """A daemon must not hold descriptors per committed checkpoint: 1,100
    of them are served with few descriptors, also under RLIMIT_NOFILE 64."""

    def tiny(self, i):
        return (i * 2654435761 % (1 << 64)).to_bytes(8, "little") + i.to_bytes(8, "little")

    def check_all(self, why):
        for i in range(N_MANY):
            got = read_all(self.ck(f"c{i:04d}", "t"))
            if got != self.tiny(i):
                self.fail(f"{why}: c{i:04d}/t reads {got.hex()}, not {self.tiny(i).hex()}")

    def test_fds_bounded_and_serves_under_rlimit_64(self):
        m = self.mount("sync_files=0,io_threads=1")
        pid = self.daemon_pid(m)
        t0 = time.monotonic()
        for i in range(N_MANY):
            ck = self.ck(f"c{i:04d}")
            os.mkdir(ck)
            write_tensor(os.path.join(ck, "t"), "int64", [2], self.tiny(i))
            commit(ck)
        took = time.monotonic() - t0
        fds_committed = open_fds(pid)
        self.check_all("after 1,100 commits")
        fds_read = open_fds(pid)
        print(f"\n  {N_MANY} commits in {took:.1f} s; daemon fds after them {fds_committed}, "
              f"after reading each once {fds_read}", file=sys.stderr)
        with self.subTest(check="fds"):
            self.assertLess(fds_read, FD_CACHE_BOUND,
                            f"open descriptors must not grow with the committed checkpoints: "
                            f"{fds_read} after reading {N_MANY} once "
                            f"({fds_committed} after the commits)")
        self.assertEqual(m.stop(), 0)

        m = LimitedMount(self.backing, self.mnt, self.log, opts="sync_files=0,io_threads=1")
        m.nofile = FD_BOUND
        self.mounts.append(m)
        t0 = time.monotonic()
        m.start()
        took = time.monotonic() - t0
        pid = self.daemon_pid(m)
        with open(f"/proc/{pid}/limits") as f:
            self.assertRegex(f.read(), rf"Max open files\s+{FD_BOUND}\s+{FD_BOUND}")
        listed = os.listdir(self.mnt)
        print(f"  remount under RLIMIT_NOFILE {FD_BOUND}: {took:.1f} s, {len(listed)} listed",
              file=sys.stderr)
        with self.subTest(check="ls under the rlimit"):
            self.assertEqual(len(listed), N_MANY,
                             f"under RLIMIT_NOFILE {FD_BOUND}, ls MOUNT must list all {N_MANY} "
                             f"checkpoints, it lists {len(listed)}")
        with self.subTest(check="reads under the rlimit"):
            try:
                self.check_all(f"under RLIMIT_NOFILE {FD_BOUND}")
            except OSError as e:
                err = repr(e)
            else:
                err = None
            if err:
                self.fail(f"under RLIMIT_NOFILE {FD_BOUND}, every checkpoint must read back: "
                          f"{err}")
        with self.subTest(check="commit under the rlimit"):
            os.mkdir(self.ck("new"))
            write_tensor(self.ck("new", "t"), "int64", [2], self.tiny(N_MANY))
            try:
                commit(self.ck("new"))
            except OSError as e:
                err = f"{e!r}: {status(self.ck('new'))}"
            else:
                err = None
            if err:
                self.fail(f"under RLIMIT_NOFILE {FD_BOUND} a new commit must succeed: {err}")
            self.assertEqual(read_all(self.ck("new", "t")), self.tiny(N_MANY))
        self.assertAlive(m, "RLIMIT_NOFILE")


# ---- 8. space freed, retry without remount -------------------------------------

class SpaceFreed(TrustCase):

    def test_retry_commits_after_space_freed(self):
        self.backing = os.path.join(self.dir, "backing")
        os.makedirs(self.backing)
        r = run("mount", "-t", "tmpfs", "-o", "size=48m", "ckptfs-trust", self.backing)
        if r.returncode:
            self.skipTest(f"cannot mount a tmpfs: {r.stderr.strip()}")
        self.addCleanup(run, "umount", "-l", self.backing)  # after the ckptfs mounts
        m = self.mount()
        first = self.stage("first", blobs=[("blob", os.urandom(8 * MiB))])
        os.mkdir(self.ck("second"))
        data = {}
        for k in range(4):
            data[f"t{k}"] = write_tensor(self.ck("second", f"t{k}"), "uint8", [16 * MiB],
                                         os.urandom(16 * MiB))
        with self.assertRaises(OSError, msg="72 MiB cannot fit in 48 MiB") as cm:
            commit(self.ck("second"))
        self.assertEqual(cm.exception.errno, errno.EIO)
        st = status(self.ck("second"))
        self.assertEqual(st.split("\n")[0], "failed", st)
        self.assertIn(os.strerror(errno.ENOSPC), st)
        self.assertNothingPublished("second")
        self.assertReadsBack("first", first)
        # space is freed: an older checkpoint and half of the staged files go
        shutil.rmtree(self.ck("first"))
        os.unlink(self.ck("second", "t1"))
        os.unlink(self.ck("second", "t3"))
        del data["t1"], data["t3"]
        try:
            commit(self.ck("second"))
        except OSError as e:
            err = f"{e!r}: {status(self.ck('second'))}\n{run('df', '-h', self.backing).stdout}"
        else:
            err = None
        if err:
            self.fail(f"after space was freed the retry must commit in the same mount: {err}")
        self.assertEqual(status(self.ck("second")).split("\n")[0], "committed")
        self.assertEqual(sorted(os.listdir(self.ck("second"))), [".metadata", "t0", "t2"])
        self.assertReadsBack("second", data)
        self.assertEqual(m.stop(), 0)
        m = self.mount()
        self.assertReadsBack("second", data)
        self.assertEqual(m.stop(), 0)
        r = fsck(self.backing)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)


if __name__ == "__main__":
    cu.main()
