#!/usr/bin/env python3
"""examples/python/train_dcp.py end to end, as the README runs it: 2 rank
mounts started with mount-scripts/ckpt-mount, the example trained under
mpirun on them (fully_shard'ed MLP + Adam, dcp.async_save through
ckptfs.dcp.Writer every 4 steps, overlapping training), ckpt-umount; then
the same backing directory mounted at 1 rank and at 4 ranks and --resume
under mpirun: the newest checkpoint loaded with dcp.load through
ckptfs.dcp.Reader must be bit-identical to the 2-rank run at that step,
and training on from it must reach the 2-rank run's final tensors bit for
bit. A reference with one digest changed (at the saved step, or at the
final step) must make --resume fail. The interpreter is
pyenv.torch_python() (.venv/bin/python, torch 2.13.0).

    python3 tests/integration/test_pytorch_dcp.py --bin build/bin/ckptfs
"""

import json
import os
import socket
import sqlite3
import subprocess

from ckpttest import sanenv, util
from ckpttest.util import CKPT_MOUNT, CKPT_UMOUNT, CkptfsTestCase, main, mountinfo_has, read_log
from ckpttest.pyenv import EXAMPLES, REPO, require_torch
from ckpttest.world import MPIRUN

EXAMPLE = os.path.join(EXAMPLES, "train_dcp.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PytorchDcp(CkptfsTestCase):

    def run_cmd(self, argv, timeout=600, env=None):
        e = sanenv.env(mpi=True)
        e.setdefault("OMP_NUM_THREADS", "1")
        e["MASTER_PORT"] = str(free_port())
        e["PYTHONWARNINGS"] = "ignore"
        if env:
            e.update(env)
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, env=e, cwd=REPO)

    def world_run(self, n, root, args):
        """ckpt-mount -n n over the backing directory at root, the example
        under mpirun -np n with --mount root/rank%r, ckpt-umount."""
        r = self.run_cmd([CKPT_MOUNT, "-n", str(n), "--bin", util.BIN,
                          self.backing, root], timeout=240)
        self.assertEqual(r.returncode, 0, f"ckpt-mount -n {n}:\n{r.stdout}\n{r.stderr}")
        log_copy = os.path.join(self.dir, f"world{n}.log")
        self.extra_logs.append(log_copy)
        hung = None
        try:
            job = self.run_cmd(MPIRUN + ["-np", str(n), "-x", "OMP_NUM_THREADS", "-x",
                                         "MASTER_PORT", "-x", "PYTHONWARNINGS", self.py,
                                         EXAMPLE, "--mount", os.path.join(root, "rank%r")]
                               + args)
        except subprocess.TimeoutExpired as e:
            hung = e  # said below, with what the job and the mounts printed
        finally:
            log = read_log(os.path.join(root, ".ckpt-mount.log"), limit=1 << 24)
            with open(log_copy, "w") as f:
                f.write(log)
            u = self.run_cmd([CKPT_UMOUNT, root], timeout=240)
        if hung is not None:
            def text(x):
                return (x.decode(errors="replace") if isinstance(x, bytes) else x or "")
            self.fail(f"the job at {n} ranks did not end in {hung.timeout} s\n"
                      f"stdout:\n{text(hung.stdout)[-4000:]}\nstderr:\n"
                      f"{text(hung.stderr)[-4000:]}\nmounts' log:\n{log[-8000:]}")
        self.assertEqual(u.returncode, 0, f"ckpt-umount:\n{u.stdout}\n{u.stderr}")
        for r_ in range(n):
            self.assertFalse(mountinfo_has(os.path.join(root, f"rank{r_}")))
        return job, log

    def test_train_two_ranks_resume_at_one_and_four(self):
        self.py = require_torch(self)
        ref = os.path.join(self.dir, "ref.json")
        train, log = self.world_run(2, os.path.join(self.dir, "w2"),
                                    ["--steps", "10", "--save-every", "4", "--ref", ref])
        self.assertEqual(train.returncode, 0,
                         f"training:\n{train.stdout}\n{train.stderr[-6000:]}\n{log[-4000:]}")
        for r_ in range(2):
            for n in (4, 8):
                self.assertIn(f"rank {r_}: step {n}: async save of step-{n} started",
                              train.stdout)
            self.assertIn(f"rank {r_}: step-4: committed (saved while training steps 5-8)",
                          train.stdout)
            self.assertIn(f"rank {r_}: step-8: committed", train.stdout)

        # what the 2-rank run stored: two checkpoints of world size 2; each
        # sharded tensor as its 2 shards, the replicated Adam step once
        self.assertEqual(sorted(os.listdir(self.backing)), ["step-4", "step-8"])
        con = sqlite3.connect(f"file:{self.bk('step-8', '.metadata')}?mode=ro", uri=True)
        try:
            ws = con.execute("select value from checkpoint where key='world_size'").fetchone()
            tensors = {r[0]: (r[1], r[2]) for r in
                       con.execute("select fqn, dtype, shape from tensors")}
            chunks = [r[0] for r in con.execute("select fqn from chunks")]
        finally:
            con.close()
        self.assertEqual(ws, ("2",))
        self.assertEqual(len(tensors), 16, tensors)
        self.assertEqual(tensors["model.0.weight"], ("float32", "[64,16]"))
        self.assertEqual(tensors["optim.state.2.weight.exp_avg_sq"], ("float32", "[8,64]"))
        self.assertEqual(chunks.count("model.0.weight"), 2)
        self.assertEqual(chunks.count("optim.state.0.weight.exp_avg"), 2)
        self.assertEqual(chunks.count("optim.state.0.weight.step"), 1)
        with open(ref) as f:
            digests = json.load(f)
        self.assertEqual(sorted(digests),
                         ["final", "micro_batches", "step-4", "step-8", "world_size"])
        self.assertEqual(digests["world_size"], 2)
        self.assertEqual(len(digests["step-8"]), 16)  # 4 params, Adam step/avg/avg_sq
        self.assertNotEqual(digests["step-4"], digests["step-8"])
        self.assertNotEqual({k: v for k, v in digests["final"].items() if k != "step"},
                            digests["step-8"])

        # resume at 1 and at 4 ranks
        for n in (1, 4):
            res, log = self.world_run(n, os.path.join(self.dir, f"w{n}"),
                                      ["--resume", "--ref", ref])
            self.assertEqual(res.returncode, 0,
                             f"resume at {n}:\n{res.stdout}\n{res.stderr[-6000:]}\n{log[-4000:]}")
            self.assertIn(f"resumed step-8 (step 8) at world size {n}", res.stdout)
            self.assertIn("step-8: model and optimizer state bit-identical to the 2-rank "
                          "run (16 tensors)", res.stdout)
            self.assertIn(f"step 10: trained on from step-8 at world size {n}, "
                          "bit-identical to the 2-rank run", res.stdout)
        # resuming stored nothing
        self.assertEqual(sorted(os.listdir(self.backing)), ["step-4", "step-8"])

        # the checks are real: one digest changed, at the loaded step or at
        # the final one, fails --resume
        self.mount()
        for where, key in (("step-8", "model.2.bias"), ("final", "optim.0.weight.exp_avg")):
            bad = dict(digests)
            bad[where] = dict(digests[where], **{key: "0" * 64})
            path = f"{ref}.bad-{where}"
            with open(path, "w") as f:
                json.dump(bad, f)
            res = self.run_cmd([self.py, EXAMPLE, "--mount", self.mnt, "--resume",
                                "--ref", path])
            self.assertEqual(res.returncode, 1, res.stdout + res.stderr)
            self.assertIn(f"{key}: ", res.stdout)
            self.assertIn("MISMATCH with the original run", res.stderr)
            if where == "final":
                self.assertIn("step-8: model and optimizer state bit-identical", res.stdout)
                self.assertNotIn("step 10: trained on", res.stdout)
            else:
                self.assertNotIn("step-8: model and optimizer state bit-identical",
                                 res.stdout)
                self.assertIn("step 10: trained on from step-8 at world size 1, "
                              "bit-identical", res.stdout)


if __name__ == "__main__":
    main()
