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
Needs root (chown to another uid) and torch (tests/integration/pyenv.py).
"""

import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckptfs_util  # noqa: E402
from ckptfs_util import CkptfsTestCase, main  # noqa: E402
from pyenv import PACKAGE, require_torch, run_py  # noqa: E402

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

# A .metadata of plain DCP classes: DIR KIND TARGET. KIND bytes/tensor: one
# item of that kind stored at relative_path TARGET; system: a Metadata
# whose planner_data holds an object that runs os.system(TARGET) when
# unpickled; system-top: that object alone.
FORGE = r'''
import os, pickle, sys, torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
    Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.filesystem import _StorageInfo
d, kind, target = sys.argv[1:4]

class Run:
    def __reduce__(self):
        return (os.system, (target,))

md, storage = {}, {}
if kind == "bytes":
    md["blob"] = BytesStorageMetadata()
    storage[MetadataIndex("blob")] = _StorageInfo(target, 0, int(sys.argv[4]))
elif kind == "tensor":
    size = torch.Size([4])
    md["t"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size,
                                    [ChunkStorageMetadata(torch.Size([0]), size)])
    storage[MetadataIndex("t", torch.Size([0]))] = _StorageInfo(target, 0, int(sys.argv[4]))
obj = Metadata(state_dict_metadata=md, planner_data={f: (f,) for f in md},
               storage_data=storage, storage_meta=StorageMeta(save_id="x"))
if kind == "system":
    obj.planner_data = {"x": Run()}
elif kind == "system-top":
    obj = Run()
with open(os.path.join(d, ".metadata"), "wb") as f:
    pickle.dump(obj, f)
'''

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
        self.ckptctl = os.path.join(os.path.dirname(ckptfs_util.BIN), "ckptctl")
        self.env = dict(os.environ, CKPTFS_PYTHON=self.py, PYTHONPATH=PACKAGE,
                        PYTHONWARNINGS="ignore", CKPTFS_BIN=ckptfs_util.BIN)
        # uid 65534 must reach its own directories in here
        os.chmod(self.dir, 0o755)

    def ctl(self, *args, cwd=None):
        return subprocess.run([self.ckptctl] + [str(a) for a in args], capture_output=True,
                              text=True, env=self.env, timeout=300, cwd=cwd,
                              stdin=subprocess.DEVNULL)

    def stock(self, path):
        run_py(self, self.py, SAVE, path)
        return path

    def forge(self, path, kind, target, length=0):
        os.makedirs(path, exist_ok=True)
        run_py(self, self.py, FORGE, path, kind, target, length)
        return path

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
        for kind in ("system", "system-top"):
            with self.subTest(kind=kind):
                marker = os.path.join(self.dir, f"marker-{kind}")
                d = self.forge(os.path.join(self.dir, f"dcp-{kind}"), kind,
                               f"id > {marker}")
                chown_tree(d)
                r = self.ctl("import-dcp", d, self.backing, "evil")
                self.assertFalse(os.path.exists(marker),
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
        for i, (label, kind, rel, length) in enumerate(cases):
            with self.subTest(case=label):
                d = self.forge(os.path.join(self.dir, f"dcp{i}"), kind, rel, length)
                os.makedirs(os.path.join(d, "sub"))
                os.symlink(self.secret, os.path.join(d, "link"))
                os.symlink(self.tsecret, os.path.join(d, "tlink"))
                chown_tree(d)
                name = f"p{i}"
                r = self.ctl("import-dcp", d, self.backing, name)
                self.assertNotImported(r, name)
                self.assertIn("refused", r.stderr)
                self.assertSecretNowhere()


if __name__ == "__main__":
    main()
