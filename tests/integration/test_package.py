#!/usr/bin/env python3
"""ckptfs installed as a user installs it: the Debian package in a fresh
Debian, and the Python package's wheel in a fresh venv.

    python3 tests/integration/test_package.py --bin build/bin/ckptfs [Class ...]

Classes (ctest label `package`: the normal build only, not under ASan):
  Tree   `cmake --install` of the build tree of --bin into a prefix, which
         is then moved: the binaries run from there (the bundled libfuse
         found through RUNPATH $ORIGIN/../lib/ckptfs), ckpt-mount uses the
         ckptfs beside it, every executable of mount-scripts/ is installed.
  Deb    `cpack -G DEB` in the build tree of --bin; a fresh `debootstrap
         --variant=minbase` of this machine's Debian release (a new one
         every run, from the Debian mirror apt uses here, in a private
         mount namespace: /dev, /proc and /sys are bound into it there
         only); `apt-get install --no-install-recommends ./ckptfs_*.deb`
         there (so Depends alone must bring what it runs); then, inside:
         no library missing, `mount -t fuse.ckptfs` with fstab-only
         options, an /etc/fstab line and `mount MNT`, `ckpt-mount -n 2`
         and `ckpt-umount`, each with a write, a sync commit and a read
         back; ckptctl ls and ckptfs-fsck on the result. Needs root, the
         network (the mirror) and debootstrap.
  Wheel  `pip wheel` of python/ (setuptools from .venv, no network), installed
         with `pip install --no-index --no-deps` into a fresh `python -m
         venv`: the core saves and loads through a mount with the standard
         library alone; then, torch lent to that venv by a .pth line naming
         .venv's site-packages, ckptfs.dcp imports from the wheel and
         `ckptctl import-dcp` finds that venv's interpreter through its
         `ckptfs-dcp` script on PATH, without CKPTFS_PYTHON, while the
         `python3` on PATH is the system's, without ckptfs (also for a
         venv with a space in its path: another #! form).
The time each stage took is printed.
"""

import os
import shutil
import subprocess
import sys
import time

from ckpttest import util
from ckpttest.util import CkptfsTestCase, main
from ckpttest.pyenv import PACKAGE, REPO, VENV_PYTHON, require_torch


def build_dir():
    """The build tree of --bin (bin/ckptfs in it)."""
    return os.path.dirname(os.path.dirname(util.BIN))


def cmake_tool(name):
    """cmake or cpack of the CMake that configured the build tree."""
    with open(os.path.join(build_dir(), "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith("CMAKE_COMMAND:"):
                return os.path.join(os.path.dirname(line.split("=", 1)[1].strip()), name)
    raise AssertionError("no CMAKE_COMMAND in CMakeCache.txt")


def timed(label, fn, *args, **kwargs):
    t0 = time.monotonic()
    out = fn(*args, **kwargs)
    print(f"  {label}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def host_release():
    """This machine's Debian codename, and the Debian mirror its apt uses
    ($CKPT_DEBIAN_MIRROR overrides it; as scripts/install-deps.sh finds it)."""
    with open("/etc/os-release") as f:
        rel = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
    suite = rel.get("VERSION_CODENAME", "").strip('"')
    d = "/etc/apt/sources.list.d"
    lists = ["/etc/apt/sources.list"] + sorted(
        os.path.join(d, n) for n in (os.listdir(d) if os.path.isdir(d) else [])
        if n.endswith((".list", ".sources")))
    uris = []
    for path in filter(os.path.isfile, lists):
        with open(path) as f:
            for words in map(str.split, f):
                if words[:1] in (["URIs:"], ["deb"]):
                    uris += [w.rstrip("/") for w in words[1:]]
    debian = [u for u in uris if u.startswith(("http://", "https://")) and u.endswith("/debian")]
    return suite, os.environ.get("CKPT_DEBIAN_MIRROR") or (
        debian[0] if debian else "http://deb.debian.org/debian")


# Runs as root in a private mount namespace (unshare -m): makes the chroot,
# installs the package, runs CHECKS inside. Processes left in the chroot
# (daemons of a failed check) are killed by pid at exit; the bind mounts
# end with the namespace.
SETUP = r'''
set -euo pipefail
root=$1 deb=$2 suite=$3 mirror=$4 checks=$5
cleanup() {
  for p in /proc/[0-9]*; do
    [[ $(readlink "$p/root" 2>/dev/null) == "$root" ]] && kill -KILL "${p#/proc/}" 2>/dev/null
  done
  return 0
}
trap cleanup EXIT
now() { echo "${EPOCHREALTIME}"; }
t0=$(now)
if ! debootstrap --variant=minbase "$suite" "$root" "$mirror" >"$root.log" 2>&1; then
  echo "debootstrap $suite $mirror failed:"; tail -n 30 "$root.log"; exit 1
fi
echo "time debootstrap $t0 $(now)"
# the chroot's / a mount point, as a machine's is (ckpt-rank-exec's unshare
# --propagation changes the propagation of /, EINVAL on a plain directory)
mount --bind "$root" "$root"
mount --rbind /dev "$root/dev"
mount --bind /proc "$root/proc"
mount --bind /sys "$root/sys"
cp /etc/resolv.conf "$root/etc/resolv.conf"
# the same Debian archives as this machine (security updates included)
if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
  cp /etc/apt/sources.list.d/debian.sources "$root/etc/apt/sources.list.d/"
  rm -f "$root/etc/apt/sources.list"
fi
cp "$deb" "$checks" "$root/tmp/"
in_root() { env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C \
              DEBIAN_FRONTEND=noninteractive chroot "$root" "$@"; }
t0=$(now)
in_root apt-get -q update >"$root.apt.log" 2>&1 || { tail -n 30 "$root.apt.log"; exit 1; }
if ! in_root apt-get install -y -q --no-install-recommends "/tmp/$(basename "$deb")" \
    >>"$root.apt.log" 2>&1; then
  echo "apt-get install failed:"; tail -n 40 "$root.apt.log"; exit 1
fi
echo "time apt-install $t0 $(now)"
t0=$(now)
in_root bash "/tmp/$(basename "$checks")"
echo "time checks $t0 $(now)"
'''

# Runs inside the chroot, as root, with the package installed and nothing
# else of ckptfs there (no build tree, no Python). Each step says what it
# checks; any failure exits non-zero naming it.
CHECKS = r'''
set -euo pipefail
step() { echo "step $*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }
daemon_of() {  # MNT: the pid of the ckptfs serving it (in its arguments)
  local p
  for p in /proc/[0-9]*; do
    [[ $(readlink "$p/exe" 2>/dev/null) == */ckptfs ]] || continue
    tr '\0' '\n' <"$p/cmdline" 2>/dev/null | grep -qxF -- "$1" && { echo "${p#/proc/}"; return 0; }
  done
  fail "no ckptfs daemon for $1"
}
gone() {  # PID: exited within 60 s
  local i
  for ((i = 0; i < 600; i++)); do [[ -e /proc/$1 ]] || return 0; sleep 0.1; done
  fail "ckptfs $1 still running 60 s after the unmount"
}
save() {  # MNT NAME FILE TEXT: write, sync commit, check .status
  mkdir "$1/$2"
  printf '%s' "$4" >"$1/$2/$3"
  echo sync >"$1/$2/.commit" || fail "commit of $1/$2"
  [[ $(head -n1 "$1/$2/.status") == committed ]] || fail "$1/$2: $(cat "$1/$2/.status")"
}
same() {  # FILE TEXT
  [[ $(cat "$1") == "$2" ]] || fail "$1 reads '$(cat "$1")', not '$2'"
}

step installed files
for p in ckptfs ckptctl ckptfs-fsck ckpt-mount ckpt-umount ckpt-rank-exec; do
  [[ $(command -v "$p") == /usr/bin/$p ]] || fail "$p is not /usr/bin/$p"
done
for p in ckptfs ckptctl ckptfs-fsck; do
  if ldd "/usr/bin/$p" | grep -q "not found"; then
    ldd "/usr/bin/$p"; fail "$p: a shared library is missing"
  fi
done
echo "libfuse: $(ldd /usr/bin/ckptfs | grep -o 'libfuse3[^ ]* => [^ ]*')"
ckptfs --version
grep -qx 'ExecStart=/usr/bin/ckptfs -o default_permissions -o ${CKPT_OPTIONS} ${CKPT_BACKING_DIR} ${CKPT_MOUNTPOINT}' \
  /usr/lib/systemd/system/ckptfs@.service || fail "the unit's ExecStart"
[[ -f /usr/share/doc/ckptfs/mounting.md ]] || fail "no docs"
mkdir -p /srv/backing /mnt/a /mnt/b /mnt/w

step mount -t fuse.ckptfs
mount -t fuse.ckptfs /srv/backing /mnt/a \
  -o io_threads=2,noatime,nodev,nosuid,_netdev,nofail,x-systemd.automount
[[ $(findmnt -n -o FSTYPE,SOURCE /mnt/a | tr -s ' ') == "fuse.ckptfs /srv/backing" ]] ||
  fail "findmnt: $(findmnt -n /mnt/a)"
pid=$(daemon_of /mnt/a)
save /mnt/a c1 msg "through mount -t"
same /mnt/a/c1/msg "through mount -t"
umount /mnt/a
gone "$pid"

step fstab line and mount MNT
echo "/srv/backing /mnt/b fuse.ckptfs noauto,nofail,_netdev,io_threads=2,commit_timeout=60 0 0" \
  >>/etc/fstab
mount /mnt/b
pid=$(daemon_of /mnt/b)
same /mnt/b/c1/msg "through mount -t"
save /mnt/b c2 msg "through fstab"
same /mnt/b/c2/msg "through fstab"
umount /mnt/b
gone "$pid"

step ckpt-mount -n 2
ckpt-mount -n 2 -o commit_timeout=60 /srv/backing /mnt/w
[[ $(findmnt -n -o FSTYPE /mnt/w/rank1) == fuse.ckptfs ]] || fail "rank1 not mounted"
mkdir /mnt/w/rank0/w1 /mnt/w/rank1/w1
printf 'rank 0' >/mnt/w/rank0/w1/part0
printf 'rank 1' >/mnt/w/rank1/w1/part1
(echo sync >/mnt/w/rank1/w1/.commit) & other=$!
echo sync >/mnt/w/rank0/w1/.commit || fail "rank 0's commit"
wait "$other" || fail "rank 1's commit"
for r in 0 1; do
  [[ $(head -n1 /mnt/w/rank$r/w1/.status) == committed ]] || fail "rank $r: $(cat /mnt/w/rank$r/w1/.status)"
  same /mnt/w/rank$r/w1/part$r "rank $r"
done
same /mnt/w/rank1/c2/msg "through fstab"
# one path for every rank: rank 1's mount at /ckpt in a namespace of its own
got=$(ckpt-rank-exec --rank 1 /mnt/w /ckpt -- cat /ckpt/w1/part1) || fail "ckpt-rank-exec"
[[ $got == "rank 1" ]] || fail "ckpt-rank-exec: /ckpt/w1/part1 reads '$got'"
[[ -z $(ls -A /ckpt) ]] || fail "the bind mount leaked out of its namespace"
ckpt-umount /mnt/w
findmnt /mnt/w/rank0 >/dev/null && fail "rank0 still mounted"

step ckptctl ls and ckptfs-fsck
ls=$(ckptctl ls --sort name /srv/backing)
echo "$ls"
for n in c1 c2 w1; do
  grep -qE "^$n +committed" <<<"$ls" || fail "ckptctl ls: no committed $n"
done
ckptfs-fsck /srv/backing
echo "all checks passed"
'''


class Tree(CkptfsTestCase):

    def test_install_tree_is_relocatable(self):
        """cmake --install --prefix P, then P moved: the binaries load (the
        bundled libfuse through RUNPATH), ckpt-mount runs the ckptfs beside
        it, the Slurm epilog's ckpt-umount link resolves."""
        first = os.path.join(self.dir, "first")
        r = subprocess.run([cmake_tool("cmake"), "--install", build_dir(), "--prefix", first],
                           capture_output=True, text=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        with open(os.path.join(first, "lib", "systemd", "system", "ckptfs@.service")) as f:
            self.assertIn(f"\nExecStart={first}/bin/ckptfs -o ", f.read())
        p = os.path.join(self.dir, "moved")
        os.rename(first, p)
        scripts = os.path.join(REPO, "mount-scripts")
        for n in os.listdir(scripts):
            if os.access(os.path.join(scripts, n), os.X_OK) and not n.startswith("slurm-"):
                self.assertTrue(os.access(os.path.join(p, "bin", n), os.X_OK), n)
        for n in ("ckptfs", "ckptctl", "ckptfs-fsck", "ckpt-mount", "ckpt-umount",
                  "ckpt-rank-exec"):
            self.assertTrue(os.access(os.path.join(p, "bin", n), os.X_OK), n)
        self.assertTrue(os.path.isfile(os.path.join(p, "share", "doc", "ckptfs", "mounting.md")))
        self.assertEqual(os.path.realpath(os.path.join(p, "share", "ckptfs", "slurm",
                                                       "ckpt-umount")),
                         os.path.join(p, "bin", "ckpt-umount"))
        env = {"PATH": "/usr/bin:/bin"}  # no ckptfs there, no build tree in it
        ldd = self.run_ok(["ldd", os.path.join(p, "bin", "ckptfs")], env=env)
        self.assertNotIn("not found", ldd)
        bundled = os.path.isdir(os.path.join(p, "lib", "ckptfs"))
        if bundled:  # the libfuse of .deps/fuse3: the moved tree's own
            self.assertRegex(ldd, rf"libfuse3\.so\.\d+ => {p}/bin/\.\./lib/ckptfs/")
            dyn = self.run_ok(["readelf", "-d", os.path.join(p, "bin", "ckptfs")])
            self.assertIn("Library runpath: [$ORIGIN/../lib/ckptfs]", dyn)
        print(f"  libfuse3 bundled: {bundled}", file=sys.stderr)
        self.assertIn("ckptfs ", self.run_ok([os.path.join(p, "bin", "ckptfs"), "--version"],
                                             env=env))
        out = self.run_ok([os.path.join(p, "bin", "ckpt-mount"), "--dry-run", "-n", "2",
                           self.backing, self.mnt], env=env)
        self.assertIn(f" {p}/bin/ckptfs -f ", out)

    def run_ok(self, argv, **kw):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL, **kw)
        self.assertEqual(r.returncode, 0, f"{argv}:\n{r.stdout}\n{r.stderr}")
        return r.stdout


class Deb(CkptfsTestCase):

    def setUp(self):
        super().setUp()
        if os.geteuid() != 0:
            self.fail("debootstrap, chroot and mount need root: run as root (CI does)")
        for tool in ("debootstrap", "unshare", "dpkg-shlibdeps"):
            if not shutil.which(tool):
                self.fail(f"no {tool}: run scripts/install-deps.sh")
        self.root = os.path.join(self.dir, "chroot")
        self.addCleanup(self.remove_root)

    def remove_root(self):
        """The chroot, once nothing is mounted in it here (its mounts were
        made in a namespace of their own)."""
        with open("/proc/self/mountinfo") as f:
            left = [line.split()[4] for line in f if line.split()[4].startswith(self.root)]
        self.assertEqual(left, [], "mounts left in the chroot")
        shutil.rmtree(self.root, ignore_errors=True)

    def build_deb(self):
        out = os.path.join(self.dir, "deb")
        r = subprocess.run([cmake_tool("cpack"), "-G", "DEB", "-B", out],
                           cwd=build_dir(), capture_output=True, text=True, timeout=900)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        debs = [n for n in os.listdir(out) if n.endswith(".deb")]
        self.assertEqual(len(debs), 1, os.listdir(out))
        return os.path.join(out, debs[0])

    def test_deb_in_fresh_chroot(self):
        deb = timed("cpack -G DEB", self.build_deb)
        arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True,
                              text=True).stdout.strip()
        with open(os.path.join(build_dir(), "CPackConfig.cmake")) as f:
            version = next(line.split('"')[1] for line in f
                           if line.startswith("set(CPACK_PACKAGE_VERSION "))
        self.assertEqual(os.path.basename(deb), f"ckptfs_{version}_{arch}.deb")
        fields = subprocess.run(["dpkg-deb", "-f", deb, "Depends"], capture_output=True,
                                text=True).stdout
        print(f"  Depends: {fields.strip()}", file=sys.stderr)
        for dep in ("fuse3", "openmpi-bin", "procps", "attr", "libsqlite3-0", "libxxhash0",
                    "libc6"):
            self.assertRegex(fields, rf"(^|, ){dep}\b", f"Depends: {fields}")
        self.assertRegex(fields, r"libopenmpi(3|40)\b")
        checks = os.path.join(self.dir, "checks.sh")
        with open(checks, "w") as f:
            f.write(CHECKS)
        suite, mirror = host_release()
        self.assertTrue(suite, "no VERSION_CODENAME in /etc/os-release")
        t0 = time.monotonic()
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c", SETUP,
                            "ckpt-chroot", self.root, deb, suite, mirror, checks],
                           capture_output=True, text=True, timeout=1500,
                           stdin=subprocess.DEVNULL)
        print(f"  in the chroot ({time.monotonic() - t0:.1f} s):", file=sys.stderr)
        times = {}
        for line in r.stdout.splitlines():
            words = line.split()
            if words[:1] == ["time"]:
                times[words[1]] = float(words[3]) - float(words[2])
                line = f"{words[1]}: {times[words[1]]:.1f} s"
            print(f"    {line}", file=sys.stderr)
        self.assertEqual(r.returncode, 0, f"{r.stdout}\n{r.stderr}")
        self.assertIn("all checks passed", r.stdout)
        for s in ("debootstrap", "apt-install", "checks"):
            self.assertIn(s, times, r.stdout)


# In the fresh venv: the core with the standard library only.
CORE = r'''
import os, sys, ckptfs
mnt = sys.argv[1]
assert ckptfs.__file__.startswith(sys.prefix), ckptfs.__file__
state = {"cfg": {"lr": 0.5, "steps": [1, 2]}, "blob": b"\x00wheel\xff"}
ckptfs.save(state, mnt, "core")
assert ckptfs.load(None, mnt, "core") == state
try:
    import ckptfs.dcp
except ImportError as e:
    print("dcp:", e)
else:
    raise AssertionError("ckptfs.dcp imported in a venv without torch")
print("core ok")
'''

# torch lent: ckptfs.dcp from the wheel; a stock DCP directory for ckptctl.
DCP = r'''
import sys, torch, ckptfs, ckptfs.dcp
import torch.distributed.checkpoint as dcp
for m in (ckptfs, ckptfs.dcp):
    assert m.__file__.startswith(sys.prefix), m.__file__
w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
dcp.save({"w": w, "step": 7}, checkpoint_id=sys.argv[1], no_dist=True)
print("dcp ok")
'''

# ckptfs.load of what ckptctl imported (the names in argv[2:]).
LOAD = r'''
import sys, torch, ckptfs
for name in sys.argv[2:]:
    sd = ckptfs.load(None, sys.argv[1], name)
    w = torch.as_tensor(sd["w"])  # a numpy array: the import kept no torch type
    assert torch.equal(w, torch.arange(24, dtype=torch.float32).reshape(4, 6)), w
    print(name, "ok")
'''


class Wheel(CkptfsTestCase):

    def run_ok(self, argv, **kw):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                           stdin=subprocess.DEVNULL, **kw)
        self.assertEqual(r.returncode, 0, f"{argv}:\n{r.stdout}\n{r.stderr}")
        return r.stdout

    def wheel(self):
        """The wheel of python/, built once per test with .venv's pip and
        setuptools (no network, no build isolation)."""
        wheels = os.path.join(self.dir, "wheels")
        if not os.path.isdir(wheels):
            if not os.access(VENV_PYTHON, os.X_OK):
                self.fail(f"no {VENV_PYTHON}: run scripts/install-deps.sh")
            # built from a copy: setuptools writes build/ and *.egg-info
            # beside the sources
            src = os.path.join(self.dir, "python")
            shutil.copytree(PACKAGE, src, ignore=shutil.ignore_patterns(
                "build", "*.egg-info", "__pycache__", "tests"))
            timed("pip wheel python/", self.run_ok,
                  [VENV_PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                   "--no-index", "--disable-pip-version-check", "-q", "-w", wheels, src])
        wheel = [n for n in os.listdir(wheels) if n.endswith(".whl")]
        self.assertEqual(len(wheel), 1, wheel)
        self.assertRegex(wheel[0], r"^ckptfs-[0-9.]+-py3-none-any\.whl$")
        return os.path.join(wheels, wheel[0])

    def make_venv(self, name="venv"):
        """A fresh venv of .venv's base interpreter at self.dir/name with
        the wheel installed; its directory."""
        wheel = self.wheel()
        base = self.run_ok([VENV_PYTHON, "-c", "import sys; print(sys._base_executable)"]).strip()
        venv = os.path.join(self.dir, name)
        timed("python -m venv", self.run_ok, [base, "-m", "venv", venv])
        py = os.path.join(venv, "bin", "python")
        timed("pip install the wheel", self.run_ok,
              [py, "-m", "pip", "install", "--no-index", "--no-deps",
               "--disable-pip-version-check", "-q", wheel])
        return venv

    def lend_torch(self, venv):
        """A .pth line naming .venv's site-packages: torch (and the rest)
        importable, after the venv's own site-packages (the wheel's
        ckptfs first; the .pth files there, the editable ckptfs's among
        them, are not read)."""
        torch_py = require_torch(self)
        site = self.run_ok([torch_py, "-c", "import torch, os; "
                            "print(os.path.dirname(os.path.dirname(torch.__file__)))"]).strip()
        own = self.run_ok([os.path.join(venv, "bin", "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
        with open(os.path.join(own, "zz-ckpt-test-torch.pth"), "w") as f:
            f.write(site + "\n")

    def test_wheel_in_fresh_venv(self):
        venv = self.make_venv()
        py = os.path.join(venv, "bin", "python")
        self.assertTrue(os.access(os.path.join(venv, "bin", "ckptfs-dcp"), os.X_OK))
        self.mount()
        # -P -s, from /: this checkout's python/ cannot be on sys.path
        out = self.run_ok([py, "-P", "-s", "-c", CORE, self.mnt], cwd="/",
                          env={"PATH": "/usr/bin:/bin"})
        self.assertIn("core ok", out)
        self.assertIn("dcp: No module named 'torch'", out)  # why ckptfs.dcp did not import

    def test_ckptctl_finds_the_venv_interpreter(self):
        """Twice: a venv whose ckptfs-dcp starts "#!VENV/bin/python", and one
        with a space in its path, for which pip writes "#!/bin/sh" and an
        exec line naming the interpreter."""
        ckptctl = os.path.join(os.path.dirname(util.BIN), "ckptctl")
        stock = os.path.join(self.dir, "stock")
        for name, first_line in (("venv", "#!{}/bin/python"), ("a venv", "#!/bin/sh")):
            venv = self.make_venv(name)
            py = os.path.join(venv, "bin", "python")
            self.lend_torch(venv)
            with open(os.path.join(venv, "bin", "ckptfs-dcp")) as f:
                self.assertEqual(f.readline().rstrip("\n"), first_line.format(venv))
            if not os.path.exists(stock):
                out = self.run_ok([py, "-P", "-s", "-c", DCP, stock], cwd="/",
                                  env={"PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"})
                self.assertIn("dcp ok", out)
            # python3 first on PATH is the system's, without ckptfs; the
            # venv's bin after it holds ckptfs-dcp
            path = f"/usr/bin:/bin:{venv}/bin"
            env = {"PATH": path, "PYTHONWARNINGS": "ignore"}
            r = subprocess.run(["python3", "-c", "import ckptfs"], env=env, capture_output=True)
            self.assertNotEqual(r.returncode, 0, "the system's python3 imports ckptfs: "
                                "this test needs one that does not")
            self.assertEqual(shutil.which("ckptfs-dcp", path=path),
                             os.path.join(venv, "bin", "ckptfs-dcp"))
            r = timed(f"ckptctl import-dcp ({name})", subprocess.run,
                      [ckptctl, "import-dcp", stock, self.backing, name.replace(" ", "-")],
                      env=env, capture_output=True, text=True, timeout=600)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        # CKPTFS_PYTHON still wins: the system's python3 cannot convert
        r = subprocess.run([ckptctl, "import-dcp", stock, self.backing, "sys"],
                           env=dict(env, CKPTFS_PYTHON="/usr/bin/python3"),
                           capture_output=True, text=True, timeout=600)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("No module named 'ckptfs'", r.stderr)
        # root takes no ckptfs-dcp another user may change, nor an env line
        vbin = os.path.join(self.dir, "venv", "bin")
        script = os.path.join(vbin, "ckptfs-dcp")
        with open(script) as f:
            text = f.read()
        for change in ("chown", "env"):
            if change == "chown":
                os.chown(script, 65534, 65534)
            else:
                os.chown(script, 0, 0)
                with open(script, "w") as f:
                    f.write(text.replace(f"#!{vbin}/python", "#!/usr/bin/env python", 1))
            r = subprocess.run([ckptctl, "import-dcp", stock, self.backing, change],
                               env={"PATH": f"/usr/bin:/bin:{vbin}",
                                    "PYTHONWARNINGS": "ignore"},
                               capture_output=True, text=True, timeout=600)
            self.assertEqual(r.returncode, 1, change + ": " + r.stdout + r.stderr)
            self.assertIn("No module named 'ckptfs'", r.stderr, change)
        with open(script, "w") as f:
            f.write(text)
        self.mount()
        out = self.run_ok([py, "-P", "-s", "-c", LOAD, self.mnt, "venv", "a-venv"], cwd="/",
                          env=env)
        self.assertEqual(out.split(), ["venv", "ok", "a-venv", "ok"])

if __name__ == "__main__":
    main()
