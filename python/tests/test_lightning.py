#!/usr/bin/env python3
"""ckptfs.lightning.CheckpointIO with lightning 2.6.6: a DDP run on the CPU
(gloo) at 2 ranks under mpirun over 2 real rank mounts, with
ModelCheckpoint(save_top_k=2, save_last=True, monitor=...) for 6 epochs
(python/tests/lightning_job.py):

- only the top 2 and last.ckpt stay committed (listed by a fresh mount),
  each a checkpoint whose tensors are tensor files (dtype and shape
  xattrs) holding the bytes of the final model and optimizer state;
- a run SIGKILLed in epoch 4 and resumed with ckpt_path="last" ends in the
  same bits (model and Adam state) as the uninterrupted run, on both ranks;
- mount-scripts/ckpt-rank-exec: the same job with ModelCheckpoint(dirpath=
  FIXED) and the plugin given no mount, each rank launched as
  `ckpt-rank-exec MOUNTROOT FIXED -- python job.py`: each rank sees its own
  rank mount at FIXED, the checkpoints commit, and a resume from
  FIXED/last.ckpt loads them bit-exact on both ranks; its checks fail
  with both numbers;
- save_last="link" (one process, one mount; a stale working directory
  of a killed save of last.ckpt is discarded): ckptfs.lightning.ModelCheckpoint
  publishes last.ckpt as a copy of the newest top-k checkpoint, where
  Lightning's own ModelCheckpoint fails (a symlink at a mount's root);
- one process, filename "{epoch}-{step}-{train_loss:.4f}": each commit
  records the global step (user.ckpt.step), not the loss's digits; with a
  newer last-v1.ckpt staged and last-v2.ckpt failed (a killed run's),
  ckpt_path="last" resumes from the committed last.ckpt; a dead mount is
  named as one.

    PYTHONPATH=tests/integration:python \\
        python3 python/tests/test_lightning.py --bin build/bin/ckptfs
"""

import hashlib
import json
import os
import re
import subprocess

from ckpttest import REPO, util
from ckpttest.util import CkptfsTestCase, Mount, main
from ckpttest.world import MPIRUN, query
from ckpttest.pyenv import PACKAGE, require_modules, run_py
from test_dcp import free_port

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_job.py")
RANK_EXEC = os.path.join(REPO, "mount-scripts", "ckpt-rank-exec")
TOP2 = ["epoch=3-step=16.ckpt", "epoch=5-step=24.ckpt"]   # lightning_job.SCORES


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class LightningCase(CkptfsTestCase):

    def setUp(self):
        super().setUp()
        self.py = require_modules(self, "lightning")

    def world(self, tag):
        return self.start_world(2, "commit_timeout=120",
                                backing=os.path.join(self.dir, f"backing-{tag}"),
                                root=os.path.join(self.dir, f"mnt-{tag}"),
                                log=os.path.join(self.dir, f"world-{tag}.log"))

    def job(self, tag, dirpath, mount, ckpt_path, wrap=(), kill_epoch=-1, expect_ok=True):
        """Run lightning_job.py under mpirun -np 2 (each rank as wrap +
        the job); {rank: its RESULT}."""
        result = os.path.join(self.dir, f"result-{tag}")
        env = dict(os.environ, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                   PYTHONPATH=PACKAGE, PYTHONWARNINGS="ignore",
                   CKPT_KILL_EPOCH=str(kill_epoch))
        cmd = MPIRUN + ["-np", "2"]
        for var in ("MASTER_PORT", "OMP_NUM_THREADS", "PYTHONPATH", "PYTHONWARNINGS",
                    "CKPT_KILL_EPOCH"):
            cmd += ["-x", var]
        cmd += list(wrap) + [self.py, JOB, dirpath, mount, ckpt_path, result]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                           stdin=subprocess.DEVNULL)
        out = {}
        for rank in (0, 1):
            if os.path.exists(f"{result}.rank{rank}"):
                with open(f"{result}.rank{rank}") as f:
                    out[rank] = json.load(f)
        why = f"{tag}: exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
        if expect_ok:
            self.assertEqual(r.returncode, 0, why)
            self.assertEqual(sorted(out), [0, 1], why)
        return out, r

    def assertCheckpoints(self, mnt, state):
        """mnt holds TOP2 and last.ckpt only; last.ckpt's tensor files hold
        state's bytes (sha256), as tensors of a world-size-1 checkpoint."""
        self.assertEqual(sorted(os.listdir(mnt)), TOP2 + ["last.ckpt"])
        last = os.path.join(mnt, "last.ckpt")
        w = os.path.join(last, "state_dict", "net.weight")
        self.assertEqual(os.getxattr(w, "user.ckpt.dtype"), b"float32")
        self.assertEqual(os.getxattr(w, "user.ckpt.shape"), b"2,4")
        self.assertEqual(sha256(w), state["model.net.weight"])
        self.assertEqual(sha256(os.path.join(last, "optimizer_states", "0", "state", "1",
                                             "exp_avg_sq")), state["opt.1.exp_avg_sq"])
        self.assertEqual(query(os.path.join(last, ".metadata"),
                               "SELECT value FROM checkpoint WHERE key='world_size'"), [("1",)])


class DDP(LightningCase):

    def test_top_k_last_kill_resume_bit_exact(self):
        # the uninterrupted run
        wa = self.world("full")
        full, _ = self.job("full", wa.mnt(0), os.path.join(wa.root, "rank%r"), "-")
        self.assertEqual(full[0]["state"], full[1]["state"])
        self.assertEqual(full[0]["global_step"], 24)
        self.assertEqual(full[0]["top_k"], TOP2)
        self.assertEqual(full[0]["last"], "last.ckpt")
        self.assertEqual(wa.stop(), 0)
        m = Mount(wa.backing, os.path.join(self.dir, "fresh-full"), self.log)
        self.mounts.append(m)
        self.assertCheckpoints(m.start().mnt, full[0]["state"])
        m.stop()

        # killed in epoch 4 (after the saves of epochs 0-3), resumed from last
        wb = self.world("kill")
        spec = os.path.join(wb.root, "rank%r")
        killed, r = self.job("killed", wb.mnt(0), spec, "-", kill_epoch=4, expect_ok=False)
        self.assertNotEqual(r.returncode, 0)
        self.assertEqual(killed, {}, "the killed run finished")
        self.assertEqual(sorted(os.listdir(wb.mnt(0))),
                         ["epoch=1-step=8.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"])
        resumed, r = self.job("resumed", wb.mnt(0), spec, "last")
        self.assertIn("Restored all states from the checkpoint at "
                      + os.path.join(wb.mnt(0), "last.ckpt"), r.stdout + r.stderr)
        for rank in (0, 1):
            self.assertEqual(resumed[rank]["state"], full[0]["state"], f"rank {rank}")
            self.assertEqual(resumed[rank]["global_step"], 24)
            self.assertEqual(resumed[rank]["top_k"], TOP2)
        self.assertEqual(wb.stop(), 0)
        m = Mount(wb.backing, os.path.join(self.dir, "fresh-kill"), self.log)
        self.mounts.append(m)
        self.assertCheckpoints(m.start().mnt, full[0]["state"])


class RankExec(LightningCase):

    def test_one_path_for_every_rank(self):
        w = self.world("exec")
        fixed = os.path.join(self.dir, "run", "checkpoints")   # made by ckpt-rank-exec
        wrap = [RANK_EXEC, w.root, fixed, "--"]
        full, _ = self.job("exec", fixed, "-", "-", wrap=wrap)
        # FIXED was each rank's own mount: rank 0 saved through its own
        for rank in (0, 1):
            self.assertEqual(full[rank]["mount_rank"], rank)
            self.assertEqual(full[rank]["dev"], os.stat(w.mnt(rank)).st_dev)
        self.assertNotEqual(full[0]["dev"], full[1]["dev"])
        self.assertEqual(os.listdir(fixed), [], "FIXED outside the namespaces is empty")
        self.assertEqual(full[0]["top_k"], TOP2)
        # every rank loads last.ckpt through its own mount at FIXED
        again, _ = self.job("exec-load", fixed, "-", os.path.join(fixed, "last.ckpt"),
                            wrap=wrap)
        for rank in (0, 1):
            self.assertEqual(again[rank]["state"], full[0]["state"], f"rank {rank}")
            self.assertEqual(again[rank]["global_step"], 24)
        self.assertCheckpoints(w.mnt(1), full[0]["state"])

    def test_checks_name_both_numbers(self):
        w = self.world("check")
        fixed = os.path.join(self.dir, "fixed")

        def run(*args, env=None):
            e = dict(os.environ)
            e.update(env or {})
            return subprocess.run([RANK_EXEC, *args], capture_output=True, text=True,
                                  env=e, timeout=60)

        # a world of 3 trainer processes over 2 rank mounts
        r = run(w.root, fixed, "--", "true",
                env={"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3"})
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("runs 3 rank(s)", r.stderr)
        self.assertIn("world of 2 rank(s)", r.stderr)
        # rank 1 given a MOUNTROOT whose rank1 is rank 0's mount
        alias = os.path.join(self.dir, "alias")
        os.mkdir(alias)
        os.symlink(w.mnt(0), os.path.join(alias, "rank1"))
        r = run("--rank", "1", alias, fixed, "--", "true")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("rank 1", r.stderr)
        self.assertIn("mount of rank 0 of a ckptfs world of 2", r.stderr)
        # no rank at all; a PATH inside the rank mount (it would stage a checkpoint)
        r = run(w.root, fixed, "--", "true", env={"OMPI_COMM_WORLD_RANK": "",
                                                   "SLURM_PROCID": "", "PMI_RANK": "",
                                                   "RANK": ""})
        self.assertEqual(r.returncode, 2, r.stderr)
        r = run("--rank", "0", w.root, os.path.join(w.mnt(0), "x"), "--", "true")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("inside the rank mount", r.stderr)
        self.assertEqual(os.listdir(w.mnt(0)), [])
        # the right rank runs the command, with its mount at PATH
        r = run("--rank", "1", w.root, fixed, "--", "stat", "-c", "%d", fixed)
        self.assertEqual((r.returncode, r.stdout), (0, f"{os.stat(w.mnt(1)).st_dev}\n"),
                         r.stderr)
        # torchrun inside mpirun (one process per node): torchrun's RANK wins
        r = run(w.root, fixed, "--", "stat", "-c", "%d", fixed,
                env={"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
                     "TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2"})
        self.assertEqual((r.returncode, r.stdout), (0, f"{os.stat(w.mnt(1)).st_dev}\n"),
                         r.stderr)
        # as root, a PATH under a directory another user may change is refused
        theirs = os.path.join(self.dir, "theirs")
        os.mkdir(theirs)
        os.chown(theirs, 65534, 65534)
        r = run("--rank", "0", w.root, os.path.join(theirs, "ckpt"), "--", "true")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("belongs to uid 65534", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(theirs, "ckpt")))  # refused before mkdir


LINK_JOB = r'''
import os, sys
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
import ckptfs.lightning

mnt, which = sys.argv[1:]


class Tiny(L.LightningModule):
    def __init__(self, out=2):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, out)

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


cls = (L.pytorch.callbacks.ModelCheckpoint if which == "stock"
       else ckptfs.lightning.ModelCheckpoint)
# "best": one name saved again at each improvement, last.ckpt its copy
names = dict(filename="best", save_top_k=1) if which == "best" else dict(save_top_k=2)
ckpt = cls(dirpath=mnt, save_last="link", monitor="step", mode="max",
           every_n_train_steps=2, **names)
trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False,
                    enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt],
                    plugins=[ckptfs.lightning.CheckpointIO()],
                    default_root_dir=os.path.dirname(mnt))
torch.manual_seed(0)
model = Tiny()
trainer.fit(model, DataLoader(TensorDataset(torch.randn(12, 4), torch.randn(12, 2)),
                              batch_size=2))
io = ckptfs.lightning.CheckpointIO()
last = io.load_checkpoint(os.path.join(mnt, "last.ckpt"))   # weights-only, hparams too
print("last global_step", last["global_step"], "hparams", dict(last["hyper_parameters"]))
back = Tiny.load_from_checkpoint(ckptfs.lightning.checkpoint_file(os.path.join(mnt, "last.ckpt")))
assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                             back.state_dict().values()))
print("load_from_checkpoint bit-exact")
'''


STEP_JOB = r'''
import os, sys
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
import ckptfs.lightning

mnt, max_steps, ckpt_path, dead = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


ckpt = ckptfs.lightning.ModelCheckpoint(dirpath=mnt, filename="{epoch}-{step}-{train_loss:.4f}",
                                        monitor="train_loss", save_top_k=-1,
                                        every_n_train_steps=2, save_last=True)
trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                    enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt],
                    plugins=[ckptfs.lightning.CheckpointIO()],
                    default_root_dir=os.path.dirname(mnt))
torch.manual_seed(0)
trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(12, 4), torch.randn(12, 2)),
                               batch_size=2), ckpt_path=None if ckpt_path == "-" else ckpt_path)
print("global_step", trainer.global_step)
try:
    ckptfs.lightning.CheckpointIO().save_checkpoint({"global_step": 1},
                                                    os.path.join(dead, "x.ckpt"))
except ckptfs.CkptfsError as e:
    print("dead:", e)
'''


class Steps(LightningCase):

    def test_step_recorded_and_last_skips_leftovers(self):
        self.mount()
        dead = util.Mount(os.path.join(self.dir, "backing-dead"), os.path.join(self.dir, "dead"),
                          self.log)
        os.mkdir(dead.backing)
        self.mounts.append(dead)
        dead.start()
        dead.proc.kill()
        dead.proc.wait()
        out = run_py(self, self.py, STEP_JOB, self.mnt, 4, "-", dead.mnt)
        self.assertIn("global_step 4", out)
        self.assertIn(f"dead: the ckptfs mount at {dead.mnt} is gone (ENOTCONN): its daemon "
                      "exited; see its log", out)
        names = sorted(os.listdir(self.mnt))
        self.assertEqual(len(names), 3, names)
        for name in names:
            want = 4 if name == "last.ckpt" else int(re.search(r"-step=(\d+)-", name).group(1))
            self.assertEqual(os.getxattr(os.path.join(self.mnt, name), "user.ckpt.step"),
                             str(want).encode(), name)
            self.assertEqual(query(os.path.join(self.mnt, name, ".metadata"),
                                   "SELECT value FROM checkpoint WHERE key='step'"),
                             [(str(want),)], name)
        # what a killed run leaves, newer than last.ckpt: a staged
        # last-v1.ckpt and a failed last-v2.ckpt (a chunk without its bytes)
        util.write_file(os.path.join(self.mnt, "last-v1.ckpt", "checkpoint.pkl"), b"partial")
        bad = os.path.join(self.mnt, "last-v2.ckpt", "w")
        util.write_file(bad, b"abc")
        util.set_tensor_xattrs(bad, "float32", [1])
        with self.assertRaises(OSError):
            util.commit(os.path.dirname(bad))
        e = dict(os.environ, PYTHONPATH=PACKAGE, OMP_NUM_THREADS="1")
        r = subprocess.run([self.py, "-c", STEP_JOB, self.mnt, "6", "last", dead.mnt],
                           capture_output=True, text=True, env=e, timeout=300)
        self.assertEqual(r.returncode, 0, r.stdout[-3000:] + r.stderr[-5000:])
        self.assertIn("Restored all states from the checkpoint at "
                      + os.path.join(self.mnt, "last.ckpt"), r.stdout + r.stderr)
        self.assertIn("global_step 6", r.stdout)
        self.assertEqual(os.getxattr(os.path.join(self.mnt, "last.ckpt"), "user.ckpt.step"), b"6")


class Link(LightningCase):

    def test_save_last_link(self):
        self.mount()
        # what a save of last.ckpt killed while replacing it leaves staged
        stale = os.path.join(self.mnt, "last.ckpt.replace-0123456789ab")
        os.makedirs(os.path.join(stale, "state_dict"))
        with open(os.path.join(stale, "state_dict", "net.weight"), "wb") as f:
            f.write(b"x" * 32)
        out = run_py(self, self.py, LINK_JOB, self.mnt, "ckptfs")
        self.assertIn("last global_step 6 hparams {'out': 2}", out)
        self.assertIn("load_from_checkpoint bit-exact", out)
        self.assertEqual(sorted(os.listdir(self.mnt)),
                         ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"])
        for f in ("state_dict/net.weight", "checkpoint.pkl"):
            self.assertEqual(sha256(os.path.join(self.mnt, "last.ckpt", f)),
                             sha256(os.path.join(self.mnt, "epoch=0-step=6.ckpt", f)), f)
        # one name saved again (filename="best"): last.ckpt follows each save
        best = os.path.join(self.dir, "mnt-best")
        os.mkdir(os.path.join(self.dir, "backing-best"))
        m = util.Mount(os.path.join(self.dir, "backing-best"), best, self.log)
        self.mounts.append(m)
        m.start()
        out = run_py(self, self.py, LINK_JOB, best, "best")
        self.assertIn("last global_step 6 hparams {'out': 2}", out)
        self.assertEqual(sorted(os.listdir(best)), ["best.ckpt", "last.ckpt"])
        for f in ("state_dict/net.weight", "checkpoint.pkl"):
            self.assertEqual(sha256(os.path.join(best, "last.ckpt", f)),
                             sha256(os.path.join(best, "best.ckpt", f)), f)
        # Lightning's own link: a symlink at the mount's root (EPERM), then a copy
        # of a directory with shutil.copy
        e = dict(os.environ, PYTHONPATH=PACKAGE, OMP_NUM_THREADS="1")
        stock = os.path.join(self.dir, "mnt-stock")
        self.mount(mnt=stock)
        r = subprocess.run([self.py, "-c", LINK_JOB, stock, "stock"], capture_output=True,
                           text=True, env=e, timeout=300)
        self.assertNotEqual(r.returncode, 0, r.stdout)
        self.assertIn("IsADirectoryError", r.stderr)


if __name__ == "__main__":
    main()
