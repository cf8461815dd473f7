#!/usr/bin/env python3
"""The Python client (python/ckptfs, `import ckptfs`): save and load round trips
through a real mount (numpy dtypes, torch dtypes with bfloat16, 0-d, empty
and non-contiguous tensors, nested dicts with int keys, bytes, pickled and
JSON objects), a sharded save from a world of 2 ranks loaded at 1 rank
with other shards (pread of each shard's byte ranges), async saves,
saves that replace a committed name (overwrite=True) and one-rank saves in
a world of two (solo=True), and the errors a user gets.

What the client wrote is checked independently of it: the committed files'
bytes, the xattrs, and .metadata's tensors and chunks tables.

    PYTHONPATH=tests/integration:python \\
        python3 python/tests/test_client.py --bin build/bin/ckptfs

The torch and numpy parts run in an interpreter that has them
(tests/integration/ckpttest/pyenv.py); the standard-library core runs in
this one.
"""

import errno
import json
import os
import pickle
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import unittest

from ckpttest import pyenv, util
from ckpttest.util import CkptfsTestCase, main, read_all, read_log, state
from ckpttest.pyenv import PACKAGE, require_torch, run_py

import ckptfs  # the client under test: python/ on PYTHONPATH


def query(db, sql):
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return [tuple(r) for r in con.execute(sql)]
    finally:
        con.close()


# Saves numpy arrays of every dtype numpy shares with ckptfs, and torch
# tensors of every torch dtype (bfloat16 too), and prints, per file, the
# dtype, shape and hex of the bytes the file must hold.
SAVE_TENSORS = r'''
import json, sys
import numpy as np, torch
import ckptfs
mnt, name, mode = sys.argv[1:4]
g = torch.Generator().manual_seed(5)
sd = {"np": {}, "torch": {}}
exp = {}
for dt in ["bool", "u1", "i1", "<i2", "<i4", "<i8", "<f2", "<f4", "<f8", "<c8", "<c16", ">f4", ">i8"]:
    a = (np.arange(24).reshape(2, 3, 4) * 7 - 50).astype(dt)
    key = "big_" + dt[1:] if dt.startswith(">") else np.dtype(dt).name
    sd["np"][key] = a
    exp["np/" + key] = (np.dtype(dt).newbyteorder("<").name if dt != "bool" else "bool",
                        [2, 3, 4], a.astype(a.dtype.newbyteorder("<")).tobytes().hex())
tdt = {"bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
       "int32": torch.int32, "int64": torch.int64, "float16": torch.float16,
       "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
       "complex64": torch.complex64, "complex128": torch.complex128}
for n, d in tdt.items():
    t = (torch.randn(3, 5, generator=g) * 40).to(d)
    sd["torch"][n] = t
    raw = t.contiguous().view(torch.int16) if d == torch.bfloat16 else t
    exp["torch/" + n] = (n, [3, 5], raw.numpy().tobytes().hex())
w = torch.randn(4, 6, generator=g)
extra = {"scalar": torch.tensor(2.5, dtype=torch.bfloat16), "empty": torch.zeros(0, 3),
         "transposed": w.t(), "param": torch.nn.Parameter(torch.ones(2, 2))}
for k, t in extra.items():
    sd["torch"][k] = t
    c = t.detach().contiguous()
    raw = c.view(torch.int16) if c.dtype == torch.bfloat16 else c
    exp["torch/" + k] = (str(c.dtype)[6:], list(c.shape), raw.numpy().tobytes().hex())
sd["optim"] = {"state": {0: {"exp_avg": torch.ones(3), "step": torch.tensor(4.0)}},
               "param_groups": [{"lr": 0.5, "betas": (0.9, 0.99), "params": [0]}]}
ckptfs.save(sd, mnt, name, mode=mode)
if mode == "async":
    ckptfs.wait(mnt, name)
print(json.dumps(exp))
'''

# Loads the checkpoint SAVE_TENSORS wrote, as a new dict and in place, and
# checks every value against a second run of the same generator.
LOAD_TENSORS = r'''
import sys
import numpy as np, torch
import ckptfs
mnt, name = sys.argv[1:3]
out = ckptfs.load(None, mnt, name)
for dt in ["bool", "u1", "i1", "<i2", "<i4", "<i8", "<f2", "<f4", "<f8", "<c8", "<c16", ">f4", ">i8"]:
    a = (np.arange(24).reshape(2, 3, 4) * 7 - 50).astype(dt)
    key = "big_" + dt[1:] if dt.startswith(">") else np.dtype(dt).name
    b = out["np"][key]
    assert isinstance(b, np.ndarray), (key, type(b))
    assert b.dtype == a.dtype.newbyteorder("<") and b.shape == a.shape, (key, b.dtype, b.shape)
    assert (b == a).all(), key
g = torch.Generator().manual_seed(5)
names = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
         "float32", "float64", "complex64", "complex128"]
for n in names:
    t = (torch.randn(3, 5, generator=g) * 40).to(getattr(torch, n))
    got = out["torch"][n]
    assert torch.is_tensor(got) and got.dtype == t.dtype and got.shape == t.shape, n
    assert torch.equal(got, t), n
w = torch.randn(4, 6, generator=g)
assert torch.equal(out["torch"]["transposed"], w.t())
assert out["torch"]["scalar"].dtype == torch.bfloat16 and out["torch"]["scalar"].shape == ()
assert out["torch"]["scalar"].item() == 2.5
assert out["torch"]["empty"].shape == (0, 3)
assert list(out["optim"]["state"].keys()) == [0], out["optim"]["state"].keys()
assert torch.equal(out["optim"]["state"][0]["exp_avg"], torch.ones(3))
assert out["optim"]["param_groups"] == [{"lr": 0.5, "betas": (0.9, 0.99), "params": [0]}]
# in place: a bfloat16 tensor, a Parameter, a non-contiguous tensor, an array
p = torch.nn.Parameter(torch.zeros(2, 2))
bf = torch.zeros(3, 5, dtype=torch.bfloat16)
nc = torch.zeros(4, 6).t()
arr = np.zeros((2, 3, 4), dtype="<f8")
big = np.zeros((2, 3, 4), dtype=">i8")
spec = {"torch": {"param": p, "bfloat16": bf, "transposed": nc},
        "np": {"float64": arr, "big_i8": big}, "optim": {"param_groups": None}}
ptr = (p.data_ptr(), bf.data_ptr(), arr.ctypes.data)
ckptfs.load(spec, mnt, name)
assert (p.data_ptr(), bf.data_ptr(), arr.ctypes.data) == ptr, "not in place"
assert torch.equal(p.detach(), torch.ones(2, 2)) and p.requires_grad
assert torch.equal(bf, out["torch"]["bfloat16"])
assert torch.equal(nc, w.t())
assert (arr == out["np"]["float64"]).all()
assert big.dtype == np.dtype(">i8") and (big == np.arange(24).reshape(2, 3, 4) * 7 - 50).all(), big
assert spec["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)
print("ok")
'''


# async_save of torch tensors (a transposed view, bfloat16, a Parameter),
# numpy arrays and a Shard, with the writes held back until the tensors
# have changed in place: the checkpoint holds the values at the call.
ASYNC_TENSORS = r"""
import sys, threading
import numpy as np, torch
import ckptfs
mnt = sys.argv[1]
g = torch.Generator().manual_seed(3)
w = torch.randn(6, 4, generator=g)
sd = {"t": w.t(), "bf": torch.randn(5, generator=g).to(torch.bfloat16),
      "p": torch.nn.Parameter(torch.ones(3)), "a": np.arange(12, dtype=np.int32).reshape(3, 4),
      "shard": ckptfs.Shard(torch.arange(8.0), [0], [8]), "step": 7}
want = {k: (v.tensor.clone() if isinstance(v, ckptfs.Shard) else
            v.detach().clone() if torch.is_tensor(v) else v.copy() if isinstance(v, np.ndarray) else v)
        for k, v in sd.items()}
real, gate = ckptfs._client.save, threading.Event()
def held(*a, **kw):
    gate.wait(60)
    return real(*a, **kw)
ckptfs._client.save = held
fut = ckptfs.async_save(sd, mnt, "bgt")
with torch.no_grad():
    w.add_(1); sd["bf"].add_(1); sd["p"].add_(1); sd["shard"].tensor.add_(1)
sd["a"] += 1
gate.set()
fut.result(120)
ckptfs._client.save = real
out = ckptfs.load(None, mnt, "bgt")
assert torch.equal(out["t"], want["t"]) and torch.equal(out["bf"], want["bf"])
assert torch.equal(out["p"], want["p"]) and np.array_equal(out["a"], want["a"])
assert out["step"] == 7
part = torch.zeros(4)
ckptfs.load({"shard": ckptfs.Shard(part, [4], [8])}, mnt, "bgt")
assert torch.equal(part, want["shard"][4:]), part
print("ok")
"""

ASYNC_BUFFERS = r"""
import sys, threading
import numpy as np, torch
import ckptfs
mnt = sys.argv[1]
bufs = ckptfs.StagingBuffers()
sd = {"w": torch.arange(12.0).reshape(3, 4), "m": {"a": np.arange(5, dtype=np.int64)},
      "v": torch.zeros(2, 3).t(), "step": 1}
try:
    ckptfs.async_save(sd, mnt, "bad", buffers={})
    raise SystemExit("a dict was taken for buffers")
except TypeError as e:
    assert "StagingBuffers" in str(e), e
assert not __import__("os").path.exists(mnt + "/bad")
ckptfs.async_save(sd, mnt, "b0", buffers=bufs).result(120)
assert len(bufs) == 3, len(bufs)
kept = dict(bufs._free)
# The next save copies into the same buffers; values are this save's.
with torch.no_grad():
    sd["w"].add_(100)
sd["m"]["a"] *= 7
sd["step"] = 2
ckptfs.async_save(sd, mnt, "b1", buffers=bufs).result(120)
assert all(bufs._free[k] is kept[k] for k in kept), (kept.keys(), bufs._free.keys())
# Held back: while b2 holds them, b3 gets fresh memory; a changed shape too.
real, gate = ckptfs._client.save, threading.Event()
def held(*a, **kw):
    gate.wait(60)
    return real(*a, **kw)
ckptfs._client.save = held
f2 = ckptfs.async_save(sd, mnt, "b2", buffers=bufs)
assert len(bufs) == 0
sd3 = dict(sd, w=torch.ones(5), v=sd["v"] + 1)
f3 = ckptfs.async_save(sd3, mnt, "b3", buffers=bufs)
with torch.no_grad():
    sd["w"].add_(1000)         # after the calls: reaches neither checkpoint
gate.set()
f2.result(120); f3.result(120)
ckptfs._client.save = real
o = {n: ckptfs.load(None, mnt, n) for n in ("b0", "b1", "b2", "b3")}
w0 = torch.arange(12.0).reshape(3, 4)
assert torch.equal(o["b0"]["w"], w0) and o["b0"]["step"] == 1, o["b0"]
assert np.array_equal(o["b0"]["m"]["a"], np.arange(5)), o["b0"]
for n in ("b1", "b2"):
    assert torch.equal(o[n]["w"], w0 + 100), (n, o[n]["w"])
    assert np.array_equal(o[n]["m"]["a"], np.arange(5) * 7) and o[n]["step"] == 2
    assert torch.equal(o[n]["v"], torch.zeros(3, 2)), (n, o[n]["v"])
assert torch.equal(o["b3"]["w"], torch.ones(5)) and torch.equal(o["b3"]["v"], torch.ones(3, 2))
assert np.array_equal(o["b3"]["m"]["a"], np.arange(5) * 7)
assert len(bufs) == 3
# A changed shape while the pool holds the old buffer: fresh memory.
old = dict(bufs._free)
sd4 = {"w": torch.full((2, 2), 9.0), "m": {"a": np.arange(5) * 3}, "v": torch.zeros(3, 2)}
ckptfs.async_save(sd4, mnt, "b4", buffers=bufs).result(120)
o4 = ckptfs.load(None, mnt, "b4")
assert bufs._free[("w",)] is not old[("w",)] and bufs._free[("w",)].shape == (2, 2)
assert bufs._free[("m", "a")] is old[("m", "a")] and bufs._free[("v",)] is old[("v",)]
assert torch.equal(o4["w"], torch.full((2, 2), 9.0)) and np.array_equal(o4["m"]["a"], np.arange(5) * 3)
# A snapshot that fails at the call keeps the buffers it had taken.
class Bad:
    def __reduce__(self):
        raise RuntimeError("no pickling")
try:
    ckptfs.async_save({"w": torch.zeros(2, 2), "z": Bad()}, mnt, "b5", buffers=bufs)
    raise SystemExit("an unpicklable value was taken")
except RuntimeError:
    pass
assert len(bufs) == 3, len(bufs)
bufs.clear()
assert len(bufs) == 0
print("ok")
"""


class Client(CkptfsTestCase):

    def world(self, opts=None):
        """A started world of 2 rank mounts over self.backing (ROOT/rankR),
        its log kept with the test's."""
        return self.start_world(2, opts or "")

    def committed_files(self, name):
        """{relative path: bytes} of every file of committed name, through the mount."""
        out = {}
        top = self.ck(name)
        for root, _, files in os.walk(top):
            for f in files:
                rel = os.path.relpath(os.path.join(root, f), top)
                if rel != ".metadata":
                    out[rel] = read_all(os.path.join(root, f))
        return out

    def test_numpy_and_torch_dtypes(self):
        py = require_torch(self)
        self.mount()
        exp = json.loads(run_py(self, py, SAVE_TENSORS, self.mnt, "t", "sync"))
        self.assertEqual(state(self.ck("t")), "committed")
        db = self.ck("t", ".metadata")
        rows = {r[0]: r[1:] for r in query(db, "select path, dtype, shape from tensors")}
        for rel, (dtype, shape, hexdata) in exp.items():
            with self.subTest(item=rel):
                path = self.ck("t", rel)
                self.assertEqual(read_all(path), bytes.fromhex(hexdata))
                self.assertEqual(os.getxattr(path, "user.ckpt.dtype").decode(), dtype)
                self.assertEqual(os.getxattr(path, "user.ckpt.shape").decode(),
                                 ",".join(map(str, shape)))
                self.assertEqual(rows[rel], (dtype, json.dumps(shape, separators=(",", ":"))))
        # bfloat16 is the upper half of the float32 of the same value
        bf = struct.unpack("<15h", read_all(self.ck("t", "torch/bfloat16")))
        self.assertTrue(any(bf))
        # non-tensor leaves are bytes items, the manifest names their kind
        blobs = {r[0] for r in query(db, "select path from blobs")}
        self.assertEqual(blobs, {"optim/param_groups", "_ckptfs/rank0.json"})
        manifest = json.loads(read_all(self.ck("t", "_ckptfs/rank0.json")))
        self.assertEqual(manifest["items"]["optim/param_groups"]["kind"], "pickle")
        self.assertEqual(manifest["items"]["optim/state/0/exp_avg"]["keys"],
                         [["s", "optim"], ["s", "state"], ["i", 0], ["s", "exp_avg"]])
        self.assertEqual(manifest["items"]["torch/bfloat16"]["kind"], "torch")
        self.assertEqual(manifest["items"]["np/float32"]["kind"], "numpy")
        self.assertEqual(run_py(self, py, LOAD_TENSORS, self.mnt, "t").strip(), "ok")
        # and again after a remount (read from BACKING_DIR, not the staging)
        self.mounts[0].stop()
        self.mount()
        self.assertEqual(run_py(self, py, LOAD_TENSORS, self.mnt, "t").strip(), "ok")

    def test_async_save(self):
        py = require_torch(self)
        self.mount()
        exp = json.loads(run_py(self, py, SAVE_TENSORS, self.mnt, "a", "async"))
        self.assertEqual(state(self.ck("a")), "committed")
        for rel, (_, _, hexdata) in exp.items():
            self.assertEqual(read_all(self.ck("a", rel)), bytes.fromhex(hexdata), rel)
        # the standard-library core: async save, wait, status
        ckptfs.save({"x": b"123"}, self.mnt, "b", mode="async")
        text = ckptfs.wait(self.mnt, "b", timeout=120)
        self.assertEqual(text.split("\n", 1)[0], "committed")
        self.assertEqual(ckptfs.status(self.mnt, "b")[0], "committed")
        self.assertEqual(read_all(self.ck("b", "x")), b"123")

    def test_async_save_in_background(self):
        """async_save copies the state dict before it returns: changes made
        while its writes are held back do not reach the checkpoint."""
        self.mount()
        real_save, gate, started = ckptfs._client.save, threading.Event(), threading.Event()

        def held_save(*a, **kw):
            started.set()
            self.assertTrue(gate.wait(60))
            return real_save(*a, **kw)

        ba, cfg = bytearray(b"abc"), {"lr": 0.1, "layers": [1, 2]}
        ckptfs._client.save = held_save
        try:
            fut = ckptfs.async_save({"ba": ba, "cfg": cfg, "empty": {}}, self.mnt, "bg")
            self.assertTrue(started.wait(60))
            self.assertFalse(fut.done())
            ba[0:1] = b"X"
            cfg["lr"] = 9.0
            cfg["layers"].append(3)
            gate.set()
            self.assertIsNone(fut.result(120))
        finally:
            ckptfs._client.save = real_save
            gate.set()
        self.assertEqual(state(self.ck("bg")), "committed")
        self.assertEqual(ckptfs.load(None, self.mnt, "bg"),
                         {"ba": b"abc", "cfg": {"lr": 0.1, "layers": [1, 2]}, "empty": {}})
        # JSON objects are encoded at the call too; commit="async" completes
        # once frozen, and the checkpoint then commits
        fut = ckptfs.async_save({"cfg": {"sizes": (1, 2)}}, self.mnt, "bgj",
                                objects="json", commit="async")
        self.assertIsNone(fut.result(120))
        ckptfs.wait(self.mnt, "bgj", timeout=120)
        self.assertEqual(ckptfs.load(None, self.mnt, "bgj"), {"cfg": {"sizes": [1, 2]}})
        # errors: bad arguments and keys at the call, the save's own in the future
        with self.assertRaises(ValueError):
            ckptfs.async_save({"x": b""}, self.mnt, "e1", commit="later")
        with self.assertRaises(ValueError):
            ckptfs.async_save({"x": b""}, self.mnt, "e1", threads=0)
        with self.assertRaisesRegex(ckptfs.CkptfsError, "cannot be a file name"):
            ckptfs.async_save({".hidden": b""}, self.mnt, "e1")
        fut = ckptfs.async_save({"x": b"again"}, self.mnt, "bg")
        with self.assertRaisesRegex(ckptfs.CkptfsError, "already committed"):
            fut.result(120)
        self.assertFalse(os.path.exists(self.ck("e1")))

    def test_async_save_tensors(self):
        py = require_torch(self)
        self.mount()
        self.assertEqual(run_py(self, py, ASYNC_TENSORS, self.mnt).strip(), "ok")

    def test_async_save_staging_buffers(self):
        """StagingBuffers: a save copies into the last save's memory, a save
        while those are in use or with a changed shape gets fresh memory,
        and every checkpoint holds the values at its call."""
        py = require_torch(self)
        self.mount()
        self.assertEqual(run_py(self, py, ASYNC_BUFFERS, self.mnt).strip(), "ok")

    def test_numpy_zero_d_keeps_its_shape(self):
        """A numpy 0-d array or scalar is saved with shape (), not (1,)."""
        py = require_torch(self)
        self.mount()
        out = run_py(self, py, r'''
import sys, numpy as np, ckptfs
mnt = sys.argv[1]
ckptfs.save({"s": np.float32(3.5), "z": np.array(7, dtype=np.int64)}, mnt, "zd")
oz = ckptfs.load(None, mnt, "zd")
assert oz["s"].shape == () and oz["s"] == np.float32(3.5), oz
assert oz["z"].shape == () and oz["z"] == 7, oz
print("ok")
''', self.mnt)
        self.assertEqual(out.strip(), "ok")

    def test_lost_race_raises_and_keeps_the_winner(self):
        """Two mounts commit one name at once (ckptfs.commit: sync, then
        async + wait): the loser gets CommitError saying its staged files
        were discarded, and
        the winner's checkpoint stays, on both mounts (the client must not
        discard the committed NAME it now shows)."""
        mnts = [os.path.join(self.dir, f"m{i}") for i in range(2)]
        for mnt in mnts:
            self.mount("sync_files=0", mnt=mnt)
        for mode in ("sync", "async"):
            name = f"race-{mode}"
            start = threading.Barrier(2)
            out = [None, None]

            for w, mnt in enumerate(mnts):  # staged on both before either commits
                os.mkdir(os.path.join(mnt, name))
                with open(os.path.join(mnt, name, "x"), "wb") as f:
                    f.write(f"writer {w}".encode())

            def go(w):
                start.wait()
                try:
                    ckptfs.commit(mnts[w], name, mode)
                    if mode == "async":
                        ckptfs.wait(mnts[w], name, timeout=120)
                    out[w] = "ok"
                except ckptfs.CommitError as e:
                    out[w] = e
            ts = [threading.Thread(target=go, args=(w,)) for w in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            self.assertEqual(sorted(o == "ok" for o in out), [False, True], f"{mode}: {out}")
            win = out.index("ok")
            msg = str(out[1 - win])
            self.assertIn("is already committed elsewhere", msg, msg)
            self.assertIn("were discarded", msg, msg)
            self.assertNotIn("stays staged", msg, msg)
            for mnt in mnts:
                self.assertEqual(ckptfs.status(mnt, name)[0], "committed", mnt)
                self.assertEqual(read_all(os.path.join(mnt, name, "x")),
                                 f"writer {win}".encode(), f"{mode}: through {mnt}")

    def test_objects_standard_library_only(self):
        self.mount()
        sd = {"raw": b"\x00\xffbytes", "ba": bytearray(b"abc"), "step": 12,
              "cfg": {"lr": 0.1, "sizes": (1, 2), "name": "run"}, "none": None,
              "deep": {"a": {"b": {"c": "leaf"}}}, "empty": {}}
        ckptfs.save(sd, self.mnt, "objs")
        self.assertEqual(read_all(self.ck("objs", "raw")), b"\x00\xffbytes")
        self.assertEqual(read_all(self.ck("objs", "ba")), b"abc")
        self.assertEqual(pickle.loads(read_all(self.ck("objs", "step"))), 12)
        self.assertEqual(pickle.loads(read_all(self.ck("objs", "deep/a/b/c"))), "leaf")
        for f in os.listdir(self.ck("objs")):
            self.assertRaises(OSError, os.getxattr, self.ck("objs", f) if f != "cfg"
                              else self.ck("objs", "cfg/lr"), "user.ckpt.dtype")
        out = ckptfs.load(None, self.mnt, "objs")
        self.assertEqual(out, sd | {"ba": b"abc"})
        self.assertEqual(out["cfg"]["sizes"], (1, 2))
        # JSON: readable by anything; tuples come back as lists
        ckptfs.save({"cfg": {"lr": 0.1, "sizes": (1, 2)}, "b": b"x"}, self.mnt, "js",
                    objects="json")
        self.assertEqual(json.loads(read_all(self.ck("js", "cfg/sizes"))), [1, 2])
        self.assertEqual(ckptfs.load(None, self.mnt, "js"),
                         {"cfg": {"lr": 0.1, "sizes": [1, 2]}, "b": b"x"})
        # into a given dict: only the items it names
        spec = {"cfg": {"lr": None}, "step": None}
        self.assertIs(ckptfs.load(spec, self.mnt, "objs"), spec)
        self.assertEqual(spec, {"cfg": {"lr": 0.1}, "step": 12})
        # refusing pickles
        with self.assertRaisesRegex(ckptfs.CkptfsError, "pickled and allow_pickle is False"):
            ckptfs.load(None, self.mnt, "objs", allow_pickle=False)
        self.assertEqual(ckptfs.load({"raw": None}, self.mnt, "objs", allow_pickle=False),
                         {"raw": b"\x00\xffbytes"})
        # the core imports neither numpy nor torch
        r = subprocess.run([sys.executable, "-c",
                            "import sys, ckptfs; "
                            "ckptfs.load(None, sys.argv[1], 'objs'); "
                            "assert 'numpy' not in sys.modules and 'torch' not in sys.modules"
                            ", sorted(sys.modules)", self.mnt],
                           capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=PACKAGE))
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_load_progress(self):
        """load(progress=callable) sees (0, total) first, then done growing
        as items are read, ending at total: the bytes of the items read (a
        Shard's part only); progress=True shows a tqdm bar; a missing tqdm
        is refused before anything is read."""
        py = require_torch(self)
        self.mount()
        out = run_py(self, py, r'''
import sys, ckptfs, torch, numpy as np
mnt = sys.argv[1]
w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
sd = {"w": w, "sub": {"h": np.arange(100, dtype=np.int16), "blob": b"x" * 1000}}
ckptfs.save(sd, mnt, "p")
def watch(spec, want):
    calls = []
    got = ckptfs.load(spec, mnt, "p", progress=lambda d, t: calls.append((d, t)))
    assert calls[0] == (0, want) and calls[-1] == (want, want), calls
    assert all(t == want for _, t in calls), calls
    done = [d for d, _ in calls]
    assert all(a < b for a, b in zip(done, done[1:])), calls
    print(len(calls))
    return got
got = watch(None, 64 * 32 * 4 + 100 * 2 + 1000)
assert torch.equal(got["w"], w) and got["sub"]["blob"] == b"x" * 1000
half = ckptfs.Shard(torch.empty(32, 32), (32, 0), (64, 32))
got = watch({"w": half, "sub": None}, 32 * 32 * 4 + 100 * 2 + 1000)
assert torch.equal(half.tensor, w[32:]) and got["sub"]["h"].tolist() == list(range(100))
import io
err, sys.stderr = sys.stderr, io.StringIO()
ckptfs.load(None, mnt, "p", progress=True)       # a tqdm bar on stderr
bar, sys.stderr = sys.stderr.getvalue(), err
assert "load p: 100%" in bar and "9.17k/9.17k" in bar, bar
try:
    ckptfs.load(None, mnt, "p", progress="bar")
    raise AssertionError("progress='bar' accepted")
except ValueError as e:
    assert "progress='bar'" in str(e), e
for m in [m for m in sys.modules if m == "tqdm" or m.startswith("tqdm.")]:
    sys.modules[m] = None                        # as if tqdm were not installed
try:
    ckptfs.load(None, mnt, "p", progress="tqdm")
    raise AssertionError("no error without tqdm")
except ckptfs.CkptfsError as e:
    assert "tqdm package is not installed" in str(e), e
print("ok")
''', self.mnt)
        self.assertEqual(out.split(), ["4", "4", "ok"])

    def test_foreign_checkpoint(self):
        """A checkpoint written with plain file calls (no manifest): tensors
        load as numpy arrays, other files as bytes."""
        py = require_torch(self)
        self.mount()
        util.write_tensor(self.ck("plain", "w"), "int16", [2, 2],
                          struct.pack("<4h", 1, -2, 3, -4))
        util.write_file(self.ck("plain", "sub", "note.txt"), b"hello")
        util.commit(self.ck("plain"))
        out = run_py(self, py, r'''
import sys, ckptfs, numpy as np
out = ckptfs.load(None, sys.argv[1], "plain")
assert isinstance(out["w"], np.ndarray) and out["w"].dtype == np.int16
assert out["w"].tolist() == [[1, -2], [3, -4]], out
assert out["sub"] == {"note.txt": b"hello"}, out
print("ok")
''', self.mnt)
        self.assertEqual(out.strip(), "ok")

    def test_errors(self):
        py = require_torch(self)
        self.mount()
        util.write_file(self.ck("x", "k"), b"")  # staged, not committed
        out = run_py(self, py, r'''
import sys, ckptfs, torch, numpy as np
mnt = sys.argv[1]
def expect(fn, *words):
    try:
        fn()
    except (ckptfs.CkptfsError, TypeError, ValueError) as e:
        msg = str(e)
        assert all(w in msg for w in words), (msg, words)
        print(type(e).__name__ + ": " + msg)
        return e
    raise AssertionError("no error for " + repr(words))
# a shard that leaves a gap: the commit fails on .status's reason
e = expect(lambda: ckptfs.save({"w": ckptfs.Shard(torch.ones(2, 3), (0, 0), (4, 3))}, mnt, "gap"),
           "commit of checkpoint 'gap' failed", "gap", "Nothing was published",
           "save again with exist_ok=True")
assert isinstance(e, ckptfs.CommitError) and e.status.startswith("failed"), e.status
import os
assert not os.path.exists(os.path.join(sys.argv[2], "gap", ".metadata"))  # nothing published
expect(lambda: ckptfs.save({"w": torch.ones(4, 3)}, mnt, "gap"), "already staged (failed)",
       "exist_ok=True")
# fixed and saved again over the failed one: the stale shard xattrs go too
ckptfs.save({"w": torch.full((4, 3), 2.0)}, mnt, "gap", exist_ok=True, threads=1)
assert torch.equal(ckptfs.load(None, mnt, "gap")["w"], torch.full((4, 3), 2.0))
ckptfs.save({"w": torch.ones(4, 3), "b": torch.zeros(2, dtype=torch.bfloat16)}, mnt, "good")
expect(lambda: ckptfs.save({"w": torch.ones(1)}, mnt, "good"), "already committed", "rm -r")
expect(lambda: ckptfs.save({"w": torch.ones(1)}, mnt, "good", exist_ok=True),
       "already committed")
assert torch.equal(ckptfs.load(None, mnt, "good")["w"], torch.ones(4, 3))
expect(lambda: ckptfs.save({"w": 1}, mnt, ".hidden"), "cannot create checkpoint")
expect(lambda: ckptfs.save({"a/b": 1}, mnt, "k"), "'a/b'", "cannot be a file name")
expect(lambda: ckptfs.save({(1, 2): 1}, mnt, "k2"), "keys must be str or int")
expect(lambda: ckptfs.save({"_ckptfs": 1}, mnt, "k3"), "reserved")
expect(lambda: ckptfs.save({"u": np.zeros(2, np.uint32)}, mnt, "k4"), "uint32", "no ckptfs dtype")
expect(lambda: ckptfs.save({"x": 1}, mnt + "/nowhere", "k5"), "is not a directory")
expect(lambda: ckptfs.save({"x": 1}, mnt, "k6", mode="later"), "mode must be")
expect(lambda: ckptfs.save({"x": 1}, mnt, "k7", threads=0), "threads must be")
assert not os.path.exists(os.path.join(mnt, "k7"))
# a write that fails on one of the staging threads is raised, with its file
expect(lambda: ckptfs.save({"a": torch.ones(3), "b" * 300: torch.ones(3), "c": torch.ones(3)},
                           mnt, "k8", threads=3),
       "cannot stage " + "b" * 300, "File name too long")
expect(lambda: ckptfs.Shard(torch.ones(3, 3), (2, 0), (4, 3)), "outside the global shape")
expect(lambda: ckptfs.load(None, mnt, "nope"), "no checkpoint 'nope'", "good")
expect(lambda: ckptfs.load({"zz": torch.ones(1)}, mnt, "good"), "has no item zz")
expect(lambda: ckptfs.load({"w": torch.ones(3, 3)}, mnt, "good"), "shape is [4, 3]", "[3, 3]")
expect(lambda: ckptfs.load({"w": torch.ones(4, 3, dtype=torch.float64)}, mnt, "good"),
       "holds float32", "float64")
expect(lambda: ckptfs.load({"w": ckptfs.Shard(torch.ones(2, 3), (0, 0), (5, 3))}, mnt, "good"),
       "global shape [5, 3]")
expect(lambda: ckptfs.load({"k": torch.ones(1)}, mnt, "x"), "'x' is staging, not committed")
print("done")
''', self.mnt, self.backing)
        self.assertIn("CommitError: commit of checkpoint 'gap' failed", out)
        self.assertTrue(out.rstrip().endswith("done"), out)
        # the failed save was restaged and committed
        self.assertEqual(state(self.ck("gap")), "committed")
        self.assertEqual(read_all(self.ck("gap", "w")), struct.pack("<12f", *[2.0] * 12))

    def test_sharded_two_ranks_loaded_at_one(self):
        py = require_torch(self)
        w = self.world()
        try:
            save = r'''
import sys, torch, ckptfs
mnt, rank = sys.argv[1], int(sys.argv[2])
full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4) * 0.5 - 3
emb = (torch.arange(4 * 10, dtype=torch.float32).reshape(4, 10) / 7).to(torch.bfloat16)
sd = {"model": {
    "rows": ckptfs.Shard(full[rank * 3:(rank + 1) * 3], (rank * 3, 0), (6, 4)),
    "cols": ckptfs.Shard(emb[:, rank * 5:(rank + 1) * 5].clone(), (0, rank * 5), (4, 10)),
    "bias": torch.full((3,), 1.5)},          # replicated
    "rng": {f"rank{rank}": torch.tensor([rank])}, "step": 3}
ckptfs.save(sd, mnt, "sharded", rank=rank, mode="async")
print(ckptfs.wait(mnt, "sharded").splitlines()[0])
# a value that differs between ranks under the same key: a replica
# mismatch, reported on every rank
try:
    ckptfs.save({"step": rank}, mnt, "conflict", rank=rank)
    print("no error")
except ckptfs.CommitError as e:
    assert "replicas differ" in str(e) and "step" in str(e), str(e)
    print("conflict refused")
'''
            outs = [None, None]

            def one(r):
                try:
                    outs[r] = run_py(self, py, save, w.mnt(r), r)
                except BaseException as e:  # noqa: B902 - reported below
                    outs[r] = e
            ts = [threading.Thread(target=one, args=(r,)) for r in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            for r in range(2):
                if isinstance(outs[r], BaseException):
                    raise outs[r]
                self.assertEqual(outs[r].split(), ["committed", "conflict", "refused"])
        finally:
            self.assertEqual(w.stop(), 0)
        db = self.bk("sharded", ".metadata")
        chunks = query(db, "select fqn, offsets, sizes, rank from chunks order by fqn, offsets")
        self.assertIn(("model.rows", "[0,0]", "[3,4]", 0), chunks)
        self.assertIn(("model.rows", "[3,0]", "[3,4]", 1), chunks)
        self.assertIn(("model.cols", "[0,5]", "[4,5]", 1), chunks)
        self.assertEqual(len([c for c in chunks if c[0] == "model.bias"]), 1)  # dedup
        self.assertEqual(query(db, "select value from checkpoint where key='world_size'"),
                         [("2",)])
        # one rank, other shards: rows in 3 pieces of 2, a 2x3 block of
        # cols, both whole; only the shards' byte ranges are read
        self.mount()
        full = struct.pack("<24f", *[i * 0.5 - 3 for i in range(24)])
        self.assertEqual(read_all(self.ck("sharded", "model/rows")), full)
        out = run_py(self, py, r'''
import sys, torch, ckptfs
mnt = sys.argv[1]
full = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4) * 0.5 - 3
emb = (torch.arange(4 * 10, dtype=torch.float32).reshape(4, 10) / 7).to(torch.bfloat16)
pieces = [ckptfs.Shard(torch.zeros(2, 4), (2 * i, 0), (6, 4)) for i in range(3)]
block = ckptfs.Shard(torch.zeros(2, 3, dtype=torch.bfloat16), (1, 4), (4, 10))
col = ckptfs.Shard(torch.zeros(6, 1), (0, 3), (6, 4))
for p in pieces:
    ckptfs.load({"model": {"rows": p}}, mnt, "sharded")
    o = p.offsets[0]
    assert torch.equal(p.tensor, full[o:o + 2]), (p.tensor, o)
ckptfs.load({"model": {"cols": block}}, mnt, "sharded")
assert torch.equal(block.tensor, emb[1:3, 4:7]), block.tensor
ckptfs.load({"model": {"rows": col}}, mnt, "sharded")
assert torch.equal(col.tensor, full[:, 3:4])
out = ckptfs.load(None, mnt, "sharded")
assert torch.equal(out["model"]["rows"], full) and torch.equal(out["model"]["cols"], emb)
assert sorted(out["rng"]) == ["rank0", "rank1"], out["rng"]
assert torch.equal(out["rng"]["rank0"], torch.tensor([0]))
assert torch.equal(out["rng"]["rank1"], torch.tensor([1]))
assert out["step"] == 3
print("ok")
''', self.mnt)
        self.assertEqual(out.strip(), "ok")

    def test_one_rank_fails_while_staging(self):
        """Issue 23 case 9: rank 1 cannot encode an item (a lambda, pickled)
        while rank 0 stages and commits: both ranks raise within seconds,
        not after commit_timeout (60 s here; rank 1 starts once rank 0's
        .status says it waits in its commit), and NAME is left staged on
        neither mount. save, then async_save (whose rank 1 raises while
        copying the state dict, before anything is staged)."""
        py = require_torch(self)
        w = self.world("commit_timeout=60")
        try:
            save = r'''
import json, os, sys, time, torch, ckptfs
mnt, rank, how, name = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
sd = {f"w{rank}": torch.arange(4096, dtype=torch.float32), "step": 3}
if rank == 1:
    sd["bad"] = lambda: 0     # the client cannot encode it
    # first rank 0 waits in its commit (for rank 1)
    st0 = os.path.join(os.path.dirname(mnt), "rank0", name, ".status")
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            with open(st0) as f:
                if "waiting for" in f.read():
                    break
        except OSError:
            pass
        time.sleep(0.05)
t0 = time.monotonic()
try:
    if how == "save":
        ckptfs.save(sd, mnt, name, rank=rank)
    else:
        ckptfs.async_save(sd, mnt, name, rank=rank).result()
    err = None
except Exception as e:
    err = f"{type(e).__name__}: {e} " + " ".join(getattr(e, "__notes__", []))
took = time.monotonic() - t0
end = time.monotonic() + 10  # a discard in the background (async_save's rank 1)
while os.path.exists(os.path.join(mnt, name)) and time.monotonic() < end:
    time.sleep(0.05)
print(json.dumps({"took": took, "err": err, "left": os.path.exists(os.path.join(mnt, name))}))
'''
            for how in ("save", "async_save"):
                with self.subTest(how=how):
                    name = f"abort-{how}"
                    outs = [None, None]

                    def one(r):
                        try:
                            outs[r] = json.loads(run_py(self, py, save, w.mnt(r), r, how, name,
                                                        timeout=300).strip().splitlines()[-1])
                        except BaseException as e:  # noqa: B902 - reported below
                            outs[r] = e
                    ts = [threading.Thread(target=one, args=(r,)) for r in range(2)]
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join()
                    for r in range(2):
                        if isinstance(outs[r], BaseException):
                            raise outs[r]
                    sys.stderr.write(f"\n  {how}: rank 0 raised after {outs[0]['took']:.2f} s "
                                     f"({outs[0]['err']}), rank 1 after "
                                     f"{outs[1]['took']:.2f} s ({outs[1]['err']})\n")
                    self.assertIn("lambda", outs[1]["err"] or "", outs[1])
                    self.assertIn(f"save of {name!r} was aborted on every rank", outs[1]["err"])
                    self.assertIsNotNone(outs[0]["err"], "rank 0 committed")
                    self.assertIn("another rank failed", outs[0]["err"], outs[0])
                    for r in range(2):
                        self.assertLess(outs[r]["took"], 30, f"rank {r}: {outs[r]}")
                        self.assertFalse(outs[r]["left"], f"{name} left on rank {r}: {outs[r]}")
                        self.assertFalse(os.path.exists(os.path.join(w.mnt(r), name)),
                                         f"{name} left staged on rank {r}")
                    # the name is free again: the same save without the bad item commits
                    ok = r'''
import sys, torch, ckptfs
mnt, rank, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ckptfs.save({"w": torch.arange(4096, dtype=torch.float32), "step": 3}, mnt, name, rank=rank)
print(ckptfs.status(mnt, name)[0])
'''
                    res = [None, None]
                    ts = [threading.Thread(target=lambda r=r: res.__setitem__(
                        r, run_py(self, py, ok, w.mnt(r), r, name, timeout=300)))
                        for r in range(2)]
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join()
                    self.assertEqual([(x or "").strip() for x in res], ["committed"] * 2)
        finally:
            self.assertEqual(w.stop(), 0)

    def test_overwrite_replaces_a_committed_name(self):
        """Issue 24: save(overwrite=True) and async_save(overwrite=True)
        replace a committed name (sync, async and with mode="async" then
        wait); without it, today's refusal stays; a failed replace
        publishes nothing and leaves no working name behind."""
        self.mount()
        ckptfs.save({"v": b"1", "only-in-1": b"x"}, self.mnt, "s")
        with self.assertRaises(ckptfs.CkptfsError) as cm:
            ckptfs.save({"v": b"2"}, self.mnt, "s")
        self.assertIn("already committed", str(cm.exception))
        self.assertIn("overwrite=True", str(cm.exception))
        self.assertEqual(ckptfs.load(None, self.mnt, "s"), {"v": b"1", "only-in-1": b"x"})
        ckptfs.save({"v": b"2"}, self.mnt, "s", overwrite=True)
        # the new version whole, nothing of the old one
        self.assertEqual(ckptfs.load(None, self.mnt, "s"), {"v": b"2"})
        ckptfs.async_save({"v": b"3"}, self.mnt, "s", overwrite=True).result(timeout=300)
        self.assertEqual(ckptfs.load(None, self.mnt, "s"), {"v": b"3"})
        ckptfs.save({"v": b"4", "cfg": [1, 2]}, self.mnt, "s", mode="async",
                    objects="json", overwrite=True)
        text = ckptfs.wait(self.mnt, "s", timeout=300)
        self.assertTrue(text.startswith("committed"), text)
        self.assertEqual(ckptfs.load(None, self.mnt, "s"), {"v": b"4", "cfg": [1, 2]})
        # overwrite=True over nothing is a plain save
        ckptfs.save({"v": b"new"}, self.mnt, "fresh", overwrite=True)
        self.assertEqual(ckptfs.load(None, self.mnt, "fresh"), {"v": b"new"})
        # a 250-byte name: its working name is replace-<sha1>-TOKEN
        ckptfs.save({"v": b"1"}, self.mnt, "n" * 250)
        ckptfs.save({"v": b"2"}, self.mnt, "n" * 250, overwrite=True)
        self.assertEqual(ckptfs.load(None, self.mnt, "n" * 250), {"v": b"2"})
        # a name with a space cannot follow replace=: saved once, refused after
        ckptfs.save({"v": b"1"}, self.mnt, "a b", overwrite=True)
        with self.assertRaises(ckptfs.CkptfsError) as cm:
            ckptfs.save({"v": b"2"}, self.mnt, "a b", overwrite=True)
        self.assertIn("cannot be replaced", str(cm.exception))
        self.assertEqual(ckptfs.load(None, self.mnt, "a b"), {"v": b"1"})
        py = require_torch(self)
        out = run_py(self, py, r'''
import os, sys, torch, ckptfs
mnt = sys.argv[1]
gap = {"w": ckptfs.Shard(torch.ones(2, 3), (0, 0), (4, 3))}   # leaves a gap
for how in ("sync", "async"):
    try:
        ckptfs.save(gap, mnt, "s", mode=how, overwrite=True)
        ckptfs.wait(mnt, "s", timeout=300)
        raise SystemExit(f"{how}: a save with a gap replaced s")
    except ckptfs.CommitError as e:
        assert "gap" in str(e) and e.discarded, (how, str(e), e.discarded)
        assert "discarded on every rank" in str(e), str(e)
    print(how, sorted(os.listdir(mnt)))
''', self.mnt)
        names = ["a b", "fresh", "n" * 250, "s"]
        self.assertEqual(out.split("\n")[:2], [f"sync {names}", f"async {names}"], out)
        self.assertEqual(ckptfs.load(None, self.mnt, "s"), {"v": b"4", "cfg": [1, 2]})
        # one directory per name in BACKING_DIR, and the same after a remount
        self.assertEqual(sorted(n for n in os.listdir(self.backing) if n[0] != "."), names)
        self.mounts[0].stop()
        self.mount()
        self.assertEqual(ckptfs.load(None, self.mnt, "s"), {"v": b"4", "cfg": [1, 2]})

    def test_replicas_that_differ_in_a_world_of_two(self):
        """A key both ranks save with different values: the commit fails on
        both, with advice for the plain client (per-rank keys, or the key
        on one rank only; its own exist_ok, not the DCP Writer's
        replicas=), and each line of the two-line reason the daemons log
        on stderr carries the "ckptfs: " prefix."""
        w = self.world("commit_timeout=60")
        try:
            errs = [None, None]

            def one(r):
                try:
                    ckptfs.save({"step": r, "seed": 10 + r}, w.mnt(r), "d", rank=r,
                                objects="json")
                except ckptfs.CommitError as e:
                    errs[r] = str(e)
            ts = [threading.Thread(target=one, args=(r,)) for r in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
        finally:
            self.assertEqual(w.stop(), 0)
        for r, msg in enumerate(errs):
            self.assertIsNotNone(msg, f"rank {r} saved")
            self.assertIn("step (step): replicas differ", msg)
            self.assertIn('a key of its own on each rank (e.g. f"rank{rank}.x")', msg)
            self.assertIn("one rank's state dict only", msg)
            self.assertIn("save again with exist_ok=True", msg)
            self.assertNotIn("replicas=", msg)
        lines = [ln for ln in read_log(w.log).splitlines() if "replicas differ" in ln]
        self.assertEqual(len(lines), 4, read_log(w.log))   # 2 keys, on each rank
        for ln in lines:
            self.assertTrue(ln.startswith("ckptfs: d: commit failed: ")
                            or ln.startswith("ckptfs: seed (seed): replicas differ")
                            or ln.startswith("ckptfs: step (step): replicas differ"), ln)

    def test_overwrite_and_solo_in_a_world_of_two(self):
        """Issue 24: both ranks of a world save NAME twice, the second with
        overwrite=True: every mount shows the second; a third that one rank
        fails to stage raises on both and leaves the second. Then rank 0 alone
        saves a checkpoint with solo=True (rank 1 does nothing) and rank 1
        alone replaces it (solo=True, overwrite=True): each mount sees
        the other's, as a checkpoint of world size 1, within seconds
        (commit_timeout is 60 s: no rank waits for the other)."""
        w = self.world("commit_timeout=60")
        try:
            def both(version, bad_rank=None, **kw):
                """Both ranks save version; bad_rank's state dict holds an
                object JSON cannot encode. The ranks' errors."""
                errs = [None, None]

                def one(r):
                    sd = {"step": version, "rng": {f"rank{r}": f"{version}:{r}"}}
                    if r == bad_rank:
                        sd["rng"]["bad"] = object()
                    try:
                        ckptfs.save(sd, w.mnt(r), "shared", rank=r, objects="json", **kw)
                    except BaseException as e:  # noqa: B902 - reported below
                        errs[r] = e
                ts = [threading.Thread(target=one, args=(r,)) for r in range(2)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                if bad_rank is None:
                    for e in errs:
                        if e is not None:
                            raise e
                return errs
            both(1)
            both(2, overwrite=True)
            want = {"step": 2, "rng": {"rank0": "2:0", "rank1": "2:1"}}
            for r in range(2):
                self.assertEqual(ckptfs.load(None, w.mnt(r), "shared"), want, f"rank {r}")
                self.assertEqual(sorted(os.listdir(w.mnt(r))), ["shared"])
            # a replace that rank 1 cannot stage: both ranks raise within
            # seconds, version 2 stays, no working name is left
            t0 = time.monotonic()
            errs = both(3, bad_rank=1, overwrite=True)
            self.assertLess(time.monotonic() - t0, 30)
            self.assertIn("JSON", str(errs[1]))
            self.assertIn("another rank failed", str(errs[0]))
            for r in range(2):
                self.assertEqual(ckptfs.load(None, w.mnt(r), "shared"), want, f"rank {r}")
                self.assertEqual(sorted(os.listdir(w.mnt(r))), ["shared"])
            t0 = time.monotonic()
            ckptfs.save({"cfg": {"lr": 0.5}}, w.mnt(0), "config", rank=0, solo=True,
                        objects="json")
            took = time.monotonic() - t0
            self.assertLess(took, 30, "the solo save waited for rank 1")
            self.assertEqual(ckptfs.load(None, w.mnt(1), "config"), {"cfg": {"lr": 0.5}})
            db = os.path.join(w.mnt(1), "config", ".metadata")
            self.assertEqual(query(db, "select value from checkpoint where key='world_size'"),
                             [("1",)])
            ckptfs.async_save({"cfg": {"lr": 0.25}}, w.mnt(1), "config", rank=1, solo=True,
                              overwrite=True, objects="json").result(timeout=30)
            for r in range(2):
                self.assertEqual(ckptfs.load(None, w.mnt(r), "config"), {"cfg": {"lr": 0.25}})
            # the manifest of a world of one is rank 0's
            self.assertEqual(os.listdir(os.path.join(w.mnt(0), "config", "_ckptfs")),
                             ["rank0.json"])
            sys.stderr.write(f"\n  solo save at rank 0 of 2: {took:.2f} s\n")
        finally:
            self.assertEqual(w.stop(), 0)

    def test_shard_runs(self):
        """The byte ranges a Shard reads: one pread per contiguous run."""
        runs = list(ckptfs.blocks.runs((6, 4), (2, 0), (2, 4)))
        self.assertEqual(runs, [(8, 8)])  # whole rows: one run
        runs = list(ckptfs.blocks.runs((4, 10), (1, 4), (2, 3)))
        self.assertEqual(runs, [(14, 3), (24, 3)])
        runs = list(ckptfs.blocks.runs((2, 3, 4), (1, 1, 0), (1, 2, 4)))
        self.assertEqual(runs, [(16, 8)])
        runs = list(ckptfs.blocks.runs((2, 3, 4), (0, 1, 1), (2, 1, 2)))
        self.assertEqual(runs, [(5, 2), (17, 2)])
        self.assertEqual(list(ckptfs.blocks.runs((), (), ())), [(0, 1)])
        self.assertEqual(list(ckptfs.blocks.runs((3, 0), (0, 0), (3, 0))), [])


class JobStart(CkptfsTestCase):
    """What a job meets when it starts or resumes: the step each commit
    records for retention, the checkpoints a killed run left, a dead mount
    named as one, and the reason a save aborted on one rank gives."""

    def test_step_recorded_at_commit(self):
        """save(step=N) and async_save(step=N) record N as the checkpoint's
        step (user.ckpt.step, .metadata's step), not the digits of its
        name; latest() orders by it; a bad step raises before anything is
        staged."""
        self.mount()
        ckptfs.save({"v": b"1"}, self.mnt, "run-loss-0.9876", step=40)
        ckptfs.async_save({"v": b"2"}, self.mnt, "run-loss-0.1234", step=30).result(60)
        ckptfs.save({"v": b"3"}, self.mnt, "plain-7")
        steps = {n: os.getxattr(self.ck(n), "user.ckpt.step")
                 for n in ("run-loss-0.9876", "run-loss-0.1234", "plain-7")}
        self.assertEqual(steps, {"run-loss-0.9876": b"40", "run-loss-0.1234": b"30",
                                 "plain-7": b"7"})
        self.assertEqual(query(self.ck("run-loss-0.9876", ".metadata"),
                               "SELECT value FROM checkpoint WHERE key='step'"), [("40",)])
        self.assertEqual(query(self.ck("plain-7", ".metadata"),
                               "SELECT value FROM checkpoint WHERE key='step'"), [])
        self.assertEqual(ckptfs.latest(self.mnt, "run-"), "run-loss-0.9876")
        for bad in (-1, "3", 2.5):
            with self.assertRaises(ValueError):
                ckptfs.save({"v": b"4"}, self.mnt, "bad-step", step=bad)
        self.assertNotIn("bad-step", os.listdir(self.mnt))

    def test_leftovers(self):
        """leftovers(): staged or failed checkpoints no live job writes (no
        `job PID alive` line in .status); a live job's staged one is not."""
        self.mount()
        os.mkdir(self.ck("checkpoint-4"))          # this process is no job of the mount yet
        util.write_file(self.ck("checkpoint-4", "x"), b"partial")
        os.mkdir(self.ck("checkpoint-6"))          # failed: a chunk without its bytes
        util.write_file(self.ck("checkpoint-6", "w"), b"abc")
        os.setxattr(self.ck("checkpoint-6", "w"), "user.ckpt.dtype", b"float32")
        os.setxattr(self.ck("checkpoint-6", "w"), "user.ckpt.shape", b"1")
        with self.assertRaises(OSError):
            util.commit(self.ck("checkpoint-6"))
        self.assertEqual(state(self.ck("checkpoint-6")), "failed")
        ckptfs.save({"v": b"1"}, self.mnt, "checkpoint-2")   # committed
        self.assertTrue(ckptfs.job.declare(self.mnt))
        try:
            os.mkdir(self.ck("checkpoint-8"))      # a live job's (this process)
            self.assertRegex(read_all(self.ck("checkpoint-8", ".status")).decode(),
                             r"\njob %d alive" % os.getpid())
            from ckptfs._client import discard_leftovers, leftovers
            self.assertEqual(leftovers(self.mnt), [("checkpoint-4", "staging"),
                                                   ("checkpoint-6", "failed")])
            self.assertEqual(leftovers(self.mnt, lambda n: n.endswith("4")),
                             [("checkpoint-4", "staging")])
            self.assertEqual(discard_leftovers(self.mnt), [("checkpoint-4", "staging"),
                                                           ("checkpoint-6", "failed")])
            self.assertEqual(sorted(os.listdir(self.mnt)), ["checkpoint-2", "checkpoint-8"])
        finally:
            ckptfs.job.end(self.mnt)

    def test_dead_mount_named_as_one(self):
        """A mount whose daemon exited (ENOTCONN) is named as one by save,
        async_save, commit and load, not as "not a directory"."""
        m = self.mount()
        ckptfs.save({"v": b"1"}, self.mnt, "s")
        m.proc.kill()
        m.proc.wait()
        with self.assertRaises(OSError) as cm:
            os.stat(self.mnt)
        self.assertEqual(cm.exception.errno, errno.ENOTCONN)
        want = (f"the ckptfs mount at {self.mnt} is gone (ENOTCONN): its daemon exited; "
                "see its log")
        for what, fn in (("save", lambda: ckptfs.save({"v": b"2"}, self.mnt, "t")),
                         ("async_save", lambda: ckptfs.async_save({"v": b"2"}, self.mnt, "t")),
                         ("commit", lambda: ckptfs.commit(self.mnt, "t")),
                         ("load", lambda: ckptfs.load(None, self.mnt, "s"))):
            with self.subTest(what):
                with self.assertRaises(ckptfs.CkptfsError) as cm:
                    fn()
                self.assertEqual(str(cm.exception), want)

    def test_abort_reason_names_the_rank(self):
        """Rank 1 of 2 fails while staging (an object it cannot pickle):
        .status and rank 0's CommitError say "rank 1 aborted the save:
        ITS ERROR", with no word of the internal item (_ckptfs_abort) or
        of its bytes; so does the daemons' log."""
        w = self.start_world(2, "commit_timeout=60")
        try:
            errs, statuses = [None, None], []

            def one(r):
                sd = {f"w{r}": b"x" * 1000}
                if r == 1:
                    sd["bad"] = lambda: 0   # pickle refuses a lambda
                try:
                    ckptfs.save(sd, w.mnt(r), "ab", rank=r)
                except BaseException as e:  # noqa: B902 - reported below
                    errs[r] = e
            ts = [threading.Thread(target=one, args=(r,)) for r in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(120)
            self.assertIsInstance(errs[0], ckptfs.CommitError, errs)
            statuses.append(errs[0].status)
            msg = str(errs[0])
            self.assertIsNotNone(errs[1], "rank 1 saved")
            self.assertIn("aborted on every rank", " ".join(getattr(errs[1], "__notes__", [])))
            self.assertNotIn("ab", os.listdir(w.mnt(0)))
            # an async commit: rank 0's .status itself, as a waiter reads it
            name = "ab2"
            done = threading.Event()

            def rank0():
                try:
                    ckptfs.save({"w0": b"y"}, w.mnt(0), name, rank=0, mode="async")
                    ckptfs.wait(w.mnt(0), name, timeout=60)
                except ckptfs.CommitError as e:
                    statuses.append(e.status)
                done.set()
            t = threading.Thread(target=rank0)
            t.start()
            os.mkdir(os.path.join(w.mnt(1), name))
            try:
                raise RuntimeError("out of host memory\nsecond line")
            except RuntimeError:
                ckptfs.abort.abort_save(os.path.join(w.mnt(1), name), name)
            self.assertTrue(done.wait(60))
            t.join()
        finally:
            self.assertEqual(w.stop(), 0)
        self.assertEqual(len(statuses), 2, statuses)
        self.assertRegex(statuses[0], r"^failed\nrank 1 aborted the save: "
                                      r"(PicklingError|AttributeError): .*lambda")
        self.assertTrue(statuses[1].startswith(
            "failed\nrank 1 aborted the save: RuntimeError: out of host memory\n"), statuses)
        self.assertIn("rank 1 aborted the save: ", msg)
        self.assertIn("another rank failed", msg)
        log = read_log(w.log, 1 << 24)
        failed = [ln for ln in log.splitlines() if "commit failed:" in ln]
        self.assertTrue(failed, log[-3000:])
        for text in statuses + [msg] + failed:
            self.assertNotIn("_ckptfs_abort", text)
            self.assertNotIn("wrote 0 bytes", text)
        self.assertNotIn("_ckptfs_abort", log)


class Stager(unittest.TestCase):
    """The staging threads of save() and the DCP Writer."""

    def test_bounded_in_flight_and_first_error(self):
        st = ckptfs.staging.Stager(2)
        gate = threading.Event()
        submitted, feed_err = [], []

        def job(k):
            gate.wait(30)
            if k == 2:
                raise OSError(5, "boom")
            return k

        def feed():
            try:
                for k in range(8):
                    st.submit(job, k)
                    submitted.append(k)
            except OSError as e:
                feed_err.append(e)

        t = threading.Thread(target=feed, daemon=True)
        t.start()
        t.join(0.5)
        # 2 x threads = 4 writes queued or running; the 5th waits for room
        self.assertEqual(submitted, [0, 1, 2, 3])
        self.assertTrue(t.is_alive())
        gate.set()
        t.join(30)
        self.assertFalse(t.is_alive())
        with self.assertRaises(OSError) as cm:
            st.done()
        self.assertEqual(cm.exception.strerror, "boom")
        for e in feed_err:  # staging stopped early, with that error
            self.assertIs(e, cm.exception)

    def test_a_failed_write_stops_staging(self):
        st = ckptfs.staging.Stager(2)

        def bad():
            raise OSError(28, "full")

        st.submit(bad)
        st.futures[0].exception(30)  # it has run and failed
        ran = []
        with self.assertRaises(OSError) as cm:
            st.submit(ran.append, 1)
        self.assertEqual(cm.exception.strerror, "full")
        with self.assertRaises(OSError):
            st.done()
        self.assertEqual(ran, [])

    def test_read_errors_stay_oserrors(self):
        fd = os.open(os.path.dirname(os.path.abspath(__file__)), os.O_RDONLY)
        try:
            with self.assertRaises(OSError) as cm:  # EISDIR
                ckptfs.blocks.pread_into(fd, memoryview(bytearray(4)), 0, "dir")
        finally:
            os.close(fd)
        self.assertIsInstance(cm.exception, ckptfs.CkptfsError)
        self.assertEqual(cm.exception.errno, errno.EISDIR)
        self.assertIn("reading dir at offset 0", str(cm.exception))

    def test_one_thread_runs_inline(self):
        st = ckptfs.staging.Stager(1)
        self.assertEqual(st.submit(lambda: 7), 7)
        self.assertIsNone(st.done())
        with self.assertRaises(ValueError):
            ckptfs.staging.Stager(0)
        for bad in (0, -1, 2.0, "4", True):
            with self.assertRaises(ValueError, msg=repr(bad)):
                ckptfs.staging.check_threads(bad)

    def test_default_threads_share_the_cpus(self):
        """threads=None: 4, at most this rank's share of the CPUs it may
        run on (the launcher's local rank count), at least 1."""
        cpus = len(os.sched_getaffinity(0))
        saved = {v: os.environ.pop(v, None) for v in
                 ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")}
        try:
            cases = [({}, min(4, cpus)),
                     ({"OMPI_COMM_WORLD_LOCAL_SIZE": str(cpus)}, 1),
                     ({"LOCAL_WORLD_SIZE": str(4 * cpus)}, 1),
                     ({"MPI_LOCALNRANKS": "x", "OMPI_COMM_WORLD_LOCAL_SIZE": "0"}, min(4, cpus)),
                     ({"LOCAL_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": str(cpus)},
                      min(4, cpus))]
            for env, want in cases:
                os.environ.update(env)
                try:
                    self.assertEqual(ckptfs.staging.default_threads(), want, env)
                    self.assertEqual(ckptfs.staging.check_threads(None), want, env)
                finally:
                    for v in env:
                        del os.environ[v]
            self.assertEqual(ckptfs.staging.check_threads(3), 3)
        finally:
            for v, x in saved.items():
                if x is not None:
                    os.environ[v] = x


class Interpreter(unittest.TestCase):
    def test_no_torch_fails_unless_allowed(self):
        """Without an interpreter that has torch, the torch tests fail, and
        are skipped only with CKPT_ALLOW_NO_TORCH=1."""
        saved = (pyenv.CANDIDATES, dict(pyenv._found), os.environ.get("CKPT_ALLOW_NO_TORCH"))
        try:
            pyenv.CANDIDATES = ("/nonexistent/python3",)
            pyenv._found.clear()
            os.environ.pop("CKPT_ALLOW_NO_TORCH", None)
            with self.assertRaisesRegex(AssertionError, "no Python with torch"):
                pyenv.require_torch(self)
            os.environ["CKPT_ALLOW_NO_TORCH"] = "1"
            with self.assertRaises(unittest.SkipTest):
                pyenv.require_torch(self)
        finally:
            pyenv.CANDIDATES = saved[0]
            pyenv._found.clear()
            pyenv._found.update(saved[1])
            if saved[2] is None:
                os.environ.pop("CKPT_ALLOW_NO_TORCH", None)
            else:
                os.environ["CKPT_ALLOW_NO_TORCH"] = saved[2]


if __name__ == "__main__":
    main()
