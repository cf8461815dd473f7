#!/usr/bin/env python3
"""mount-scripts/slurm-prolog.sh and slurm-epilog.sh, run as slurmd runs
them (as root, with SLURM_JOB_ID, SLURM_JOB_UID, SLURM_JOB_GID set) on
this machine: the prolog prepares the job's MOUNTROOT, the "job" mounts 2
ranks there with ckpt-mount and commits a checkpoint, and the epilog
clears what the job left: live rank mounts it did not unmount, or dead
ones after Slurm killed the daemons. The checkpoints in BACKING_DIR stay.

    python3 tests/integration/test_slurm_scripts.py --bin build/bin/ckptfs
"""

import os
import signal
import subprocess
import time

from ckpttest import REPO, sanenv, util
from ckpttest.util import CKPT_MOUNT, CkptfsTestCase, main, read_all, wait_until
from test_mount_scripts import alive, mounts_under, processes_naming

PROLOG = os.path.join(REPO, "mount-scripts", "slurm-prolog.sh")
EPILOG = os.path.join(REPO, "mount-scripts", "slurm-epilog.sh")
JOB = "4242"
NOBODY = 65534


class SlurmScripts(CkptfsTestCase):

    def setUp(self):
        super().setUp()
        if os.geteuid() != 0:
            self.fail("the Slurm prolog and epilog run as root: run this test as root")
        self.base = os.path.join(self.dir, "local-ckpt")
        self.root = os.path.join(self.base, JOB)
        self.logs = os.path.join(self.dir, "logs")
        self.addCleanup(self.leftovers)

    def leftovers(self):
        for p in mounts_under(self.dir):
            subprocess.run(["fusermount3", "-uz", p], capture_output=True)
        for pid in processes_naming(self.dir):
            os.kill(pid, signal.SIGKILL)

    def slurm_env(self, **extra):
        env = sanenv.env(mpi=True)
        for k in ("CKPT_LOG_DIR", "CKPT_KEEP_LOGS", "CKPT_LOG_DAYS"):
            env.pop(k, None)
        env.update(CKPT_MOUNT_BASE=self.base, SLURM_JOB_ID=JOB,
                   SLURM_JOB_UID=str(NOBODY), SLURM_JOB_GID=str(NOBODY))
        if not {"CKPT_LOG_DIR", "CKPT_KEEP_LOGS", "default_log_dir"} & set(extra):
            env["CKPT_LOG_DIR"] = self.logs   # not /var/log/ckptfs of this machine
        extra.pop("default_log_dir", None)
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def run_script(self, script, env, timeout=240):
        return subprocess.run([script], capture_output=True, text=True, env=env,
                              stdin=subprocess.DEVNULL, timeout=timeout)

    def prolog(self, **extra):
        r = self.run_script(PROLOG, self.slurm_env(**extra))
        self.assertEqual(r.returncode, 0, r.stderr)
        return r

    def job(self, commit=True, differ=False):
        """What a job script does: ckpt-mount 2 ranks in MOUNTROOT, save
        (differ: replicas that differ, so the commit fails). The job's user
        would run it; root does here (a FUSE mount as uid 65534 needs a
        /dev/fuse that user may open), and ckpt-mount as root takes only a
        MOUNTROOT of root's: the job's is root's while ckpt-mount runs, then
        the user's again (the epilog then sees root's files in the user's
        directory, and a launcher of root's it does not signal)."""
        for d in [self.root] + [os.path.join(self.root, n) for n in os.listdir(self.root)
                                if n.startswith("rank")]:
            os.chown(d, 0, 0)   # (rank directories the prolog made stay root's)
        try:
            r = subprocess.run([CKPT_MOUNT, "-n", "2", "--bin", util.BIN,
                                self.backing, self.root], capture_output=True, text=True,
                               env=sanenv.env(mpi=True), timeout=240, stdin=subprocess.DEVNULL)
        finally:
            os.chown(self.root, NOBODY, NOBODY)
        self.assertEqual(r.returncode, 0, r.stderr)
        if commit:
            for rank in range(2):
                util.write_file(os.path.join(self.root, f"rank{rank}", "s", "x"),
                                b"replica%d" % rank if differ else b"replica")
            import threading
            def commit(r):
                try:
                    util.commit(os.path.join(self.root, f"rank{r}", "s"))
                except OSError:
                    pass   # the state says
            ts = [threading.Thread(target=commit, args=(r,)) for r in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            self.assertEqual(util.state(os.path.join(self.root, "rank0", "s")),
                             "failed" if differ else "committed")

    def assert_cleared(self, r):
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(mounts_under(self.base), [])
        self.assertFalse(os.path.exists(self.root), os.listdir(self.root)
                         if os.path.exists(self.root) else "")
        self.assertTrue(os.path.isdir(self.base))
        # the checkpoint is in BACKING_DIR, untouched
        self.assertTrue(os.path.exists(self.bk("s", ".metadata")))
        deadline = time.monotonic() + 30
        while processes_naming(self.root) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertEqual(processes_naming(self.root), [], "daemons left running")

    def test_prolog_prepares_mountroot(self):
        # left from an earlier job with this id (a node reboot)
        os.makedirs(os.path.join(self.root, "rank0"))
        with open(os.path.join(self.root, ".ckpt-mount.log"), "w") as f:
            f.write("old")
        self.prolog(CKPT_PRECREATE_RANKS=2)
        for d in (self.root, os.path.join(self.root, "rank0"),
                  os.path.join(self.root, "rank1")):
            st = os.stat(d)
            self.assertEqual((st.st_uid, st.st_gid, st.st_mode & 0o777),
                             (NOBODY, NOBODY, 0o700), d)
        self.assertEqual(sorted(os.listdir(self.root)), ["rank0", "rank1"])
        self.assertEqual(os.stat(self.base).st_mode & 0o777, 0o755)

    def test_prolog_outside_slurm_fails(self):
        env = self.slurm_env()
        del env["SLURM_JOB_ID"]
        r = self.run_script(PROLOG, env)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("not run by Slurm", r.stderr)
        self.assertFalse(os.path.exists(self.base))

    def test_epilog_unmounts_live_ranks(self):
        """The job did not run ckpt-umount: its daemons still run."""
        self.prolog()
        self.job()
        self.assertEqual(len(mounts_under(self.root)), 2)
        # a checkpoint the job staged and never committed: discarded, named
        os.mkdir(os.path.join(self.root, "rank1", "unsaved"))
        with open(os.path.join(self.root, "rank1", "unsaved", "f"), "wb") as f:
            f.write(b"12345")
        r = self.run_script(EPILOG, self.slurm_env())
        self.assert_cleared(r)
        self.assertIn("discarding " + os.path.join(os.path.realpath(self.root), "rank1", "unsaved")
                      + ": staging, 1 file, 5 bytes", r.stderr)
        # and the checkpoint reads back through a fresh mount
        self.mount()
        self.assertEqual(read_all(self.ck("s", "x")), b"replica")

    def test_epilog_after_daemons_were_killed(self):
        """Slurm killed the job's processes, daemons included: dead mounts."""
        self.prolog(CKPT_PRECREATE_RANKS=2)
        self.job()
        killed = processes_naming(self.root)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not any(alive(p) for p in killed), 30, "the killed processes gone")
        self.assertEqual(len(mounts_under(self.root)), 2)  # dead, still there
        r = self.run_script(EPILOG, self.slurm_env(CKPT_KEEP_LOGS=os.path.join(self.dir, "logs")))
        self.assert_cleared(r)
        kept = os.listdir(os.path.join(self.dir, "logs"))
        self.assertEqual(len(kept), 1)
        self.assertTrue(kept[0].startswith(f"ckpt-mount.{JOB}."), kept)

    def test_epilog_keeps_the_log_by_default(self):
        """The job's .ckpt-mount.log, the only record of why its commit
        failed, outlives the job: in /var/log/ckptfs (here a tmpfs in a
        mount namespace of the epilog's own), readable by its owner only."""
        self.prolog()
        self.job(differ=True)
        r = subprocess.run([os.path.join(REPO, "mount-scripts", "ckpt-umount"), "--discard",
                            self.root], capture_output=True, text=True, timeout=240,
                           stdin=subprocess.DEVNULL)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(self.root, ".ckpt-mount.log")) as f:
            log = f.read()
        self.assertIn("replicas differ", log)
        out = os.path.join(self.dir, "var-log-ckptfs")
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            'mount -t tmpfs none /var/log && "$0" && cp -a /var/log/ckptfs "$1"',
                            EPILOG, out], capture_output=True, text=True, timeout=240,
                           env=self.slurm_env(default_log_dir=True), stdin=subprocess.DEVNULL)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertFalse(os.path.exists(self.root))
        kept = os.listdir(out)
        self.assertEqual(len(kept), 1, kept)
        self.assertRegex(kept[0], rf"^ckpt-mount\.{JOB}\.[^.]+\.log$")
        self.assertEqual(read_all(os.path.join(out, kept[0])).decode(), log)
        self.assertEqual(os.stat(os.path.join(out, kept[0])).st_mode & 0o777, 0o600)

    def test_epilog_log_dir_and_pruning(self):
        """CKPT_LOG_DIR chooses where; logs older than CKPT_LOG_DAYS go;
        CKPT_LOG_DIR=none drops the log with the job."""
        os.makedirs(self.logs)
        old, recent = (os.path.join(self.logs, f"ckpt-mount.{j}.node9.log") for j in (1, 2))
        for path, days in ((old, 40), (recent, 20)):
            util.write_file(path, b"an earlier job\n")
            t = time.time() - days * 86400
            os.utime(path, (t, t))
        for log_dir in (self.logs, "none"):
            self.prolog()
            util.write_file(os.path.join(self.root, ".ckpt-mount.log"), b"why\n")
            r = self.run_script(EPILOG, self.slurm_env(CKPT_LOG_DIR=log_dir))
            self.assertEqual((r.returncode, r.stderr), (0, ""))
            self.assertFalse(os.path.exists(self.root))
        kept = sorted(os.listdir(self.logs))
        self.assertEqual(len(kept), 2, kept)
        self.assertEqual(kept[0], os.path.basename(recent))
        self.assertTrue(kept[1].startswith(f"ckpt-mount.{JOB}."), kept)
        self.assertEqual(read_all(os.path.join(self.logs, kept[1])), b"why\n")

    def test_epilog_leaves_user_files(self):
        """Never rm -r: a file the user left keeps MOUNTROOT, and exit 0."""
        self.prolog()
        with open(os.path.join(self.root, "notes.txt"), "w") as f:
            f.write("mine")
        r = self.run_script(EPILOG, self.slurm_env())
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f"job {JOB}: {self.root} is not empty, left in place", r.stderr)
        self.assertEqual(read_all(os.path.join(self.root, "notes.txt")), b"mine")

    def test_epilog_without_mountroot(self):
        r = self.run_script(EPILOG, self.slurm_env())
        self.assertEqual((r.returncode, r.stderr), (0, ""))


if __name__ == "__main__":
    main()
