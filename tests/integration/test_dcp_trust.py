#!/usr/bin/env python3
"""What `ckptctl import-dcp` and `ckptctl export --dcp` trust (issue 23,
case 1). They run as root on directories other users own: the DCP
directory and the current directory here belong to uid 65534, and every
attack must be refused with nothing run, nothing outside DCP_DIR read and
nothing committed.

    python3 tests/integration/test_dcp_trust.py --bin build/bin/ckptfs [Class ...]

Classes:
  HostilePickle   a .metadata pickle that calls os.system (inside a real
                  Metadata, and at its top): the marker file is never
                  created, ckptctl exits non-zero naming the refused global
  HostileCwd      a ckptfs/__init__.py in the (uid 65534) current directory:
                  never run, by import-dcp nor by export --dcp; the
                  conversion works (DCP_DIR given relative to that cwd)
  HostileExportDir  symlinks planted in export's DCP_DIR under its temporary
                  names: replaced, never written through (a 0600 root file
                  stays as it was)
  HostilePaths    items whose relative_path is absolute, '../secret', has a
                  '/', or is a symlink to a 0600 secret (a bytes item and a
                  tensor item): refused before anything is read or
                  committed; the secret's bytes appear nowhere under
                  BACKING_DIR
  Tiling          (issue 33, case 4) chunks that do not tile their tensor
                  exactly: a tensor with no chunks (its buffer, uninitialised
                  memory, was committed), a gap, overlapping chunks, overlaps
                  whose element count hides a gap, a chunk out of bounds or
                  of another rank than its tensor: refused before anything
                  is created (not even BACKING_DIR, which a mount would
                  make), naming the tensor and what is wrong; an exact
                  irregular tiling (and a scalar, an empty tensor) imports
                  with the right values
  Backing         (issue 33, case 4) sizes the item files do not back: a
                  size bomb (a tensor of 2**40 elements whose chunk claims a
                  1 KiB torch.save) refused within seconds and with under
                  256 MiB more memory than a tiny refused import (the
                  baseline: Python and torch); a chunk or a bytes item
                  stored past the end of its file, a chunk with no storage
                  entry, chunks sharing one stored range: refused before
                  anything is created
Needs root (chown to another uid) and torch (tests/integration/ckpttest/pyenv.py).
"""

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

from ckpttest import util
from ckpttest.util import CkptfsTestCase, main
from ckpttest.pyenv import PACKAGE, require_torch, run_py

NOBODY = 65534

# A stock DCP checkpoint made by dcp.save: DIR.
SAVE = r'''
import sys, torch, torch.distributed.checkpoint as dcp
sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "obj": {"k": [1, 2]}}
dcp.save(sd, checkpoint_id=sys.argv[1], no_dist=True)
'''

# DIR's .metadata pickled again with each enum member as getattr(ENUM,
# NAME), as Debian 12's Python 3.11.2 pickles it: HOW member (its name) or
# dunder ("__class__": no member).
REPICKLE = r'''
import enum, pickle, sys
d, how = sys.argv[1:3]
with open(d + "/.metadata", "rb") as f:
    md = pickle.load(f)
class P(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return (getattr, (type(obj), obj.name if how == "member" else "__class__"))
        return NotImplemented
with open(d + "/.metadata", "wb") as f:
    P(f, protocol=4).dump(md)
'''

# .metadata files of plain DCP classes, for each "DIR KIND TARGET LENGTH"
# of the arguments (one process: one import of torch). KIND bytes/tensor:
# one item of that kind stored at relative_path TARGET, LENGTH bytes;
# system: a Metadata whose planner_data holds an object that runs
# os.system(TARGET) when unpickled; system-top: that object alone.
FORGE = r'''
import os, pickle, sys, torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
    Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.filesystem import _StorageInfo

class Run:
    def __init__(self, target):
        self.target = target
    def __reduce__(self):
        return (os.system, (self.target,))

def forge(d, kind, target, length):
    md, storage = {}, {}
    if kind == "bytes":
        md["blob"] = BytesStorageMetadata()
        storage[MetadataIndex("blob")] = _StorageInfo(target, 0, length)
    elif kind == "tensor":
        size = torch.Size([4])
        md["t"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size,
                                        [ChunkStorageMetadata(torch.Size([0]), size)])
        storage[MetadataIndex("t", torch.Size([0]))] = _StorageInfo(target, 0, length)
    obj = Metadata(state_dict_metadata=md, planner_data={f: (f,) for f in md},
                   storage_data=storage, storage_meta=StorageMeta(save_id="x"))
    if kind == "system":
        obj.planner_data = {"x": Run(target)}
    elif kind == "system-top":
        obj = Run(target)
    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(obj, f)

args = sys.argv[1:]
for i in range(0, len(args), 4):
    forge(args[i], args[i + 1], args[i + 2], int(args[i + 3]))
'''

# A DCP directory described by SPEC (JSON): DIR SPEC. SPEC maps each FQN
# to {"dtype", "size", "chunks": [{"offsets", "sizes", ...}]} (a tensor) or
# {"bytes": HEX} (a bytes item). Every chunk is stored as stock DCP stores
# it, a torch.save of the chunk (its elements' values: 1 + their row-major
# index in the tensor), appended to __0_0.distcp, unless it says otherwise:
# "store": SHAPE saves a tensor of that shape instead (a size bomb's small
# file); "storage": "none" gives it no storage_data entry; "same_as": K
# points its entry at chunk K's stored bytes; "length_add" / "offset_add"
# move its entry's end / start (past the end of the file).
FORGE_CHUNKS = r"""
import io, json, math, os, pickle, sys, torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
    Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.filesystem import _StorageInfo
def forge(d, spec):
    data = "__0_0.distcp"
    md, storage = {}, {}
    with open(os.path.join(d, data), "wb") as out:
        for fqn, t in spec.items():
            if "bytes" in t:
                b = bytes.fromhex(t["bytes"])
                pos = out.tell()
                out.write(b)
                md[fqn] = BytesStorageMetadata()
                storage[MetadataIndex(fqn)] = _StorageInfo(data, pos + t.get("offset_add", 0),
                                                           len(b) + t.get("length_add", 0))
                continue
            dt = getattr(torch, t["dtype"])
            chunks, stored = [], []
            for c in t["chunks"]:
                off, sz = torch.Size(c["offsets"]), torch.Size(c["sizes"])
                chunks.append(ChunkStorageMetadata(off, sz))
                if "store" in c:
                    x = torch.ones(c["store"], dtype=dt)
                elif len(sz) == len(t["size"]) and math.prod(t["size"]) <= 1 << 20:
                    whole = torch.arange(1, math.prod(t["size"]) + 1, dtype=torch.float64)
                    x = whole.reshape(t["size"])[tuple(slice(o, o + s) for o, s in zip(off, sz))]
                    x = x.to(dt).contiguous()
                else:
                    x = torch.ones(4, dtype=dt)
                if "same_as" in c:
                    pos, length = stored[c["same_as"]]
                else:
                    buf = io.BytesIO()
                    torch.save(x, buf)
                    pos, length = out.tell(), len(buf.getvalue())
                    out.write(buf.getvalue())
                stored.append((pos, length))
                if c.get("storage") != "none":
                    storage[MetadataIndex(fqn, off)] = _StorageInfo(
                        data, pos + c.get("offset_add", 0), length + c.get("length_add", 0))
            md[fqn] = TensorStorageMetadata(TensorProperties(dtype=dt), torch.Size(t["size"]),
                                            chunks)
    obj = Metadata(state_dict_metadata=md, planner_data={f: (f,) for f in md},
                   storage_data=storage, storage_meta=StorageMeta(save_id="x"))
    with open(os.path.join(d, ".metadata"), "wb") as f:
        pickle.dump(obj, f)

# argv[1]: a JSON file of [[DIR, SPEC], ...]: every forged directory in one
# process (one import of torch)
for d, spec in json.load(open(sys.argv[1])):
    forge(d, spec)
"""

# Runs ARGV; prints {rc, stdout, stderr, seconds, maxrss_kib}: the peak
# resident set of the largest process of ARGV's tree (ckptctl, the
# converter it runs, and anything they waited for), in KiB.
MEASURE = r"""
import json, resource, subprocess, sys, time
t0 = time.monotonic()
r = subprocess.run(sys.argv[1:], capture_output=True, text=True, stdin=subprocess.DEVNULL)
print(json.dumps({"rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr,
                  "seconds": time.monotonic() - t0,
                  "maxrss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""

# torch.save of a float32 tensor [4] to FILE (a secret in tensor form).
TSAVE = r'''
import sys, torch
torch.save(torch.tensor([1.5, 2.5, 3.5, 4.5]), sys.argv[1])
'''


def read_text(path):
    """path's text, "" when it does not exist."""
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def chown_tree(top, uid=NOBODY):
    for root, dirs, files in os.walk(top):
        for n in dirs + files:
            os.lchown(os.path.join(root, n), uid, uid)
    os.lchown(top, uid, uid)


class DcpTrustCase(CkptfsTestCase):

    def setUp(self):
        super().setUp()
        self.py = require_torch(self)
        self.ckptctl = os.path.join(os.path.dirname(util.BIN), "ckptctl")
        self.env = dict(os.environ, CKPTFS_PYTHON=self.py, PYTHONPATH=PACKAGE,
                        PYTHONWARNINGS="ignore", CKPTFS_BIN=util.BIN)
        # uid 65534 must reach its own directories in here
        os.chmod(self.dir, 0o755)

    def ctl(self, *args, cwd=None):
        return subprocess.run([self.ckptctl] + [str(a) for a in args], capture_output=True,
                              text=True, env=self.env, timeout=300, cwd=cwd,
                              stdin=subprocess.DEVNULL)

    def stock(self, path):
        run_py(self, self.py, SAVE, path)
        return path

    def forge(self, cases):
        """FORGE for each (path, kind, target, length), in one process:
        the paths."""
        args = []
        for path, kind, target, length in cases:
            os.makedirs(path, exist_ok=True)
            args += [path, kind, target, length]
        run_py(self, self.py, FORGE, *args)
        return [c[0] for c in cases]

    def assertNotImported(self, r, name):
        self.assertNotEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertFalse(os.path.exists(self.bk(name)), f"{name} was created in BACKING_DIR")


class HostilePickle(DcpTrustCase):

    def test_enum_pickled_by_getattr(self):
        """An enum member pickled as builtins.getattr(ENUM, NAME) (Python
        3.11.2's dcp.save) imports; a getattr of anything but a member of
        an admitted enum is refused."""
        for how in ("member", "dunder"):
            with self.subTest(how=how):
                d = self.stock(os.path.join(self.dir, f"enum-{how}"))
                run_py(self, self.py, REPICKLE, d, how)
                with open(os.path.join(d, ".metadata"), "rb") as f:
                    self.assertIn(b"getattr", f.read())
                chown_tree(d)
                r = self.ctl("import-dcp", d, self.backing, how)
                if how == "member":
                    self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
                    self.assertTrue(os.path.exists(self.bk(how, ".metadata")))
                else:
                    self.assertNotImported(r, how)
                    self.assertIn("refused getattr", r.stderr)

    def test_os_system_never_runs(self):
        kinds = ("system", "system-top")
        marker = {kind: os.path.join(self.dir, f"marker-{kind}") for kind in kinds}
        dirs = self.forge([(os.path.join(self.dir, f"dcp-{kind}"), kind, f"id > {marker[kind]}", 0)
                           for kind in kinds])
        for kind, d in zip(kinds, dirs):
            with self.subTest(kind=kind):
                chown_tree(d)
                r = self.ctl("import-dcp", d, self.backing, "evil")
                self.assertFalse(os.path.exists(marker[kind]),
                                 "the pickle's os.system ran: " + r.stderr)
                self.assertNotImported(r, "evil")
                # os.system pickles as posix.system
                self.assertIn("posix.system", r.stderr)
                self.assertIn("refused", r.stderr)


class HostileCwd(DcpTrustCase):

    def test_cwd_package_never_runs(self):
        cwd = os.path.join(self.dir, "cwd")
        os.makedirs(os.path.join(cwd, "ckptfs"))
        marker = os.path.join(self.dir, "marker")
        for mod in ("__init__.py", "dcp.py"):
            with open(os.path.join(cwd, "ckptfs", mod), "w") as f:
                f.write(f"import os\nopen({marker!r}, 'a').write('ran {mod} as %d\\n' % os.getuid())\n")
        self.stock(os.path.join(cwd, "stock"))
        chown_tree(cwd)
        # DCP_DIR relative to the cwd: the converter must still find it
        r = self.ctl("import-dcp", "stock", self.backing, "good", cwd=cwd)
        ran = read_text(marker)
        self.assertEqual(ran, "", "the cwd's ckptfs package ran")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertTrue(os.path.exists(self.bk("good", ".metadata")))
        r = self.ctl("export", self.backing, "good", "--dcp", "out", cwd=cwd)
        ran = read_text(marker)
        self.assertEqual(ran, "", "the cwd's ckptfs package ran")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertTrue(os.path.exists(os.path.join(cwd, "out", ".metadata")))


class HostileExportDir(DcpTrustCase):

    def test_planted_symlinks_not_written_through(self):
        self.stock(os.path.join(self.dir, "stock"))
        r = self.ctl("import-dcp", os.path.join(self.dir, "stock"), self.backing, "good")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        victim = os.path.join(self.dir, "victim")
        fd = os.open(victim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"root's file")
        os.close(fd)
        out = os.path.join(self.dir, "out")
        os.mkdir(out)
        for n in ("__0_0.distcp.tmp", ".metadata.tmp"):
            os.symlink(victim, os.path.join(out, n))
        chown_tree(out)
        r = self.ctl("export", self.backing, "good", "--dcp", out)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        with open(victim, "rb") as f:
            self.assertEqual(f.read(), b"root's file", "export wrote through a symlink")
        self.assertTrue(os.path.isfile(os.path.join(out, ".metadata")))
        self.assertFalse(os.path.islink(os.path.join(out, ".metadata")))


class HostilePaths(DcpTrustCase):

    def setUp(self):
        super().setUp()
        self.secret = os.path.join(self.dir, "secret")
        self.secret_bytes = b"SECRET-" + os.urandom(16).hex().encode()
        fd = os.open(self.secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, self.secret_bytes)
        os.close(fd)
        self.tsecret = os.path.join(self.dir, "tsecret")
        run_py(self, self.py, TSAVE, self.tsecret)
        os.chmod(self.tsecret, 0o600)
        with open(self.tsecret, "rb") as f:
            self.tsecret_bytes = f.read()

    def assertSecretNowhere(self):
        for root, _, files in os.walk(self.backing):
            for n in files:
                p = os.path.join(root, n)
                if os.path.islink(p) or not os.path.isfile(p):
                    continue
                with open(p, "rb") as f:
                    data = f.read()
                self.assertNotIn(self.secret_bytes, data, f"secret bytes in {p}")
                # the tensor secret's values, as raw float32
                self.assertNotIn(bytes.fromhex("0000c03f000020400000604000009040"), data,
                                 f"tensor secret in {p}")

    def test_paths_refused(self):
        n = len(self.secret_bytes)
        cases = [("abs", "bytes", self.secret, n), ("dotdot", "bytes", "../secret", n),
                 ("slash", "bytes", "sub/../../secret", n), ("empty", "bytes", "", n),
                 ("symlink", "bytes", "link", n),
                 ("tensor-abs", "tensor", self.tsecret, len(self.tsecret_bytes)),
                 ("tensor-symlink", "tensor", "tlink", len(self.tsecret_bytes))]
        dirs = self.forge([(os.path.join(self.dir, f"dcp{i}"), kind, rel, length)
                           for i, (_, kind, rel, length) in enumerate(cases)])
        for i, ((label, kind, rel, length), d) in enumerate(zip(cases, dirs)):
            with self.subTest(case=label):
                os.makedirs(os.path.join(d, "sub"))
                os.symlink(self.secret, os.path.join(d, "link"))
                os.symlink(self.tsecret, os.path.join(d, "tlink"))
                chown_tree(d)
                name = f"p{i}"
                r = self.ctl("import-dcp", d, self.backing, name)
                self.assertNotImported(r, name)
                self.assertIn("refused", r.stderr)
                self.assertSecretNowhere()



def chunk(offsets, sizes, **kw):
    return dict(offsets=list(offsets), sizes=list(sizes), **kw)


def tensor(size, chunks, dtype="float32"):
    return dict(dtype=dtype, size=list(size), chunks=chunks)


def f32(values):
    return struct.pack(f"<{len(values)}f", *values)


class CheckedCase(DcpTrustCase):
    """Forged DCP directories (FORGE_CHUNKS) that import-dcp must refuse
    before it creates anything: not NAME, and not BACKING_DIR either (the
    test leaves it absent; the converter's mount of it would make it).
    Every directory a test of the class imports is in the class's SPECS
    ({label: spec}): all are forged at its first test, in one process (one
    import of torch), owned by uid 65534; import-dcp only reads them."""

    SPECS = {}
    forged = None

    def forged_dir(self, label):
        """The forged directory of SPECS[label]."""
        cls = type(self)
        if cls.forged is None:
            top = tempfile.mkdtemp(prefix="ckptfs-forged-", dir="/tmp")
            cls.addClassCleanup(shutil.rmtree, top, ignore_errors=True)
            os.chmod(top, 0o755)
            dirs = {name: os.path.join(top, f"dcp-{name}") for name in cls.SPECS}
            for d in dirs.values():
                os.makedirs(d)
            listing = os.path.join(top, "forge.json")
            with open(listing, "w") as f:
                json.dump([[dirs[name], spec] for name, spec in cls.SPECS.items()], f)
            run_py(self, self.py, FORGE_CHUNKS, listing)
            for d in dirs.values():
                chown_tree(d)
            cls.forged = dirs
        return cls.forged[label]

    def assertRefusedEarly(self, r, name, *words):
        out = r.stdout + r.stderr
        self.assertNotEqual(r.returncode, 0, out)
        self.assertFalse(os.path.exists(self.bk(name)), f"{name} was created: {out}")
        self.assertFalse(os.path.exists(self.backing),
                         f"BACKING_DIR was made (the converter mounted it): {out}")
        self.assertNotIn("Traceback", out)
        for w in words:
            self.assertIn(w, r.stderr)

    def refused(self, label, *words):
        """Import SPECS[label] as NAME=label: refused early, stderr holding
        words."""
        r = self.ctl("import-dcp", self.forged_dir(label), self.backing, label)
        self.assertRefusedEarly(r, label, *words)
        return r

    def all_refused(self, cases):
        """refused() for each (label, words...)."""
        for label, *words in cases:
            with self.subTest(case=label):
                self.refused(label, *words)

    def ctl_measured(self, *args):
        """ckptctl ARGS run under MEASURE: (CompletedProcess-like, seconds,
        peak RSS in KiB of its largest process)."""
        r = subprocess.run([sys.executable, "-c", MEASURE, self.ckptctl] + [str(a) for a in args],
                           capture_output=True, text=True, env=self.env, timeout=300,
                           stdin=subprocess.DEVNULL)
        self.assertEqual(r.returncode, 0, r.stderr)
        m = json.loads(r.stdout)
        return (subprocess.CompletedProcess(args, m["rc"], m["stdout"], m["stderr"]),
                m["seconds"], m["maxrss_kib"])


GOOD = chunk([0], [4])


class Tiling(CheckedCase):

    SPECS = {
        "nochunks": {"w": tensor([4], [GOOD]), "t": tensor([16384], [])},
        "gap1d": {"t": tensor([8], [chunk([0], [4]), chunk([6], [2])])},
        "gap2d": {"t": tensor([4, 4], [chunk([0, 0], [2, 4]), chunk([2, 0], [2, 2])])},
        "over1d": {"t": tensor([8], [chunk([0], [6]), chunk([4], [4])])},
        "over2d": {"t": tensor([4, 4], [chunk([0, 0], [4, 4]), chunk([1, 1], [2, 2])])},
        "twice": {"t": tensor([4], [chunk([0], [4]), chunk([0], [4], same_as=0)])},
        # sizes adding up to the tensor's element count, but overlapping:
        # so they leave a gap
        "hide1d": {"t": tensor([8], [chunk([0], [4]), chunk([2], [4])])},
        "hide2d": {"t": tensor([2, 4], [chunk([0, 0], [2, 2]), chunk([0, 1], [2, 2])])},
        "hide3": {"t": tensor([6], [chunk([0], [2]), chunk([1], [2]), chunk([4], [2])])},
        "oob": {"t": tensor([8], [chunk([0], [6]), chunk([6], [4])])},
        "oob2d": {"t": tensor([4, 4], [chunk([0, 0], [4, 2]), chunk([0, 2], [4, 3])])},
        "rank": {"t": tensor([8], [chunk([0, 0], [8, 1])])},
        "rank0": {"t": tensor([2, 2], [chunk([], [])])},
        "dims": {"t": tensor([8], [chunk([0], [8, 1])])},
        # irregular chunks that tile exactly, a scalar, an empty tensor
        "exact": {"m": tensor([4, 6], [chunk([0, 0], [2, 6]), chunk([2, 0], [2, 1]),
                                       chunk([2, 1], [1, 5]), chunk([3, 1], [1, 5])]),
                  "v": tensor([10], [chunk([7], [3]), chunk([0], [7])]),
                  "s": tensor([], [chunk([], [])]),
                  "e": tensor([0, 3], [chunk([0, 0], [0, 3])]),
                  "blob": {"bytes": b"hello".hex()}},
    }

    def test_tensor_without_chunks(self):
        """A tensor of 16384 elements with no chunks (DCP plans no read
        for it): its torch.empty buffer was committed."""
        self.refused("nochunks", "'t'", "no chunks", "16384")

    def test_chunks_leaving_a_gap(self):
        self.all_refused([("gap1d", "'t'", "gap", "[4]"), ("gap2d", "'t'", "gap", "[2, 2]")])

    def test_overlapping_chunks(self):
        self.all_refused([(label, "'t'", "overlap") for label in ("over1d", "over2d", "twice")])

    def test_overlaps_hiding_a_gap(self):
        self.all_refused([(label, "'t'", "overlap") for label in ("hide1d", "hide2d", "hide3")])

    def test_chunk_out_of_bounds(self):
        self.all_refused([("oob", "'t'", "out of bounds"), ("oob2d", "'t'", "out of bounds"),
                          ("rank", "'t'", "2 dimensions", "1"), ("rank0", "'t'", "0 dimensions"),
                          ("dims", "'t'", "dimensions")])

    def test_exact_tiling_imports(self):
        """Irregular chunks that tile exactly (and a scalar, an empty
        tensor) import, with every element's value."""
        r = self.ctl("import-dcp", self.forged_dir("exact"), self.backing, "exact")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.mount()
        with open(self.ck("exact", "m"), "rb") as f:
            self.assertEqual(f.read(), f32(range(1, 25)))
        with open(self.ck("exact", "v"), "rb") as f:
            self.assertEqual(f.read(), f32(range(1, 11)))
        with open(self.ck("exact", "s"), "rb") as f:
            self.assertEqual(f.read(), f32([1]))
        self.assertEqual(os.path.getsize(self.ck("exact", "e")), 0)


BOMB = 1 << 40
SHARED = 1 << 20


class Backing(CheckedCase):

    SPECS = {
        "baseline": {"t": tensor([8], [chunk([0], [4])])},
        # 2**40 float32 elements (4 TiB), its one chunk a torch.save of 4
        "bomb": {"t": tensor([BOMB], [chunk([0], [BOMB], store=[4])])},
        "nochunkbomb": {"t": tensor([BOMB], [])},
        "end": {"t": tensor([4], [chunk([0], [4], length_add=100)])},
        "start": {"t": tensor([4], [chunk([0], [4], offset_add=1 << 30)])},
        "bytes": {"b": {"bytes": os.urandom(64).hex(), "length_add": 1 << 30}},
        "nostorage": {"t": tensor([8], [chunk([0], [4]), chunk([4], [4], storage="none")])},
        # eight chunks of 2**20 elements, all pointing at one torch.save of
        # 2**20 elements: 32 MiB of tensor from 4 MiB of file
        "shared": {"t": tensor([8 * SHARED], [chunk([0], [SHARED], store=[SHARED])] + [
            chunk([i * SHARED], [SHARED], same_as=0) for i in range(1, 8)])},
    }

    def test_size_bomb_refused_quickly_with_little_memory(self):
        """A tensor of 2**40 float32 elements (4 TiB) whose one chunk claims
        a torch.save of 4 elements: refused within seconds, its time and
        peak memory within 5 s and 256 MiB of a tiny refused import's (a
        gap: Python and torch are most of both)."""
        base, bomb = self.forged_dir("baseline"), self.forged_dir("bomb")
        r, secs, rss = self.ctl_measured("import-dcp", bomb, self.backing, "bomb")
        sys.stderr.write(f"\n  bomb: {secs:.2f} s, {rss / 1024:.0f} MiB peak; ")
        self.assertRefusedEarly(r, "bomb", "'t'", "not backed", str(BOMB))
        r0, s0, rss0 = self.ctl_measured("import-dcp", base, self.backing, "baseline")
        sys.stderr.write(f"baseline (a gap): {s0:.2f} s, {rss0 / 1024:.0f} MiB peak\n")
        self.assertRefusedEarly(r0, "baseline", "'t'", "gap")
        # the time and memory are Python's and torch's: the check adds little
        self.assertLess(secs - s0, 5, "the bomb took too long to refuse")
        self.assertLess(secs, 60, "the bomb took too long to refuse")
        self.assertLess(rss - rss0, 256 << 10,
                        f"the bomb's refusal peaked at {rss} KiB, the baseline at {rss0} KiB")

    def test_bomb_without_chunks(self):
        """2**40 elements and no chunk at all: refused as such, at once."""
        r, secs, rss = self.ctl_measured("import-dcp", self.forged_dir("nochunkbomb"),
                                         self.backing, "nochunkbomb")
        self.assertRefusedEarly(r, "nochunkbomb", "'t'", "no chunks")
        self.assertLess(secs, 60)

    def test_stored_past_the_end_of_its_file(self):
        self.all_refused([("end", "'t'", "past the end"), ("start", "'t'", "past the end"),
                          ("bytes", "'b'", "past the end")])

    def test_chunk_without_storage_entry(self):
        self.refused("nostorage", "'t'", "no storage_data entry")

    def test_chunks_sharing_stored_bytes(self):
        self.refused("shared", "'t'", "share")


if __name__ == "__main__":
    main()
