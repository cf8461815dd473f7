#!/usr/bin/env python3
"""Edge cases: a full backing filesystem (tmpfs of a few MiB), commits
queued or repeated while one runs, removal while committing, shell usage
(echo > .commit, cat, ls), large directories (readdir paging), parallel
readers of committed data."""

import errno
import os
import shutil
import subprocess
import threading

from ckpttest.util import (CkptfsTestCase, commit, main, pread, read_all, state, status,
                           tensor_bytes, wait_state, write_file, write_tensor)

MiB = 1 << 20


class FullBacking(CkptfsTestCase):
    def setUp(self):
        super().setUp()
        os.makedirs(self.backing)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "ckptfs-test", self.backing],
                           capture_output=True, text=True)
        if r.returncode != 0:
            self.skipTest(f"cannot mount a tmpfs: {r.stderr.strip()}")
        # after the ckptfs mounts are stopped (cleanups run last-in first-out)
        self.addCleanup(subprocess.run, ["umount", "-l", self.backing], capture_output=True)

    def test_no_space_left(self):
        for opts in ("sync_files=1", "sync_files=0,io_threads=2"):
            m = self.mount(opts)
            os.mkdir(self.ck("small"))
            write_file(self.ck("small", "f"), b"fits")
            commit(self.ck("small"))
            os.mkdir(self.ck("big"))
            write_file(self.ck("big", "a"), b"\1" * (3 * MiB))
            write_tensor(self.ck("big", "b"), "uint8", [3 * MiB], b"\2" * (3 * MiB))
            self.assertErrno(errno.EIO, commit, self.ck("big"))
            st = status(self.ck("big"))
            self.assertEqual(st.split("\n")[0], "failed")
            self.assertIn("No space left on device", st)
            self.assertNothingPublished("big")
            self.assertFalse(os.path.exists(self.bk("big")), os.listdir(self.backing))
            self.assertEqual(read_all(self.ck("small", "f")), b"fits")
            # the space is back: a smaller retry of the same checkpoint commits
            os.unlink(self.ck("big", "a"))
            commit(self.ck("big"))
            self.assertEqual(read_all(self.ck("big", "b")), b"\2" * (3 * MiB))
            # async fails the same way
            os.mkdir(self.ck("big2"))
            write_file(self.ck("big2", "a"), b"\3" * (2 * MiB))
            commit(self.ck("big2"), "async")
            st = wait_state(self.ck("big2"))
            self.assertEqual(st.split("\n")[0], "failed")
            self.assertIn("No space left on device", st)
            self.assertNothingPublished("big2")
            self.assertEqual(m.stop(), 0)
            for n in os.listdir(self.backing):
                shutil.rmtree(os.path.join(self.backing, n))


    def test_space_runs_out_at_any_step(self):
        # data sizes around the capacity: the data files or the metadata
        # run out of space; each commit either commits whole or leaves
        # nothing behind
        self.mount()
        outcomes = set()
        cap = 4 * MiB
        for i, k in enumerate(range(cap - 64 * 1024, cap + 8192, 4096)):
            n = f"c{i}"
            os.mkdir(self.ck(n))
            write_file(self.ck(n, "data"), b"\1" * k)
            write_tensor(self.ck(n, "t"), "int32", [3], tensor_bytes("int32", [3]))
            try:
                commit(self.ck(n))
            except OSError as e:
                self.assertEqual(e.errno, errno.EIO)
                st = status(self.ck(n))
                self.assertEqual(st.split("\n")[0], "failed")
                self.assertIn("No space left on device", st)
                self.assertFalse(os.path.exists(self.bk(n)), os.listdir(self.backing))
                outcomes.add("metadata" if ".metadata" in st else "data")
            else:
                self.assertEqual(read_all(self.ck(n, "data")), b"\1" * k)
                self.assertEqual(read_all(self.ck(n, "t")), tensor_bytes("int32", [3]))
                outcomes.add("committed")
            shutil.rmtree(self.ck(n))
            self.assertEqual(os.listdir(self.backing), [])
        self.assertEqual(outcomes, {"committed", "data", "metadata"})


class Concurrency(CkptfsTestCase):
    def test_queued_async_commits(self):
        self.mount()
        want = {}
        for i in range(4):
            n = f"q{i}"
            os.mkdir(self.ck(n))
            want[n] = os.urandom(MiB) * (8 + i)
            write_file(self.ck(n, "data"), want[n])
            commit(self.ck(n), "async")
        for n, data in want.items():
            self.assertEqual(wait_state(self.ck(n)).split("\n")[0], "committed", n)
            self.assertEqual(read_all(self.ck(n, "data")), data)
        # a sync commit queued behind an async one
        os.mkdir(self.ck("a"))
        write_file(self.ck("a", "data"), os.urandom(MiB) * 32)
        os.mkdir(self.ck("s"))
        write_file(self.ck("s", "data"), b"sync")
        commit(self.ck("a"), "async")
        commit(self.ck("s"), "sync")
        self.assertEqual(state(self.ck("s")), "committed")
        self.assertEqual(wait_state(self.ck("a")).split("\n")[0], "committed")

    def test_busy_while_committing(self):
        self.mount()
        os.mkdir(self.ck("b"))
        payload = os.urandom(MiB) * 96
        write_file(self.ck("b", "data"), payload)
        commit(self.ck("b"), "async")
        checks = [(commit, (self.ck("b"),)), (os.rmdir, (self.ck("b"),)),
                  (os.truncate, (self.ck("b", "data"), 0)),
                  (os.setxattr, (self.ck("b", "data"), "user.ckpt.dtype", b"uint8")),
                  (os.mkdir, (self.ck("b", "d"),)),
                  (os.open, (self.ck("b", "new"), os.O_WRONLY | os.O_CREAT, 0o644)),
                  (os.rename, (self.ck("b", "data"), self.ck("b", "data2"))),
                  (os.unlink, (self.ck("b", "data"),))]
        done = 0
        for fn, args in checks:
            if state(self.ck("b")) != "committing":
                break  # the save ended: the remaining checks would not apply
            try:
                fn(*args)
            except OSError as e:
                if e.errno not in (errno.EBUSY, errno.EROFS):
                    # only acceptable when the save ended meanwhile
                    self.assertNotEqual(state(self.ck("b")), "committing", f"{fn.__name__}: {e}")
                    break
            else:
                self.assertNotEqual(state(self.ck("b")), "committing",
                                    f"{fn.__name__}{args} succeeded while committing")
                break
            done += 1
        if done == 0:
            self.skipTest("the save was over before the first check")
        self.assertEqual(wait_state(self.ck("b")).split("\n")[0], "committed")
        if done == len(checks):
            self.assertEqual(sorted(os.listdir(self.ck("b"))), [".metadata", "data"])
            self.assertEqual(read_all(self.ck("b", "data")), payload)

    def test_parallel_readers(self):
        self.mount()
        os.mkdir(self.ck("r"))
        shape = [512, 1024]
        data = write_tensor(self.ck("r", "w"), "float32", shape, tensor_bytes("float32", shape))
        blobs = {f"b{i}": os.urandom(100000 + i) for i in range(8)}
        for k, v in blobs.items():
            write_file(self.ck("r", k), v)
        commit(self.ck("r"))
        errors = []

        def reader(t):
            try:
                for j in range(20):
                    off = (t * 7919 + j * 104729) % len(data)
                    n = 1 + (t * 131 + j * 977) % 70000
                    got = pread(self.ck("r", "w"), n, off)
                    if got != data[off:off + n]:
                        errors.append((t, off, n))
                    k = f"b{(t + j) % 8}"
                    if read_all(self.ck("r", k)) != blobs[k]:
                        errors.append((t, k))
            except Exception as e:
                errors.append((t, repr(e)))

        threads = [threading.Thread(target=reader, args=(t,)) for t in range(12)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        self.assertEqual(errors, [])

    def test_stage_next_while_reading_previous(self):
        self.mount()
        os.mkdir(self.ck("p"))
        prev = write_tensor(self.ck("p", "w"), "int64", [1000, 10], tensor_bytes("int64", [1000, 10]))
        commit(self.ck("p"))
        errors = []
        stop = threading.Event()

        def reader():
            try:
                while not stop.is_set():
                    if read_all(self.ck("p", "w")) != prev:
                        errors.append("mismatch")
            except Exception as e:
                errors.append(repr(e))

        th = threading.Thread(target=reader)
        th.start()
        try:
            for i in range(5):
                n = f"n{i}"
                os.mkdir(self.ck(n))
                write_tensor(self.ck(n, "w"), "int64", [1000, 10], tensor_bytes("int64", [1000, 10], seed=i))
                commit(self.ck(n), "async" if i % 2 else "sync")
        finally:
            stop.set()
            th.join()
        self.assertEqual(errors, [])
        for i in range(5):
            wait_state(self.ck(f"n{i}"))
            self.assertEqual(read_all(self.ck(f"n{i}", "w")), tensor_bytes("int64", [1000, 10], seed=i))


class Shell(CkptfsTestCase):
    def sh(self, script):
        r = subprocess.run(["sh", "-ec", script], cwd=self.mnt, capture_output=True, text=True,
                           timeout=120)
        return r

    def test_shell_usage(self):
        self.mount()
        r = self.sh("mkdir step-1 && mkdir -p step-1/model/l0 && printf 'abc' > step-1/model/l0/b "
                    "&& echo hello > step-1/notes.txt && cat step-1/.status")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "staging\nfiles 2\nbytes 9\n")
        r = self.sh("echo sync > step-1/.commit && head -1 step-1/.status && cat step-1/notes.txt "
                    "&& ls -a step-1")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.split("\n")[:2], ["committed", "hello"])
        self.assertEqual(r.stdout.split("\n")[2:-1], [".", "..", ".metadata", "model", "notes.txt"])
        r = self.sh("echo bogus > step-1/.commit")
        self.assertNotEqual(r.returncode, 0)
        r = self.sh("mkdir step-2 && echo x > step-2/x && echo nonsense > step-2/.commit")
        self.assertNotEqual(r.returncode, 0)
        self.assertEqual(state(self.ck("step-2")), "staging")
        r = self.sh("echo async > step-2/.commit")
        self.assertEqual(r.returncode, 0, r.stderr)
        wait_state(self.ck("step-2"))
        r = self.sh("cp step-2/x /dev/null && rm -r step-1 && ls")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "step-2\n")
        if shutil.which("getfattr"):
            self.sh("mkdir t && : > t/w && setfattr -n user.ckpt.dtype -v float32 t/w "
                    "&& setfattr -n user.ckpt.shape -v 0 t/w && echo sync > t/.commit")
            r = self.sh("getfattr -n user.ckpt.dtype --only-values t/w")
            self.assertEqual(r.stdout, "float32")

    def test_copy_out_and_back_in(self):
        # ordinary tools: find, cp -a out of the mount; copytree (copy2
        # with xattrs) back into a new checkpoint, which commits the same
        self.mount()
        os.mkdir(self.ck("src"))
        want = {"m/a/w": write_tensor(self.ck("src", "m/a/w"), "bfloat16", [16, 3],
                                      tensor_bytes("bfloat16", [16, 3])),
                "m/b/deeper/v": write_tensor(self.ck("src", "m/b/deeper/v"), "int8", [7],
                                             tensor_bytes("int8", [7])),
                "cfg.json": b'{"a": 1}'}
        write_file(self.ck("src", "cfg.json"), want["cfg.json"])
        commit(self.ck("src"))
        r = subprocess.run(["find", "src", "-type", "f"], cwd=self.mnt, capture_output=True, text=True)
        self.assertEqual(sorted(r.stdout.split()),
                         sorted(["src/.metadata"] + [f"src/{p}" for p in want]))
        out = os.path.join(self.dir, "copy")
        r = subprocess.run(["cp", "-a", self.ck("src"), out], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        for p, data in want.items():
            self.assertEqual(read_all(os.path.join(out, p)), data, p)
        shutil.copytree(out, self.ck("again"), ignore=shutil.ignore_patterns(".*"))
        self.assertEqual(os.getxattr(self.ck("again", "m/a/w"), "user.ckpt.dtype"), b"bfloat16")
        commit(self.ck("again"))
        for p, data in want.items():
            self.assertEqual(read_all(self.ck("again", p)), data, p)
        self.assertEqual(os.getxattr(self.ck("again", "m/a/w"), "user.ckpt.shape"), b"16,3")
        self.assertEqual(os.listxattr(self.ck("again", "cfg.json")), [])

    def test_large_directory(self):
        self.mount("sync_files=0")
        os.mkdir(self.ck("big"))
        names = {f"entry_{i:05d}_{'x' * (i % 50)}" for i in range(3000)}
        for n in names:
            os.close(os.open(self.ck("big", n), os.O_WRONLY | os.O_CREAT, 0o644))
        self.assertEqual(set(os.listdir(self.ck("big"))), names)
        r = subprocess.run(["ls", "-1", self.ck("big")], capture_output=True, text=True)
        self.assertEqual(set(r.stdout.split()), names)
        commit(self.ck("big"))
        self.assertEqual(set(os.listdir(self.ck("big"))), names | {".metadata"})
        with os.scandir(self.ck("big")) as it:
            self.assertEqual(sum(1 for e in it if e.is_file()), 3001)


if __name__ == "__main__":
    main()
