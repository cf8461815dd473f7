#!/usr/bin/env python3
"""Issue 27's rows: multi-level checkpoints across simulated nodes, each
figure a ratio against a limit measured in the same run.

    python3 bench/tiers.py --bin build/bin/ckptfs [--per-rank 32M] [--slots 2,2,2]
        [--store-bps 25M] [--levels none,local,partner,shared] [--rounds 1] [--json out.json]
    python3 bench/bench.py --tiers ...   (the same)

Run as root, alone (no other benchmark or test at the same time: 2 cores
here). The nodes are network namespaces (tests/integration/ckpttest/netns.py;
3 x 2 ranks by default, started by ckpt-mount as test_netns.py does), each
node's tier a private tmpfs; BACKING_DIR is on a slow shared store, an
ext4 loop device throttled to --store-bps for writes and reads
(tests/integration/ckpttest/slowstore.py). Each rank stages --per-rank bytes (one
file), then all commit `sync` at once.

Limits (measured first, every round):
  tier write   every rank's bytes written and fsynced into its node's
               tier at once (threads): what a sync commit into the tiers
               cannot beat;
  tier read    the same files read back at once;
  store write  32 MiB written and fsynced into the store (its MiB/s);
  store read   every rank's bytes read from the store at once, its page
               cache dropped;
  net copy     every rank's bytes sent over TCP to the next node and
               written and fsynced into its tier, all at once (the floor
               of a partner copy; with 2+ nodes).

Rows, per level (a level the binary refuses prints why):
  none     no tier: sync commit (the stall); restart: a new world reads
           each rank's bytes from the store, its cache dropped;
  local    -o tier=: sync commit; flush throughput (commit returned ->
           every rank's .status `location shared`) against store write;
           restart from the tier: a checkpoint whose flush is held back
           (flush_rate=64K), the world remounted, each rank reads its own
           bytes;
  partner  -o tier_level=partner: the same, and the restart after node
           loss: node 2 killed before the flush, a world on the 2
           survivors reads every rank's bytes (node 2's from the partner
           copies on node 0);
  shared   a commit `sync level=shared` (written to BACKING_DIR
           directly, as without the tier: returns once published there).
The sync commit is also given against the one without the tier (speedup,
goal >= 10x), against the tier write (goal <= 1.3x) and, for partner,
against the net copy. Each level's world makes a small first commit
before the timed one.
"""
import argparse
import json
import re
import os
import shutil
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
from ckpttest import netns, slowstore, util as cu  # noqa: E402
from ckpttest.networld import NetWorld  # noqa: E402
from ckpttest.world import read_all, status, write_file  # noqa: E402

MiB = 1 << 20
HOLD = "flush_rate=64K"  # a flush held back: the checkpoint stays in the tier


def parse_size(s):
    units = {"K": 1 << 10, "M": MiB, "G": 1 << 30}
    return int(float(s[:-1]) * units[s[-1].upper()]) if s[-1].upper() in units else int(s)


def log(msg):
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def parallel(fns):
    """Run every fn at once (threads); seconds until the last returned."""
    errs = []

    def wrap(f):
        try:
            f()
        except BaseException as e:  # noqa: B902 - reported below
            errs.append(e)

    ts = [threading.Thread(target=wrap, args=(f,)) for f in fns]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]
    return time.monotonic() - t0


def write_sync(path, data):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        for off in range(0, len(data), 8 * MiB):
            os.write(fd, view[off:off + 8 * MiB])
        os.fsync(fd)
    finally:
        os.close(fd)


class NotBuilt(Exception):
    """The binary refuses this level."""


class Bench:
    """The cluster and the store, and a NetWorld's `case` (cluster, root,
    dir)."""

    def __init__(self, args):
        self.args = args
        self.per = args.per_rank
        self.slots = args.slots
        self.n = sum(self.slots)
        self.rank_node = [i for i, s in enumerate(self.slots) for _ in range(s)]
        self.dir = f"/tmp/ckptfs-tierbench-{os.getpid()}"
        self.root = os.path.join(self.dir, "mnt")
        self.tier = os.path.join(self.dir, "tier")
        self.store = slowstore.SlowStore(self.dir + "-store", write_bps=args.store_bps,
                                         read_bps=args.store_bps)
        self.cluster = None
        self.worlds = 0
        self.data = [os.urandom(self.per) for _ in range(self.n)]

    def __enter__(self):
        os.makedirs(self.dir)
        self.store.start()
        self.backing = os.path.join(self.store.path, "backing")
        self.cluster = netns.Cluster(len(self.slots), self.dir,
                                     private_dirs=[self.root, self.tier], private_size="4g")
        self.cluster.start()
        return self

    def __exit__(self, *exc):
        try:
            if self.cluster:
                self.cluster.destroy()
        finally:
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            shutil.rmtree(self.dir + "-store", ignore_errors=True)

    # ---- worlds
    def mount(self, slots, opts):
        self.worlds += 1
        w = NetWorld(self, slots, f"commit_timeout=300{opts}", self.backing,
                     f"world{self.worlds}")
        r = w.mount()
        if r.returncode != 0:
            text = r.stderr + w.log_text()
            why = [ln for ln in text.splitlines() if "not built yet" in ln or "tier_level" in ln]
            if why:
                raise NotBuilt(re.sub(r"^ckptfs: tier=\S+: ", "", why[0].strip()))
            raise RuntimeError(f"ckpt-mount failed:\n{r.stderr}\n{w.log_text()[-3000:]}")
        return w

    def tier_opts(self, level, extra=""):
        if level == "none":
            return ""
        o = f",tier={self.tier}"
        if level == "partner":
            o += ",tier_level=partner"
        return o + (f",{extra}" if extra else "")

    def umount(self, w):
        r = w.umount("--discard")
        if r.returncode != 0:
            log(f"  ckpt-umount: exit {r.returncode}: {r.stderr.strip()[-500:]}")

    def stage(self, w, name):
        for r in range(w.n):
            ck = os.path.join(w.mnt(r), name)
            os.mkdir(ck)
            write_file(os.path.join(ck, f"rank{r}.bin"), self.data[r])

    def warm_up(self, w, name):
        """A first small commit: the ranks' connections are up before the
        timed one (as for a training run's later checkpoints)."""
        for r in range(w.n):
            ck = os.path.join(w.mnt(r), name)
            os.mkdir(ck)
            write_file(os.path.join(ck, f"rank{r}"), b"x")
        self.commit(w, name)

    def commit(self, w, name, word="sync"):
        """Every rank commits at once: seconds until the last returned."""
        def one(r):
            return lambda: cu.commit(os.path.join(w.mnt(r), name), word)
        return parallel([one(r) for r in range(w.n)])

    def wait_shared(self, w, name, timeout=900):
        deadline = time.monotonic() + timeout
        while True:
            st = [status(os.path.join(w.mnt(r), name)) for r in range(w.n)]
            if all("location shared" in s for s in st):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not flushed in {timeout}s: {st}")
            time.sleep(0.05)

    def read_back(self, w, name, which):
        """which: {rank: [ranks whose bytes it reads]}; checked; seconds."""
        def one(r, k):
            def f():
                got = read_all(os.path.join(w.mnt(r), name, f"rank{k}.bin"))
                if got != self.data[k]:
                    raise RuntimeError(f"rank {r}: rank{k}.bin differs")
            return f
        return parallel([one(r, k) for r, ks in which.items() for k in ks])

    # ---- limits
    def limits(self):
        c = self.cluster
        paths = [os.path.join(c.path(self.rank_node[r], self.tier), f".limit-{r}")
                 for r in range(self.n)]
        tw = parallel([lambda p=p, r=r: write_sync(p, self.data[r]) for r, p in enumerate(paths)])
        tr = parallel([lambda p=p: read_all(p) for p in paths])
        for p in paths:
            os.unlink(p)
        _, store_bps, _ = self.store.slowdown(c.path(0, self.tier))
        spaths = [os.path.join(self.store.path, f".limit-{r}") for r in range(self.n)]
        self.store.limit(0, 0)
        for r, p in enumerate(spaths):
            write_file(p, self.data[r])
        self.store.limit()
        self.store.drop_cache()
        sr = parallel([lambda p=p: read_all(p) for p in spaths])
        for p in spaths:
            os.unlink(p)
        L = {"tier_write": tw, "tier_read": tr, "store_write_bps": store_bps, "store_read": sr}
        if len(self.slots) > 1:
            pairs = [(i, (i + 1) % len(self.slots)) for i in self.rank_node]
            L["net_copy"] = netns.tcp_copy_time(c, pairs, self.per, self.tier)
        return L

    # ---- levels
    def level(self, level, k):
        """One level's figures (seconds, bytes/s), or {"not_built": why}."""
        R = {}
        name = f"{level}-{k}"
        opts = self.tier_opts(level)
        try:
            w = self.mount(self.slots, opts)
        except NotBuilt as e:
            return {"not_built": str(e)}
        try:
            self.warm_up(w, f"warm-{name}")
            self.stage(w, name)
            if level == "shared":
                try:
                    R["commit"] = self.commit(w, name, "sync level=shared")
                except OSError as e:
                    return {"not_built": f"commit word level=shared: {e}"}
                return R
            R["commit"] = self.commit(w, name)
            if level != "none":
                t0 = time.monotonic()
                self.wait_shared(w, name)
                R["flush_bps"] = self.n * self.per / (time.monotonic() - t0)
        finally:
            self.umount(w)
        if level == "none":
            self.store.drop_cache()
            w = self.mount(self.slots, "")
            try:
                R["restart"] = self.read_back(w, name, {r: [r] for r in range(self.n)})
            finally:
                self.umount(w)
            return R
        R["restart"] = self.restart_from_tier(level, k)
        return R

    def restart_from_tier(self, level, k):
        """A checkpoint whose flush is held back; the world remounted; each
        rank reads its own bytes (from its node's tier)."""
        name = f"{level}-held-{k}"
        w = self.mount(self.slots, self.tier_opts(level, HOLD))
        try:
            self.stage(w, name)
            self.commit(w, name)
        finally:
            self.umount(w)
        w = self.mount(self.slots, self.tier_opts(level, HOLD))
        try:
            took = self.read_back(w, name, {r: [r] for r in range(self.n)})
        finally:
            self.umount(w)
        # flushed now, at the store's rate: its flush would otherwise share
        # the store with the next level's and halve that level's figures
        w = self.mount(self.slots, self.tier_opts(level))
        try:
            self.wait_shared(w, name)
        finally:
            self.umount(w)
        return took

    def node_loss(self):
        """Partner level: node (last) killed before the flush; a world on the
        survivors reads every rank's bytes. Ends the cluster's use."""
        lost = len(self.slots) - 1
        name = "partner-loss"
        w = self.mount(self.slots, self.tier_opts("partner", HOLD))
        self.stage(w, name)
        self.commit(w, name)
        self.cluster.kill_node(lost)
        self.umount(w)
        survivors = self.slots[:lost] + [0]
        s = self.mount(survivors, self.tier_opts("partner", HOLD))
        gone = [r for r in range(self.n) if self.rank_node[r] == lost]
        which = {r: [r] for r in range(sum(survivors))}
        for i, r in enumerate(gone):     # node 0 holds the lost node's copies
            which.setdefault(i % self.slots[0], []).append(r)
        try:
            return self.read_back(s, name, which), sum(len(v) for v in which.values())
        finally:
            self.umount(s)


def table(args, L, rows):
    """Markdown: per level, each figure and its ratio against its limit."""
    n, per = sum(args.slots), args.per_rank
    total = n * per
    out = [f"{len(args.slots)} nodes x {args.slots[0]} ranks, {per >> 20} MiB a rank "
           f"({total >> 20} MiB); tier: tmpfs; store: {args.store_bps / MiB:g} MiB/s "
           f"(measured {L['store_write_bps'] / MiB:.1f} MiB/s writes)",
           "",
           "| level | figure | seconds | limit | ratio | goal |",
           "| --- | --- | --- | --- | --- | --- |"]
    none = rows.get("none", {}).get("commit")
    at_store = total / L["store_write_bps"]
    for level, R in rows.items():
        if "not_built" in R:
            out.append(f"| {level} | not built: {R['not_built']} | | | | |")
            continue
        c = R["commit"]
        if level == "none":
            out.append(f"| none | sync commit (stall) | {c:.3f} | bytes at store write "
                       f"{total / L['store_write_bps']:.3f} | "
                       f"{c / (total / L['store_write_bps']):.2f}x | |")
        elif level == "shared":  # waits for the store by definition
            out.append(f"| {level} | sync commit (stall) | {c:.3f} | bytes at store write "
                       f"{at_store:.3f} | {c / at_store:.2f}x | ~1x |")
            if none:
                out.append(f"| {level} | vs no tier | {c:.3f} | no tier {none:.3f} | "
                           f"{c / none:.2f}x | ~1x |")
        else:
            out.append(f"| {level} | sync commit (stall) | {c:.3f} | tier write "
                       f"{L['tier_write']:.3f} | {c / L['tier_write']:.2f}x | <= 1.3x |")
            if level == "partner" and "net_copy" in L:
                out.append(f"| {level} | sync commit (stall) | {c:.3f} | net copy "
                           f"{L['net_copy']:.3f} | {c / L['net_copy']:.2f}x | |")
            if none:
                out.append(f"| {level} | speedup vs no tier | {c:.3f} | no tier {none:.3f} | "
                           f"{none / c:.1f}x | >= 10x |")
        if "flush_bps" in R:
            out.append(f"| {level} | flush MiB/s | {R['flush_bps'] / MiB:.1f} | store write "
                       f"{L['store_write_bps'] / MiB:.1f} | "
                       f"{R['flush_bps'] / L['store_write_bps']:.2f}x | ~1x |")
        if "restart" in R:
            lim, what = ((L["store_read"], "store read, cache dropped") if level == "none"
                         else (L["tier_read"], "tier read"))
            src = "shared store, cache dropped" if level == "none" else "tier"
            out.append(f"| {level} | restart from the {src} | {R['restart']:.3f} | {what} "
                       f"{lim:.3f} | {R['restart'] / lim:.2f}x | |")
        if "loss" in R:
            t, files = R["loss"]
            lim = L["tier_read"] * files / n
            out.append(f"| {level} | restart after node loss ({files} files, partner copies) | "
                       f"{t:.3f} | tier read, scaled {lim:.3f} | {t / lim:.2f}x | |")
    return "\n".join(out)


def median_rows(runs):
    out = {}
    for level in runs[0]:
        rs = [r[level] for r in runs]
        if any("not_built" in r for r in rs):
            out[level] = next(r for r in rs if "not_built" in r)
            continue
        out[level] = {}
        for key in rs[0]:
            vals = [r[key] for r in rs if key in r]
            out[level][key] = (vals[0] if key == "loss" else statistics.median(vals))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default="build/bin/ckptfs")
    ap.add_argument("--per-rank", default="32M", type=parse_size, help="bytes each rank stages")
    ap.add_argument("--slots", default="2,2,2", type=lambda s: [int(x) for x in s.split(",")],
                    help="ranks per node (3+ nodes for the node loss)")
    ap.add_argument("--store-bps", default="25M", type=parse_size,
                    help="the shared store's write and read limit, bytes/s")
    ap.add_argument("--levels", default="none,local,partner,shared")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (medians)")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args(argv)
    cu.BIN = os.path.abspath(args.bin)
    levels = args.levels.split(",")
    try:
        with Bench(args) as b:
            Ls, runs = [], []
            for k in range(args.rounds):
                Ls.append(b.limits())
                rows = {}
                for level in levels:
                    log(f"round {k}: {level}")
                    rows[level] = b.level(level, k)
                    log(f"  {rows[level]}")
                runs.append(rows)
            rows = median_rows(runs)
            if "partner" in levels and "not_built" not in rows["partner"]:
                log("node loss (partner)")
                rows["partner"]["loss"] = b.node_loss()
    except (slowstore.Unavailable, netns.Unavailable) as e:
        sys.exit(f"cannot run here: {e}")
    L = {key: statistics.median(x[key] for x in Ls) for key in Ls[0]}
    print(table(args, L, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"limits": Ls, "runs": runs, "rows": rows,
                       "args": {"per_rank": args.per_rank, "slots": args.slots,
                                "store_bps": args.store_bps}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
