#!/usr/bin/env python3
"""examples/python/train_resume.py end to end, as the README runs it:
2 rank mounts started with mount-scripts/ckpt-mount, the example trained
under mpirun on them (data-parallel, async saves of model and Adam state
every 4 steps), ckpt-umount; then a 1-rank mount of the same backing
directory and --resume: the newest checkpoint must be bit-identical to the
2-rank run at that step, and training on from it in 1 process must reach
the 2-rank run's final parameters bit for bit. A reference with one digest
changed must make --resume fail. The interpreter is pyenv.torch_python()
(.venv/bin/python, torch 2.13.0, with the ckptfs package installed
editable); train_dcp.py, over torch.distributed.checkpoint, is tested by
test_pytorch_dcp.py.

    python3 tests/integration/test_pytorch_resume.py --bin build/bin/ckptfs
"""

import json
import os
import sqlite3
import subprocess

from ckpttest import sanenv, util
from ckpttest.util import CKPT_MOUNT, CKPT_UMOUNT, CkptfsTestCase, main, mountinfo_has, read_log
from ckpttest.pyenv import EXAMPLES, REPO, require_torch
from ckpttest.world import MPIRUN

EXAMPLE = os.path.join(EXAMPLES, "train_resume.py")


class PytorchResume(CkptfsTestCase):

    def run_cmd(self, argv, timeout=600, env=None):
        e = sanenv.env(mpi=True)
        e.setdefault("OMP_NUM_THREADS", "1")
        if env:
            e.update(env)
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, env=e, cwd=REPO)

    def test_train_two_ranks_resume_one(self):
        py = require_torch(self)
        root = os.path.join(self.dir, "ranks")
        ref = os.path.join(self.dir, "ref.json")
        r = self.run_cmd([CKPT_MOUNT, "-n", "2", "--bin", util.BIN,
                          self.backing, root], timeout=240)
        self.assertEqual(r.returncode, 0, f"ckpt-mount:\n{r.stdout}\n{r.stderr}")
        self.extra_logs.append(os.path.join(self.dir, "world.log"))
        try:
            train = self.run_cmd(MPIRUN + ["-np", "2", "-x", "OMP_NUM_THREADS", py, EXAMPLE,
                                           "--mount", os.path.join(root, "rank%r"),
                                           "--steps", "10", "--save-every", "4", "--ref", ref])
        finally:
            log = read_log(os.path.join(root, ".ckpt-mount.log"), limit=1 << 24)
            with open(os.path.join(self.dir, "world.log"), "w") as f:
                f.write(log)
            u = self.run_cmd([CKPT_UMOUNT, root], timeout=240)
        self.assertEqual(train.returncode, 0,
                         f"training:\n{train.stdout}\n{train.stderr}\n{log[-4000:]}")
        self.assertEqual(u.returncode, 0, f"ckpt-umount:\n{u.stdout}\n{u.stderr}")
        for r_ in range(2):
            self.assertFalse(mountinfo_has(os.path.join(root, f"rank{r_}")))
            for n in (4, 8):
                self.assertIn(f"rank {r_}: step {n}: async save of step-{n} started",
                              train.stdout)
            self.assertIn(f"rank {r_}: step-8: committed", train.stdout)

        # what the 2-rank run stored: two checkpoints of world size 2, the
        # replicated model and optimizer state stored once
        self.assertEqual(sorted(os.listdir(self.backing)), ["step-4", "step-8"])
        con = sqlite3.connect(f"file:{self.bk('step-8', '.metadata')}?mode=ro", uri=True)
        try:
            ws = con.execute("select value from checkpoint where key='world_size'").fetchone()
            fqns = [r[0] for r in con.execute("select fqn from chunks")]
            blobs = {r[0] for r in con.execute("select fqn from blobs")}
        finally:
            con.close()
        self.assertEqual(ws, ("2",))
        self.assertEqual(sorted(set(fqns)), sorted(fqns))  # every chunk once
        self.assertIn("model.0.weight", fqns)
        self.assertIn("optim.state.0.exp_avg", fqns)
        self.assertIn("optim.state.3.exp_avg_sq", fqns)
        self.assertTrue({"optim.param_groups", "step", "rng.rank0", "rng.rank1"} <= set(fqns)
                        | blobs, (fqns, blobs))
        with open(ref) as f:
            digests = json.load(f)
        self.assertEqual(sorted(digests), ["final", "step-4", "step-8"])
        self.assertEqual(len(digests["step-8"]), 4 + 4 * 3)  # params, Adam step/avg/avg_sq
        self.assertNotEqual(digests["step-4"], digests["step-8"])

        # resume at 1 rank
        self.mount()
        res = self.run_cmd([py, EXAMPLE, "--mount", self.mnt, "--resume", "--ref", ref])
        self.assertEqual(res.returncode, 0, f"resume:\n{res.stdout}\n{res.stderr}")
        self.assertIn("resumed step-8 (step 8)", res.stdout)
        self.assertIn("step-8: model and optimizer state bit-identical to the 2-rank "
                      "run (16 tensors)", res.stdout)
        self.assertIn("step 10: trained on from step-8 in 1 process, bit-identical",
                      res.stdout)

        # the check is real: one digest changed fails it
        bad = dict(digests)
        bad["step-8"] = dict(digests["step-8"], **{"model.2.bias": "0" * 64})
        with open(ref + ".bad", "w") as f:
            json.dump(bad, f)
        res = self.run_cmd([py, EXAMPLE, "--mount", self.mnt, "--resume",
                            "--ref", ref + ".bad"])
        self.assertEqual(res.returncode, 1, res.stdout + res.stderr)
        self.assertIn("model.2.bias", res.stdout)
        self.assertIn("MISMATCH", res.stderr)


if __name__ == "__main__":
    main()
