#!/usr/bin/env python3
"""ckptfs.dcp, the torch.distributed.checkpoint storage backend, with torch
2.13.0 under mpirun + gloo over real rank mounts (tests/integration/
ckpttest/world.py): DCP save at 2 ranks loaded at 1 and 4, at 4 ranks (2-D
mesh) loaded at 2; DTensors Shard(0) (uneven), Shard(1), Replicate(),
2-D meshes; rank-unique and replicated plain tensors; object items; FQNs
that are not path-safe; model and Adam state of a fully_shard'ed model
(get_state_dict) loaded at another world size; async_save overlapping a
training step; a checkpoint_id saved again replacing the last, as stock
DCP's overwrite=True does, and overwrite=False refusing it; an error on
one rank raised on every rank, its reason "rank R aborted the save:
ITS ERROR"; a dead mount named as one when DCP sets the Writer and
Reader up; the
safetensors package reading the .safetensors view; import of a stock DCP
checkpoint and export to one stock DCP loads. All compared bit for bit.
The jobs are python/tests/dcp_job.py.

    PYTHONPATH=tests/integration:python \\
        python3 python/tests/test_dcp.py --bin build/bin/ckptfs
"""

import json
import os
import pickle
import re
import socket
import subprocess
import sys
import time
import unittest

from ckpttest import util
from ckpttest.util import CkptfsTestCase, main
from ckpttest.world import MPIRUN, query
from ckpttest.pyenv import PACKAGE, require_torch, run_py

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dcp_job.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DcpCase(CkptfsTestCase):

    def setUp(self):
        super().setUp()
        self.py = require_torch(self)

    def world(self, n, opts="commit_timeout=120"):
        return self.start_world(n, opts)

    def stop(self, w):
        rc = w.stop()
        self.assertEqual(rc, 0, f"world of {w.n} exited with {rc}")

    def job(self, n, scenario, mount, *args, timeout=900, expect_ok=True):
        """Run dcp_job.py SCENARIO under mpirun -np n; {rank: RESULT dict}."""
        self.njobs = getattr(self, "njobs", 0) + 1
        results = os.path.join(self.dir, f"results{self.njobs}")
        os.mkdir(results)
        env = dict(os.environ, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                   PYTHONPATH=PACKAGE, PYTHONWARNINGS="ignore", CKPT_RESULT_DIR=results)
        cmd = MPIRUN + ["-np", str(n), "-x", "MASTER_PORT", "-x", "OMP_NUM_THREADS",
                        "-x", "PYTHONPATH", "-x", "PYTHONWARNINGS", "-x", "CKPT_RESULT_DIR",
                        self.py, JOB, scenario, mount] + [str(a) for a in args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env=env, stdin=subprocess.DEVNULL)
        out = {}
        for f in os.listdir(results):
            if f.endswith(".json"):
                with open(os.path.join(results, f)) as fh:
                    d = json.load(fh)
                out[d["rank"]] = d
        if expect_ok:
            self.assertEqual(r.returncode, 0, f"{scenario} at {n} ranks:\n"
                             f"{r.stdout[-5000:]}\n{r.stderr[-8000:]}")
            self.assertEqual(sorted(out), list(range(n)), r.stdout[-3000:])
        return out

    def spec(self, w):
        return os.path.join(w.root, "rank%r")


class SaveLoad(DcpCase):

    def test_save_2_load_1_and_4(self):
        w2 = self.world(2)
        self.job(2, "save", self.spec(w2), "s2", "odd")
        # what ckptfs holds: each DTensor once, every FQN exactly
        db = os.path.join(w2.mnt(0), "s2", ".metadata")
        fqns = {r[0] for r in query(db, "SELECT fqn FROM tensors")}
        for f in ("dt.row", "dt.col", "dt.rep", "dt.big", "rep.w", "unique.rank0",
                  "unique.rank1", "a..b", "x/y", "p" * 300, "q..hidden", "dir", "dir.leaf"):
            self.assertIn(f, fqns)
        blobs = {r[0] for r in query(db, "SELECT fqn FROM blobs")}
        self.assertLessEqual({"obj.step", "obj.cfg.lr", "obj.cfg.name", "obj.cfg.betas"},
                             blobs)
        # dt.col (Shard(1)) was saved as two column chunks
        chunks = query(db, "SELECT offsets, sizes FROM chunks WHERE fqn='dt.col' ORDER BY offsets")
        self.assertEqual(chunks, [("[0,0]", "[6,5]"), ("[0,5]", "[6,5]")])
        # strided.w: 9 chunks of 2 rows, 5 from rank 0 and 4 from rank 1
        ranks = query(db, "SELECT rank, count(*) FROM chunks WHERE fqn='strided.w' GROUP BY rank")
        self.assertEqual(sorted(ranks), [(0, 5), (1, 4)])
        # the committed tensor shows once, at the path of its first chunk
        self.assertEqual(query(db, "SELECT path FROM tensors WHERE fqn='strided.w'"),
                         [("strided/w",)])
        self.assertEqual(sorted(os.listdir(os.path.join(w2.mnt(1), "s2", "strided"))), ["w"])
        self.stop(w2)
        w4 = self.world(4)
        self.job(4, "load", self.spec(w4), "s2", 2, "odd")
        self.stop(w4)
        w1 = self.world(1)
        self.job(1, "load", self.spec(w1), "s2", 2, "odd")

    def test_deprecated_save_state_dict_keeps_the_name(self):
        """save_state_dict/load_state_dict reset() the storage with no
        checkpoint_id: every rank raised 'pass checkpoint_id=NAME'."""
        w = self.world(2)
        self.job(2, "deprecated_api", self.spec(w), "old-api")
        self.stop(w)

    def test_save_4_two_d_mesh_load_2(self):
        w4 = self.world(4)
        self.job(4, "save", self.spec(w4), "s4", "2d")
        self.stop(w4)
        w2 = self.world(2)
        self.job(2, "load", self.spec(w2), "s4", 4, "2d")


    def test_writer_commit_async_and_reader_progress(self):
        w2 = self.world(2)
        self.job(2, "save_commit_async", self.spec(w2), "sa")
        out = self.job(2, "load_progress", self.spec(w2), "lp")
        self.assertEqual(out[0]["calls"][-1], out[1]["calls"][-1])  # same sizes

    def test_cached_plans_and_replicas(self):
        """DCP's plan caching (later saves send empty local plans); a
        replica whose bytes differ: refused by default, with advice a DCP
        user can follow, saved with replicas="dedup". The daemons' log
        (-o log=FILE) gives the reason's lines, each with its own time and
        rank."""
        logfile = os.path.join(self.dir, "daemons.log")
        self.extra_logs.append(logfile)
        w2 = self.world(2, opts="commit_timeout=120,log=" + logfile)
        self.job(2, "cached_plans", self.spec(w2), "cp")
        out = self.job(2, "replicas", self.spec(w2), "rp")
        for r in (0, 1):
            msg = out[r]["message"]
            for key in ("tag (tag): replicas differ", "tags (tags): replicas differ"):
                self.assertIn(key, msg)
            self.assertIn("same checkpoint_id can be saved again", msg)
            self.assertIn('a key of its own on each rank (e.g. f"rank{rank}.x")', msg)
            self.assertIn('ckptfs.dcp.Writer(mount, replicas="dedup")', msg)
            self.assertNotIn("exist_ok", msg)   # the plain client's option
        self.assertFalse(os.path.exists(os.path.join(self.backing, "rp-check")))
        with open(logfile) as f:
            log = f.read().splitlines()
        differ = [ln for ln in log if "replicas differ" in ln]
        self.assertGreaterEqual(len(differ), 4, log)   # 2 lines, on each rank
        stamp = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ckptfs\[\d+\] rank [01]: ")
        for ln in log:
            self.assertRegex(ln, stamp)


class Replace(DcpCase):
    """Issue 24: a checkpoint_id saved again replaces the committed one, as
    stock DCP's FileSystemWriter (overwrite=True) does; overwrite=False
    raises as stock DCP does (dcp_job.resave)."""

    def test_save_twice_replaces_overwrite_false_raises(self):
        w2 = self.world(2)
        out = self.job(2, "resave", self.spec(w2), "again")
        # saves 2, 3, 5, 6 and 7 replaced it on both ranks, each staged under
        # one working name on every rank (the token comes with DCP's global
        # plan; a cached plan brings its earlier token, which is free again)
        log = util.read_log(w2.log, 1 << 24)
        published = re.findall(r"(again\.replace-[0-9a-f]{12}): published as again "
                               r"\(replace=\)", log)
        self.assertEqual(len(published), 10, log[-3000:])
        self.assertTrue(all(published.count(p) % 2 == 0 for p in published), published)
        for r in (0, 1):
            self.assertIn("Checkpoint already exists and self.overwrite=False",
                          out[r]["refused"])
            # the failed replace (rank 1 could not pickle an object) raised
            # on every rank within seconds (commit_timeout is 120 s)
            self.assertLess(out[r]["failed_seconds"], 60, out[r])
        self.assertIn("refuses to be saved", out[1]["failed"])
        self.assertIn("another rank failed", out[0]["failed"])
        # one checkpoint in BACKING_DIR, nothing left of the replaced ones
        self.assertEqual(sorted(n for n in os.listdir(self.backing)
                                if not n.startswith(".")), ["again", "again b"])
        saves = os.path.join(self.backing, ".saves")
        self.assertEqual(os.listdir(saves) if os.path.isdir(saves) else [], [])
        self.stop(w2)
        w1 = self.world(1)
        self.job(1, "load_version", self.spec(w1), "again", 7)


class Client(DcpCase):
    """The package's own save/load (not DCP) of DTensors, across world sizes."""

    def test_dtensors_saved_at_4_loaded_at_2_and_1(self):
        w4 = self.world(4)
        self.job(4, "client_save", self.spec(w4), "c4", "2d")
        db = os.path.join(w4.mnt(0), "c4", ".metadata")
        # dt.rep (Replicate) is one chunk; dt2.rs ([Replicate, Shard(0)])
        # has 2 distinct chunks held by 2 ranks each: stored once each
        self.assertEqual(query(db, "SELECT count(*) FROM chunks WHERE fqn='dt.rep'"), [(1,)])
        self.assertEqual(query(db, "SELECT count(*) FROM chunks WHERE fqn='dt2.rs'"), [(2,)])
        self.stop(w4)
        w2 = self.world(2)
        self.job(2, "client_load", self.spec(w2), "c4", "2d")
        self.stop(w2)
        w1 = self.world(1)
        self.job(1, "client_load", self.spec(w1), "c4")


class Optimizer(DcpCase):

    def test_fully_sharded_adam_state_and_async_save(self):
        w2 = self.world(2)
        out = self.job(2, "optim_save", self.spec(w2), "opt", "opt-async")
        digest = out[0]["digest"]
        self.assertEqual(out[1]["digest"], digest)
        self.assertNotEqual(out[0]["after_step"], digest, "the step changed nothing")
        print(f"optimizer: {out[0]['how']}, async_save stall {out[0]['stall']:.3f} s, "
              f"overlapped a step: {out[0]['overlapped']}", file=sys.stderr)
        self.stop(w2)
        w1 = self.world(1)
        for name in ("opt", "opt-async"):
            got = self.job(1, "optim_load", self.spec(w1), name)
            self.assertEqual(got[0]["digest"], digest, f"{name} at 1 rank")
        self.stop(w1)
        w4 = self.world(4)
        got = self.job(4, "optim_load", self.spec(w4), "opt-async")
        self.assertEqual({d["digest"] for d in got.values()}, {digest})


class Errors(DcpCase):

    def test_error_on_one_rank_raises_on_every_rank(self):
        w2 = self.world(2, opts="commit_timeout=60")
        out = self.job(2, "fail_one", self.spec(w2), "bad", 1)
        for r in (0, 1):
            self.assertEqual(out[r]["raised"], "CheckpointException", out[r])
            self.assertLess(out[r]["seconds"], 60, out[r])
            self.assertFalse(out[r]["staged_left"], out[r])
        self.assertIn("refuses to be saved", out[1]["message"])
        self.assertIn("another rank failed", out[0]["message"] + out[1]["message"])
        # the reason reads as what it is: rank 1's own error, never the
        # item a rank commits to abort (nor its bytes), on .status or in the log
        self.assertRegex(out[0]["message"], r"rank 1 aborted the save: \w+: .*refuses to be saved")
        log = util.read_log(w2.log, 1 << 24)
        self.assertIn("bad: commit failed: rank 1 aborted the save: ", log)
        for text in (out[0]["message"], out[1]["message"], log):
            self.assertNotIn("_ckptfs_abort", text)
            self.assertNotIn("wrote 0 bytes", text)
        # the retry committed
        self.assertTrue(os.path.exists(os.path.join(w2.mnt(0), "bad", ".metadata")))

    def test_dead_mount_named_at_set_up(self):
        """A rank mount whose daemon exited (ENOTCONN): the Writer and the
        Reader say so when DCP sets them up (dcp.save, dcp.load), before
        anything is planned, not that it "is not a directory"."""
        m = self.mount()
        m.proc.kill()
        m.proc.wait()
        out = run_py(self, self.py, r'''
import sys, torch
import torch.distributed.checkpoint as dcp
import ckptfs.dcp
mnt = sys.argv[1]
w = ckptfs.dcp.Writer(mnt)
w.reset("s")
for what, fn in (("writer", lambda: w.set_up_storage_writer(True)),
                 ("reader", lambda: ckptfs.dcp.Reader(mnt, checkpoint_id="s").read_metadata()),
                 ("dcp.save", lambda: dcp.save({"w": torch.ones(2)}, checkpoint_id="s",
                                               storage_writer=ckptfs.dcp.Writer(mnt),
                                               no_dist=True)),
                 ("dcp.load", lambda: dcp.load({"w": torch.ones(2)}, checkpoint_id="s",
                                               storage_reader=ckptfs.dcp.Reader(mnt),
                                               no_dist=True))):
    try:
        fn()
        print(what, "went ahead")
    except BaseException as e:
        print(what, "raised:", type(e).__name__, " | ".join(str(e).splitlines()))
''', self.mnt)
        want = (f"rank 0: the ckptfs mount at {self.mnt} is gone (ENOTCONN): its daemon "
                "exited; see its log")
        for what in ("writer", "reader", "dcp.save", "dcp.load"):
            line = [ln for ln in out.splitlines() if ln.startswith(what + " ")]
            self.assertEqual(len(line), 1, out)
            self.assertIn(want, line[0])
        self.assertIn("writer raised: CkptfsError", out)
        self.assertIn("reader raised: CkptfsError", out)

    def test_leftover_staged_checkpoint_on_one_rank(self):
        w2 = self.world(2, opts="commit_timeout=60")
        out = self.job(2, "leftover", self.spec(w2), "left")
        for r in (0, 1):
            self.assertLess(out[r]["seconds"], 30, out[r])
        self.assertIn("already exists", out[1]["message"])
        self.assertIn("another rank failed", out[0]["message"])
        self.assertTrue(os.path.exists(os.path.join(self.backing, "left", ".metadata")))

    def test_commit_error_pickles(self):
        code = r'''
import pickle, ckptfs
e = ckptfs.CommitError("step-1", "failed\nw: rank 1 wrote 4 bytes, 8 expected", "/m/step-1")
f = pickle.loads(pickle.dumps(e))
assert type(f) is ckptfs.CommitError and str(f) == str(e) and f.status == e.status, (f, e)
assert f.name == "step-1" and f.path == "/m/step-1"
'''
        run_py(self, sys.executable, code)


class Paths(unittest.TestCase):

    def test_fqn_paths(self):
        py = require_torch(self)
        code = r'''
from ckptfs.dcp import fqn_paths
p = fqn_paths(["model.l0.w", "a..b", "x/y", "dir", "dir.leaf", ".h", "_fqn.z", "e" * 256])
assert p["model.l0.w"] == "model/l0/w", p
assert p["dir.leaf"] == "dir/leaf" and p["_fqn.z"] == "_fqn/z", p
for k in ("a..b", "x/y", "dir", ".h", "e" * 256):
    assert p[k].startswith("_fqn1/") and len(p[k]) == 6 + 40, (k, p[k])
assert len(set(p.values())) == len(p)
assert fqn_paths(["b", "a"]) == fqn_paths(["a", "b"])
import ckptfs.dcp
for bad in (0, -1, 1.5):
    try:
        ckptfs.dcp.Writer("/mnt/rank%r", threads=bad)
    except ValueError as e:
        assert "threads=" in str(e), e
    else:
        raise AssertionError(f"threads={bad} accepted")
assert ckptfs.dcp.Writer("/mnt/rank%r", threads=1).threads == 1
'''
        run_py(self, py, code)


class Formats(DcpCase):

    def test_safetensors_package_reads_the_view(self):
        """safetensors' load_file, safe_open with slices (torch and numpy),
        and torch's HuggingFaceStorageReader, on the .safetensors view."""
        w1 = self.world(1)
        self.job(1, "save", self.spec(w1), "st")
        view = os.path.join(w1.mnt(0), "st", ".safetensors", "model.safetensors")
        code = r'''
import sys, torch, numpy as np
sys.path.insert(0, sys.argv[2])
from dcp_job import make, DTENSORS, PLAIN
from safetensors import safe_open
from safetensors.torch import load_file
path = sys.argv[1]
want = {n: make(n, s, d) for n, (s, d, _p) in DTENSORS.items()}
want.update({n: make(n, s, d) for n, (s, d) in PLAIN.items()})
sd = load_file(path)
for n, t in want.items():
    assert n in sd, (n, sorted(sd))
    assert sd[n].dtype == t.dtype and torch.equal(sd[n], t), n
with safe_open(path, "pt") as f:
    sl = f.get_slice("dt.big")
    assert torch.equal(sl[100:200, 64:128], want["dt.big"][100:200, 64:128])
    assert torch.equal(f.get_tensor("rep.w"), want["rep.w"])
with safe_open(path, "np") as f:  # numpy has no bfloat16: float64 here
    assert np.array_equal(f.get_tensor("dt.col"), want["dt.col"].numpy())
# torch's own Hugging Face reader, on the view's directory
import os, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
names = ["dt.big", "dt.col", "rep.w", "rep.bf", "dt.rep"]
tgt = {n: torch.zeros_like(want[n]) for n in names}
dcp.load(tgt, storage_reader=HuggingFaceStorageReader(path=os.path.dirname(path)), no_dist=True)
for n in names:
    assert torch.equal(tgt[n], want[n]), n
print("ok", len(sd))
'''
        out = run_py(self, self.py, code, view, os.path.dirname(JOB))
        self.assertTrue(out.startswith("ok"), out)

    def test_import_stock_dcp_and_export_to_it(self):
        stock = os.path.join(self.dir, "stock")
        out = os.path.join(self.dir, "exported")
        # a stock checkpoint written by dcp.save at 2 ranks (FileSystemWriter),
        # with non-contiguous chunks (transposed and strided views)
        code_save = r'''
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard
sys.path.insert(0, sys.argv[2])
from dcp_job import make
rank = int(os.environ["OMPI_COMM_WORLD_RANK"]); ws = int(os.environ["OMPI_COMM_WORLD_SIZE"])
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
dist.init_process_group("gloo", rank=rank, world_size=ws)
m = init_device_mesh("cpu", (ws,))
sd = {"w": distribute_tensor(make("w", (12, 7)), m, [Shard(0)]),
      "wt": make("wt", (9, 4)).t(),                      # a transposed view
      "strided": make("strided", (10, 6), torch.float64)[::2, 1::2],
      "bf": make("bf", (33,), torch.bfloat16),
      "nested": {"i": make("i", (5,), torch.int32), "obj": {"k": [1, 2]}}}
dcp.save(sd, checkpoint_id=sys.argv[1])
dist.barrier()
# saved on every rank: end without torch's teardown (its gloo threads
# sometimes abort a finished job there, see dcp_job.main)
sys.stdout.flush()
os._exit(0)
'''
        env = dict(os.environ, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                   PYTHONPATH=PACKAGE, PYTHONWARNINGS="ignore")
        r = subprocess.run(MPIRUN + ["-np", "2", "-x", "MASTER_PORT", "-x", "PYTHONPATH",
                                     "-x", "OMP_NUM_THREADS", "-x", "PYTHONWARNINGS",
                                     self.py, "-c", code_save, stock, os.path.dirname(JOB)],
                           capture_output=True, text=True, timeout=600, env=env)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        # import into BACKING_DIR (the package mounts it for the import)
        code_imp = r'''
import sys, ckptfs.dcp
ckptfs.dcp.import_checkpoint(sys.argv[1], sys.argv[2], "imported", binary=sys.argv[3])
'''
        run_py(self, self.py, code_imp, stock, self.backing, util.BIN)
        self.assertTrue(os.path.exists(os.path.join(self.backing, "imported", ".metadata")))
        m = self.mount()
        code_chk = r'''
import sys, torch, numpy as np
sys.path.insert(0, sys.argv[2])
from dcp_job import make
ck = sys.argv[1]
def t(rel, dt, shape):
    return torch.frombuffer(bytearray(open(f"{ck}/{rel}", "rb").read()), dtype=dt).reshape(shape)
assert torch.equal(t("w", torch.float32, (12, 7)), make("w", (12, 7)))
assert torch.equal(t("wt", torch.float32, (4, 9)), make("wt", (9, 4)).t())
assert torch.equal(t("strided", torch.float64, (5, 3)), make("strided", (10, 6), torch.float64)[::2, 1::2])
assert torch.equal(t("bf", torch.bfloat16, (33,)), make("bf", (33,), torch.bfloat16))
assert torch.equal(t("nested/i", torch.int32, (5,)), make("i", (5,), torch.int32))
import io
assert torch.load(io.BytesIO(open(f"{ck}/nested/obj/k", "rb").read()), weights_only=False) == [1, 2]
print("ok")
'''
        run_py(self, self.py, code_chk, os.path.join(m.mnt, "imported"), os.path.dirname(JOB))
        # export the imported checkpoint back to a stock DCP directory
        code_exp = r'''
import sys, ckptfs.dcp
ckptfs.dcp.export_checkpoint(sys.argv[1], "imported", sys.argv[2])
'''
        run_py(self, self.py, code_exp, m.mnt, out)
        code_load = r'''
import sys, torch, torch.distributed.checkpoint as dcp
sys.path.insert(0, sys.argv[3])
from dcp_job import make
for d in (sys.argv[1], sys.argv[2]):
    sd = {"w": torch.zeros(12, 7), "wt": torch.zeros(4, 9), "strided": torch.zeros(5, 3, dtype=torch.float64),
          "bf": torch.zeros(33, dtype=torch.bfloat16), "nested": {"i": torch.zeros(5, dtype=torch.int32), "obj": {"k": None}}}
    dcp.load(sd, checkpoint_id=d)
    assert torch.equal(sd["w"], make("w", (12, 7))), d
    assert torch.equal(sd["wt"], make("wt", (9, 4)).t()), d
    assert torch.equal(sd["strided"], make("strided", (10, 6), torch.float64)[::2, 1::2]), d
    assert torch.equal(sd["bf"], make("bf", (33,), torch.bfloat16)), d
    assert torch.equal(sd["nested"]["i"], make("i", (5,), torch.int32)), d
    assert sd["nested"]["obj"]["k"] == [1, 2], d
print("ok")
'''
        run_py(self, self.py, code_load, stock, out, os.path.dirname(JOB),
               env={"PYTHONWARNINGS": "ignore"})
        # the same through ckptctl (which runs the package's converter)
        ckptctl = os.path.join(os.path.dirname(util.BIN), "ckptctl")
        env = dict(os.environ, CKPTFS_PYTHON=self.py, PYTHONPATH=PACKAGE,
                   PYTHONWARNINGS="ignore")
        backing2 = os.path.join(self.dir, "backing2")
        r = subprocess.run([ckptctl, "import-dcp", stock, backing2, "viactl"],
                           capture_output=True, text=True, env=env, timeout=600)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        out2 = os.path.join(self.dir, "exported2")
        r = subprocess.run([ckptctl, "export", "--json", backing2, "viactl", "--dcp", out2],
                           capture_output=True, text=True, env=env, timeout=600)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(json.loads(r.stdout), {"name": "viactl", "from": backing2,
                                                "to": out2, "format": "dcp"})
        run_py(self, self.py, code_load, stock, out2, os.path.dirname(JOB),
               env={"PYTHONWARNINGS": "ignore"})
        # a converter that cannot run: a clear error, nothing imported
        r = subprocess.run([ckptctl, "import-dcp", stock, backing2, "nopy"],
                           capture_output=True, text=True, timeout=60,
                           env=dict(env, CKPTFS_PYTHON="/nonexistent/python"))
        self.assertEqual(r.returncode, 1)
        self.assertIn("needs a Python with the ckptfs package", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(backing2, "nopy")))


if __name__ == "__main__":
    main()
