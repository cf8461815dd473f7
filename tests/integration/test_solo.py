#!/usr/bin/env python3
"""`sync solo` in a world of 2 ranks (issue 24): one rank publishes a
checkpoint from its own files alone, as a checkpoint of world size 1, while
the other rank does nothing (rank-0-only saves: Lightning and the Hugging
Face Trainer under DDP, configs, tokenizers); every mount sees it, and the
world's collective commits go on as before."""

import errno
import os
import sqlite3
import time

from ckpttest.util import (CkptfsTestCase, main, read_all, state, status, tensor_bytes, wait_state,
                           wait_until, write_file, write_tensor)

MiB = 1 << 20


def seen_within(path, seconds=5.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if os.path.exists(path):
            return True
        time.sleep(0.05)
    return False


class World2(CkptfsTestCase):
    OPTS = "commit_timeout=20"

    def setUp(self):
        super().setUp()
        from ckpttest.world import commit_all
        self.commit_all = commit_all
        self.world = self.start_world(2, self.OPTS)
        self.m = self.world.mnts()

    def solo_commit(self, rank, name, mode="sync"):
        with open(os.path.join(self.m[rank], name, ".commit"), "w") as f:
            f.write(f"{mode} solo\n")

    def test_one_rank_publishes_alone(self):
        for rank, name in ((1, "tokenizer"), (0, "config-only")):
            with self.subTest(rank=rank):
                ck = os.path.join(self.m[rank], name)
                os.mkdir(ck)
                write_file(os.path.join(ck, "tokenizer.json"), b'{"vocab": %d}' % rank)
                big = os.urandom(3 * MiB + 5)  # streamed: a data file of its own
                write_file(os.path.join(ck, "big.bin"), big)
                w = tensor_bytes("float32", [8, 4], seed=rank)
                write_tensor(os.path.join(ck, "model", "w"), "float32", [8, 4], w)
                t0 = time.monotonic()
                self.solo_commit(rank, name)
                took = time.monotonic() - t0
                # it did not wait for the other rank (commit_timeout is 20 s)
                self.assertLess(took, 10, status(ck))
                self.assertEqual(state(ck), "committed")
                other = os.path.join(self.m[1 - rank], name)
                self.assertTrue(seen_within(other), f"{name} not seen by rank {1 - rank}")
                for mnt in self.m:
                    d = os.path.join(mnt, name)
                    self.assertEqual(read_all(os.path.join(d, "big.bin")), big)
                    self.assertEqual(read_all(os.path.join(d, "model", "w")), w)
                    self.assertEqual(read_all(os.path.join(d, "tokenizer.json")),
                                     b'{"vocab": %d}' % rank)
                db = sqlite3.connect(f"file:{self.backing}/{name}/.metadata?mode=ro", uri=True)
                ws = db.execute("select value from checkpoint where key='world_size'").fetchone()[0]
                ranks = {r for (r,) in db.execute("select rank from chunks union select rank from blobs")}
                db.close()
                self.assertEqual((int(ws), ranks), (1, {0}))
                self.assertEqual(sorted(f for f in os.listdir(os.path.join(self.backing, name))
                                        if f.endswith(".distcp")),
                                 sorted(set(f for f in os.listdir(os.path.join(self.backing, name))
                                            if f.startswith("__0_") and f.endswith(".distcp"))))
                self.assertIn("committed\n", status(other))

    def test_collective_commits_go_on(self):
        # a solo save on rank 1 while rank 0 waits in a collective commit of
        # another checkpoint: neither holds the other up
        os.mkdir(os.path.join(self.m[1], "solo"))
        write_file(os.path.join(self.m[1], "solo", "f"), b"one rank")
        for r in range(2):
            os.mkdir(os.path.join(self.m[r], "both"))
            write_file(os.path.join(self.m[r], "both", f"r{r}"), b"rank %d" % r)
        res0 = {}
        import threading
        t = threading.Thread(target=lambda: res0.update(
            self.commit_all(self.world, "both", ranks=[0], timeout=60)))
        t.start()
        both0 = os.path.join(self.m[0], "both")
        wait_until(lambda: "waiting for" in status(both0), 30, "rank 0 waiting in its commit")
        self.solo_commit(1, "solo")
        self.assertEqual(state(os.path.join(self.m[1], "solo")), "committed")
        res1 = self.commit_all(self.world, "both", ranks=[1], timeout=60)
        t.join(70)
        self.assertIsNone(res0[0][0], status(os.path.join(self.m[0], "both")))
        self.assertIsNone(res1[1][0], status(os.path.join(self.m[1], "both")))
        for mnt in self.m:
            self.assertEqual(read_all(os.path.join(mnt, "both", "r0")), b"rank 0")
            self.assertEqual(read_all(os.path.join(mnt, "both", "r1")), b"rank 1")
            self.assertEqual(read_all(os.path.join(mnt, "solo", "f")), b"one rank")

    def solo_while_waited_for(self, solo_rank, coll, solo):
        """The other rank waits in a collective commit of coll that
        solo_rank has not reached; solo_rank first saves solo alone: that
        is neither taken for its part of coll nor held up by it, and then
        coll commits on both."""
        other = 1 - solo_rank
        for r in range(2):
            os.mkdir(os.path.join(self.m[r], coll))
            write_file(os.path.join(self.m[r], coll, f"r{r}"), b"%s %d" % (coll.encode(), r))
        os.mkdir(os.path.join(self.m[solo_rank], solo))
        write_file(os.path.join(self.m[solo_rank], solo, "config.json"), b"{}")
        res = {}
        import threading
        t = threading.Thread(target=lambda: res.update(
            self.commit_all(self.world, coll, ranks=[other], timeout=60)))
        t.start()
        waiting = os.path.join(self.m[other], coll)
        wait_until(lambda: "waiting for" in status(waiting), 30,
                   f"rank {other} waiting in its commit of {coll}")
        t0 = time.monotonic()
        self.solo_commit(solo_rank, solo)
        self.assertLess(time.monotonic() - t0, 10)
        self.assertEqual(state(os.path.join(self.m[solo_rank], solo)), "committed")
        self.assertTrue(seen_within(os.path.join(self.m[other], solo, "config.json")))
        res.update(self.commit_all(self.world, coll, ranks=[solo_rank], timeout=60))
        t.join(70)
        for r in range(2):
            self.assertIsNone(res[r][0], status(os.path.join(self.m[r], coll)))
        for mnt in self.m:
            for r in range(2):
                self.assertEqual(read_all(os.path.join(mnt, coll, f"r{r}")),
                                 b"%s %d" % (coll.encode(), r))

    def test_solo_while_the_world_waits_for_this_rank(self):
        self.solo_while_waited_for(0, "both", "cfg")   # on the coordinator
        self.solo_while_waited_for(1, "both2", "cfg1")  # on a client rank

    def test_async_solo_and_errors(self):
        ck = os.path.join(self.m[0], "a")
        os.mkdir(ck)
        write_file(os.path.join(ck, "x"), b"x" * 1000)
        self.solo_commit(0, "a", "async")
        self.assertEqual(wait_state(ck, timeout=60).split("\n")[0], "committed")
        self.assertTrue(seen_within(os.path.join(self.m[1], "a", "x")))
        # a name committed already: EEXIST, the staged data stays staged
        os.mkdir(os.path.join(self.m[1], "b"))
        write_file(os.path.join(self.m[1], "b", "y"), b"y")
        self.solo_commit(1, "b")
        os.mkdir(os.path.join(self.m[0], "b2"))
        write_file(os.path.join(self.m[0], "b2", "y"), b"z")
        os.rename(os.path.join(self.m[0], "b2"), os.path.join(self.m[0], "c"))
        with self.assertRaises(OSError) as cm:
            self.solo_commit(1, "b")
        self.assertIn(cm.exception.errno, (errno.EROFS,))
        # a bad tensor fails the solo save on that rank alone, with the reason
        os.mkdir(os.path.join(self.m[1], "bad"))
        write_tensor(os.path.join(self.m[1], "bad", "w"), "float32", [4], b"\0" * 8)
        with self.assertRaises(OSError) as cm:
            self.solo_commit(1, "bad")
        self.assertEqual(cm.exception.errno, errno.EIO)
        st = status(os.path.join(self.m[1], "bad"))
        self.assertTrue(st.startswith("failed\n"), st)
        self.assertIn("8 bytes", st)
        self.assertFalse(os.path.exists(os.path.join(self.backing, "bad")))
        self.assertEqual(state(os.path.join(self.m[0], "c")), "staging")


if __name__ == "__main__":
    main()
