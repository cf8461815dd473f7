#!/usr/bin/env python3
"""Retention users can state (issue 27): the commit words step=N,
metric=KEY:VALUE and protect, the mount option keep=, ckptctl prune with
the same rules, and ckptctl protect / unprotect.

    python3 tests/integration/test_retention.py --bin build/bin/ckptfs [Class ...]

Classes:
  Policy   one rank, -o keep=last:2,every:1000,best:1:loss:min over 10
           commits whose names sort, and whose commit times run, in
           another order than their steps: the survivors are exactly
           those the policy names; what the commits recorded (.metadata,
           xattrs, ckptctl show/ls); ckptctl prune --dry-run with the same
           rules removes nothing and agrees with the mount but for the
           checkpoint the mount kept as its newest commit; protect and
           unprotect (also over a commit's protect word) move a
           checkpoint in and out of what prune removes; so does
           setxattr user.ckpt.protected through a mount; the mark
           survives the removal of an entry inside the checkpoint
  Words    bad commit words are refused (EINVAL) and commit nothing;
           the Python client's commit(step=, metrics=, protect=);
           keep= and tier_keep= errors at mount
Python standard library only.
"""

import errno
import os
import sqlite3
import subprocess
import unittest

from ckpttest import util
from ckpttest.util import CkptfsTestCase, commit, write_file
from test_ckptctl import ctl, ctl_json

POLICY = "last:2,every:1000,best:1:loss:min"
PRUNE_FLAGS = ["--keep-last", "2", "--keep-every", "1000", "--keep-best", "1",
               "--metric", "loss", "--mode", "min"]

# In commit order: (name, words after "sync", step, loss). Names sort, and
# commit times run, otherwise than steps: by name the last two would be
# x-1750 and zeta, by time first and epoch=9-step=1500.
COMMITS = [
    ("zeta", "step=3000 metric=loss:0.9", 3000, 0.9),
    ("ckpt-500", "metric=loss:0.1 metric=acc:0.5", 500, 0.1),  # step from the name
    ("alpha", "step=1000 metric=loss:0.5", 1000, 0.5),
    ("mid", "step=2500 protect metric=loss:0.95", 2500, 0.95),
    ("x-1750", "metric=loss:0.6", 1750, 0.6),
    ("b-7100", "metric=loss:0.8", 7100, 0.8),
    ("first", "step=1200 metric=loss:0.3", 1200, 0.3),
    ("epoch=9-step=1500", "metric=loss:0.7", 1500, 0.7),
]
# After each commit: zeta and b-7100 the last two by step, alpha and zeta
# multiples of 1000, ckpt-500 the best loss, mid protected, and the one
# just committed. x-1750 goes at b-7100's commit, first at epoch's.
SURVIVORS = {"zeta", "ckpt-500", "alpha", "mid", "b-7100", "epoch=9-step=1500"}


def keys(backing, name):
    con = sqlite3.connect(f"file:{os.path.join(backing, name, '.metadata')}?mode=ro", uri=True)
    try:
        return dict(con.execute("select key, value from checkpoint"))
    finally:
        con.close()


def prune_doc(test, backing, *extra):
    doc = ctl_json(test, "prune", *PRUNE_FLAGS, *extra, backing)
    return ({e["name"] for e in doc["removed"]},
            {e["name"]: e["kept_by"] for e in doc["kept"]}, doc)


class Policy(CkptfsTestCase):

    def save(self, name, words):
        os.mkdir(self.ck(name))
        write_file(self.ck(name, "state"), name.encode())
        commit(self.ck(name), ("sync " + words).strip())

    def test_policy_mount_prune_protect(self):
        self.mount("keep=" + POLICY)
        for name, words, _, _ in COMMITS:
            self.save(name, words)
        self.assertEqual(set(os.listdir(self.backing)) - {".saves", ".staging"}, SURVIVORS)
        self.assertEqual(set(os.listdir(self.mnt)), SURVIVORS)
        log = self.daemon_log()
        self.assertIn(f"keep={POLICY}: removed x-1750 (step 1750)", log)
        self.assertIn(f"keep={POLICY}: removed first (step 1200)", log)

        # What the commits recorded: keys of .metadata, only those given.
        k = keys(self.backing, "zeta")
        self.assertEqual((k["step"], k["metric.loss"]), ("3000", "0.9"))
        self.assertNotIn("protect", k)
        k = keys(self.backing, "ckpt-500")
        self.assertNotIn("step", k)  # from the name, not recorded
        self.assertEqual((k["metric.loss"], k["metric.acc"]), ("0.1", "0.5"))
        self.assertEqual(keys(self.backing, "mid")["protect"], "1")
        # ... shown as xattrs of the checkpoint's directory on the mount
        self.assertEqual(os.getxattr(self.ck("zeta"), "user.ckpt.step"), b"3000")
        self.assertEqual(os.getxattr(self.ck("ckpt-500"), "user.ckpt.step"), b"500")
        self.assertEqual(os.getxattr(self.ck("ckpt-500"), "user.ckpt.metric.acc"), b"0.5")
        self.assertEqual(os.getxattr(self.ck("mid"), "user.ckpt.protected"), b"1")
        self.assertEqual(os.getxattr(self.ck("alpha"), "user.ckpt.protected"), b"0")
        self.assertEqual(sorted(os.listxattr(self.ck("ckpt-500"))),
                         ["user.ckpt.metric.acc", "user.ckpt.metric.loss",
                          "user.ckpt.protected", "user.ckpt.step"])
        with self.assertRaises(OSError) as cm:
            os.getxattr(self.ck("zeta"), "user.ckpt.metric.acc")
        self.assertEqual(cm.exception.errno, errno.ENODATA)
        # ... and by ckptctl show and ls
        doc = ctl_json(self, "show", self.backing, "ckpt-500")
        self.assertEqual((doc["step"], doc["step_recorded"], doc["protected"], doc["metrics"]),
                         (500, False, False, {"acc": 0.5, "loss": 0.1}))
        self.assertIn("step 3000 (recorded at commit), loss 0.9",
                      ctl("show", self.backing, "zeta").stdout)
        ls = {c["name"]: c for c in ctl_json(self, "ls", self.backing)["checkpoints"]}
        self.assertEqual({n: (c["step"], c["protected"]) for n, c in ls.items()},
                         {n: (s, n == "mid") for n, _, s, _ in COMMITS if n in SURVIVORS})

        # prune with the same rules: what the mount kept, but for its newest
        # commit, which prune does not know of (dry run: nothing removed).
        gone, kept, doc = prune_doc(self, self.backing, "--dry-run")
        self.assertEqual(gone, {"epoch=9-step=1500"})
        self.assertEqual(kept, {"ckpt-500": "best", "alpha": "every", "mid": "protected",
                                "zeta": "last+every", "b-7100": "last"})
        self.assertEqual(doc["policy"], POLICY)
        self.assertEqual(set(os.listdir(self.mnt)), SURVIVORS)
        r = ctl("prune", *PRUNE_FLAGS, "--dry-run", self.backing)
        self.assertIn("would remove  epoch=9-step=1500", r.stdout)
        self.assertRegex(r.stdout, r"kept +zeta .* step 3000: last\+every")
        # protect it after the fact: prune now agrees with the mount exactly
        r = ctl("protect", self.backing, "epoch=9-step=1500")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(os.getxattr(self.ck("epoch=9-step=1500"), "user.ckpt.protected"), b"1")
        gone, kept, _ = prune_doc(self, self.backing)
        self.assertEqual(gone, set())
        self.assertEqual(set(kept), SURVIVORS)
        # unprotect undoes a commit's protect word too
        self.assertEqual(ctl("unprotect", self.backing, "mid").returncode, 0)
        self.assertEqual(os.getxattr(self.ck("mid"), "user.ckpt.protected"), b"0")
        gone, _, _ = prune_doc(self, self.backing, "--dry-run")
        self.assertEqual(gone, {"mid"})
        self.assertTrue(os.path.isdir(self.bk("mid")))
        gone, _, _ = prune_doc(self, self.backing)
        self.assertEqual(gone, {"mid"})
        self.assertFalse(os.path.exists(self.bk("mid")))
        self.assertEqual(set(os.listdir(self.mnt)), SURVIVORS - {"mid"})
        # the next commit of the mount follows the marker as prune did
        self.save("step-900", "metric=loss:0.99")
        self.assertEqual(set(os.listdir(self.mnt)), SURVIVORS - {"mid"} | {"step-900"})
        self.save("late", "step=8000 metric=loss:0.98")  # step-900 goes
        self.assertEqual(set(os.listdir(self.mnt)), SURVIVORS - {"mid"} | {"late"})
        r = subprocess.run([os.path.join(os.path.dirname(util.BIN), "ckptfs-fsck"),
                            self.backing], capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_protect_errors_and_marker_survives_an_entry_removal(self):
        self.mount()
        self.save("s-1", "")
        os.mkdir(self.ck("s-2"))
        write_file(self.ck("s-2", "a"), b"a")
        write_file(self.ck("s-2", "b"), b"b")
        commit(self.ck("s-2"), "sync step=20 metric=loss:0.5")
        r = ctl("protect", self.backing, "nosuch")
        self.assertEqual(r.returncode, 1)
        self.assertIn("no committed checkpoint of that name", r.stderr)
        self.assertEqual(ctl_json(self, "protect", self.backing, "s-2"),
                         {"name": "s-2", "protected": True})
        # removing one entry publishes a new version: still protected
        os.unlink(self.ck("s-2", "a"))
        self.assertEqual(os.getxattr(self.ck("s-2"), "user.ckpt.protected"), b"1")
        doc = ctl_json(self, "show", self.backing, "s-2")
        self.assertEqual((doc["protected"], doc["step"], doc["metrics"]), (True, 20, {"loss": 0.5}))
        self.assertEqual(keys(self.backing, "s-2")["version"], "2")  # a new version indeed
        # through the mount: setxattr user.ckpt.protected, as ckptctl does
        os.setxattr(self.ck("s-1"), "user.ckpt.protected", b"1")
        self.assertTrue(ctl_json(self, "show", self.backing, "s-1")["protected"])
        os.setxattr(self.ck("s-1"), "user.ckpt.protected", b"0\n")
        self.assertFalse(ctl_json(self, "show", self.backing, "s-1")["protected"])
        for name, value, err in (("user.ckpt.protected", b"yes", errno.EINVAL),
                                 ("user.ckpt.step", b"5", errno.EROFS),
                                 ("user.other", b"5", errno.EROFS)):
            with self.assertRaises(OSError, msg=name) as cm:
                os.setxattr(self.ck("s-1"), name, value)
            self.assertEqual(cm.exception.errno, err, name)
        doc = ctl_json(self, "prune", "--keep-last", "1", "--dry-run", self.backing)
        self.assertEqual([(e["name"], e["kept_by"]) for e in doc["kept"]],
                         [("s-2", "last+protected")])  # step 20 after s-1
        self.assertEqual([e["name"] for e in doc["removed"]], ["s-1"])


class Words(CkptfsTestCase):

    def test_bad_words_commit_nothing(self):
        self.mount()
        os.mkdir(self.ck("w"))
        write_file(self.ck("w", "x"), b"x")
        for bad in ("sync step=", "sync step=-1", "sync step=1x", "sync step=1 step=2",
                    "sync metric=loss", "sync metric=loss:", "sync metric=:1",
                    "sync metric=loss:nan", "sync metric=loss:inf", "sync metric=loss:0x10",
                    "sync metric=a:1 metric=a:2", "sync metric=a b:1", "sync protect protect",
                    "sync protected"):
            with self.assertRaises(OSError, msg=bad) as cm:
                commit(self.ck("w"), bad)
            self.assertEqual(cm.exception.errno, errno.EINVAL, bad)
        self.assertFalse(os.path.exists(self.bk("w")))
        commit(self.ck("w"), "sync metric=a.b-c_d:1e-05 step=0")
        k = keys(self.backing, "w")
        self.assertEqual((k["step"], k["metric.a.b-c_d"]), ("0", "1e-05"))

    def test_python_client_commit_words(self):
        from ckpttest.pyenv import import_client
        ckptfs = import_client()
        self.mount()
        os.mkdir(self.ck("p-3"))
        write_file(self.ck("p-3", "x"), b"x")
        with self.assertRaises(ValueError):
            ckptfs.commit(self.mnt, "p-3", step=-1)
        with self.assertRaises(ValueError):
            ckptfs.commit(self.mnt, "p-3", metrics={"loss": float("nan")})
        self.assertFalse(os.path.exists(self.bk("p-3")))
        ckptfs.commit(self.mnt, "p-3", step=30, metrics={"loss": 0.1 + 0.2, "acc": 1},
                      protect=True)
        doc = ctl_json(self, "show", self.backing, "p-3")
        self.assertEqual((doc["step"], doc["step_recorded"], doc["protected"]), (30, True, True))
        self.assertEqual(doc["metrics"], {"acc": 1.0, "loss": 0.1 + 0.2})  # the same double

    def test_keep_option_errors(self):
        for bad in ("last:0", "last:x", "every:", "best:3:loss", "best:3:loss:avg",
                    "last:2,last:3", "", "first:2", "best:1:a b:min"):
            r = subprocess.run([util.BIN, "-f", "-o", "keep=" + bad, self.backing,
                                self.mnt], capture_output=True, text=True, timeout=30)
            self.assertEqual(r.returncode, 2, bad)
            self.assertIn(f"invalid keep '{bad}'", r.stderr)
        r = subprocess.run([util.BIN, "-f", "-o", "keep=last:2,keep_last=3",
                            self.backing, self.mnt], capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 2)
        self.assertIn("one retention option", r.stderr)
        r = subprocess.run([util.BIN, "-f", "-o", "tier_keep=2", self.backing, self.mnt],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(r.returncode, 2)
        self.assertIn("tier_keep=N needs tier=DIR", r.stderr)


if __name__ == "__main__":
    util.main()
