#!/usr/bin/env python3
"""Every writer at the speed of a plain directory (issue 38), case by case,
with the real tools of .venv (pyenv.require_modules: safetensors 0.8,
transformers, h5py as scripts/install-deps.sh pins them):

1. Writers that open their file read-write (safetensors 0.8's save_file
   and so save_pretrained, h5py): the file is created read-write, extended
   with ftruncate and written front to back, and read back by the same
   tool. On 53b8824 such a file went through the daemon, its bytes into
   staging memory, kept after the commit (safetensors 1 GiB: +1.06 GB
   resident); now a file created for writing, read-write too, is written
   by the kernel into its own backing file (write once), and the daemon's
   resident memory after a 256 MiB save is within 64 MiB of the idle
   daemon's. The bytes are checked by each tool's own reader, after the
   commit and after a remount.
4. Holes: a sparse file (256 MiB holding 8 bytes) reports its holes while
   staged (through the kernel's backing file, or the daemon's segments
   with passthrough=0) and once committed (its data file's holes):
   st_blocks counts what is allocated, lseek SEEK_DATA/SEEK_HOLE find the
   data, so cp (sparse=auto) and tar -S copy it sparsely. On 53b8824 the
   mount reported it fully allocated and without SEEK_DATA: cp and tar
   wrote every byte.

    python3 tests/integration/test_every_writer.py --bin build/bin/ckptfs
"""

import hashlib
import os
import subprocess
import sys

from ckpttest.pyenv import require_modules, run_py
from ckpttest.util import CkptfsTestCase, commit, main, rss_kib, state
from test_passthrough import skip_without_passthrough

MiB = 1 << 20


def vm_rss(pid):
    return rss_kib(pid) * 1024


SAFETENSORS = r'''
import hashlib, json, sys
import torch
from safetensors.torch import load_file, save_file
path, mib = sys.argv[1], int(sys.argv[2])
torch.manual_seed(1)
sd = {f"layer.{i}.weight": torch.randn(mib * (1 << 20) // 4 // 16) for i in range(16)}
save_file(sd, path, metadata={"format": "pt"})
back = load_file(path)
assert all(torch.equal(sd[k], back[k]) for k in sd), "read back differs"
print(json.dumps({k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in sd.items()}))
'''

SAFETENSORS_CHECK = r'''
import hashlib, json, sys
from safetensors.torch import load_file
want = json.loads(sys.argv[2])
got = {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in load_file(sys.argv[1]).items()}
assert got == want, "committed bytes differ"
print("ok")
'''

SAVE_PRETRAINED = r'''
import hashlib, json, os, sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel
out = sys.argv[1]
torch.manual_seed(2)
cfg = GPT2Config(n_embd=512, n_layer=6, n_head=8, vocab_size=8192, n_positions=512)
model = GPT2LMHeadModel(cfg)
model.save_pretrained(out, max_shard_size="40MB")
shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
assert len(shards) > 1, shards
back = GPT2LMHeadModel.from_pretrained(out)
sd, bd = model.state_dict(), back.state_dict()
assert all(torch.equal(sd[k], bd[k]) for k in sd), "read back differs"
print(json.dumps({"shards": len(shards),
                  "bytes": sum(os.path.getsize(os.path.join(out, f)) for f in shards)}))
'''

H5PY = r'''
import hashlib, json, sys
import h5py, numpy as np
path, mib = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(3)
data = {f"w{i}": rng.standard_normal(mib * (1 << 20) // 8 // 8) for i in range(8)}
with h5py.File(path, "w") as f:            # H5F_ACC_TRUNC: O_RDWR | O_CREAT
    for k, v in data.items():
        f.create_dataset(k, data=v)        # contiguous
with h5py.File(path, "r") as f:
    assert all(np.array_equal(f[k][()], v) for k, v in data.items()), "read back differs"
print(json.dumps({k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in data.items()}))
'''


class ReadWriteWriters(CkptfsTestCase):
    """Case 1: tools that create their file read-write take the write-once
    path, and the daemon's memory stays where it was."""

    SIZE_MIB = 256
    SLACK = 64 * MiB

    def setUp(self):
        super().setUp()
        skip_without_passthrough(self)

    def save_with(self, modules, code, name, *args):
        """Mount, run code (a tool's save into NAME) in the venv, commit;
        the daemon's resident memory before and after; code's output."""
        py = require_modules(self, *modules)
        m = self.mount()
        os.mkdir(self.ck(name))
        idle = vm_rss(m.proc.pid)
        out = run_py(self, py, code, *args, timeout=600)
        commit(self.ck(name))
        self.assertEqual(state(self.ck(name)), "committed")
        grown = vm_rss(m.proc.pid) - idle
        sys.stderr.write(f"\n  {name}: daemon resident +{grown / MiB:.0f} MiB after the "
                         f"commit ({idle / MiB:.0f} MiB idle); ")
        self.assertLess(grown, self.SLACK, "the tool's bytes stayed in the daemon's memory")
        return py, out.strip().splitlines()[-1]

    def test_safetensors_save_file(self):
        path = self.ck("st", "model.safetensors")
        py, digests = self.save_with(("torch", "safetensors"), SAFETENSORS, "st",
                                     path, self.SIZE_MIB)
        self.assertEqual(run_py(self, py, SAFETENSORS_CHECK, path, digests).strip(), "ok")
        self.mount_again()
        self.assertEqual(run_py(self, py, SAFETENSORS_CHECK, path, digests).strip(), "ok")

    def test_save_pretrained_sharded(self):
        self.save_with(("torch", "transformers"), SAVE_PRETRAINED, "hf", self.ck("hf"))

    def test_h5py_contiguous(self):
        self.save_with(("h5py", "numpy"), H5PY, "h5", self.ck("h5", "weights.h5"),
                       self.SIZE_MIB)

    def mount_again(self):
        self.assertEqual(self.mounts[-1].stop(), 0)
        self.mount()


class SparseFiles(CkptfsTestCase):
    """Case 4: holes reported as holes, staged and committed."""

    SIZE = 256 * MiB
    AT = 128 * MiB           # where the 8 bytes are
    SMALL = 4 * MiB          # what a sparse copy may take at most

    def write_sparse(self, path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, b"8 bytes!", self.AT)
            os.ftruncate(fd, self.SIZE)
        finally:
            os.close(fd)

    def assert_sparse(self, path):
        st = os.stat(path)
        self.assertEqual(st.st_size, self.SIZE)
        self.assertLess(st.st_blocks * 512, self.SMALL, f"{path}: reported allocated")
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.lseek(fd, 0, os.SEEK_DATA)
            self.assertTrue(self.AT - MiB < data <= self.AT, data)
            hole = os.lseek(fd, data, os.SEEK_HOLE)
            self.assertTrue(self.AT < hole <= self.AT + MiB, hole)
            self.assertEqual(os.lseek(fd, 0, os.SEEK_HOLE), 0)
            with self.assertRaises(OSError) as cm:
                os.lseek(fd, hole, os.SEEK_DATA)
            self.assertEqual(cm.exception.errno, 6, "ENXIO past the last data")
            self.assertEqual(os.pread(fd, 8, self.AT), b"8 bytes!")
        finally:
            os.close(fd)

    def assert_copies_sparsely(self, path):
        out = os.path.join(self.dir, "out")
        os.makedirs(out, exist_ok=True)
        dest = os.path.join(out, "copy")
        subprocess.run(["cp", path, dest], check=True)
        self.assertLess(os.stat(dest).st_blocks * 512, self.SMALL, "cp wrote the holes")
        self.assertEqual(sha(dest), self.want)
        tarball = os.path.join(out, "a.tar")
        subprocess.run(["tar", "-cSf", tarball, "-C", os.path.dirname(path),
                        os.path.basename(path)], check=True)
        self.assertLess(os.path.getsize(tarball), self.SMALL, "tar -S wrote the holes")
        subprocess.run(["tar", "-xSf", tarball, "-C", out], check=True)
        self.assertEqual(sha(os.path.join(out, os.path.basename(path))), self.want)
        subprocess.run(["rm", "-rf", out], check=True)

    def check(self, opts):
        self.want = hashlib.sha256(bytes(self.AT) + b"8 bytes!" +
                                   bytes(self.SIZE - self.AT - 8)).hexdigest()
        m = self.mount(opts)
        os.mkdir(self.ck("sp"))
        path = self.ck("sp", "sparse.bin")
        self.write_sparse(path)
        self.assert_sparse(path)
        self.assert_copies_sparsely(path)
        commit(self.ck("sp"))
        self.assertEqual(state(self.ck("sp")), "committed")
        self.assert_sparse(path)
        self.assertEqual(m.stop(), 0)
        self.mount(opts)
        self.assert_sparse(path)
        self.assert_copies_sparsely(path)

    def test_written_once(self):
        skip_without_passthrough(self)
        self.check(None)

    def test_through_the_daemon(self):
        self.check("passthrough=0")


def sha(path):
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


if __name__ == "__main__":
    main()
