#!/usr/bin/env python3
"""Crash and restart of a Hugging Face Trainer, an Accelerate and a
Lightning job on the same rank mounts, as test_restart.py does for DCP:
each a small deterministic model on the CPU, 2 ranks under mpirun (gloo),
8 steps, a save every 2 steps (python/tests/restart_{hf,acc,lightning}
_job.py, whose docstrings say where each kill point is):

  - Trainer: ckptfs.hf.CommitCallback, save_steps=2, checkpoint-N;
    resumed with trainer.train(resume_from_checkpoint=True);
  - Accelerate: ckptfs.hf.save_state/load_state, step-N; resumed from
    ckptfs.latest(mount, "step-");
  - Lightning: DDP, ckptfs.lightning.CheckpointIO and ModelCheckpoint
    (every_n_train_steps=2, save_last=True); resumed with
    ckpt_path="last".

The job SIGKILLs itself at a kill point: a rank (0, 1, or every rank)
before a save, during it (in the middle of the framework's writes, before
the commit), or right after it; mpirun takes the rest of the job down.
Then, on the same mounts (the daemons never restarted):

  - no leftover of the killed job stays staged or committing on any rank
    for more than 10 s (abandoned: the job is gone);
  - the restarted job resumes from the newest committed checkpoint (the
    one a kill before or during a save leaves: the one before; after: that
    save's), trains the steps after it, saves the same names again without
    an error, and ends with the same checkpoint names as an uninterrupted
    run and bit-exact with it (model and optimizer state, each rank).

All three resume bit-exact on the CPU, so every kill point is compared
with the uninterrupted run: the Trainer restores each rank's RNG state and
skips the batches of the epoch already trained (checkpoint-2 and -6 are in
the middle of an epoch); the Accelerate job draws its data and dropout
from the RNG states save_state saves. Lightning saves no RNG state and does
not move a plain DataLoader to the middle of an epoch on resume (it warns
that the loader is not resumable): resumed from a mid-epoch checkpoint,
even on plain files with its own ModelCheckpoint and TorchCheckpointIO
(checked without a kill), it does not end where an uninterrupted run does.
So its job has no dropout and epochs of 2 steps: every save is at an
epoch's end.

Rank 0 alone saves under Lightning (solo commits), so a kill of rank 1
alone before or during a save races rank 0's save of that step: the
resumed step is then that save's or the one before, either accepted.

One kill point per framework by default; CKPT_RESTART_ALL=1 (the ctest
label long) runs all 18 of each (ranks 0, 1, all x before, during, after x
the saves of steps 4 and 8).

    PYTHONPATH=tests/integration:python \\
        python3 python/tests/test_restart_frameworks.py --bin build/bin/ckptfs
"""

import json
import os
import subprocess
import time

from ckpttest import util
from ckpttest.util import CkptfsTestCase, main, read_log
from ckpttest.world import MPIRUN
from ckpttest.pyenv import PACKAGE, require_modules
from test_dcp import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
ALL = [f"{r}:{w}:{s}" for s in (4, 8) for w in ("before", "during", "after")
       for r in ("0", "1", "all")]


class RestartCase(CkptfsTestCase):
    JOB = None        # the job script
    MODULES = ()      # what it imports
    QUICK = None      # the default run's kill point
    PREFIX = None     # the names of the checkpoints it resumes from

    def setUp(self):
        super().setUp()
        self.py = require_modules(self, *self.MODULES)

    def world(self, tag):
        return self.start_world(2, "commit_timeout=120",
                                backing=os.path.join(self.dir, f"backing-{tag}"),
                                root=os.path.join(self.dir, f"mnt-{tag}"),
                                log=os.path.join(self.dir, f"world-{tag}.log"))

    def job(self, w, phase, kill="none", expect_ok=True):
        """The job under mpirun -np 2 on w's mounts; {rank: its result}."""
        self.njobs = getattr(self, "njobs", 0) + 1
        results = os.path.join(self.dir, f"results{self.njobs}")
        os.mkdir(results)
        env = dict(os.environ, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                   PYTHONPATH=PACKAGE, PYTHONWARNINGS="ignore", CKPT_RESULT_DIR=results,
                   **OFFLINE)
        cmd = list(MPIRUN) + ["-np", "2"]
        for var in ("MASTER_PORT", "OMP_NUM_THREADS", "PYTHONPATH", "PYTHONWARNINGS",
                    "CKPT_RESULT_DIR", *OFFLINE):
            cmd += ["-x", var]
        cmd += [self.py, os.path.join(HERE, self.JOB), w.root, phase, kill]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                           stdin=subprocess.DEVNULL)
        out = {}
        for f in os.listdir(results):
            if f.endswith(".json"):
                with open(os.path.join(results, f)) as fh:
                    d = json.load(fh)
                out[d["rank"]] = d
        why = (f"{self.JOB} {phase} {kill}: exit {r.returncode}\n{r.stdout[-4000:]}\n"
               f"{r.stderr[-8000:]}")
        if expect_ok:
            self.assertEqual(r.returncode, 0, why)
            self.assertEqual(sorted(out), [0, 1], why)
        else:
            self.assertNotEqual(r.returncode, 0, why)
            ranks, _when, _step = kill.split(":")
            # a rank killed finished nothing (the other may have, killed
            # after the last save)
            dead = [0, 1] if ranks == "all" else [int(ranks)]
            self.assertEqual([k for k in dead if k in out], [],
                             f"a rank finished the run it was killed in\n{why}")
            # the kill point was reached (with "all", by one rank at least:
            # mpirun may take the other down first)
            said = [f"ckpt-kill rank {k}:" in r.stderr + r.stdout for k in (0, 1)]
            self.assertTrue(any(said) if ranks == "all" else said[int(ranks)],
                            f"the kill point was not reached\n{why}")
        return out

    def leftovers(self, w):
        return util.leftovers([w.mnt(r) for r in range(w.n)])

    def newest(self, mnt):
        """The newest committed checkpoint a resume may pick, and its step
        (None, 0 when there is none)."""
        steps = {}
        for name in os.listdir(mnt):
            if name.startswith(self.PREFIX):
                steps[name] = int(os.getxattr(os.path.join(mnt, name), "user.ckpt.step"))
        if not steps:
            return None, 0
        name = max(steps, key=steps.get)
        return name, steps[name]

    def expected_steps(self, point):
        """The steps the newest committed checkpoint may have after a kill
        at point."""
        _ranks, when, step = point.split(":")
        return {int(step) if when == "after" else int(step) - 2}

    def kill_points(self):
        ref_world = self.world("ref")
        t0 = time.monotonic()
        ref = self.job(ref_world, "run")
        print(f"\n  uninterrupted run {time.monotonic() - t0:.1f} s", flush=True)
        self.assertEqual(ref[0]["digest"], ref[1]["digest"], "the ranks' replicas differ")
        self.assertEqual(ref_world.stop(), 0)
        points = ALL if os.environ.get("CKPT_RESTART_ALL") == "1" else [self.QUICK]
        for point in points:
            with self.subTest(point=point):
                self.one(point, ref)

    def one(self, point, ref):
        w = self.world(point.replace(":", "-"))
        t0 = time.monotonic()
        self.job(w, "run", point, expect_ok=False)
        killed = time.monotonic()
        try:
            util.wait_until(lambda: not self.leftovers(w), 10, "no leftovers")
        except TimeoutError:
            self.fail(f"{point}: left {self.leftovers(w)}\n{read_log(w.log)[-4000:]}")
        settled = time.monotonic() - killed
        newest, step = self.newest(w.mnt(0))
        self.assertEqual(self.newest(w.mnt(1)), (newest, step), "the mounts differ")
        self.assertIn(step, self.expected_steps(point),
                      f"{point}: {newest} is the newest committed checkpoint")
        out = self.job(w, "resume")
        took = time.monotonic() - killed
        for r in range(2):
            self.assertEqual(out[r]["resumed"], newest, f"{point}: rank {r} resumed from")
            self.assertEqual(out[r]["steps"], list(range(step + 1, 9)),
                             f"{point}: rank {r} trained")
            self.assertEqual(out[r]["listing"], ref[r]["listing"],
                             f"{point}: rank {r}: not the uninterrupted run's names")
            self.assertEqual(out[r]["digest"], ref[r]["digest"],
                             f"{point}: rank {r} resumed from {newest}: not bit-exact "
                             "with the uninterrupted run")
        self.assertEqual(self.leftovers(w), {})
        gone = read_log(w.log, 1 << 24).count("exited without \"end\": abandoning")
        print(f"\n  {point}: killed run {killed - t0:.1f} s, leftovers gone in "
              f"{settled:.2f} s ({gone} abandoning), resumed from {newest} (step {step}), restart "
              f"{took:.1f} s", flush=True)
        self.assertEqual(w.stop(), 0)


class HfTrainer(RestartCase):
    JOB = "restart_hf_job.py"
    MODULES = ("transformers", "accelerate")
    QUICK = "0:during:4"
    PREFIX = "checkpoint-"

    def test_kill_points(self):
        self.kill_points()


class Accelerate(RestartCase):
    JOB = "restart_acc_job.py"
    MODULES = ("accelerate",)
    QUICK = "1:during:6"
    PREFIX = "step-"

    def test_kill_points(self):
        self.kill_points()


class Lightning(RestartCase):
    JOB = "restart_lightning_job.py"
    MODULES = ("lightning",)
    QUICK = "0:during:6"
    PREFIX = "last"

    def expected_steps(self, point):
        ranks, when, step = point.split(":")
        if ranks == "1" and when != "after":   # rank 0 saves alone: a race
            return {int(step) - 2, int(step)}
        return super().expected_steps(point)

    def test_kill_points(self):
        self.kill_points()


if __name__ == "__main__":
    main()
