"""A trainer's crash leaves nothing that blocks the restarted job.

A process that declares itself a job of a mount (setxattr MOUNT
user.ckpt.job LABEL, what the integrations do) and exits without "end"
(SIGKILL here) has its unfinished saves abandoned on its rank: a staged
one is discarded at once (the name free, the log saying why); a committing one fails on every rank when some rank's plan
is not in yet (the coordinator's round fails at once, no commit_timeout
waited for), and commits when every rank's is. The restarted job then
saves under the same names without an error. A process that never
declared itself, or that said "end", leaves its saves as they are.

    python3 tests/integration/test_restart.py --bin build/bin/ckptfs
"""

import os
import subprocess
import sys
import time

from ckpttest import util as cu
from ckpttest.util import CkptfsTestCase, commit, read_log, status, write_file

JOB = "user.ckpt.job"

# A trainer on one rank mount: declares itself (unless LABEL is ""),
# stages NAME (mkdir, two files), commits it (COMMIT: "", "sync", "async"),
# says "ready" and sleeps until killed; END: it says "end" before that.
TRAINER = r"""
import os, sys, time
mnt, name, label, mode, end = sys.argv[1:6]
if label:
    os.setxattr(mnt, "user.ckpt.job", label.encode())
ck = os.path.join(mnt, name)
os.mkdir(ck)
for i in range(2):
    with open(os.path.join(ck, f"{os.path.basename(mnt)}_{i}"), "wb") as f:
        f.write(os.urandom(4096 * (i + 1)))
if mode:
    with open(os.path.join(ck, ".commit"), "w") as f:
        f.write(mode)
if end == "1":
    os.setxattr(mnt, "user.ckpt.job", b"end")
print("ready", flush=True)
time.sleep(600)
"""


class Trainer:
    """One trainer process on mount mnt (see TRAINER)."""

    def __init__(self, mnt, name, label="job 1", mode="", end=False):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER, mnt, name, label, mode, "1" if end else "0"],
            stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise AssertionError(f"trainer on {mnt} did not stage {name}: {line!r}")

    def kill(self):
        t0 = time.monotonic()
        self.proc.kill()
        self.proc.wait(5)
        took = time.monotonic() - t0
        self.proc.stdout.close()
        return took


def gone(path, timeout=10):
    """Wait until path is no longer there; seconds it took."""
    t0 = time.monotonic()
    cu.wait_until(lambda: not os.path.exists(path), timeout, f"{path} gone")
    return time.monotonic() - t0


class OneRank(CkptfsTestCase):

    def test_killed_job_staged_save_is_abandoned(self):
        self.mount()
        ck = self.ck("step-8")
        t = Trainer(self.mnt, "step-8")
        self.assertEqual(status(ck).split("\n")[0], "staging")
        t.kill()
        took = gone(ck)
        self.assertLess(took, 2.0)
        self.assertNotIn("step-8", os.listdir(self.mnt))
        log = read_log(self.log)
        self.assertIn("step-8: abandoned: the job that wrote it is gone", log)
        self.assertIn("job 1", log)
        # the restarted job saves the same name, no error
        t2 = Trainer(self.mnt, "step-8", label="job 2", mode="sync")
        self.assertEqual(status(ck).split("\n")[0], "committed")
        t2.kill()
        self.assertEqual(status(ck).split("\n")[0], "committed")

    def test_undeclared_or_ended_processes_keep_their_saves(self):
        self.mount()
        plain = Trainer(self.mnt, "plain", label="")
        ended = Trainer(self.mnt, "ended", end=True)
        plain.kill()
        ended.kill()
        time.sleep(0.5)  # an abandon takes milliseconds: none comes
        for name in ("plain", "ended"):
            self.assertEqual(status(self.ck(name)).split("\n")[0], "staging", name)
        commit(self.ck("plain"))
        self.assertEqual(status(self.ck("plain")).split("\n")[0], "committed")

    def test_label_checked(self):
        self.mount()
        for bad in (b"a\nb", b"x" * 200):
            with self.assertRaises(OSError):
                os.setxattr(self.mnt, JOB, bad)


class World(CkptfsTestCase):
    """Two ranks, commit_timeout=60: a wait for it would show."""

    def start(self):
        return self.start_world(2, "commit_timeout=60")

    def resave(self, w, name, took_max=10):
        """The restarted job (new processes) saves name on both ranks."""
        t0 = time.monotonic()
        ts = [Trainer(w.mnt(r), name, label="job 2", mode="async") for r in range(2)]
        try:
            for r in range(2):
                cu.wait_until(lambda: status(os.path.join(w.mnt(r), name)).split("\n")[0]
                              == "committed", took_max, f"rank {r}: {name} committed")
        except TimeoutError as e:
            sts = {r: status(os.path.join(w.mnt(r), name)) for r in range(2)}
            self.fail(f"{e}: {sts}\n{read_log(w.log)[-4000:]}")
        finally:
            for t in ts:
                t.kill()
        return time.monotonic() - t0

    def check_abandoned(self, w, name):
        for r in range(2):
            took = gone(os.path.join(w.mnt(r), name))
            self.assertLess(took, 5.0, f"rank {r}")

    def test_client_committed_coordinator_only_staged(self):
        """Case 1 of the issue: the rank that finished staging commits
        (async) and waits for the coordinator, whose trainer is killed
        before its commit: both abandoned at once, the name saved again."""
        w = self.start()
        t0 = Trainer(w.mnt(0), "step-8")
        t1 = Trainer(w.mnt(1), "step-8", mode="async")
        ck1 = os.path.join(w.mnt(1), "step-8")
        cu.wait_until(lambda: "waiting for" in status(ck1), 30, "rank 1 waits")
        for t in (t0, t1):
            self.assertLess(t.kill(), 1.0)
        self.check_abandoned(w, "step-8")
        self.assertLess(self.resave(w, "step-8"), 10)
        self.assertIn("abandoned", read_log(w.log))

    def test_coordinator_committed_client_only_staged(self):
        w = self.start()
        t0 = Trainer(w.mnt(0), "step-8", mode="async")
        t1 = Trainer(w.mnt(1), "step-8")
        ck0 = os.path.join(w.mnt(0), "step-8")
        cu.wait_until(lambda: "waiting for" in status(ck0), 30, "rank 0 waits")
        t1.kill()
        gone(os.path.join(w.mnt(1), "step-8"))
        # rank 0's trainer still lives: its save waits (for rank 1)
        self.assertEqual(status(ck0).split("\n")[0], "committing")
        t0.kill()
        self.check_abandoned(w, "step-8")
        self.assertLess(self.resave(w, "step-8"), 10)

    def test_every_rank_committed_goes_on(self):
        """Once every rank committed, the save is the job's last word: it
        commits although the trainers are gone."""
        w = self.start()
        ts = [Trainer(w.mnt(r), "step-4", mode="async") for r in range(2)]
        for t in ts:
            t.kill()
        for r in range(2):
            ck = os.path.join(w.mnt(r), "step-4")
            cu.wait_until(lambda: not os.path.exists(ck) or
                          status(ck).split("\n")[0] in ("committed", "failed"),
                          30, "the save ended")
            self.assertTrue(os.path.exists(ck), f"rank {r}: abandoned\n{read_log(w.log)}")
            self.assertEqual(status(ck).split("\n")[0], "committed", status(ck))


if __name__ == "__main__":
    cu.main()
