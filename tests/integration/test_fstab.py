#!/usr/bin/env python3
"""Mounting ckptfs like any filesystem: an /etc/fstab line (mount -T with
an alternative fstab), mount -t fuse.ckptfs, mount -t fuse PROG#SOURCE,
umount, the fstab-only options mount(8) and systemd pass, mount errors as
a non-zero exit with ckptfs's message, and the systemd unit template
mount-scripts/ckptfs@.service. Needs root (mount(8)) and, for the fstab
and fuse.ckptfs cases, unshare(1) (in a chroot, where a mount namespace
cannot be made private, the bind mount below is made and undone in place).

mount(8) runs the helper /sbin/mount.fuse3 (as mount.fuse) with PATH
removed from the environment, so the helper's shell finds `ckptfs` in its
default PATH only (/usr/local/sbin, /usr/local/bin, /usr/sbin, /usr/bin,
/sbin, /bin). These cases therefore run in a private mount namespace
(unshare -m) in which a temporary directory holding a `ckptfs` symlink to
the binary under test is bind-mounted over /usr/local/sbin: the system's
directories are never changed, and the mount is seen only inside. A save
made there is then read back through an ordinary mount.

    python3 tests/integration/test_fstab.py --bin build/bin/ckptfs
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

from ckpttest import util
from ckpttest.util import CkptfsTestCase, main, mountinfo_has, read_all
from ckpttest.pyenv import PACKAGE, REPO

UNIT = os.path.join(REPO, "mount-scripts", "ckptfs@.service")
FSTAB_NOISE = ("rw,nodev,nosuid,noatime,noauto,nofail,_netdev,users,"
               "x-systemd.automount,x-systemd.device-timeout=10s")

# Runs as root inside a private mount namespace: puts `ckptfs` on the
# helper's default PATH, mounts with argv[5:], saves a checkpoint with the
# Python client, reads it back, unmounts with umount(8), waits for the
# daemon to exit. Prints what it saw as JSON lines.
INNER = r'''
import json, os, subprocess, sys, time
sbin, mnt, backing, package = sys.argv[1:5]
cmd = sys.argv[5:]
sys.path.insert(0, package)
import ckptfs

def say(**kw):
    print(json.dumps(kw), flush=True)

def daemon_pid():
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                argv = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if os.path.basename(argv[0]) == b"ckptfs" and os.fsencode(mnt) in argv:
                return int(p)
    return None

# the first directory of the helper shell's default PATH that exists
target = next(d for d in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin")
              if os.path.isdir(d))
if os.environ.get("CKPT_FSTAB_NO_NS") == "1":
    # no private namespace (a chroot): the bind mount is undone at exit
    import atexit
    atexit.register(subprocess.run, ["umount", target])
else:
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
subprocess.run(["mount", "--bind", sbin, target], check=True)
r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
say(mount=r.returncode, stderr=r.stderr)
if r.returncode:
    sys.exit(0)
pid = daemon_pid()
try:
    f = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,SOURCE,VFS-OPTIONS", mnt],
                       capture_output=True, text=True)
    ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) if pid else 0
    say(findmnt=f.stdout.split(), daemon=pid is not None,
        daemon_parent=open(f"/proc/{ppid}/comm").read().strip() if ppid > 1 else "init")
    ckptfs.save({"cfg": {"lr": 0.25}, "blob": b"\x00fstab\xff"}, mnt, "fst", mode="async")
    ckptfs.wait(mnt, "fst", timeout=120)
    w = os.path.join(mnt, "fst2", "w")
    os.makedirs(os.path.dirname(w))
    with open(w, "wb") as fh:
        fh.write(bytes(range(16)))
    os.setxattr(w, "user.ckpt.dtype", b"int32")
    os.setxattr(w, "user.ckpt.shape", b"2,2")
    with open(os.path.join(mnt, "fst2", ".commit"), "w") as fh:
        fh.write("sync")
    say(saved=ckptfs.load(None, mnt, "fst") == {"cfg": {"lr": 0.25}, "blob": b"\x00fstab\xff"},
        state=ckptfs.status(mnt, "fst2")[0])
finally:
    u = subprocess.run(["umount", mnt], capture_output=True, text=True)
    deadline = time.monotonic() + 60
    while pid and os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    left = pid is not None and os.path.exists(f"/proc/{pid}")
    if left:
        os.kill(pid, 9)
    say(umount=u.returncode, umount_stderr=u.stderr, daemon_left=left,
        mounted=any(l.split()[4] == mnt for l in open("/proc/self/mountinfo")))
'''


def need_root(test):
    if os.geteuid() != 0:
        test.fail("mount(8) needs root: run this test as root (CI does)")


class Fstab(CkptfsTestCase):

    def setUp(self):
        super().setUp()
        need_root(self)
        self.sbin = os.path.join(self.dir, "sbin")
        os.makedirs(self.sbin)
        os.symlink(util.BIN, os.path.join(self.sbin, "ckptfs"))
        os.makedirs(self.backing)
        self.addCleanup(self.kill_daemons)

    def kill_daemons(self):
        """A daemon a failed case left (in its namespace): SIGKILL by pid."""
        want = os.fsencode(self.dir)
        for p in os.listdir("/proc"):
            if p.isdigit() and int(p) != os.getpid():
                try:
                    with open(f"/proc/{p}/cmdline", "rb") as f:
                        argv = f.read().split(b"\0")
                except OSError:
                    continue
                if argv and os.path.basename(argv[0]) == b"ckptfs" and \
                        any(want in a for a in argv):
                    os.kill(int(p), signal.SIGKILL)

    def in_namespace(self, *cmd):
        """Run INNER with mount command cmd in a private mount namespace;
        its reports, merged into one dict."""
        ns = ["unshare", "-m", "--propagation", "private"]
        env = dict(os.environ)
        if subprocess.run(ns + ["true"], capture_output=True).returncode:
            # a chroot has no mount namespace of its own to make private:
            # bind over the helper's PATH directory for this run only
            ns, env["CKPT_FSTAB_NO_NS"] = [], "1"
        r = subprocess.run(ns + [sys.executable, "-c", INNER, self.sbin, self.mnt,
                                 self.backing, PACKAGE, *cmd],
                           capture_output=True, text=True, timeout=300, env=env)
        self.assertEqual(r.returncode, 0, f"inner:\n{r.stdout}\n{r.stderr}")
        out = {}
        for line in r.stdout.splitlines():
            out.update(json.loads(line))
        return out

    def check_mounted_run(self, out):
        self.assertEqual(out["mount"], 0, out.get("stderr"))
        fstype, source, opts = out["findmnt"]
        self.assertEqual(fstype, "fuse.ckptfs")
        self.assertEqual(source, self.backing)
        self.assertTrue(out["daemon"], "no ckptfs process for the mount")
        # mount(8) returned and the daemon lives on, reparented (to init or
        # a subreaper), not a child of the helper's shell or of this test
        self.assertNotIn(out["daemon_parent"], ("sh", "dash", "mount", "mount.fuse3",
                                                "mount.fuse", "python3", "unshare"),
                         "ckptfs did not daemonize")
        self.assertTrue(out["saved"])
        self.assertEqual(out["state"], "committed")
        self.assertEqual(out["umount"], 0, out.get("umount_stderr"))
        self.assertFalse(out["daemon_left"], "ckptfs still running after umount")
        self.assertFalse(out["mounted"])
        return opts.split(",")

    def check_saved_outside(self):
        """What was saved through mount(8) reads back through a plain mount."""
        self.assertTrue(os.path.exists(self.bk("fst", ".metadata")))
        self.mount()
        self.assertEqual(read_all(self.ck("fst", "blob")), b"\x00fstab\xff")
        self.assertEqual(read_all(self.ck("fst2", "w")), bytes(range(16)))
        self.assertEqual(os.getxattr(self.ck("fst2", "w"), "user.ckpt.shape"), b"2,2")

    def test_fstab_line(self):
        fstab = os.path.join(self.dir, "fstab")
        with open(fstab, "w") as f:
            f.write("# an alternative fstab (mount -T)\n")
            f.write(f"{self.backing} {self.mnt} fuse.ckptfs "
                    f"{FSTAB_NOISE},io_threads=2,commit_timeout=60 0 0\n")
        out = self.in_namespace("mount", "-T", fstab, self.mnt)
        opts = self.check_mounted_run(out)
        for o in ("nodev", "nosuid", "noatime", "rw"):
            self.assertIn(o, opts)
        self.check_saved_outside()

    def test_mount_t_fuse_ckptfs(self):
        out = self.in_namespace("mount", "-t", "fuse.ckptfs", self.backing, self.mnt,
                                "-o", "io_threads=3,sync_files=1,noatime,nofail,_netdev")
        opts = self.check_mounted_run(out)
        self.assertIn("noatime", opts)
        self.check_saved_outside()

    def test_mount_error_exits_nonzero(self):
        """A bad option or BACKING_DIR: mount(8) fails with ckptfs's message."""
        out = self.in_namespace("mount", "-t", "fuse.ckptfs", self.backing, self.mnt,
                                "-o", "io_threads=0")
        self.assertNotEqual(out["mount"], 0)
        self.assertIn("ckptfs: invalid io_threads '0': expected 1 to 256", out["stderr"])
        afile = os.path.join(self.dir, "afile")
        open(afile, "w").close()
        out = self.in_namespace("mount", "-t", "fuse.ckptfs", afile, self.mnt)
        self.assertNotEqual(out["mount"], 0)
        self.assertRegex(out["stderr"], r"ckptfs: cannot (create|open) BACKING_DIR")
        self.assertFalse(mountinfo_has(self.mnt))

    def test_helper_with_program_path(self):
        """mount -t fuse 'PROGRAM#SOURCE': the helper runs PROGRAM by its
        path, no PATH needed; visible to this process, umount(8) stops it."""
        r = subprocess.run(["mount", "-t", "fuse", f"{util.BIN}#{self.backing}",
                            self.mnt, "-o", FSTAB_NOISE + ",io_threads=2"],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(mountinfo_has(self.mnt))
        try:
            pid = util.find_daemon(self.mnt)
            self.assertIsNotNone(pid)
            util.write_file(self.ck("h", "x"), b"helper")
            util.commit(self.ck("h"))
            self.assertEqual(read_all(self.ck("h", "x")), b"helper")
            f = subprocess.run(["findmnt", "-n", "-o", "FSTYPE,SOURCE", self.mnt],
                               capture_output=True, text=True)
            self.assertEqual(f.stdout.split(), ["fuse.ckptfs", self.backing])
        finally:
            u = subprocess.run(["umount", self.mnt], capture_output=True, text=True)
        self.assertEqual(u.returncode, 0, u.stderr)
        deadline = time.monotonic() + 60
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(os.path.exists(f"/proc/{pid}"), "daemon still running")
        self.assertTrue(os.path.exists(self.bk("h", ".metadata")))

    def test_fstab_only_options_run_by_hand(self):
        """ckptfs itself drops the options only fstab and systemd use."""
        self.mount(opts=FSTAB_NOISE + ",comment=x,defaults,io_threads=2")
        util.write_file(self.ck("o", "x"), b"1")
        util.commit(self.ck("o"))
        self.assertEqual(util.state(self.ck("o")), "committed")


class Errors(CkptfsTestCase):
    """Errors at start-up say what was wrong and what to do."""

    def run_bin(self, *args):
        return subprocess.run([util.BIN, *args], capture_output=True, text=True,
                              timeout=60, stdin=subprocess.DEVNULL)

    def test_mountpoint_problems(self):
        missing = os.path.join(self.dir, "missing")
        r = self.run_bin(self.backing, missing)
        self.assertEqual(r.returncode, 1)
        self.assertIn(f"ckptfs: MOUNTPOINT {missing} does not exist: create it "
                      f"(mkdir -p {missing})", r.stderr)
        afile = os.path.join(self.dir, "afile")
        open(afile, "w").close()
        r = self.run_bin(self.backing, afile)
        self.assertEqual(r.returncode, 1)
        self.assertIn(f"ckptfs: MOUNTPOINT {afile} is not a directory", r.stderr)
        self.assertFalse(mountinfo_has(afile))
        # a mount whose daemon was killed
        m = self.mount()
        m.proc.kill()
        m.proc.wait()
        try:
            r = self.run_bin(self.backing, self.mnt)
            self.assertEqual(r.returncode, 1)
            self.assertIn(f"ckptfs: MOUNTPOINT {self.mnt} is a dead FUSE mount (its "
                          f"daemon died): unmount it first (fusermount3 -u {self.mnt})",
                          r.stderr)
        finally:
            subprocess.run(["fusermount3", "-uz", self.mnt], capture_output=True)
        m.proc = None

    def test_unknown_option(self):
        r = self.run_bin("-o", "no_such_option=1", self.backing, self.mnt)
        self.assertEqual(r.returncode, 2)
        self.assertIn("no_such_option", r.stderr)
        self.assertIn("Try 'ckptfs --help' for the options.", r.stderr)
        self.assertFalse(mountinfo_has(self.mnt))

    def test_help_lists_every_option_with_its_default(self):
        r = self.run_bin("--help")
        self.assertEqual(r.returncode, 0)
        entries = re.split(r"(?m)^  (?=-o )", r.stdout)[1:]
        names = set()
        for e in entries:
            name = re.match(r"-o (\w+)=", e)
            if name:
                names.add(name.group(1))
                self.assertIn("(default: ", e, f"no default for {name.group(1)}: {e}")
        # every -o option of the README's table is there
        with open(os.path.join(REPO, "docs", "mounting.md")) as f:
            readme = f.read()
        table = set(re.findall(r"(?m)^\| `(\w+)=[^`]*` \|", readme))
        self.assertTrue(table, "no option table in docs/mounting.md")
        self.assertEqual(table - names, set(), "README options missing from --help")
        self.assertIn("fuse.ckptfs", r.stdout)


class SystemdUnit(CkptfsTestCase):
    """mount-scripts/ckptfs@.service: its fields, systemd-analyze verify,
    and its commands run as systemd would run them (variables expanded)."""

    def unit(self):
        sections, cur = {}, None
        with open(UNIT) as f:
            for line in f:
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                m = re.fullmatch(r"\[(\w+)\]", line)
                if m:
                    cur = sections.setdefault(m.group(1), {})
                    continue
                k, v = line.split("=", 1)
                cur.setdefault(k, []).append(v)
        return sections

    def test_fields(self):
        u = self.unit()
        s = u["Service"]
        self.assertEqual(s["Type"], ["forking"])  # ready when ckptfs forks away
        self.assertEqual(s["EnvironmentFile"], ["/etc/ckptfs/%i.conf"])
        self.assertTrue(s["ExecStart"][0].startswith("/usr/local/bin/ckptfs -o "))
        self.assertNotIn(" -f ", s["ExecStart"][0])
        self.assertEqual(s["ExecStop"], ["/bin/fusermount3 -u ${CKPT_MOUNTPOINT}"])
        self.assertIn("multi-user.target", u["Install"]["WantedBy"])

    def test_systemd_analyze_verify(self):
        if not os.path.exists("/usr/bin/systemd-analyze"):
            self.skipTest("no systemd-analyze on this machine (the fields are "
                          "checked by test_fields)")
        d = os.path.join(self.dir, "units")
        os.makedirs(d)
        with open(UNIT) as f:
            text = f.read().replace("/usr/local/bin/ckptfs", util.BIN)
        path = os.path.join(d, "ckptfs@ci.service")
        with open(path, "w") as f:
            f.write(text)
        r = subprocess.run(["systemd-analyze", "verify", path], capture_output=True,
                           text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertNotIn("ckptfs@ci.service", r.stderr, r.stderr)

    def test_commands_as_systemd_runs_them(self):
        need_root(self)
        env = {"CKPT_OPTIONS": "default_permissions"}
        conf = {"CKPT_BACKING_DIR": self.backing,
                "CKPT_MOUNTPOINT": os.path.join(self.dir, "svc", "mnt"),
                "CKPT_OPTIONS": "io_threads=2,commit_timeout=60"}
        env.update(conf)
        s = self.unit()["Service"]

        def argv(line):
            words = shlex.split(line)
            return [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], w) for w in words]

        pre = argv(s["ExecStartPre"][0])
        start = argv(s["ExecStart"][0])
        stop = argv(s["ExecStop"][0])
        start[0] = util.BIN
        self.assertEqual(subprocess.run(pre).returncode, 0)
        r = subprocess.run(start, capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)  # forked: the mount is ready
        mnt = conf["CKPT_MOUNTPOINT"]
        self.assertTrue(mountinfo_has(mnt))
        pid = util.find_daemon(mnt)
        try:
            util.write_file(os.path.join(mnt, "svc", "x"), b"unit")
            util.commit(os.path.join(mnt, "svc"), "async")
        finally:
            r = subprocess.run(stop, capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        deadline = time.monotonic() + 60
        while pid and os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertFalse(os.path.exists(f"/proc/{pid}"))
        # the async save in flight finished before the daemon exited
        self.assertTrue(os.path.exists(self.bk("svc", ".metadata")))


if __name__ == "__main__":
    main()
