#!/usr/bin/env python3
"""The README's quick starts run as written: the shell block (it mounts,
saves, browses and unmounts by itself), the C program (compiled with
-Wall -Werror, run on a mount) and the Python block (on a mount, with an
interpreter that has numpy). Only the paths are replaced: /mnt/ckpt by the
test's mountpoint, /var/tmp/ckpt-data by its backing directory,
build/bin/ckptfs by the binary under test.

The PyTorch quick start: its shell block (train_dcp.py on 2 rank mounts
of ckpt-mount, browse, resume on 4) runs as written, with /var/tmp/ckpt,
/tmp/ckpt and /tmp/ckpt-ref.json replaced by the test's directories,
ckpt-mount given the binary under test and .venv/bin/python replaced by
pyenv.torch_python(); its trainer block runs in 1 process on a mount,
between a prelude (init_process_group, a fully_shard'ed model and Adam
after one step) and checks (step-100 and step-200 committed, the load
restores step-100 bit for bit after the test changed the model and the
optimizer state just before the block's "# resume" line).

    python3 tests/integration/test_readme.py --bin build/bin/ckptfs
"""

import os
import re
import shutil
import socket
import subprocess
import sys
import unittest

from ckpttest import sanenv, util
from ckpttest.util import CkptfsTestCase, main, mountinfo_has
from ckpttest.pyenv import REPO, require_torch

README = os.path.join(REPO, "README.md")


def block(section, lang):
    """The one ```lang block of README section `## section`."""
    with open(README) as f:
        text = f.read()
    m = re.search(r"(?m)^## " + re.escape(section) + r"\n(.*?)(?=^## |\Z)", text, re.S)
    if not m:
        raise AssertionError(f"README has no section '## {section}'")
    blocks = re.findall(r"(?ms)^```" + lang + r"\n(.*?)^```", m.group(1))
    if len(blocks) != 1:
        raise AssertionError(f"'## {section}': {len(blocks)} ```{lang} blocks, expected 1")
    return blocks[0]


PYTORCH = "Quick start for PyTorch: save, browse, resume"

# Around the PyTorch section's trainer block: what a trainer has before it
# (one process, a gloo group, a fully_shard'ed model with Adam state), and
# what the test checks after it.
TRAINER_PRELUDE = """
import hashlib, os, socket, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
with socket.socket() as s_:
    s_.bind(("127.0.0.1", 0)); port_ = s_.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port_))
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)

def train_step_():
    model(torch.randn(5, 8)).pow(2).mean().backward()
    opt.step(); opt.zero_grad()

def digest_():
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd_, osd_ = get_state_dict(model, opt)
    h = hashlib.sha256()
    items = [(k, v) for k, v in msd_.items()]
    items += [(f"{p}.{k}", v) for p, st in osd_["state"].items() for k, v in st.items()]
    for k, v in sorted(items):
        v = v.full_tensor() if isinstance(v, DTensor) else v
        h.update(k.encode() + v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest(), len(items)

train_step_()
saved_ = digest_()
"""
CHANGE_BEFORE_RESUME = """
train_step_()
assert digest_() != saved_, "the test's training step changed nothing"
"""
TRAINER_CHECKS = """
assert digest_() == saved_, "the load did not restore step-100"
for n_ in ("step-100", "step-200"):
    print(n_, open(os.path.join(ckptfs.dcp.rank_mount(mount, 0), n_, ".status")).readline().strip())
print("restored", saved_[1], "tensors")
dist.barrier()
sys.stdout.flush()
os._exit(0)  # without torch's teardown: its gloo threads sometimes abort there
"""


class QuickStarts(CkptfsTestCase):
    def paths(self, code):
        return (code.replace("build/bin/ckptfs", util.BIN)
                    .replace("/var/tmp/ckpt-data", self.backing)
                    .replace("/mnt/ckpt", self.mnt))

    def test_shell(self):
        for tool in ("setfattr", "getfattr", "sqlite3", "od"):
            if not shutil.which(tool):
                self.fail(f"no {tool}: scripts/install-deps.sh installs it")
        script = "set -euo pipefail\n" + self.paths(block("Quick start from the shell", "sh"))
        env = sanenv.env()
        r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                           env=env, cwd=REPO, stdin=subprocess.DEVNULL)
        self.assertEqual(r.returncode, 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}")
        self.assertIn("committed\ntensors 1\nblobs 0\nworld_size 1\n", r.stdout)
        self.assertIn("model.layer0.weight|float32|[4,4]", r.stdout)
        self.assertIn('user.ckpt.shape="4,4"', r.stdout)
        self.assertRegex(r.stdout, r"-r--r--r-- .* 64 .* weight")
        self.assertFalse(mountinfo_has(self.mnt), "the block's unmount did not happen")
        self.assertTrue(os.path.exists(self.bk("step-100", ".metadata")))

    def test_c(self):
        cc = shutil.which("cc") or shutil.which("gcc")
        if not cc:
            self.fail("no C compiler: scripts/install-deps.sh installs build-essential")
        src = os.path.join(self.dir, "save.c")
        with open(src, "w") as f:
            f.write(block("Quick start in C", "c"))
        exe = os.path.join(self.dir, "save")
        r = subprocess.run([cc, "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror",
                            "-o", exe, src], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.mount()
        r = subprocess.run([exe, self.mnt], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "row 2: 8 9 10 11\n")
        with open(self.ck("step-1", ".status")) as f:
            self.assertEqual(f.readline(), "committed\n")

    def test_python(self):
        py = next((p for p in (sys.executable, "/usr/bin/python3")
                   if subprocess.run([p, "-c", "import numpy"], capture_output=True).returncode == 0),
                  None)
        if not py:
            self.fail("no Python with numpy: scripts/install-deps.sh installs python3-numpy")
        self.mount()
        code = self.paths(block("Quick start in Python", "python"))
        r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}")
        self.assertIn("committed\ntensors 1\n", r.stdout)


    def test_pytorch_shell(self):
        py = require_torch(self)
        root = os.path.join(self.dir, "ranks")
        ref = os.path.join(self.dir, "ref.json")
        code = block(PYTORCH, "sh")
        for s in ("/var/tmp/ckpt ", "/tmp/ckpt/rank%r", "/tmp/ckpt-ref.json",
                  "mount-scripts/ckpt-mount ", ".venv/bin/python"):
            self.assertIn(s, code)
        # placeholders first: the test's directories hold "/tmp/ckpt" too
        code = (code.replace("/var/tmp/ckpt ", "@BACKING@ ")
                    .replace("/tmp/ckpt-ref.json", "@REF@")
                    .replace("/tmp/ckpt", "@ROOT@")
                    .replace("@BACKING@", self.backing)
                    .replace("@REF@", ref)
                    .replace("@ROOT@", root)
                    .replace("mount-scripts/ckpt-mount ",
                             f"mount-scripts/ckpt-mount --bin {util.BIN} ")
                    .replace(".venv/bin/python", py))
        env = sanenv.env(mpi=True)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONWARNINGS"] = "ignore"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env["MASTER_PORT"] = str(s.getsockname()[1])
        try:
            r = subprocess.run(["bash", "-c", "set -euo pipefail\n" + code],
                               capture_output=True, text=True, timeout=900, env=env,
                               cwd=REPO, stdin=subprocess.DEVNULL)
        finally:
            if mountinfo_has(os.path.join(root, "rank0")):
                subprocess.run(["mount-scripts/ckpt-umount", root], cwd=REPO,
                               capture_output=True, timeout=240, env=env)
        self.assertEqual(r.returncode, 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-8000:]}")
        for rank in range(2):
            self.assertIn(f"rank {rank}: step 8: async save of step-8 started", r.stdout)
            self.assertIn(f"rank {rank}: step-8: committed", r.stdout)
        self.assertIn('user.ckpt.shape="64,16"', r.stdout)
        self.assertIn("model.0.weight|float32|[64,16]", r.stdout)
        self.assertIn("optim.state.2.weight.exp_avg_sq|float32|[8,64]", r.stdout)
        # what the README says the resume prints
        self.assertIn("step-8: model and optimizer state bit-identical to the\n2-rank run "
                      "(16 tensors)", self.readme_section(PYTORCH))
        self.assertIn("step-8: model and optimizer state bit-identical to the 2-rank run "
                      "(16 tensors)", r.stdout)
        self.assertIn("step 10: trained on from step-8 at world size 4, bit-identical to "
                      "the 2-rank run", r.stdout)
        self.assertEqual(sorted(os.listdir(self.backing)), ["step-4", "step-8"])
        self.assertFalse(mountinfo_has(os.path.join(root, "rank0")))

    def readme_section(self, section):
        with open(README) as f:
            text = f.read()
        return text[text.index("## " + section):]

    def test_pytorch_trainer(self):
        py = require_torch(self)
        code = block(PYTORCH, "python")
        marker = "# resume, at any world size, from the newest committed checkpoint\n"
        self.assertEqual(code.count(marker), 1)
        self.assertIn('mount = "/tmp/ckpt/rank%r"', code)
        self.mount()
        code = (code.replace(marker, CHANGE_BEFORE_RESUME + marker)
                    .replace('"/tmp/ckpt/rank%r"', repr(self.mnt)))
        e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        r = subprocess.run([py, "-c", TRAINER_PRELUDE + code + TRAINER_CHECKS],
                           capture_output=True, text=True, timeout=600, env=e,
                           stdin=subprocess.DEVNULL)
        self.assertEqual(r.returncode, 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-8000:]}")
        self.assertIn("step-100 committed\nstep-200 committed\nrestored 16 tensors\n",
                      r.stdout)


if __name__ == "__main__":
    main()
