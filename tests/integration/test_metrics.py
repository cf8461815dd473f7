#!/usr/bin/env python3
"""-o metrics=FILE (issue 25): the mount's counters in the Prometheus text
format, parsed by prometheus_client's own parser (in .venv): commits by
outcome and failure reason, the duration histogram, bytes staged,
committed and read, the staged gauges; the file replaced whole (never
seen partial), written once more at unmount; the commit log lines with
duration and throughput; a bad metrics= value refused with exit 2 (class
Metrics). verify=1's counters (class Verify): damaged chunks once each,
and the bytes hashed or known (hashed by this mount's commit, or by
another mount sharing verify_shared), a verify_shared DIR others can
write refused."""

import errno
import json
import os
import re
import subprocess
import threading
import time

from ckpttest import sanenv, util
from ckpttest.util import (CkptfsTestCase, commit, main, mountinfo_has, read_all, tensor_bytes,
                           write_file, write_tensor)
from ckpttest.pyenv import require_modules, run_py
from test_integrity import flip, stored

MiB = 1 << 20

# Parse FILE with prometheus_client: print {"name{k=v,...}": value} (the
# rank and mount labels checked here and left out of the key), or exit 1
# saying what is wrong.
PARSE = r"""
import json, sys
from prometheus_client.parser import text_string_to_metric_families
text = open(sys.argv[1]).read()
want_mount = sys.argv[2]
out = {}
for fam in text_string_to_metric_families(text):
    for s in fam.samples:
        labels = dict(s.labels)
        assert labels.pop("rank") == "0", s
        assert labels.pop("mount") == want_mount, s
        key = s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
        out[key] = s.value
    out["#type:" + fam.name] = fam.type
print(json.dumps(out))
"""

# Read FILE over and over for argv[3] seconds while commits run: every
# read must parse, end in a newline and hold every family (argv[2]); print how many
# reads and how many different contents were seen.
READ_LOOP = r"""
import sys, time
from prometheus_client.parser import text_string_to_metric_families
path, families, seconds = sys.argv[1], sys.argv[2].split(","), float(sys.argv[3])
reads, contents = 0, set()
end = time.monotonic() + seconds
while time.monotonic() < end:
    with open(path) as f:
        text = f.read()
    reads += 1
    contents.add(text)
    assert text.endswith("\n"), repr(text[-200:])
    names = [fam.name for fam in text_string_to_metric_families(text)]
    assert names == families, (names, text[-300:])
print(reads, len(contents))
"""

# Every family the file holds, in its order.
FAMILIES = ["ckptfs_commits", "ckptfs_commit_failures", "ckptfs_commit_duration_seconds",
            "ckptfs_fuse_requests",
            "ckptfs_bytes_staged", "ckptfs_bytes_committed", "ckptfs_bytes_read",
            "ckptfs_drain_hashed_bytes",
            "ckptfs_verify_failures", "ckptfs_verify_bytes", "ckptfs_staged_checkpoints", "ckptfs_staged_bytes",
            "ckptfs_resident_memory_bytes", "ckptfs_open_fds"]


class MetricsCase(CkptfsTestCase):
    """A mount's metrics file, scraped by prometheus_client's parser."""

    def setUp(self):
        super().setUp()
        self.py = require_modules(self, "prometheus_client")
        self.mdir = os.path.join(self.dir, "metrics")
        os.makedirs(self.mdir)
        self.mfile = os.path.join(self.mdir, "ckptfs.prom")

    def scrape(self):
        return json.loads(run_py(self, self.py, PARSE, self.mfile, self.mnt, timeout=60))

    def wait_for(self, pred, what, timeout=15):
        """Scrape until pred(metrics) holds (the file is rewritten every 2 s)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.scrape() if os.path.exists(self.mfile) else None
            if m is not None and pred(m):
                return m
            if time.monotonic() > deadline:
                self.fail(f"{what}: not seen within {timeout} s; last scrape: {m}")
            time.sleep(0.3)

    def mount_metrics(self):
        self.mount("metrics=" + self.mfile)


class Metrics(MetricsCase):
    def test_counters_move(self):
        self.mount_metrics()
        m = self.wait_for(lambda m: True, "the first write")
        # every family, typed, from zero
        self.assertEqual(m["#type:ckptfs_commits"], "counter")
        self.assertEqual(m["#type:ckptfs_commit_duration_seconds"], "histogram")
        self.assertEqual(m["#type:ckptfs_staged_checkpoints"], "gauge")
        for outcome in ("committed", "failed", "lost"):
            self.assertEqual(m[f"ckptfs_commits_total{{outcome={outcome}}}"], 0)
        for reason in ("timeout", "no_space", "io", "invalid", "exists", "other"):
            self.assertEqual(m[f"ckptfs_commit_failures_total{{reason={reason}}}"], 0)
        self.assertEqual(m["ckptfs_commit_duration_seconds_count{}"], 0)
        self.assertEqual(m["ckptfs_bytes_staged_total{}"], 0)
        self.assertGreater(m["ckptfs_resident_memory_bytes{}"], 1 << 20)
        self.assertGreater(m["ckptfs_open_fds{}"], 3)

        # a good checkpoint: 1 MiB of tensor, a small blob
        os.mkdir(self.ck("good"))
        data = write_tensor(self.ck("good", "w"), "float32", [512, 512],
                            tensor_bytes("float32", [512, 512]))
        write_file(self.ck("good", "cfg"), b"x" * 1000)
        staged = len(data) + 1000
        commit(self.ck("good"))
        m = self.wait_for(lambda m: m["ckptfs_commits_total{outcome=committed}"] == 1,
                          "the committed commit")
        self.assertEqual(m["ckptfs_commits_total{outcome=failed}"], 0)
        self.assertEqual(m["ckptfs_bytes_staged_total{}"], staged)
        self.assertEqual(m["ckptfs_bytes_committed_total{}"], staged)
        self.assertEqual(m["ckptfs_commit_duration_seconds_count{}"], 1)
        self.assertEqual(m["ckptfs_commit_duration_seconds_bucket{le=+Inf}"], 1)
        self.assertGreater(m["ckptfs_commit_duration_seconds_sum{}"], 0)
        self.assertEqual(m["ckptfs_bytes_read_total{}"], 0)

        # reads of the committed checkpoint through the daemon are counted;
        # the 1 MiB tensor, a whole data file, is read by FUSE passthrough
        # where it is available (from the data file, not seen)
        self.assertEqual(read_all(self.ck("good", "w")), data)
        self.assertEqual(read_all(self.ck("good", "cfg")), b"x" * 1000)
        m = self.wait_for(lambda m: m["ckptfs_bytes_read_total{}"] >= 1000, "the reads")
        self.assertIn(m["ckptfs_bytes_read_total{}"], (staged, 1000))

        # a tensor of the wrong length: the commit fails, as invalid
        os.mkdir(self.ck("bad"))
        write_tensor(self.ck("bad", "t"), "float32", [4], b"0123456789")
        with self.assertRaises(OSError):
            commit(self.ck("bad"))
        m = self.wait_for(lambda m: m["ckptfs_commits_total{outcome=failed}"] == 1,
                          "the failed commit")
        self.assertEqual(m["ckptfs_commits_total{outcome=committed}"], 1)
        self.assertEqual(m["ckptfs_commit_failures_total{reason=invalid}"], 1)
        self.assertEqual(sum(v for k, v in m.items()
                             if k.startswith("ckptfs_commit_failures_total")), 1)
        self.assertEqual(m["ckptfs_commit_duration_seconds_count{}"], 2)
        self.assertEqual(m["ckptfs_bytes_staged_total{}"], staged + 10)
        self.assertEqual(m["ckptfs_bytes_committed_total{}"], staged)

        # the log lines: duration, bytes and throughput
        log = self.daemon_log()
        self.assertRegex(log, r"good: committed in \d+\.\d\d s \(this rank wrote %d bytes, "
                         r"\d+\.\d MB/s\)" % staged)
        self.assertRegex(log, r"bad: commit failed: .*16 expected.* \(after \d+\.\d\d s\)")

    def test_staged_gauges(self):
        self.mount_metrics()
        self.wait_for(lambda m: m["ckptfs_staged_checkpoints{}"] == 0, "no staged checkpoint")
        os.mkdir(self.ck("a"))
        write_file(self.ck("a", "x"), b"a" * 5000)
        os.mkdir(self.ck("b"))
        write_file(self.ck("b", "y"), b"b" * 3000)
        m = self.wait_for(lambda m: m["ckptfs_staged_checkpoints{}"] == 2, "two staged")
        self.assertEqual(m["ckptfs_staged_bytes{}"], 8000)
        commit(self.ck("a"))
        m = self.wait_for(lambda m: m["ckptfs_staged_checkpoints{}"] == 1, "a committed")
        self.assertEqual(m["ckptfs_staged_bytes{}"], 3000)
        os.unlink(self.ck("b", "y"))
        os.rmdir(self.ck("b"))
        m = self.wait_for(lambda m: m["ckptfs_staged_checkpoints{}"] == 0, "b removed")
        self.assertEqual(m["ckptfs_staged_bytes{}"], 0)
        self.assertEqual(m["ckptfs_bytes_staged_total{}"], 8000)

    def test_file_always_whole(self):
        """Read in a loop while commits run: never partial; no temporary
        file left; the last counts written at unmount."""
        self.mount_metrics()
        self.wait_for(lambda m: True, "the first write")
        reader = subprocess.Popen([self.py, "-c", READ_LOOP, self.mfile, ",".join(FAMILIES),
                                   "7"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        errors, done = [], []

        def commits():
            try:
                for i in range(60):
                    if reader.poll() is not None:
                        break
                    name = f"c{i}"
                    os.mkdir(self.ck(name))
                    write_file(self.ck(name, "f"), os.urandom(64 << 10))
                    commit(self.ck(name))
                    done.append(name)
                    time.sleep(0.05)
            except Exception as e:  # reported below
                errors.append(e)

        t = threading.Thread(target=commits)
        t.start()
        out, err = reader.communicate(timeout=120)
        t.join()
        self.assertEqual(errors, [])
        self.assertEqual(reader.returncode, 0, f"a read of the metrics file failed:\n{err}")
        reads, contents = map(int, out.split())
        self.assertGreater(reads, 100, out)
        self.assertGreaterEqual(contents, 3, f"the file was not rewritten: {out}")
        # one commit just before unmount: only the last write can count it
        os.mkdir(self.ck("last"))
        write_file(self.ck("last", "f"), b"z")
        before = self.scrape()["ckptfs_commits_total{outcome=committed}"]
        commit(self.ck("last"))
        self.assertEqual(self.mounts[0].stop(), 0)
        m = self.scrape()
        self.assertEqual(m["ckptfs_commits_total{outcome=committed}"], len(done) + 1)
        self.assertLessEqual(before, len(done))
        self.assertEqual(os.listdir(self.mdir), ["ckptfs.prom"])

    def test_daemonized_relative_path(self):
        """A daemon (no -f) works in /: a relative FILE is the caller's."""
        self.mount("metrics=" + os.path.relpath(self.mfile), foreground=False)
        self.wait_for(lambda m: m["ckptfs_commits_total{outcome=committed}"] == 0,
                      "the daemon's first write")

    def test_rank_in_name(self):
        self.mount("metrics=" + os.path.join(self.mdir, "m%r.prom"))
        deadline = time.monotonic() + 10
        while not os.path.exists(os.path.join(self.mdir, "m0.prom")):
            self.assertLess(time.monotonic(), deadline, os.listdir(self.mdir))
            time.sleep(0.1)
        self.mfile = os.path.join(self.mdir, "m0.prom")
        self.assertIn("ckptfs_commits_total{outcome=committed}", self.scrape())

    def test_bad_values(self):
        write_file(self.log, b"")  # a file, not a directory
        for bad, says in [("metrics=", "a file name"),
                          ("metrics=" + self.mdir + "/", "a file name"),
                          ("metrics=" + os.path.join(self.dir, "no", "m.prom"),
                           "No such file or directory"),
                          ("metrics=" + os.path.join(self.log, "m.prom"), "not a directory")]:
            r = subprocess.run([util.BIN, "-f", "-o", bad, self.backing, self.mnt],
                               capture_output=True, text=True, timeout=60,
                               stdin=subprocess.DEVNULL, env=sanenv.env())
            self.assertEqual(r.returncode, 2, f"-o {bad}: rc {r.returncode}\n{r.stderr}")
            self.assertIn("invalid metrics", r.stderr, bad)
            self.assertIn(says, r.stderr, bad)
            self.assertFalse(mountinfo_has(self.mnt), bad)
            self.assertFalse(os.path.exists(self.backing), f"-o {bad} created BACKING_DIR")


class Verify(MetricsCase):
    """verify=1's counters: damaged chunks, and the bytes hashed or known."""

    def test_verify_failures(self):
        """verify=1 finding a damaged chunk: counted once per chunk."""
        self.mount("verify=1,metrics=" + self.mfile)
        os.mkdir(self.ck("v"))
        w = write_tensor(self.ck("v", "w"), "float32", [256], os.urandom(1024))
        write_file(self.ck("v", "cfg"), os.urandom(5000))
        commit(self.ck("v"))
        f, off, ln = stored(self.backing, "v", "cfg")
        flip(self.bk("v", f), off + 7)
        for _ in range(2):  # the second read finds it known bad
            self.assertErrno(errno.EIO, read_all, self.ck("v", "cfg"))
        self.assertEqual(read_all(self.ck("v", "w")), w)
        m = self.wait_for(lambda m: m["ckptfs_verify_failures_total{}"] >= 1, "the bad chunk")
        self.assertEqual(m["ckptfs_verify_failures_total{}"], 1)
        self.assertEqual(m["ckptfs_bytes_read_total{}"], len(w))

    def test_verify_known_from_the_commit(self):
        """A chunk this mount's commit hashed from its data file itself (a
        file streamed into it as it was written) is not hashed again at
        its first read while the data file is unchanged; once it changed,
        it is hashed, and a flipped byte found."""
        self.mount("verify=1,metrics=" + self.mfile)
        os.mkdir(self.ck("k"))
        w = write_tensor(self.ck("k", "w"), "float32", [256, 1024], os.urandom(MiB))
        s = write_tensor(self.ck("k", "s"), "float32", [256], os.urandom(1024))
        commit(self.ck("k"))
        self.assertEqual(read_all(self.ck("k", "w")), w)
        self.assertEqual(read_all(self.ck("k", "s")), s)
        m = self.wait_for(lambda m: m['ckptfs_verify_bytes_total{how=known}'] > 0,
                          "the known chunk")
        self.assertEqual(m['ckptfs_verify_bytes_total{how=known}'], len(w))
        self.assertEqual(m['ckptfs_verify_bytes_total{how=hashed}'], len(s))
        # the data file changed (one byte flipped: its mtime and ctime move):
        # hashed at the next open, and refused
        f, off, ln = stored(self.backing, "k", "w")
        flip(self.bk("k", f), off + ln // 2)
        self.assertErrno(errno.EIO, read_all, self.ck("k", "w"))
        m = self.wait_for(lambda m: m["ckptfs_verify_failures_total{}"] == 1, "the flip")
        self.assertEqual(m['ckptfs_verify_bytes_total{how=known}'], len(w))
        flip(self.bk("k", f), off + ln // 2)  # put right: hashed, and served
        self.assertEqual(read_all(self.ck("k", "w")), w)
        # every hash counts: the damaged one, then the one put right (the
        # file is rewritten every 2 s: wait for both)
        m = self.wait_for(lambda m: m['ckptfs_verify_bytes_total{how=hashed}']
                          >= len(s) + 2 * len(w), "both hashes of w")
        self.assertEqual(m['ckptfs_verify_bytes_total{how=hashed}'], len(s) + 2 * len(w))
        self.assertEqual(m['ckptfs_verify_bytes_total{how=known}'], len(w))

    def test_verify_shared_between_mounts(self):
        """verify_shared=DIR: what one mount's commit or read hashed, a
        later mount sharing DIR does not hash again (on this node, this
        boot); with verify_shared=none it does. A DIR others can write is
        refused (exit 2)."""
        share = os.path.join(self.dir, "share")
        m = self.mount(f"verify=1,verify_shared={share}")
        os.mkdir(self.ck("k"))
        w = write_tensor(self.ck("k", "w"), "float32", [256, 1024], os.urandom(MiB))
        s = write_tensor(self.ck("k", "s"), "float32", [256], os.urandom(1024))
        commit(self.ck("k"))
        self.assertEqual(m.stop(), 0)
        # a verified read records what it hashed only of a file unchanged
        # for 2 s (a change within the clock tick of its stat could keep
        # the ctime); the commit's own records need no wait
        time.sleep(2.2)
        for k, (opts, known, hashed) in enumerate([
                (f"verify_shared={share}", len(w), len(s)),   # s hashed here first
                (f"verify_shared={share}", len(w) + len(s), 0),
                ("verify_shared=none", 0, len(w) + len(s))]):
            self.mfile = os.path.join(self.mdir, f"m{k}.prom")
            m = self.mount(f"verify=1,{opts},metrics={self.mfile}")
            self.assertEqual(read_all(self.ck("k", "w")), w)
            self.assertEqual(read_all(self.ck("k", "s")), s)
            self.assertEqual(m.stop(), 0)  # the last metrics written
            got = self.scrape()
            self.assertEqual((got["ckptfs_verify_bytes_total{how=known}"],
                              got["ckptfs_verify_bytes_total{how=hashed}"]),
                             (known, hashed), opts)
        os.chmod(share, 0o777)
        m = self.mount(f"verify_shared={share}", start=False)
        r = subprocess.run(m.argv(), capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(f"verify_shared={share}: ", r.stderr)
        self.assertIn("writable", r.stderr)


if __name__ == "__main__":
    main()
