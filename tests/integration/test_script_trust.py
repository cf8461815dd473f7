#!/usr/bin/env python3
"""mount-scripts/ run as root trust nothing another user could have
planted (issue 33 #3, #5 and the scripts read once more): a MOUNTROOT, a
--log FILE, a Slurm CKPT_MOUNT_BASE or CKPT_LOG_DIR that another user can
change is refused; files in a user's MOUNTROOT (.ckpt-mount.pid, .state,
.rc, .made) are never followed through a symbolic link nor waited on as a
FIFO, and a pid or an mpirun named there is not signalled or run as root;
a rank "mount" that is a directory with user.ckpt.* xattrs is no mount;
the systemd unit's example keeps default_permissions.

The attacker is uid 65534 (a forked child that drops to it). Needs root.

    python3 tests/integration/test_script_trust.py --bin build/bin/ckptfs [CLASS]
"""

import os
import re
import shlex
import signal
import stat
import subprocess
import time
import traceback
import unittest

from ckpttest import REPO, sanenv, util
from ckpttest.util import CKPT_MOUNT, CKPT_UMOUNT, CkptfsTestCase, main, mountinfo_has, read_all
from test_mount_scripts import alive, mounts_under, processes_naming

RANK_EXEC = os.path.join(REPO, "mount-scripts", "ckpt-rank-exec")
PROLOG = os.path.join(REPO, "mount-scripts", "slurm-prolog.sh")
EPILOG = os.path.join(REPO, "mount-scripts", "slurm-epilog.sh")
UNIT = os.path.join(REPO, "mount-scripts", "ckptfs@.service")
NOBODY = 65534
OTHER = 65533   # another user still
JOB = "4343"
SECRET = b"root's own file: not to be changed\n"


def as_user(fn, *args, uid=NOBODY):
    """Run fn(*args) in a forked child that is uid (and gid) uid, no groups."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            fn(*args)
            os._exit(0)
        except BaseException:  # noqa: B036 - the child must not return
            traceback.print_exc()
            os._exit(1)
    _, st = os.waitpid(pid, 0)
    if st != 0:
        raise AssertionError(f"as uid {uid}: {fn.__name__}{args!r} failed")


def mounts_below(root):
    """The mount points under root, decoded (a space shows as \\040 in
    mountinfo), the deepest first."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if mp.startswith(root + "/"):
                out.append(mp)
    return sorted(out, reverse=True)


class Result:
    def __init__(self, returncode, stdout, stderr, seconds, hung):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr
        self.seconds, self.hung = seconds, hung


def run(argv, timeout=120, env=None, **kw):
    """Run a script in a session of its own; on timeout kill the whole
    session (a child blocked in open() on a FIFO holds the pipes)."""
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL, start_new_session=True,
                         env=env if env is not None else sanenv.env(mpi=True), **kw)
    hung = False
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hung = True
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate(timeout=30)
    return Result(p.returncode, out, err, time.monotonic() - t0, hung)


class TrustCase(CkptfsTestCase):
    """self.dir is root's, 0755 (the attacker can reach what it owns in
    it); self.secret is a root-only directory with a root 0600 file."""

    def setUp(self):
        super().setUp()
        if os.geteuid() != 0:
            self.fail("these tests run the scripts as root: run them as root")
        os.chmod(self.dir, 0o755)
        self.secret = os.path.join(self.dir, "secret")
        os.mkdir(self.secret, 0o700)
        self.victim = os.path.join(self.secret, "victim")
        with open(self.victim, "wb") as f:
            f.write(SECRET)
        os.chmod(self.victim, 0o600)
        self.addCleanup(self.leftovers)

    def leftovers(self):
        for p in sorted(mounts_under(self.dir), reverse=True):
            subprocess.run(["fusermount3", "-u", p], capture_output=True)
        deadline = time.monotonic() + 20
        while processes_naming(self.dir) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in processes_naming(self.dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for p in mounts_below(self.dir):
            if subprocess.run(["fusermount3", "-uz", p], capture_output=True).returncode:
                subprocess.run(["umount", "-l", p], capture_output=True)

    def user_dir(self, *parts, mode=0o755, uid=NOBODY):
        """A directory of uid's (made by root, then given away)."""
        d = os.path.join(self.dir, *parts)
        os.makedirs(d, exist_ok=True)
        os.chown(d, uid, uid)
        os.chmod(d, mode)
        return d

    def assert_victim_intact(self):
        st = os.lstat(self.victim)
        self.assertEqual(read_all(self.victim), SECRET, "root's 0600 file was written")
        self.assertEqual((st.st_uid, stat.S_IMODE(st.st_mode)), (0, 0o600))

    def ckpt_mount(self, root, *args, timeout=120):
        return run([CKPT_MOUNT, "--bin", util.BIN, "--timeout", "30", *args,
                    self.backing, root], timeout=timeout)

    def ckpt_umount(self, root, *args, timeout=120):
        return run([CKPT_UMOUNT, *args, root], timeout=timeout)


# ---- ckpt-mount -----------------------------------------------------------------

class MountRoot(TrustCase):
    """ckpt-mount as root works only in a MOUNTROOT that root alone can
    change (issue 33 #3)."""

    def test_foreign_mountroot_log_link(self):
        """The README's /tmp/ckpt made by another user first, with
        .ckpt-mount.log a link to a root 0600 file: refused, the file
        unchanged; removed, ckpt-mount creates it itself, 0755, root's."""
        root = self.user_dir("ckpt")
        as_user(os.symlink, self.victim, os.path.join(root, ".ckpt-mount.log"))
        r = self.ckpt_mount(root, "-n", "1")
        self.assert_victim_intact()
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn(f"{root} belongs to uid {NOBODY}", r.stderr)
        self.assertIn("mkdir -m 0755", r.stderr)
        self.assertEqual(mounts_under(self.dir), [])
        # as the message says: without it, ckpt-mount makes it
        os.unlink(os.path.join(root, ".ckpt-mount.log"))
        os.rmdir(root)
        r = self.ckpt_mount(root, "-n", "1")
        self.assertEqual(r.returncode, 0, r.stderr)
        st = os.lstat(root)
        self.assertEqual((st.st_uid, stat.S_IMODE(st.st_mode)), (0, 0o755))
        self.assertTrue(mountinfo_has(os.path.join(root, "rank0")))
        u = self.ckpt_umount(root)
        self.assertEqual(u.returncode, 0, u.stderr)

    def test_writable_mountroot_planted_files(self):
        """A MOUNTROOT of root's that others can write (0777, or sticky
        1777 as /tmp itself): the pidfile's temporary, .ckpt-mount.made and
        rank0 planted as links are not followed: refused."""
        for mode in (0o777, 0o1777):
            with self.subTest(mode=oct(mode)):
                root = os.path.join(self.dir, f"w{mode:o}")
                os.mkdir(root)
                os.chmod(root, mode)
                rankdir = os.path.join(self.secret, f"rank-{mode:o}")
                os.mkdir(rankdir, 0o700)

                def plant():
                    os.symlink(self.victim, os.path.join(root, ".ckpt-mount.pid.tmp"))
                    os.symlink(self.victim, os.path.join(root, ".ckpt-mount.made"))
                    os.symlink(rankdir, os.path.join(root, "rank0"))
                as_user(plant)
                r = self.ckpt_mount(root, "-n", "2")
                self.assert_victim_intact()
                self.assertFalse(mountinfo_has(rankdir), "root's rank 0 mounted in "
                                 "the directory a link planted in MOUNTROOT named")
                self.assertEqual(r.returncode, 1, r.stderr)
                self.assertIn(f"{root} is writable by others than its owner "
                              f"(mode {mode:o})", r.stderr)
                self.assertEqual(mounts_under(self.dir), [])

    def test_mountroot_under_foreign_directory(self):
        """MOUNTROOT root's, in a directory of another user: that user can
        rename it away and put anything in its place: refused."""
        parent = self.user_dir("users-dir")
        root = os.path.join(parent, "ckpt")
        os.mkdir(root, 0o755)
        r = self.ckpt_mount(root, "-n", "1")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn(f"{parent} belongs to uid {NOBODY}", r.stderr)
        self.assertEqual(mounts_under(self.dir), [])

    def test_mountroot_symlink(self):
        """MOUNTROOT a link another user planted in a sticky directory,
        to a root-only directory: refused (root's mount would go there); a
        link of root's is followed once, and the ranks mount at its target."""
        sticky = os.path.join(self.dir, "tmp")
        os.mkdir(sticky)
        os.chmod(sticky, 0o1777)
        target = os.path.join(self.secret, "mnt")
        os.mkdir(target, 0o755)
        link = os.path.join(sticky, "ckpt")
        as_user(os.symlink, target, link)
        r = self.ckpt_mount(link, "-n", "1")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn(f"{link} is a symbolic link that belongs to uid {NOBODY}", r.stderr)
        self.assertEqual(mounts_under(self.dir), [])
        os.unlink(link)
        real = os.path.join(self.dir, "real-root")
        os.symlink(real, link)
        r = self.ckpt_mount(link, "-n", "1")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, os.path.join(real, "rank0") + "\n")
        u = self.ckpt_umount(link)
        self.assertEqual(u.returncode, 0, u.stderr)

    def test_log_option(self):
        """--log FILE: refused in a directory another user can change; in a
        sticky one (/tmp), a link planted under that name is replaced, not
        followed."""
        users = self.user_dir("users-logs")
        log = os.path.join(users, "ckpt.log")
        as_user(os.symlink, self.victim, log)
        root = os.path.join(self.dir, "mnt1")
        r = self.ckpt_mount(root, "-n", "1", "--log", log)
        self.assert_victim_intact()
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn(f"--log {log}: {users} belongs to uid {NOBODY}", r.stderr)
        self.assertEqual(mounts_under(self.dir), [])

        sticky = os.path.join(self.dir, "tmp")
        os.mkdir(sticky)
        os.chmod(sticky, 0o1777)
        log = os.path.join(sticky, "ckpt.log")
        as_user(os.symlink, self.victim, log)
        r = self.ckpt_mount(root, "-n", "1", "--log", log)
        self.assert_victim_intact()
        self.assertEqual(r.returncode, 0, r.stderr)
        st = os.lstat(log)
        self.assertTrue(stat.S_ISREG(st.st_mode))
        self.assertEqual(st.st_uid, 0)
        self.assertIn("# ckpt-mount ", read_all(log).decode())
        u = self.ckpt_umount(root)
        self.assertEqual(u.returncode, 0, u.stderr)

    def test_multi_node_remote_mountroot(self):
        """Multi-node: the job that makes the rank directories checks
        MOUNTROOT on each host too. Here the "other host" is this one, where
        an mpirun wrapper hands MOUNTROOT to another user (with rank0 and
        .ckpt-mount.made planted as links) just before that job."""
        root = os.path.join(self.dir, "multi")
        os.mkdir(root, 0o755)
        rankdir = os.path.join(self.secret, "rankdir")
        os.mkdir(rankdir, 0o700)
        mpirun = os.path.join(self.dir, "mpirun-other-host")
        with open(mpirun, "w") as f:
            f.write(f"""#!/bin/bash
case " $* " in
  *" ckpt-prep "*)
    chown {NOBODY}:{NOBODY} {root}
    setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups \\
      sh -c 'ln -s {rankdir} {root}/rank0 && ln -s {self.victim} {root}/.ckpt-mount.made' ;;
esac
exec mpirun "$@"
""")
        os.chmod(mpirun, 0o755)
        r = self.ckpt_mount(root, "-n", "2", "--multi-node", "--mpirun", mpirun)
        self.assert_victim_intact()
        self.assertFalse(mountinfo_has(rankdir))
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("cannot create the rank directories", r.stderr)
        self.assertRegex(r.stderr, rf"untrusted 0 \S+ {root} belongs to uid {NOBODY}")
        self.assertEqual(mounts_under(self.dir), [])


# ---- ckpt-umount ------------------------------------------------------------------

class UmountForeignRoot(TrustCase):
    """ckpt-umount as root in a MOUNTROOT another user owns (the Slurm
    epilog's case): its files are that user's."""

    def setUp(self):
        super().setUp()
        self.root = self.user_dir("job")

    def plant(self, name, text):
        def write():
            with open(os.path.join(self.root, name), "w") as f:
                f.write(text)
        as_user(write)

    def test_state_file_runs_nothing_as_root(self):
        """.ckpt-mount.state naming a program of the user's as mpirun in
        multi-node mode: not run (before: run as root, twice)."""
        marker = os.path.join(self.dir, "ran-as")
        evil = os.path.join(self.root, "mpirun")
        self.plant("mpirun", f"#!/bin/sh\nid -u >> {marker}\n")
        os.chmod(evil, 0o755)
        self.plant(".ckpt-mount.state", f"mode=multi-node\nnranks=1\nmpirun={evil}\n"
                   f"template={self.root}/rank%r\nmpi_arg=-np\nmpi_arg=1\n")
        r = self.ckpt_umount(self.root)
        self.assertFalse(os.path.exists(marker), "the user's program ran as root: "
                         + (read_all(marker).decode() if os.path.exists(marker) else ""))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f"{self.root} belongs to uid {NOBODY}: its .ckpt-mount files are "
                      "not trusted", r.stderr)

    def test_planted_fifos_and_links(self):
        """FIFOs as .ckpt-mount.pid, .state and .made: not waited on (before:
        ckpt-umount hung in open()); .rc a link to a root file: not read
        into the messages."""
        for name in (".ckpt-mount.pid", ".ckpt-mount.state", ".ckpt-mount.made"):
            as_user(os.mkfifo, os.path.join(self.root, name))
        r = self.ckpt_umount(self.root, "--local", timeout=30)
        self.assertFalse(r.hung, "ckpt-umount hung on a FIFO planted in MOUNTROOT")
        self.assertEqual(r.returncode, 0, r.stderr)
        for name in (".ckpt-mount.pid", ".ckpt-mount.state", ".ckpt-mount.made"):
            os.unlink(os.path.join(self.root, name))
        self.plant(".ckpt-mount.pid", "999999\n")
        as_user(os.symlink, self.victim, os.path.join(self.root, ".ckpt-mount.rc"))
        r = self.ckpt_umount(self.root, "--local", timeout=30)
        self.assertFalse(r.hung)
        self.assertNotIn("root's own file", r.stderr)
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_foreign_pid_not_signalled(self):
        """.ckpt-mount.pid naming a root process that looks like the
        launcher (its command line has the template): not stopped as root.
        One of the MOUNTROOT owner's own is, as before."""
        template = os.path.join(os.path.realpath(self.root), "rank%r")
        # runs until killed (it cannot open the template, it follows /dev/null)
        sleeper = ["tail", "-f", "/dev/null", template]
        quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rootproc = subprocess.Popen(sleeper, **quiet)
        self.addCleanup(rootproc.wait)
        self.addCleanup(rootproc.kill)
        self.plant(".ckpt-mount.pid", f"{rootproc.pid}\n")
        r = self.ckpt_umount(self.root, "--local", "--timeout", "1", timeout=60)
        self.assertIsNone(rootproc.poll(), f"root's process was killed:\n{r.stderr}")
        self.assertIn(f"pid {rootproc.pid}", r.stderr)
        self.assertIn("not stopped", r.stderr)
        # the owner's own launcher is stopped (the user could do that himself)
        userproc = subprocess.Popen(sleeper, **quiet, preexec_fn=lambda: (
            os.setgroups([]), os.setgid(NOBODY), os.setuid(NOBODY)))
        self.addCleanup(userproc.wait)
        self.addCleanup(userproc.kill)
        if os.path.lexists(os.path.join(self.root, ".ckpt-mount.pid")):
            os.unlink(os.path.join(self.root, ".ckpt-mount.pid"))
        self.plant(".ckpt-mount.pid", f"{userproc.pid}\n")
        r = self.ckpt_umount(self.root, "--local", "--timeout", "1", timeout=60)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("stopping it", r.stderr)
        userproc.wait(timeout=30)


    def test_link_or_parent_of_another_user(self):
        """MOUNTROOT a link of another user's to root's own world: refused
        (before: root's rank mount there was unmounted); MOUNTROOT under a
        directory of another user's (who could swap it for such a link
        while ckpt-umount unmounts by name): refused."""
        users = self.user_dir("users")
        world = os.path.join(self.dir, "world")
        os.makedirs(os.path.join(world, "rank0"))
        self.mount(mnt=os.path.join(world, "rank0"))
        link = os.path.join(users, "ckpt")
        as_user(os.symlink, world, link)
        r = self.ckpt_umount(link, "--discard")
        self.assertTrue(mountinfo_has(os.path.join(world, "rank0")),
                        "root's rank mount of another MOUNTROOT was unmounted:\n" + r.stderr)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn(f"{users} belongs to uid {NOBODY}", r.stderr)
        os.unlink(link)
        os.mkdir(link)   # root's, in the user's directory
        r = self.ckpt_umount(link)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn(f"MOUNTROOT {link}: {users} belongs to uid {NOBODY}", r.stderr)


# ---- ckpt-rank-exec -----------------------------------------------------------------

class RankExec(TrustCase):
    """ckpt-rank-exec as root binds only a FUSE mount of root's (or the
    caller's): user.ckpt.* xattrs prove nothing, any owner sets them."""

    def test_xattrs_of_a_plain_directory(self):
        root = os.path.join(self.dir, "w")
        os.mkdir(root, 0o755)
        rank0 = self.user_dir("w", "rank0")
        path = os.path.join(self.dir, "ckpt")

        def plant():
            os.setxattr(rank0, "user.ckpt.rank", b"0")
            os.setxattr(rank0, "user.ckpt.world_size", b"1")
            with open(os.path.join(rank0, "weights"), "w") as f:
                f.write("planted weights\n")
        as_user(plant)
        argv = [RANK_EXEC, "--rank", "0", "--world-size", "1", root, path, "--",
                "cat", os.path.join(path, "weights")]
        r = run(argv, timeout=60)
        self.assertNotIn("planted", r.stdout)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn(f"{rank0} is not a ckptfs mount", r.stderr)
        # a real rank mount (root's) still works
        os.rename(rank0, os.path.join(self.dir, "planted"))
        os.mkdir(rank0)
        self.mount(mnt=rank0)
        os.mkdir(os.path.join(rank0, "c"))
        util.write_file(os.path.join(rank0, "c", "weights"), b"real weights\n")
        util.commit(os.path.join(rank0, "c"))
        argv[-1] = os.path.join(path, "c", "weights")
        r = run(argv, timeout=60)
        self.assertEqual((r.returncode, r.stdout), (0, "real weights\n"), r.stderr)


# ---- the Slurm prolog and epilog ------------------------------------------------------

class SlurmTrust(TrustCase):
    """The example prolog and epilog (root, on every node) in a
    CKPT_MOUNT_BASE, a job directory and a CKPT_LOG_DIR that users may have
    touched."""

    def env(self, base, **extra):
        env = sanenv.env(mpi=True)
        env.update(CKPT_MOUNT_BASE=base, SLURM_JOB_ID=JOB, SLURM_JOB_UID=str(NOBODY),
                   SLURM_JOB_GID=str(NOBODY), CKPT_LOG_DIR=os.path.join(self.dir, "logs"))
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def test_prolog_leftover_job_directory(self):
        """A directory left by an earlier job with this id (another user's,
        not empty, rank0 a link to a root-only directory): not handed to the
        new job's user, the link not followed by install -d (before: the
        root-only directory became the user's)."""
        base = os.path.join(self.dir, "local-ckpt")
        os.mkdir(base, 0o755)
        old = self.user_dir("local-ckpt", JOB, mode=0o700, uid=OTHER)
        target = os.path.join(self.secret, "rootonly")
        os.mkdir(target, 0o700)

        def plant():
            with open(os.path.join(old, "notes.txt"), "w") as f:
                f.write("the earlier user's")
            os.symlink(target, os.path.join(old, "rank0"))
        as_user(plant, uid=OTHER)
        r = run([PROLOG], env=self.env(base, CKPT_PRECREATE_RANKS=2), timeout=60)
        st = os.lstat(target)
        self.assertEqual((st.st_uid, stat.S_IMODE(st.st_mode)), (0, 0o700),
                         "a root-only directory was given to the job's user")
        self.assertEqual(r.returncode, 0, r.stderr)
        root = os.path.join(base, JOB)
        for d in (root, os.path.join(root, "rank0"), os.path.join(root, "rank1")):
            st = os.lstat(d)
            self.assertTrue(stat.S_ISDIR(st.st_mode), d)
            self.assertEqual((st.st_uid, stat.S_IMODE(st.st_mode)), (NOBODY, 0o700), d)
        self.assertEqual(sorted(os.listdir(root)), ["rank0", "rank1"])
        moved = [n for n in os.listdir(base) if n != JOB]
        self.assertEqual(len(moved), 1, moved)
        self.assertIn(f"moved to {os.path.join(base, moved[0])}", r.stderr)
        kept = os.path.join(base, moved[0])
        self.assertEqual(os.lstat(kept).st_uid, OTHER)
        self.assertEqual(read_all(os.path.join(kept, "notes.txt")), b"the earlier user's")

    def test_base_another_user_controls(self):
        """CKPT_MOUNT_BASE in a directory of a user's, who made BASE/JOB a
        link to a root-only directory: the prolog refuses (before: that
        directory became the user's), the epilog does nothing there
        (before: it moved a root file away from it)."""
        users = self.user_dir("users")
        base = os.path.join(users, "ckpt")
        target = os.path.join(self.secret, "rootonly")
        os.mkdir(target, 0o700)
        rootlog = os.path.join(target, ".ckpt-mount.log")
        with open(rootlog, "w") as f:
            f.write("root's\n")

        def plant():
            os.mkdir(base, 0o755)
            os.symlink(target, os.path.join(base, JOB))
        as_user(plant)
        r = run([PROLOG], env=self.env(base, CKPT_PRECREATE_RANKS=1), timeout=60)
        st = os.lstat(target)
        self.assertEqual((st.st_uid, stat.S_IMODE(st.st_mode)), (0, 0o700))
        self.assertEqual(os.listdir(target), [".ckpt-mount.log"])
        self.assertNotEqual(r.returncode, 0)
        self.assertIn(f"CKPT_MOUNT_BASE {base}: {users} belongs to uid {NOBODY}", r.stderr)
        r = run([EPILOG], env=self.env(base), timeout=120)
        self.assertEqual(read_all(rootlog), b"root's\n", "the epilog took a root file")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f"CKPT_MOUNT_BASE {base}: {users} belongs to uid {NOBODY}", r.stderr)

    def test_epilog_log_dir_link(self):
        """CKPT_LOG_DIR a link a user planted (in a directory of its own)
        to a root-only directory: the job's log (the user's text) is not
        moved in there."""
        base = os.path.join(self.dir, "local-ckpt")
        r = run([PROLOG], env=self.env(base), timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        shared = self.user_dir("shared")
        logdir = os.path.join(shared, "logs")
        target = os.path.join(self.secret, "rootonly")
        os.mkdir(target, 0o700)
        as_user(os.symlink, target, logdir)
        root = os.path.join(base, JOB)

        def write_log():
            with open(os.path.join(root, ".ckpt-mount.log"), "w") as f:
                f.write("the user's text\n")
        as_user(write_log)
        r = run([EPILOG], env=self.env(base, CKPT_LOG_DIR=logdir), timeout=120)
        self.assertEqual(os.listdir(target), [], "the user's file was moved into a "
                         "root-only directory")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f"cannot keep the log in {logdir}: {shared} belongs to uid {NOBODY}",
                      r.stderr)
        self.assertFalse(os.path.exists(root))

    def test_epilog_mount_name_link(self):
        """A mount under the job directory whose name has a space (shown as
        \\040 in mountinfo) and a link named with the \\040 spelled out, to
        another mount: the epilog unmounts neither as root (before: its
        umount -l followed the link and detached the other mount)."""
        base = os.path.join(self.dir, "local-ckpt")
        r = run([PROLOG], env=self.env(base), timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        root = os.path.join(base, JOB)
        other = os.path.join(self.dir, "system-mount")
        os.mkdir(other)
        subprocess.run(["mount", "-t", "tmpfs", "none", other], check=True)
        self.addCleanup(subprocess.run, ["umount", "-l", other], capture_output=True)
        spaced = os.path.join(root, "m n")
        as_user(os.mkdir, spaced)
        # the user's mount (a FUSE mount of its own on a real node)
        subprocess.run(["mount", "-t", "tmpfs", "none", spaced], check=True)
        as_user(os.symlink, other, os.path.join(root, "m\\040n"))
        r = run([EPILOG], env=self.env(base), timeout=120)
        self.assertTrue(mountinfo_has(other), "the epilog detached a mount outside the "
                        "job directory:\n" + r.stderr)
        self.assertEqual(r.returncode, 0, r.stderr)


# ---- the systemd unit ------------------------------------------------------------------

class SystemdUnitExample(TrustCase):
    """mount-scripts/ckptfs@.service with the CKPT_OPTIONS of its header's
    example (io_threads=4,allow_other): mode bits still enforced
    (default_permissions), issue 33 #5."""

    def unit(self):
        service, example, cur = {}, {}, None
        with open(UNIT) as f:
            for line in f:
                line = line.strip()
                if line.startswith("#"):
                    m = re.match(r"#\s+(CKPT_\w+)=(\S+)", line)
                    if m and cur is None:
                        example[m.group(1)] = m.group(2)
                    continue
                if line.startswith("["):
                    cur = line
                    continue
                if cur == "[Service]" and "=" in line:
                    k, v = line.split("=", 1)
                    service.setdefault(k, []).append(v)
        return service, example

    def test_example_keeps_default_permissions(self):
        service, example = self.unit()
        self.assertIn("CKPT_OPTIONS", example, "no CKPT_OPTIONS example in the header")
        self.assertIn("allow_other", example["CKPT_OPTIONS"])
        # as systemd: Environment=, then the EnvironmentFile overrides
        env = {}
        for e in service.get("Environment", []):
            for w in shlex.split(e):
                k, v = w.split("=", 1)
                env[k] = v
        env.update(example)
        mnt = os.path.join(self.dir, "svc")
        os.mkdir(mnt, 0o755)
        env.update(CKPT_BACKING_DIR=self.backing, CKPT_MOUNTPOINT=mnt)

        def argv(line):
            return [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], w)
                    for w in shlex.split(line)]

        start = argv(service["ExecStart"][0])
        start[0] = util.BIN
        r = subprocess.run(start, capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        try:
            with open("/proc/self/mountinfo") as f:
                line = [x for x in f if x.split()[4] == mnt][-1]
            opts = line.split(" - ", 1)[1].split()[2].split(",")
            os.mkdir(os.path.join(mnt, "c"))
            secret = os.path.join(mnt, "c", "root-only")
            util.write_file(secret, b"root's checkpoint\n")
            os.chmod(secret, 0o600)
            os.chmod(os.path.join(mnt, "c"), 0o755)
            util.commit(os.path.join(mnt, "c"))

            def read_it():
                try:
                    with open(secret, "rb"):
                        pass
                except PermissionError:
                    return
                raise AssertionError("uid 65534 opened root's 0600 file")
            as_user(read_it)
            self.assertIn("default_permissions", opts)
        finally:
            subprocess.run(argv(service["ExecStop"][0]), capture_output=True)


if __name__ == "__main__":
    main()
