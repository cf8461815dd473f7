#!/usr/bin/env python3
"""Stock `dcp.save(checkpoint_id=MOUNT/NAME)` (torch's FileSystemWriter, as
Lightning's DCPIO and torchtitan call it) into a ckptfs mount (issue 24).

It cannot work end to end: FileSystemWriter's `.metadata` is a pickle that
stock `dcp.load` reads back by that name, while a committed checkpoint's
`.metadata` is ckptfs's SQLite database (the contract every other reader
relies on). So it is refused before its first data file is written: the
creation of `__R_K.distcp` directly under a staged checkpoint gets EPERM,
and the daemon's log line names `ckptfs.dcp.Writer`, which is stock DCP
with a ckptfs storage writer (and `ckptctl import-dcp` for a DCP directory
saved elsewhere). Nothing is left half-written."""

import os

from ckpttest.util import CkptfsTestCase, main, read_all, state
from ckpttest.pyenv import require_torch, run_py

STOCK_SAVE = r"""
import errno, os, sys, warnings
import torch
import torch.distributed.checkpoint as dcp
warnings.simplefilter("ignore")
path = sys.argv[1]
sd = {"w": torch.arange(1000, dtype=torch.float32), "step": 7}
try:
    dcp.save(sd, checkpoint_id=path)
except BaseException as e:  # DCP wraps each rank's error: CheckpointException
    failures = getattr(e, "failures", None) or {}
    e = next(iter(failures.values()), e)
    e = e[0] if isinstance(e, tuple) else e  # (exception, traceback)
    while not isinstance(e, OSError) and (e.__cause__ or e.__context__):
        e = e.__cause__ or e.__context__
    if isinstance(e, OSError):
        print("refused", errno.errorcode[e.errno], os.path.basename(e.filename or ""))
    else:
        print("failed", type(e).__name__, str(e)[-300:])
else:
    print("saved")
"""

WRITER_SAVE = r"""
import sys, warnings
import torch
import torch.distributed.checkpoint as dcp
import ckptfs.dcp
warnings.simplefilter("ignore")
mount, name = sys.argv[1], sys.argv[2]
sd = {"w": torch.arange(1000, dtype=torch.float32), "step": 7}
dcp.save(sd, checkpoint_id=name, storage_writer=ckptfs.dcp.Writer(mount))
back = {"w": torch.zeros(1000), "step": 0}
dcp.load(back, checkpoint_id=name, storage_reader=ckptfs.dcp.Reader(mount))
assert torch.equal(back["w"], sd["w"]) and back["step"] == 7
print("ok")
"""


class StockDcp(CkptfsTestCase):
    def test_refused_before_the_first_data_file(self):
        py = require_torch(self)
        self.mount()
        path = self.ck("step-7")
        out = run_py(self, py, STOCK_SAVE, path).split()
        self.assertEqual(out, ["refused", "EPERM", "__0_0.distcp"])
        log = self.daemon_log()
        self.assertIn("step-7/__0_0.distcp: refused", log)
        self.assertIn("ckptfs.dcp.Writer", log)
        # nothing half-written: the staged checkpoint holds no file at all
        self.assertEqual(state(path), "staging")
        self.assertEqual(os.listdir(path), [])
        os.rmdir(path)
        self.assertEqual([n for n in os.listdir(self.backing) if not n.startswith(".")], [])
        # the same state dict through ckptfs.dcp.Writer: saved and loaded
        out = run_py(self, py, WRITER_SAVE, self.mnt, "step-7")
        self.assertEqual(out.split(), ["ok"])
        self.assertEqual(state(path), "committed")
        # other names ending in .distcp, and the same name deeper, are files
        os.mkdir(self.ck("files"))
        for rel in ("__0_0.distcp.bak", "x__0_0.distcp", "sub/__0_0.distcp"):
            p = self.ck("files", rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(rel.encode())
        with open(self.ck("files", ".commit"), "w") as f:
            f.write("sync")
        self.assertEqual(read_all(self.ck("files", "sub", "__0_0.distcp")), b"sub/__0_0.distcp")


if __name__ == "__main__":
    main()
