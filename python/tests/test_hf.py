#!/usr/bin/env python3
"""ckptfs.hf with the Hugging Face Trainer (transformers) and Accelerate of
.venv, at 2 ranks under mpirun (gloo on CPU) over real rank mounts, each
process with its own mount as output_dir (python/tests/hf_job.py):

- a Trainer (tiny GPT-2 from a config, dropout on, a different RNG stream
  per rank) with save_steps=2, save_total_limit=2 and CommitCallback:
  checkpoint-2, -4, -6 committed (the staged checkpoint-4 a killed run
  left on rank 1 discarded first), checkpoint-2 rotated away by the
  Trainer's own rmtree on rank 0; a fresh mount lists checkpoint-4 and -6
  only, each of world size 2 holding both ranks' rng_state_R.pth; resumed
  from checkpoint-4 (over the committed checkpoint-6, which it saves again)
  into other initial weights, both ranks end with the uninterrupted run's
  model and Adam state bit for bit; without rank 1's rng_state_1.pth they
  do not (so the check is real); save_only_model=True (rank 1 writes
  nothing) commits too;
- resume_from_checkpoint=True (the Trainer's get_last_checkpoint) at one
  rank picks the newest committed checkpoint-N: the staged and failed
  checkpoint-N a killed run left, newer, are discarded when the Trainer
  is made (a live job's staged one is kept); each commit records the
  global step (.metadata's step);
- Accelerator.save_state/load_state through ckptfs.hf.save_state/
  load_state: resumed bit-exact, a rank with another RNG state not; a
  committed name saved again refused with overwrite=False, replaced by
  default (as Accelerate overwrites), its step= recorded;
- docs/pytorch.md's Trainer and Accelerate examples, as written;
- `import ckptfs` imports no transformers; a Trainer whose output_dir is
  not a rank mount, or whose world is not the mount's (saying both
  sizes), or a dead mount (ENOTCONN, named as one), fails when the
  Trainer is made and at train begin.

    PYTHONPATH=tests/integration:python \\
        python3 python/tests/test_hf.py --bin build/bin/ckptfs
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys

from ckpttest import REPO, util
from ckpttest.util import CkptfsTestCase, main
from ckpttest.world import MPIRUN, query
from ckpttest.pyenv import PACKAGE, require_modules, run_py

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_job.py")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
           "TRANSFORMERS_VERBOSITY": "error"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HfCase(CkptfsTestCase):

    def setUp(self):
        super().setUp()
        self.py = require_modules(self, "transformers", "accelerate")

    def world(self, n=2):
        return self.start_world(n, "commit_timeout=60", root=os.path.join(self.dir, "ranks"))

    def mpirun(self, argv, n=2, **env):
        """argv under mpirun -np n (gloo's rendezvous on a free port)."""
        env = dict(OMP_NUM_THREADS="1", PYTHONPATH=PACKAGE, **OFFLINE, **env)
        cmd = MPIRUN + ["-np", str(n), "-x", "MASTER_ADDR=127.0.0.1",
                        "-x", f"MASTER_PORT={free_port()}"]
        for var in env:
            cmd += ["-x", var]
        r = subprocess.run(cmd + [str(a) for a in argv], capture_output=True, text=True,
                           timeout=600, env=dict(os.environ, **env), stdin=subprocess.DEVNULL)
        self.assertEqual(r.returncode, 0, f"{argv}:\n{r.stdout[-5000:]}\n{r.stderr[-8000:]}")

    def job(self, *args, n=2, **env):
        """hf_job.py ARGS under mpirun -np n; {rank: its result dict}."""
        self.njobs = getattr(self, "njobs", 0) + 1
        results = os.path.join(self.dir, f"results{self.njobs}")
        os.mkdir(results)
        self.mpirun([self.py, JOB, *args], n, CKPT_RESULT_DIR=results, **env)
        out = {}
        for f in os.listdir(results):
            with open(os.path.join(results, f)) as fh:
                d = json.load(fh)
            out[d["rank"]] = d
        self.assertEqual(sorted(out), list(range(n)))
        return out

    def assert_committed(self, mnt, name, files):
        """NAME, seen through mnt, is committed by a world of 2 and holds files."""
        with open(os.path.join(mnt, name, ".status")) as f:
            self.assertEqual(f.readline(), "committed\n")
        self.assertLessEqual(set(files), set(os.listdir(os.path.join(mnt, name))))
        ws = query(os.path.join(mnt, name, ".metadata"),
                   "SELECT value FROM checkpoint WHERE key='world_size'")
        self.assertEqual(ws, [("2",)])


class Trainer(HfCase):

    def test_rotation_and_resume(self):
        w = self.world()
        # what a killed run left staged on rank 1: discarded before the save
        os.makedirs(os.path.join(w.mnt(1), "checkpoint-4"))
        with open(os.path.join(w.mnt(1), "checkpoint-4", "stale.txt"), "w") as f:
            f.write("from a killed run")
        full = self.job("trainer", w.root)
        for r in range(2):
            self.assertEqual(full[r]["steps"], [1, 2, 3, 4, 5, 6])
            # rank 1 lists what rank 0's rotation left, with no staged leftovers
            self.assertEqual(full[r]["listing"][:2], ["checkpoint-4", "checkpoint-6"])
        self.assertEqual(full[0]["model"], full[1]["model"])

        self.mount()  # a fresh mount of the backing directory
        kept = ["checkpoint-4", "checkpoint-6", "final"]
        self.assertEqual(sorted(os.listdir(self.mnt)), kept)
        self.assertEqual(sorted(os.listdir(self.backing)), kept)
        for name in ("checkpoint-4", "checkpoint-6"):
            self.assert_committed(self.mnt, name, [
                "rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "config.json",
                "optimizer.pt", "scheduler.pt", "trainer_state.json", "training_args.bin"])
        self.assertNotIn("stale.txt", os.listdir(os.path.join(self.mnt, "checkpoint-4")))
        # the Trainer's rotation sorts by the directories' mtimes: kept at commit
        self.assertLess(*(os.stat(os.path.join(self.mnt, n)).st_mtime_ns for n in kept[:2]))
        self.assertEqual(sorted(os.listdir(os.path.join(self.mnt, "final"))), [
            ".metadata", "config.json", "generation_config.json", "model.safetensors",
            "training_args.bin"])
        self.assertIn("checkpoint-2: removed as a whole", util.read_log(w.log))

        # resumed from checkpoint-4 (saving checkpoint-6 again over the
        # committed one), from other initial weights: steps 5 and 6 only
        resumed = self.job("trainer", w.root, "checkpoint-4")
        for r in range(2):
            self.assertEqual(resumed[r]["steps"], [5, 6])
            self.assertEqual(resumed[r]["model"], full[r]["model"], f"rank {r}: model")
            self.assertEqual(resumed[r]["optimizer"], full[r]["optimizer"], f"rank {r}: Adam")
            self.assertEqual(resumed[r]["listing"], ["checkpoint-4", "checkpoint-6", "final"])
        self.assert_committed(self.mnt, "checkpoint-6", ["rng_state_1.pth"])

        # the control: without rank 1's RNG state (removed from the committed
        # checkpoint-4 for every mount) the resumed run ends elsewhere. It
        # saves with save_only_model=True: rank 1 writes nothing into
        # checkpoint-6, and commits its empty part
        os.unlink(os.path.join(self.mnt, "checkpoint-4", "rng_state_1.pth"))
        control = self.job("trainer", w.root, "checkpoint-4", CKPT_HF_MODEL_ONLY="1")
        for r in range(2):
            self.assertNotEqual(control[r]["model"], full[r]["model"], f"rank {r}")
        self.assert_committed(self.mnt, "checkpoint-6", ["model.safetensors"])
        self.assertNotIn("rng_state_0.pth", os.listdir(os.path.join(self.mnt, "checkpoint-6")))

    def test_setup_errors(self):
        """No transformers on `import ckptfs`; CommitCallback refuses, when
        the Trainer is made (on_init_end) and at train begin, an output_dir
        that is no rank mount, a world of another size, a dead mount
        (named as one), and save_total_limit=1 (the Trainer rotates before
        the commit)."""
        w = self.world()
        code = r'''
import sys
import ckptfs
assert "transformers" not in sys.modules, "import ckptfs imported transformers"
from transformers import TrainingArguments
cb = ckptfs.hf.CommitCallback()
for hook in (cb.on_init_end, cb.on_train_begin):
    for out in sys.argv[1:]:
        limit = 1 if out.startswith("limit1:") else None
        try:
            hook(TrainingArguments(output_dir=out.removeprefix("limit1:"),
                                   use_cpu=True, report_to="none",
                                   save_total_limit=limit), None, None)
            print(f"{hook.__name__} accepted:", out)
        except ckptfs.CkptfsError as e:
            print(f"{hook.__name__} refused:", e)
'''
        plain = os.path.join(self.dir, "plain")
        os.mkdir(plain)
        one = self.mount().mnt   # a world of one
        dead = util.Mount(os.path.join(self.dir, "backing-dead"), os.path.join(self.dir, "dead"),
                          self.log)
        os.mkdir(dead.backing)
        self.mounts.append(dead)
        dead.start()
        dead.proc.send_signal(signal.SIGKILL)
        dead.proc.wait()
        out = run_py(self, self.py, code, plain, w.mnt(0), one, "limit1:" + one, dead.mnt,
                     env=OFFLINE)
        for hook in ("on_init_end", "on_train_begin"):
            self.assertIn(f"{hook} accepted: {one}", out)
            self.assertIn(f"{hook} refused: save_total_limit=1 with ckptfs", out)
            self.assertIn(f"{hook} refused: {plain} is not the root of a ckptfs rank mount", out)
            self.assertIn(f"{hook} refused: the trainer runs 1 rank but {w.mnt(0)} belongs to "
                          "a ckptfs world of 2 ranks", out)
            self.assertIn(f"{hook} refused: the ckptfs mount at {dead.mnt} is gone (ENOTCONN): "
                          "its daemon exited; see its log", out)

    def test_resume_last_skips_leftovers(self):
        """resume_from_checkpoint=True at 1 rank: checkpoint-2 and -4
        committed by a first run (each recording its global step), then
        what a killed run leaves, newer: checkpoint-6 staged and
        checkpoint-8 failed, no job writing them; and checkpoint-1 staged
        by a live job. The resumed run discards the first two when the
        Trainer is made (before get_last_checkpoint), resumes from
        checkpoint-4 (steps 5 and 6) and keeps the live job's."""
        w = self.world(1)
        mnt = w.mnt(0)
        first = self.job("trainer", w.root, n=1, CKPT_HF_MAX_STEPS="4", CKPT_HF_NO_LIMIT="1")
        self.assertEqual(first[0]["steps"], [1, 2, 3, 4])
        for step in (2, 4):
            self.assertEqual(query(os.path.join(mnt, f"checkpoint-{step}", ".metadata"),
                                   "SELECT value FROM checkpoint WHERE key='step'"),
                             [(str(step),)])
        # the killed run's: staged, and failed (a chunk without its bytes)
        util.write_file(os.path.join(mnt, "checkpoint-6", "rng_state_0.pth"), b"partial")
        bad = os.path.join(mnt, "checkpoint-8", "w")
        util.write_file(bad, b"abc")
        util.set_tensor_xattrs(bad, "float32", [1])
        with self.assertRaises(OSError):
            util.commit(os.path.dirname(bad))
        self.assertEqual(util.state(os.path.dirname(bad)), "failed")
        # a live job's staged checkpoint-1
        live = subprocess.Popen(
            [sys.executable, "-c", "import os, sys, time, ckptfs.job\n"
             "assert ckptfs.job.declare(sys.argv[1])\n"
             "os.mkdir(os.path.join(sys.argv[1], 'checkpoint-1'))\n"
             "print('ready', flush=True)\ntime.sleep(600)", mnt],
            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=PACKAGE))
        try:
            self.assertEqual(live.stdout.readline().strip(), "ready")
            resumed = self.job("trainer", w.root, "last", n=1, CKPT_HF_NO_LIMIT="1")
            self.assertEqual(resumed[0]["steps"], [5, 6])
            self.assertEqual(resumed[0]["listing"], ["checkpoint-1", "checkpoint-2",
                                                     "checkpoint-4", "checkpoint-6", "final"])
            self.assertEqual(util.state(os.path.join(mnt, "checkpoint-1")), "staging")
        finally:
            live.kill()
            live.wait()
            live.stdout.close()
        self.assertEqual(util.state(os.path.join(mnt, "checkpoint-6")), "committed")
        self.assertEqual(query(os.path.join(mnt, "checkpoint-6", ".metadata"),
                               "SELECT value FROM checkpoint WHERE key='step'"), [("6",)])
        log = util.read_log(w.log, 1 << 24)
        self.assertNotIn("checkpoint-6: commit failed", log)


class Accelerate(HfCase):

    def test_save_state_load_state(self):
        w = self.world()
        res = self.job("accelerate", w.root)
        for r in range(2):
            self.assertEqual(res[r]["listing"], [
                ".metadata", "model.safetensors", "optimizer.bin", "random_states_0.pkl",
                "random_states_1.pkl", "scheduler.bin"])
            self.assertEqual(res[r]["resumed"], res[r]["uninterrupted"], f"rank {r}")
            # the control's model differs: rank 1's RNG state counts
            self.assertNotEqual(res[r]["control"][0], res[r]["uninterrupted"][0], f"rank {r}")
            # overwrite=False refused; the default replaced it with the control's state
            self.assertIn("checkpoint 'acc-3' is already committed", res[r]["refused"])
            self.assertIn("pass overwrite=True", res[r]["refused"])
            self.assertEqual(res[r]["replaced"], res[r]["control"][0], f"rank {r}")
            self.assertEqual(res[r]["step"], "6", f"rank {r}: step=6 recorded, not the "
                             "name's digits")
            self.assertEqual(res[r]["listing_after"], ["acc-3"])
        self.mount()
        self.assert_committed(self.mnt, "acc-3", ["random_states_0.pkl", "random_states_1.pkl"])


class DocsExamples(HfCase):
    """docs/pytorch.md's two examples run as written, launched as it says
    (mpirun, RANK/WORLD_SIZE/LOCAL_RANK from Open MPI's variables)."""

    def run_example(self, code, *args):
        script = os.path.join(self.dir, "example.py")
        with open(script, "w") as f:
            f.write(code)
        self.mpirun(["sh", "-c", "RANK=$OMPI_COMM_WORLD_RANK WORLD_SIZE=$OMPI_COMM_WORLD_SIZE "
                     'LOCAL_RANK=$OMPI_COMM_WORLD_LOCAL_RANK exec "$0" "$@"',
                     self.py, script, *args])

    def test_examples(self):
        trainer, accelerate = docs_blocks()
        w = self.world()
        self.run_example(trainer, w.root)
        self.run_example(accelerate, w.root)
        self.run_example(accelerate, w.root, "step-4")  # saves step-8 again
        self.mount()
        self.assertEqual(sorted(os.listdir(self.mnt)),
                         ["checkpoint-4", "checkpoint-6", "final", "step-4", "step-8"])
        self.assert_committed(self.mnt, "checkpoint-6", ["rng_state_1.pth"])
        self.assertIn("model.safetensors", os.listdir(os.path.join(self.mnt, "final")))
        self.assert_committed(self.mnt, "step-8", ["random_states_1.pkl"])
        self.assertEqual(util.read_log(w.log).count(
            "published as step-8 (replace=)"), 2)


def docs_blocks():
    """The ```python blocks of docs/pytorch.md's Hugging Face section."""
    with open(os.path.join(REPO, "docs", "pytorch.md")) as f:
        text = f.read()
    section = text.split("\n## The Hugging Face Trainer and Accelerate", 1)[1]
    section = section.split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


if __name__ == "__main__":
    main()
