#!/usr/bin/env python3
"""Integration tests of ckptctl (build/bin/ckptctl, beside ckptfs) and of
the mount option keep_last: checkpoints committed through real mounts, then
every ckptctl command in its text and its --json form, the JSON checked
against the .metadata (sqlite3) and against what was written.

    python3 tests/integration/test_ckptctl.py --bin build/bin/ckptfs [Class ...]

Classes:
  Commands   one rank: ls, show, diff, export (checked with a safetensors
             reader written here from the format's specification), prune
             (dry run and for real, unfinished saves untouched), wait
             (committed, failed, timed out), usage errors, --help
  KeepLast   one rank: -o keep_last=2 over 4 commits; ckptfs --help
  World2     2 ranks (mpirun): keep_last=2 over 4 commits seen by both
             ranks, show and export of sharded tensors, wait with a
             progress bar on a terminal while a rank is late, and a
             timeout
Python standard library only.
"""

import fcntl
import json
import math
import os
import signal
import pty
import re
import select
import shutil
import sqlite3
import struct
import subprocess
import tempfile
import time
import unittest

from ckpttest import util
from ckpttest.util import (CkptfsTestCase, commit, read_all, tensor_bytes, wait_state, write_file,
                           write_tensor)

ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
            "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
            "complex64": 8, "complex128": 16}
# safetensors dtype names (the format's specification)
ST_DTYPE = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16",
            "int32": "I32", "int64": "I64", "float16": "F16", "bfloat16": "BF16",
            "float32": "F32", "float64": "F64", "complex64": "C64"}
ST_SIZE = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "F16": 2,
           "BF16": 2, "F32": 4, "F64": 8, "C64": 8}
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def ctl_bin():
    return os.path.join(os.path.dirname(util.BIN), "ckptctl")


def ctl(*args, timeout=120):
    r = subprocess.run([ctl_bin()] + [str(a) for a in args], capture_output=True,
                       text=True, timeout=timeout)
    bad = util.sanitizer_report(r.stderr)
    if bad:  # the ASan+UBSan build
        raise AssertionError(f"ckptctl {args}: sanitizer report: {bad}\n{r.stderr[-6000:]}")
    return r


def ctl_json(test, *args, rc=0):
    r = ctl(*args, "--json")
    test.assertEqual(r.returncode, rc, f"ckptctl {args}: {r.stdout}{r.stderr}")
    test.assertEqual(r.stdout.count("\n"), 1, "one JSON document on one line")
    return json.loads(r.stdout)


def query(db, sql, args=()):
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def meta_row(backing, name):
    """What .metadata says of NAME: the checkpoint keys and sums."""
    db = os.path.join(backing, name, ".metadata")
    keys = dict(query(db, "select key, value from checkpoint"))
    return {
        "created_at": keys["created_at"],
        "world_size": int(keys["world_size"]),
        "save_id": keys["save_id"],
        "tensors": query(db, "select count(*) from tensors")[0][0],
        "chunks": query(db, "select count(*) from chunks")[0][0],
        "blobs": query(db, "select count(*) from blobs")[0][0],
        "bytes": (query(db, "select coalesce(sum(length), 0) from chunks")[0][0]
                  + query(db, "select coalesce(sum(length), 0) from blobs")[0][0]),
    }


def read_safetensors(test, path):
    """Parse a safetensors file as the specification describes it: u64 LE
    header size N, N bytes of JSON (padded with spaces), then a byte buffer
    that the tensors' data_offsets cover exactly, without holes. Returns
    ({name: (dtype, shape, bytes)}, metadata)."""
    raw = read_all(path)
    test.assertGreaterEqual(len(raw), 8)
    n = struct.unpack("<Q", raw[:8])[0]
    test.assertLessEqual(8 + n, len(raw))
    test.assertEqual((8 + n) % 8, 0, "the data starts 8-aligned")
    text = raw[8:8 + n].decode("utf-8")
    test.assertEqual(text, text.rstrip(" ") + " " * (len(text) - len(text.rstrip(" "))))
    test.assertTrue(text.startswith("{"), text[:40])
    header = json.loads(text)
    meta = header.pop("__metadata__", None)
    if meta is not None:
        test.assertTrue(all(isinstance(v, str) for v in meta.values()), meta)
    data = raw[8 + n:]
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items())
    pos = 0
    for b, e, k in spans:
        test.assertEqual(b, pos, f"{k}: a hole or an overlap before it")
        pos = e
    test.assertEqual(pos, len(data), "the buffer ends with the last tensor")
    out = {}
    for k, v in header.items():
        b, e = v["data_offsets"]
        test.assertEqual(e - b, math.prod(v["shape"]) * ST_SIZE[v["dtype"]], k)
        out[k] = (v["dtype"], v["shape"], data[b:e])
    return out, meta


class Base(CkptfsTestCase):

    def setUp(self):
        super().setUp()
        if not os.access(ctl_bin(), os.X_OK):
            self.fail(f"no ckptctl at {ctl_bin()}")

    def save(self, name, tensors=(), blobs=(), mode="sync"):
        """Stage and commit NAME: tensors (path, dtype, shape, seed), blobs
        (path, bytes). Returns {path: bytes written}."""
        ck = self.ck(name)
        os.mkdir(ck)
        written = {}
        for path, dtype, shape, seed in tensors:
            written[path] = write_tensor(os.path.join(ck, path), dtype, shape,
                                         tensor_bytes(dtype, shape, seed))
        for path, data in blobs:
            write_file(os.path.join(ck, path), data)
            written[path] = data
        commit(ck, mode)
        return written


class Commands(Base):

    def test_ls_sort(self):
        """ls lists in creation order by default; --sort name orders numbers
        in names by value, --sort size largest first (issue 13)."""
        self.mount()
        order = ["step-8", "step-100", "step-4", "step-10"]
        sizes = {"step-8": 300, "step-100": 100, "step-4": 400, "step-10": 200}
        for name in order:
            self.save(name, blobs=[("b", b"x" * sizes[name])])
            time.sleep(0.01)  # distinct .metadata mtimes within one second
        os.makedirs(self.bk("step-0"))  # an unfinished save: after the committed
        names = lambda *args: [c["name"] for c in ctl_json(self, "ls", *args, self.backing)["checkpoints"]]
        self.assertEqual(names(), order + ["step-0"])
        self.assertEqual(names("--sort", "time"), order + ["step-0"])
        self.assertEqual(names("--sort", "name"), ["step-0", "step-4", "step-8", "step-10", "step-100"])
        self.assertEqual(names("--sort", "size")[:4], ["step-4", "step-8", "step-10", "step-100"])
        text = ctl("ls", self.backing).stdout.splitlines()
        self.assertEqual([line.split()[0] for line in text[1:]], order + ["step-0"])
        r = ctl("ls", "--sort", "age", self.backing)
        self.assertEqual(r.returncode, 2)
        self.assertIn("expected time, name or size", r.stderr)

    def test_ls_shows_saves_being_committed(self):
        """A save being written (.saves/ID, held by its writer's flock) is
        listed as committing with the bytes written so far; an unheld one
        as unfinished (issue 13)."""
        self.mount()
        self.save("done", blobs=[("b", b"x")])
        live, dead = "a" * 32, "b" * 32
        for sid, size in ((live, 5000), (dead, 10)):
            os.makedirs(self.bk(".saves", sid))
            write_file(self.bk(".saves", sid, "__0_0.distcp"), b"y" * size)
        fd = os.open(self.bk(".saves", live), os.O_RDONLY | os.O_DIRECTORY)
        self.addCleanup(os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_SH)
        doc = ctl_json(self, "ls", self.backing)
        got = {c["name"]: (c["state"], c["disk_bytes"], c["held"]) for c in doc["checkpoints"]}
        self.assertEqual(got[f".saves/{live}"], ("committing", 5000, True))
        self.assertEqual(got[f".saves/{dead}"], ("unfinished", 10, False))
        self.assertEqual(got["done"][0], "committed")
        text = ctl("ls", self.backing).stdout
        self.assertRegex(text, rf"\.saves/{live}\s+committing .*a save being written")

    def test_ls_shows_what_local_mounts_stage(self):
        """Checkpoints staged or failed on a mount of this host over
        BACKING_DIR are listed with their state, staged bytes and mount
        (issue 13)."""
        self.mount()
        self.save("done", blobs=[("b", b"x")])
        os.mkdir(self.ck("wip"))
        write_file(self.ck("wip", "a"), b"a" * 1000)
        write_file(self.ck("wip", "b"), b"b" * 24)
        os.mkdir(self.ck("bad"))
        write_tensor(self.ck("bad", "w"), "float32", [8], b"\0" * 16)  # 16 of 32 bytes
        with self.assertRaises(OSError):
            commit(self.ck("bad"))
        doc = ctl_json(self, "ls", self.backing)
        got = {c["name"]: c for c in doc["checkpoints"]}
        self.assertEqual((got["wip"]["state"], got["wip"]["disk_bytes"], got["wip"]["mount"]),
                         ("staging", 1024, self.mnt))
        self.assertEqual(got["bad"]["state"], "failed")
        self.assertIn("expected", got["bad"]["error"])
        self.assertEqual((got["done"]["state"], got["done"]["mount"]), ("committed", None))
        self.assertEqual([c["name"] for c in doc["checkpoints"]].count("done"), 1)
        with open(self.ck("wip", ".status")) as f:
            self.assertEqual(f.read(), "staging\nfiles 2\nbytes 1024\n")

    def test_ls_does_not_hang_on_a_stopped_daemon(self):
        """A mount over BACKING_DIR whose daemon is stopped (SIGSTOP) does
        not answer: ls waits for it a bounded time, says which mount it
        skipped, and lists the rest; once the daemon runs again, its
        staged checkpoint is listed."""
        m = self.mount()
        self.save("done", blobs=[("b", b"x")])
        os.mkdir(self.ck("wip"))
        write_file(self.ck("wip", "a"), b"a" * 100)
        pid = m.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = ctl("ls", "--json", self.backing, timeout=60)
            took = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertLess(took, 20)
        self.assertIn(f"{self.mnt} does not answer", r.stderr)
        names = [c["name"] for c in json.loads(r.stdout)["checkpoints"]]
        self.assertEqual(names, ["done"])
        doc = ctl_json(self, "ls", self.backing)
        got = {c["name"]: c["state"] for c in doc["checkpoints"]}
        self.assertEqual(got, {"done": "committed", "wip": "staging"})

    def test_ls_text_and_json(self):
        self.mount()
        self.save("a", [("model/w", "float32", [4, 3], 1), ("model/b", "int64", [5], 2)],
                  [("extra.json", b'{"step": 1}')])
        self.save("b", [("model/w", "float32", [4, 3], 3)])
        # an interrupted save, one held by a writer (shared flock), a
        # damaged .metadata
        os.makedirs(self.bk("gone"))
        write_file(self.bk("gone", "__0_0.distcp"), b"x" * 100)
        os.makedirs(self.bk("busy"))
        fd = os.open(self.bk("busy"), os.O_RDONLY | os.O_DIRECTORY)
        self.addCleanup(os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.makedirs(self.bk("bad"))
        write_file(self.bk("bad", ".metadata"), b"not a database" * 100)

        doc = ctl_json(self, "ls", self.backing)
        self.assertEqual(doc["backing_dir"], self.backing)
        byname = {c["name"]: c for c in doc["checkpoints"]}
        self.assertEqual(sorted(byname), ["a", "b", "bad", "busy", "gone"])
        self.assertEqual([c["name"] for c in doc["checkpoints"]], sorted(byname))
        keys = {"name", "state", "created_at", "created_at_unix", "save_id", "world_size",
                "tensors", "chunks", "blobs", "bytes", "disk_bytes", "held", "error", "mount",
                "step", "protected", "metrics"}
        for c in doc["checkpoints"]:
            self.assertEqual(set(c), keys, c["name"])
        for name in ("a", "b"):
            c, m = byname[name], meta_row(self.backing, name)
            self.assertEqual(c["state"], "committed")
            self.assertEqual(c["created_at"], m["created_at"])
            self.assertRegex(c["created_at"], ISO)
            self.assertEqual(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(c["created_at_unix"])),
                             m["created_at"])
            for k in ("world_size", "save_id", "tensors", "chunks", "blobs", "bytes"):
                self.assertEqual(c[k], m[k], f"{name}: {k}")
            self.assertIsNone(c["error"])
        self.assertEqual((byname["a"]["tensors"], byname["a"]["blobs"], byname["a"]["bytes"]),
                         (2, 1, 4 * 3 * 4 + 5 * 8 + 11))
        self.assertEqual(byname["gone"]["state"], "unfinished")
        self.assertFalse(byname["gone"]["held"])
        self.assertEqual(byname["gone"]["disk_bytes"], 100)
        self.assertIsNone(byname["gone"]["created_at"])
        self.assertEqual(byname["busy"]["state"], "unfinished")
        self.assertTrue(byname["busy"]["held"])
        self.assertEqual(byname["bad"]["state"], "damaged")
        self.assertTrue(byname["bad"]["error"])

        r = ctl("ls", self.backing)
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = r.stdout.splitlines()
        self.assertEqual(lines[0].split(), ["NAME", "STATE", "CREATED", "WORLD", "TENSORS",
                                            "BLOBS", "BYTES", "STEP"])
        row = {ln.split()[0]: ln for ln in lines[1:]}
        self.assertEqual(row["a"].split()[:7],
                         ["a", "committed", byname["a"]["created_at"], "1", "2", "1", "99"])
        self.assertIn("a save in flight holds it", row["busy"])
        self.assertIn("interrupted save", row["gone"])
        self.assertIn("damaged", row["bad"])

        # A mountpoint given for BACKING_DIR: said so, with the right one.
        r = ctl("ls", self.mnt)
        self.assertEqual(r.returncode, 1)
        self.assertIn(f"{self.mnt} is a ckptfs mount, not a backing directory: give its "
                      f"BACKING_DIR, {os.path.realpath(self.backing)}", r.stderr)

        # No mount needed: the same with every daemon stopped.
        self.mounts[0].stop()
        self.assertEqual(ctl_json(self, "ls", self.backing), doc)

    def test_show_text_and_json(self):
        self.mount()
        self.save("s", [("model/layer0/weight", "bfloat16", [8, 16], 1),
                        ("step", "int64", [], 2), ("empty", "float32", [0, 4], 3)],
                  [("rng", b"\x00\x01" * 50), ("cfg/opt.json", b"{}")])
        doc = ctl_json(self, "show", self.backing, "s")
        m = meta_row(self.backing, "s")
        for k in ("created_at", "world_size", "save_id", "bytes"):
            self.assertEqual(doc[k], m[k], k)
        self.assertEqual(doc["name"], "s")
        db = self.bk("s", ".metadata")
        want_t = {fqn: (path, dtype, json.loads(shape))
                  for fqn, path, dtype, shape in query(db, "select fqn, path, dtype, shape from tensors")}
        self.assertEqual({t["fqn"]: (t["path"], t["dtype"], t["shape"]) for t in doc["tensors"]},
                         want_t)
        for t in doc["tensors"]:
            self.assertEqual(t["chunks"], 1)
            self.assertEqual(t["ranks"], [0])
            self.assertEqual(t["bytes"], math.prod(t["shape"]) * ITEMSIZE[t["dtype"]])
        self.assertEqual({b["fqn"]: (b["path"], b["rank"], b["bytes"]) for b in doc["blobs"]},
                         {"rng": ("rng", 0, 100), "cfg.opt.json": ("cfg/opt.json", 0, 2)})

        r = ctl("show", self.backing, "s")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("world size 1, 3 tensors in 3 chunks, 2 blobs", r.stdout)
        rows = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines() if ln and ln[0] != " "}
        self.assertEqual(rows["model.layer0.weight"], ["model.layer0.weight", "bfloat16", "[8,16]",
                                                       "1", "0", "256"])
        self.assertEqual(rows["step"], ["step", "int64", "[]", "1", "0", "8"])
        self.assertEqual(rows["rng"], ["rng", "0", "100"])

        r = ctl("show", self.backing, "nope")
        self.assertEqual(r.returncode, 1)
        self.assertIn("no checkpoint nope", r.stderr)
        self.assertIn("ckptctl ls", r.stderr)

    def test_diff(self):
        self.mount()
        base = [("w", "float32", [4, 4], 1), ("b", "float32", [4], 2), ("old", "int32", [3], 3),
                ("retyped", "float32", [2, 2], 4)]
        self.save("a", base, [("cfg", b"abc"), ("same", b"xyz")])
        self.save("a2", base, [("cfg", b"abc"), ("same", b"xyz")])
        self.save("b", [("w", "float32", [4, 4], 9), ("b", "float32", [4], 2),
                        ("new", "int8", [7], 5), ("retyped", "float16", [4], 4)],
                  [("cfg", b"abcd"), ("same", b"xyz")])

        r = ctl("diff", self.backing, "a", "a2")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("6 unchanged, 0 added, 0 removed, 0 changed: identical", r.stdout)
        doc = ctl_json(self, "diff", self.backing, "a", "a2")
        self.assertEqual(doc, {"a": "a", "b": "a2", "added": [], "removed": [], "changed": [],
                               "unchanged": 6, "identical": True})

        doc = ctl_json(self, "diff", self.backing, "a", "b", rc=1)
        self.assertFalse(doc["identical"])
        self.assertEqual(doc["added"], [{"kind": "tensor", "fqn": "new"}])
        self.assertEqual(doc["removed"], [{"kind": "tensor", "fqn": "old"}])
        changed = {(c["kind"], c["fqn"]): c["reasons"] for c in doc["changed"]}
        self.assertEqual(changed, {("tensor", "w"): ["data"],
                                   ("tensor", "retyped"): ["dtype", "shape"],
                                   ("blob", "cfg"): ["data"]})
        self.assertEqual(doc["unchanged"], 2)  # tensor b, blob same

        r = ctl("diff", self.backing, "a", "b")
        self.assertEqual(r.returncode, 1)
        out = r.stdout.splitlines()
        self.assertEqual(out[:2], ["--- a", "+++ b"])
        self.assertIn("+ tensor new: int8 [7]", out)
        self.assertIn("- tensor old: int32 [3]", out)
        self.assertIn("~ tensor w: data: 1 of 1 chunks differ", out)
        self.assertIn("~ tensor retyped: dtype float32 -> float16, shape [2,2] -> [4]", out)
        self.assertTrue(any(ln.startswith("~ blob cfg: data: 3 -> 4 bytes") for ln in out), out)
        self.assertEqual(out[-1], "2 unchanged, 1 added, 1 removed, 3 changed")

        r = ctl("diff", self.backing, "a", "missing")
        self.assertEqual(r.returncode, 2)
        self.assertIn("no checkpoint missing", r.stderr)

    def test_export_safetensors(self):
        self.mount()
        tensors = [("model/w", "float32", [6, 5], 1), ("model/emb", "bfloat16", [7, 3], 2),
                   ("step", "int64", [], 3), ("mask", "bool", [9], 4), ("h", "float16", [3, 1, 2], 5),
                   ("ids", "uint8", [13], 6), ("z", "float32", [0, 3], 7),
                   ("c", "complex64", [2], 8), ("cc", "complex128", [2], 9)]
        written = self.save("e", tensors, [("extra.json", b"{}")])
        out = os.path.join(self.dir, "e.safetensors")
        doc = ctl_json(self, "export", self.backing, "e", "--safetensors", out)
        self.assertFalse(os.path.exists(out + ".tmp"))
        got, meta = read_safetensors(self, out)
        self.assertEqual(doc["file"], out)
        self.assertEqual(doc["format"], "safetensors")
        self.assertEqual(doc["bytes"], os.path.getsize(out))
        self.assertEqual(doc["tensors"], len(tensors) - 1)
        self.assertEqual(doc["left_out"], ["cc"])
        self.assertEqual(doc["blobs_left_out"], ["extra.json"])
        self.assertEqual(meta.get("format"), "pt")
        want = {p.replace("/", "."): (ST_DTYPE[d], s, written[p])
                for p, d, s, _ in tensors if d != "complex128"}
        self.assertEqual(sorted(got), sorted(want))
        for fqn, (dt, shape, data) in want.items():
            self.assertEqual(got[fqn][0], dt, fqn)
            self.assertEqual(got[fqn][1], shape, fqn)
            self.assertEqual(got[fqn][2], data, f"{fqn}: bytes differ")
        for path, dtype, _, _ in tensors:  # what the mount shows of them
            if dtype != "complex128":
                self.assertEqual(read_all(self.ck("e", *path.split("/"))),
                                 got[path.replace("/", ".")][2], path)

        r = ctl("export", self.backing, "e", "--safetensors", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f"e: wrote {out}: 8 tensors", r.stdout)
        self.assertIn("every chunk's checksum verified", r.stdout)
        self.assertIn("left out: tensor cc (complex128", r.stdout)
        self.assertIn("left out: 1 blobs, 2 bytes", r.stdout)

    def test_export_damaged_chunk_fails_and_leaves_nothing(self):
        self.mount()
        self.save("d", [("a", "float32", [64], 1), ("b", "float32", [32, 8], 2)])
        db = self.bk("d", ".metadata")
        (f, off, length), = query(db, "select file, file_offset, length from chunks where fqn='b'")
        p = self.bk("d", f)
        with open(p, "r+b") as fh:
            fh.seek(off + length // 2)
            byte = fh.read(1)
            fh.seek(off + length // 2)
            fh.write(bytes([byte[0] ^ 0x40]))
        out = os.path.join(self.dir, "d.safetensors")
        write_file(out, b"an older export")
        r = ctl("export", self.backing, "d", "--safetensors", out)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("tensor b chunk at [0,0]", r.stderr)
        self.assertIn("checksum mismatch", r.stderr)
        self.assertIn(f, r.stderr)
        self.assertIn("removed the partial", r.stderr)
        self.assertFalse(os.path.exists(out + ".tmp"))
        self.assertEqual(read_all(out), b"an older export")
        # a missing data file
        os.unlink(p)
        r = ctl("export", self.backing, "d", "--safetensors", out)
        self.assertEqual(r.returncode, 1)
        self.assertIn("cannot open", r.stderr)
        self.assertFalse(os.path.exists(out + ".tmp"))

    def test_many_data_files_under_a_low_fd_limit(self):
        # 80 data files (io_threads=80; files written out of order are
        # staged in RAM and spread over every file): ckptfs-fsck and export
        # keep each open once, within RLIMIT_NOFILE 48.
        self.mount("io_threads=80")
        ck = self.ck("wide")
        os.mkdir(ck)
        want = {}
        for i in range(160):
            data = tensor_bytes("int32", [16], i)
            p = os.path.join(ck, f"t{i:03d}")
            fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
            os.pwrite(fd, data[32:], 32)
            os.pwrite(fd, data[:32], 0)
            os.close(fd)
            os.setxattr(p, "user.ckpt.dtype", b"int32")
            os.setxattr(p, "user.ckpt.shape", b"16")
            want[f"t{i:03d}"] = data
        commit(ck)
        files = query(self.bk("wide", ".metadata"), "select count(distinct file) from chunks")[0][0]
        self.assertGreater(files, 64)

        def low_limit():
            import resource
            resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

        fsck = os.path.join(os.path.dirname(util.BIN), "ckptfs-fsck")
        for _ in range(2):  # every chunk checked twice: reopened files too
            r = subprocess.run([fsck, self.backing, "wide", "wide"], capture_output=True,
                               text=True, preexec_fn=low_limit)
            self.assertEqual(r.returncode, 0, r.stdout[-3000:])
        out = os.path.join(self.dir, "wide.safetensors")
        r = subprocess.run([ctl_bin(), "export", self.backing, "wide", "--safetensors", out],
                           capture_output=True, text=True, preexec_fn=low_limit)
        self.assertEqual(r.returncode, 0, r.stderr)
        got, _ = read_safetensors(self, out)
        self.assertEqual({k: v[2] for k, v in got.items()}, want)

    def test_prune(self):
        m = self.mount()
        data = {}
        for i in range(1, 5):
            data[f"c{i}"] = self.save(f"c{i}", [("w", "float32", [16], i)])
        os.makedirs(self.bk("held"))
        write_file(self.bk("held", "__0_0.distcp"), b"staged bytes")
        fd = os.open(self.bk("held"), os.O_RDONLY | os.O_DIRECTORY)
        self.addCleanup(os.close, fd)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.makedirs(self.bk("stale"))
        before = sorted(os.listdir(self.backing))

        doc = ctl_json(self, "prune", self.backing, "--keep", "2", "--dry-run")
        self.assertEqual(sorted(os.listdir(self.backing)), before, "a dry run removes nothing")
        self.assertEqual((doc["keep"], doc["dry_run"]), (2, True))
        self.assertEqual([c["name"] for c in doc["removed"]], ["c1", "c2"])
        self.assertEqual([c["name"] for c in doc["kept"]], ["c3", "c4"])
        skipped = {c["name"]: c["reason"] for c in doc["skipped"]}
        self.assertEqual(sorted(skipped), ["held", "stale"])
        self.assertIn("a writer holds it", skipped["held"])
        self.assertEqual(doc["errors"], [])
        for c in doc["removed"] + doc["kept"]:
            self.assertEqual(c["created_at"], meta_row(self.backing, c["name"])["created_at"])

        r = ctl("prune", self.backing, "--keep", "2", "--dry-run")
        self.assertEqual(r.returncode, 0)
        self.assertRegex(r.stdout, r"(?m)^would remove  c1  \d{4}-")
        self.assertRegex(r.stdout, r"(?m)^kept\s+c4  ")
        self.assertRegex(r.stdout, r"(?m)^skipped\s+held: unfinished save, a writer holds it$")

        r = ctl("prune", self.backing, "--keep", "2")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertRegex(r.stdout, r"(?m)^removed\s+c1  ")
        self.assertRegex(r.stdout, r"(?m)^removed\s+c2  ")
        self.assertEqual(sorted(os.listdir(self.backing)),
                         sorted(set(before) - {"c1", "c2"}))
        self.assertEqual(read_all(self.bk("held", "__0_0.distcp")), b"staged bytes")
        self.assertTrue(os.path.isdir(self.bk("stale")))
        # the mount's view follows at once; the kept ones read back
        self.assertEqual(sorted(os.listdir(self.mnt)), ["c3", "c4"])
        for n in ("c3", "c4"):
            self.assertEqual(read_all(self.ck(n, "w")), data[n]["w"])
        self.assertTrue(m.mounted())

        doc = ctl_json(self, "prune", self.backing, "--keep", "1")
        self.assertEqual([c["name"] for c in doc["removed"]], ["c3"])
        self.assertEqual(sorted(os.listdir(self.mnt)), ["c4"])
        fsck = os.path.join(os.path.dirname(util.BIN), "ckptfs-fsck")
        r = subprocess.run([fsck, self.backing, "c4"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout)

    def test_wait_committed(self):
        self.mount()
        ck = self.ck("big")
        os.mkdir(ck)
        write_tensor(os.path.join(ck, "w"), "float32", [8 << 20], b"\x01" * (32 << 20))
        commit(ck, "async")
        r = ctl("wait", ck)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertRegex(r.stdout.splitlines()[-1],
                         r"^big: committed \(tensors 1, blobs 0, world size 1\) after [\d.]+ s$")
        r = ctl("wait", ck + "/")
        self.assertTrue(r.stdout.startswith("big: committed"), r.stdout)
        doc = ctl_json(self, "wait", ck, "--timeout", "5")
        self.assertEqual(doc["state"], "committed")
        self.assertIsNone(doc["reason"])
        self.assertEqual(doc["checkpoint"], ck)

    def test_wait_failed(self):
        self.mount()
        ck = self.ck("broken")
        os.mkdir(ck)
        write_tensor(os.path.join(ck, "w"), "float32", [4, 4], b"\0" * 10)
        commit(ck, "async")
        r = ctl("wait", ck, "--timeout", "60")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        reason = wait_state(ck).split("\n", 1)[1].strip()
        self.assertIn("64 expected", reason)
        self.assertIn(f"broken: the save failed: {reason}", r.stderr)
        self.assertIn("broken: failed after", r.stdout)
        doc = ctl_json(self, "wait", ck, rc=1)
        self.assertEqual((doc["state"], doc["reason"]), ("failed", reason))

    def test_wait_timeout_and_usage(self):
        self.mount()
        ck = self.ck("idle")
        os.mkdir(ck)
        write_file(os.path.join(ck, "x"), b"x")
        t0 = time.monotonic()
        r = ctl("wait", ck, "--timeout", "0.5")
        self.assertEqual(r.returncode, 3, r.stdout + r.stderr)
        self.assertLess(time.monotonic() - t0, 10)
        self.assertIn("idle: staging (waiting for the commit)", r.stdout)
        self.assertIn("still staging after 0.5 s (--timeout)", r.stderr)
        doc = ctl_json(self, "wait", ck, "--timeout", "0.3", rc=3)
        self.assertEqual((doc["state"], doc["last_state"]), ("timeout", "staging"))

        r = ctl("wait", self.ck("nothing"))
        self.assertEqual(r.returncode, 2)
        self.assertIn("cannot read", r.stderr)
        r = ctl("wait", self.backing)
        self.assertEqual(r.returncode, 2)
        self.assertIn("not a checkpoint directory of a ckptfs mount", r.stderr)
        for bad in (["wait"], ["wait", ck, "--timeout", "soon"], ["wait", ck, "--timeout", "0"],
                    ["wait", ck, "extra"]):
            r = ctl(*bad)
            self.assertEqual(r.returncode, 2, bad)
            self.assertIn("usage: ckptctl wait", r.stderr, bad)

    def test_usage_errors_exit_2_with_a_message(self):
        cases = [
            ([], "usage: ckptctl COMMAND"),
            (["frobnicate"], "unknown command 'frobnicate'"),
            (["ls"], "missing arguments"),
            (["ls", "a", "b"], "unexpected argument 'b'"),
            (["ls", "--keep", "3", self.backing], "--keep is not an option of this command"),
            (["ls", "--frob", self.backing], "unknown option '--frob'"),
            (["show", self.backing], "missing arguments"),
            (["diff", self.backing, "a"], "missing arguments"),
            (["export", self.backing, "a"], "--safetensors FILE or --dcp DIR is required"),
            (["export", self.backing, "a", "--safetensors"], "needs a value"),
            (["prune", self.backing], "a rule is required: --keep-last N"),
            (["prune", self.backing, "--keep", "2", "--keep-last", "3"], "give one of them"),
            (["prune", self.backing, "--keep-best", "2"], "needs --metric KEY"),
            (["prune", self.backing, "--keep-last", "2", "--mode", "max"], "go with --keep-best"),
            (["prune", self.backing, "--keep-best", "2", "--metric", "a b"],
             "expected a metric key"),
            (["prune", self.backing, "--keep", "0"], "at least 1"),
            (["prune", self.backing, "--keep", "x"], "expected a number"),
        ]
        for args, msg in cases:
            r = ctl(*args)
            self.assertEqual(r.returncode, 2, f"{args}: {r.stdout}{r.stderr}")
            self.assertIn(msg, r.stderr, args)
        r = ctl("ls", os.path.join(self.dir, "nowhere"))
        self.assertEqual(r.returncode, 1)
        self.assertIn("cannot open BACKING_DIR", r.stderr)
        self.assertIn("No such file or directory", r.stderr)

    def test_help_lists_every_option_with_its_default(self):
        r = ctl("--help")
        self.assertEqual(r.returncode, 0)
        for cmd in ("ls", "show", "diff", "export", "prune", "protect", "unprotect", "wait"):
            self.assertRegex(r.stdout, rf"(?m)^  {cmd} ")
            h = ctl(cmd, "--help")
            self.assertEqual(h.returncode, 0, cmd)
            self.assertTrue(h.stdout.startswith(f"usage: ckptctl {cmd} "), h.stdout)
            opts = re.findall(r"(?m)^  (-[-\w, ]+?)(?:  +| [A-Z]+  +)(.*)$", h.stdout)
            self.assertIn("--json", [o[0].strip() for o in opts], cmd)
            lines = h.stdout.split("options:\n", 1)[1]
            entries = re.split(r"(?m)^  (?=-)", lines)[1:]
            for e in entries:
                if e.startswith("-h, --help"):
                    continue
                self.assertRegex(e, r"\((default: [^)]*|required)\)", f"{cmd}: {e!r}")


class KeepLast(Base):

    def test_keep_last_2_over_4_commits(self):
        self.mount("keep_last=2")
        data = {}
        for i in range(1, 5):
            data[i] = self.save(f"k{i}", [("w", "int32", [10], i)], [("meta", b"%d" % i)])
            want = [f"k{j}" for j in range(max(1, i - 1), i + 1)]
            self.assertEqual(sorted(os.listdir(self.backing)), want, f"after commit {i}")
            self.assertEqual(sorted(os.listdir(self.mnt)), want, f"after commit {i}")
        for i in (3, 4):
            self.assertEqual(read_all(self.ck(f"k{i}", "w")), data[i]["w"])
            self.assertEqual(read_all(self.ck(f"k{i}", "meta")), data[i]["meta"])
        log = self.daemon_log()
        self.assertIn("keep_last=2: removed k1", log)
        self.assertIn("keep_last=2: removed k2", log)

    def test_async_commits_and_a_checkpoint_being_read(self):
        self.mount("keep_last=1")
        self.save("r1", [("w", "float32", [1 << 16], 1)])
        fh = open(self.ck("r1", "w"), "rb")
        self.addCleanup(fh.close)
        head = fh.read(4096)
        self.save("r2", [("w", "float32", [1 << 16], 2)], mode="async")
        wait_state(self.ck("r2"))
        deadline = time.monotonic() + 10
        while os.path.exists(self.bk("r1")) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(os.path.exists(self.bk("r1")), "r1 removed after r2's async commit")
        self.assertEqual(os.listdir(self.mnt), ["r2"])
        # As after rm -r: a file opened before reads on, a new open fails.
        want = tensor_bytes("float32", [1 << 16], 1)
        self.assertEqual(head + fh.read(), want)
        self.assertRaises(OSError, open, self.ck("r1", "w"), "rb")

    def test_option_help_and_errors(self):
        r = subprocess.run([util.BIN, "--help"], capture_output=True, text=True)
        self.assertRegex(r.stdout, r"-o keep_last=N .*\n.*\(default: 0\)")
        r = subprocess.run([util.BIN, "-f", "-o", "keep_last=some", self.backing, self.mnt],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 2)
        self.assertIn("invalid keep_last 'some'", r.stderr)


class World2(unittest.TestCase):
    """A world of 2 rank mounts with keep_last=2 (commit_timeout 60 s)."""

    @classmethod
    def setUpClass(cls):
        from ckpttest.world import World
        if not shutil.which("mpirun"):
            raise RuntimeError("mpirun is missing: cannot start a world")
        cls.dir = tempfile.mkdtemp(prefix="ckptfs-ctl-", dir="/tmp")
        cls.backing = os.path.join(cls.dir, "backing")
        cls.log = os.path.join(cls.dir, "world.log")
        cls.world = World(util.BIN, 2, cls.backing, os.path.join(cls.dir, "mnt"),
                          cls.log, opts="keep_last=2,commit_timeout=60")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        cls.addClassCleanup(cls.world.stop_checked)
        cls.world.start()

    def items(self, seed):
        from ckpttest.world import Blob, Tensor
        return [
            Tensor("model/rows", "float32", [6, 4], {0: ([0, 0], [3, 4]), 1: ([3, 0], [3, 4])}, seed),
            Tensor("model/cols", "int16", [5, 6], {0: ([0, 0], [5, 2]), 1: ([0, 2], [5, 4])}, seed + 1),
            Tensor("bias", "bfloat16", [8], {0: None, 1: None}, seed + 2),
            Blob("rng0", {0: b"rank0 state %d" % seed}),
            Blob("rng1", {1: b"rank1 state %d" % seed}),
        ]

    def commit_both(self, name, mode="sync"):
        from ckpttest.world import commit_all
        res = commit_all(self.world, name, mode)
        for r, (err, _) in res.items():
            self.assertIsNone(err, f"rank {r}: {err}")

    def test_1_keep_last_show_and_export(self):
        from ckpttest.world import stage
        items = {}
        # w4 also holds a column-sharded tensor larger than export's 16 MiB
        # window: its chunks are read window by window, front to back.
        R, C, cut = 5000, 4100, 1333
        big = os.urandom(R * C)
        for i in range(1, 5):
            items[i] = self.items(10 * i)
            stage(self.world, f"w{i}", items[i])
            if i == 4:
                for r, (c0, c1) in enumerate(((0, cut), (cut, C))):
                    p = os.path.join(self.world.mnt(r), "w4", "big")
                    write_file(p, b"".join(big[row * C + c0:row * C + c1] for row in range(R)))
                    for k, v in (("dtype", "uint8"), ("shape", f"{R},{C}"),
                                 ("offsets", f"0,{c0}"), ("sizes", f"{R},{c1 - c0}")):
                        os.setxattr(p, "user.ckpt." + k, v.encode())
            self.commit_both(f"w{i}")
            want = [f"w{j}" for j in range(max(1, i - 1), i + 1)]
            self.assertEqual(sorted(os.listdir(self.backing)), want, f"after commit {i}")
            for r in range(2):
                self.assertEqual(sorted(os.listdir(self.world.mnt(r))), want, f"rank {r}, commit {i}")
        for r in range(2):
            for it in items[4]:
                self.assertEqual(read_all(os.path.join(self.world.mnt(r), "w4", it.path)), it.data)

        doc = ctl_json(self, "show", self.backing, "w4")
        self.assertEqual(doc["world_size"], 2)
        t = {x["fqn"]: x for x in doc["tensors"]}
        self.assertEqual((t["model.rows"]["chunks"], t["model.rows"]["ranks"]), (2, [0, 1]))
        self.assertEqual((t["model.cols"]["chunks"], t["model.cols"]["ranks"]), (2, [0, 1]))
        self.assertEqual(t["bias"]["chunks"], 1)
        self.assertEqual({b["fqn"]: b["rank"] for b in doc["blobs"]}, {"rng0": 0, "rng1": 1})
        r = ctl("show", self.backing, "w4")
        self.assertRegex(r.stdout, r"(?m)^model\.cols\s+int16\s+\[5,6\]\s+2\s+0,1\s+60$")

        out = os.path.join(self.dir, "w4.safetensors")
        ctl_json(self, "export", self.backing, "w4", "--safetensors", out)
        got, _ = read_safetensors(self, out)
        self.assertEqual(got["big"][:2], ("U8", [R, C]))
        self.assertTrue(got["big"][2] == big, "big: bytes differ")
        for it in items[4]:
            if it.kind == "tensor":
                self.assertEqual(got[it.fqn][1], it.shape)
                self.assertEqual(got[it.fqn][2], it.data, it.fqn)
        doc = ctl_json(self, "diff", self.backing, "w3", "w4", rc=1)
        self.assertEqual(sorted(c["fqn"] for c in doc["changed"]),
                         ["bias", "model.cols", "model.rows", "rng0", "rng1"])
        self.assertEqual(doc["added"], [{"kind": "tensor", "fqn": "big"}])

    def test_2_wait_progress_bar_and_timeout(self):
        from ckpttest.world import commit, stage
        stage(self.world, "late", self.items(99))
        ck0 = os.path.join(self.world.mnt(0), "late")
        commit(ck0, "async")  # rank 1 commits later: rank 0 stays committing
        r = ctl("wait", ck0, "--timeout", "1")
        self.assertEqual(r.returncode, 3, r.stdout + r.stderr)
        self.assertIn("still committing after 1 s", r.stderr)

        pid, fd = pty.fork()
        if pid == 0:
            os.execv(ctl_bin(), [ctl_bin(), "wait", ck0, "--timeout", "60"])
        out = b""
        deadline = time.monotonic() + 90
        committed_at = None
        while time.monotonic() < deadline:
            if committed_at is None and b"committing [" in out:
                commit(os.path.join(self.world.mnt(1), "late"), "async")
                committed_at = time.monotonic()
            rl, _, _ = select.select([fd], [], [], 0.1)
            if rl:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
        _, st = os.waitpid(pid, 0)
        os.close(fd)
        text = out.decode(errors="replace")
        self.assertIsNotNone(committed_at, text)
        self.assertEqual(os.waitstatus_to_exitcode(st), 0, text)
        self.assertRegex(text, r"late: committing \[[#.]{30}\] +\d+%")
        self.assertIn("\r", text, "the bar is redrawn in place")
        self.assertRegex(text, r"late: committed \(tensors 3, blobs 2, world size 2\)")

    def test_3_diff_content_of_differently_chunked_tensors(self):
        from ckpttest.world import Tensor, stage
        shards = {0: ([0, 0], [3, 4]), 1: ([3, 0], [3, 4])}
        stage(self.world, "x11", [Tensor("t", "float32", [6, 4], shards, 7),
                                  Tensor("u", "int8", [5], {0: None, 1: None}, 1)])
        self.commit_both("x11")
        stage(self.world, "x12", [Tensor("t", "float32", [6, 4], {0: None, 1: None}, 7),
                                  Tensor("u", "int8", [5], {0: None, 1: None}, 1)])
        self.commit_both("x12")
        doc = ctl_json(self, "diff", self.backing, "x11", "x12", rc=1)
        self.assertEqual(doc["changed"][0]["fqn"], "t")
        self.assertEqual(doc["changed"][0]["reasons"], ["chunks"])
        self.assertIn("contents not compared", doc["changed"][0]["detail"])
        doc = ctl_json(self, "diff", "--content", self.backing, "x11", "x12")
        self.assertEqual((doc["identical"], doc["unchanged"]), (True, 2))

        stage(self.world, "x13", [Tensor("t", "float32", [6, 4], {0: None, 1: None}, 8),
                                  Tensor("u", "int8", [5], {0: None, 1: None}, 1)])
        # keep_last=2 (keep=last:2, by step: 11 to 14 come after the
        # earlier tests' w3, w4 and the step-less "late") removes x11
        self.commit_both("x13")
        self.assertFalse(os.path.exists(os.path.join(self.backing, "x11")))
        r = ctl("diff", "--content", self.backing, "x12", "x13")
        self.assertEqual(r.returncode, 1)
        self.assertIn("~ tensor t: data: 1 of 1 chunks differ", r.stdout)
        stage(self.world, "x14", [Tensor("t", "float32", [6, 4], shards, 8),
                                  Tensor("u", "int8", [5], {0: None, 1: None}, 1)])
        self.commit_both("x14")
        r = ctl("diff", "--content", self.backing, "x13", "x14")
        self.assertEqual(r.returncode, 0, r.stdout)
        self.assertIn("2 unchanged, 0 added, 0 removed, 0 changed: identical", r.stdout)
        r = ctl("diff", "--content", self.backing, "x12", "x14")
        self.assertEqual(r.returncode, 2)  # removed by keep_last
        # a damaged chunk: the comparison fails (exit 2), nothing on stdout
        (f, off), = query(os.path.join(self.backing, "x14", ".metadata"),
                          "select file, file_offset from chunks where fqn='t' and rank=1")
        with open(os.path.join(self.backing, "x14", f), "r+b") as fh:
            fh.seek(off)
            b = fh.read(1)
            fh.seek(off)
            fh.write(bytes([b[0] ^ 1]))
        r = ctl("diff", "--content", "--json", self.backing, "x13", "x14")
        self.assertEqual(r.returncode, 2)
        self.assertEqual(r.stdout, "")
        self.assertIn("checksum mismatch", r.stderr)
        r = ctl("diff", self.backing, "x13", "x14")  # without --content: metadata only
        self.assertEqual(r.returncode, 1)
        self.assertIn("~ tensor t: stored in other chunks (1 -> 2", r.stdout)


if __name__ == "__main__":
    util.main()
