#!/usr/bin/env python3
"""Issue 38: every writer at the speed of a plain directory.

    python3 bench/writers.py --bin build/bin/ckptfs [--dir /var/tmp/ckwriters] [--rounds 5]
        [--size 1G] [--writers safetensors,hf,h5py,torch,numpy,tensorstore]
        [--settle 1.0] [--quiet-wait 30] [--opts K=V] [--json out.json]

One row per writer, each saving with its own library call, unchanged:

  safetensors  safetensors.torch.save_file, 16 float32 tensors, SIZE, one file
  hf           transformers save_pretrained of a random-weight GPT-2 (config
               built here, no download), about SIZE x 9/16 (600 MB at 1G) in
               4 shards (max_shard_size), plus config.json and the index
  h5py         h5py.File(..., "w"), 8 contiguous float64 datasets, SIZE / 2
  torch        torch.save of the same 16 tensors as safetensors, one file
  numpy        np.save of 16 float32 arrays, SIZE, one .npy file each
  tensorstore  tensorstore zarr driver on a file kvstore, one float32 array
               of SIZE / 2 in 4 MiB chunks, uncompressed (128 chunk files at
               1G; the kvstore writes each to a lock file, fsyncs, renames)

The data is generated once per writer and saved once into DIR/plain
(untimed: imports, the tool's lazy set-up); every round saves it again.
For each writer a fresh ckptfs daemon mounts DIR/backing with default
options (one rank, world size 1), then rounds alternate in ABBA order
(mount, plain, plain, mount, ...: the second of a pair finds the pages the
first freed, which on a VM reporting free memory to its host fill faster
than older free memory), each after an untimed `sync`:

  mount  mkdir NAME in the mount, the tool writes its file(s) into NAME
         (plain bytes files, no xattrs), then one write(2) of "sync\\n" to
         NAME/.commit; timed from the mkdir until that write returns (the
         checkpoint committed: data durable and published). Then .status
         must read "committed", and the checkpoint is removed through the
         mount (shutil.rmtree, untimed).
  plain  mkdir DIR/plain/NAME, the same tool call into it, then syncfs(2)
         on a descriptor of DIR/plain; timed from the mkdir until syncfs
         returns. Then rmtree (untimed).

DIR/backing and DIR/plain must be on one filesystem (checked). Reported:
median [min-max] seconds of each, the ratio of the medians (mount / plain)
and whether it is within 1.2x; the daemon's resident memory relative to
the idle daemon's (its VmRSS once mounted, before the first round): the
peak (VmHWM, reset before each round through /proc/PID/clear_refs, so it
is the round's own peak; the max over rounds is shown) and the resident
memory after the commit and --settle seconds (max over rounds). The detail
line of each round also splits the time at the end of the tool's call
(write, then commit or syncfs) and gives the daemon's CPU seconds (utime +
stime); --json has all of it and the tail of the daemon's log.
Before each pair of rounds it waits up to --quiet-wait seconds for the
CPUs to be < 15% busy (other jobs skew the figures; a round that started
busy says so).
Run as root (FUSE passthrough, clear_refs). Re-runs itself under the
project's .venv python when torch is missing.
"""
import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MiB, GiB = 1 << 20, 1 << 30
GOAL = 1.2


def in_venv():
    """Re-run under the project venv (torch, safetensors, ...) if torch is missing."""
    try:
        import torch  # noqa: F401
        return
    except ImportError:
        pass
    for py in (os.path.join(REPO, ".venv", "bin", "python"), "/work/main/.venv/bin/python"):
        if os.access(py, os.X_OK) and not os.environ.get("CKPTFS_WRITERS_VENV"):
            print(f"writers: re-running under {py} (torch missing here)", file=sys.stderr)
            os.environ["CKPTFS_WRITERS_VENV"] = "1"
            os.execv(py, [py, os.path.abspath(__file__)] + sys.argv[1:])
    sys.exit("writers: torch is missing and no .venv found")


def parse_size(s):
    mult = {"K": 1 << 10, "M": MiB, "G": GiB}
    s = s.strip()
    return int(float(s[:-1]) * mult[s[-1].upper()]) if s[-1].upper() in mult else int(s)


def fmt_size(n):
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


# ---------------------------------------------------------------------------
# The writers: prepare(size) -> (state, bytes), write(state, dirpath).
# ---------------------------------------------------------------------------

def _normal(n_elems, seed, dtype="float32"):
    import numpy as np
    return np.random.default_rng(seed).standard_normal(n_elems, dtype=dtype)


def prep_tensors(size):
    """16 float32 tensors of size/16 bytes each (torch views of numpy)."""
    import torch
    per = size // 16 // 4
    arr = _normal(per * 16, 1)
    sd = {f"layer.{i}.weight": torch.from_numpy(arr[i * per:(i + 1) * per]) for i in range(16)}
    return sd, per * 16 * 4


def prep_arrays(size):
    per = size // 16 // 4
    arr = _normal(per * 16, 1)
    return [arr[i * per:(i + 1) * per] for i in range(16)], per * 16 * 4


def write_safetensors(sd, d):
    from safetensors.torch import save_file
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})


def write_torch(sd, d):
    import torch
    torch.save(sd, os.path.join(d, "model.pt"))


def write_numpy(arrays, d):
    import numpy as np
    for i, a in enumerate(arrays):
        np.save(os.path.join(d, f"layer{i}.npy"), a)


def prep_hf(size):
    """A random-weight GPT-2 of about size x 9/16 bytes (float32)."""
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    target = size * 9 // 16
    d, vocab, ctx = (768, 32000, 1024) if target > 256 * MiB else (256, 8192, 512)
    per_layer = 4 * (12 * d * d + 13 * d)
    layers = max(1, round((target - 4 * (vocab + ctx + 2) * d) / per_layer))
    cfg = GPT2Config(n_embd=d, n_layer=layers, n_head=d // 64, vocab_size=vocab,
                     n_positions=ctx, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(2)
    model = GPT2LMHeadModel(cfg).eval()
    seen, total = set(), 0
    for t in model.state_dict().values():       # tied lm_head counted once
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return (model, total // 4 + MiB), total


def write_hf(state, d):
    model, shard = state
    model.save_pretrained(d, max_shard_size=shard)


def prep_h5py(size):
    per = size // 2 // 8 // 8
    arr = _normal(per * 8, 3, "float64")
    return [arr[i * per:(i + 1) * per] for i in range(8)], per * 8 * 8


def write_h5py(arrays, d):
    import h5py
    with h5py.File(os.path.join(d, "weights.h5"), "w") as f:    # O_RDWR|O_CREAT|O_TRUNC
        for i, a in enumerate(arrays):
            f.create_dataset(f"w{i}", data=a)                   # contiguous layout


def prep_tensorstore(size):
    cols = 1024
    rows = max(1024, size // 2 // 4 // cols // 1024 * 1024)
    return _normal(rows * cols, 4).reshape(rows, cols), rows * cols * 4


def write_tensorstore(arr, d):
    import tensorstore as ts
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": os.path.join(d, "array.zarr")},
            "metadata": {"dtype": "<f4", "shape": list(arr.shape), "chunks": [1024, 1024],
                         "compressor": None}}
    ts.open(spec, create=True, delete_existing=True).result().write(arr).result()


WRITERS = {
    "safetensors": (prep_tensors, write_safetensors),
    "hf": (prep_hf, write_hf),
    "h5py": (prep_h5py, write_h5py),
    "torch": (prep_tensors, write_torch),
    "numpy": (prep_arrays, write_numpy),
    "tensorstore": (prep_tensorstore, write_tensorstore),
}


# ---------------------------------------------------------------------------
# The daemon and the system.
# ---------------------------------------------------------------------------

def mounted(path):
    path = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def syncfs(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), f"syncfs {path}")
    finally:
        os.close(fd)


def cpu_busy(dt=0.5):
    """Fraction of all CPUs busy over dt seconds (/proc/stat)."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return sum(v), v[3] + v[4]
    t1, i1 = snap()
    time.sleep(dt)
    t2, i2 = snap()
    return 1 - (i2 - i1) / max(1, t2 - t1)


def wait_quiet(limit):
    """Wait up to limit seconds for the CPUs to be < 15% busy (other jobs
    skew the figures); the last busy fraction seen."""
    deadline = time.time() + limit
    busy = cpu_busy()
    while busy >= 0.15 and time.time() < deadline:
        busy = cpu_busy()
    return busy


def fs_type(path):
    path, best, typ = os.path.realpath(path), "", "?"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            p = line.split()
            if (path == p[4] or path.startswith(p[4].rstrip("/") + "/")) and len(p[4]) >= len(best):
                best, typ = p[4], p[p.index("-") + 1]
    return typ


class Daemon:
    """One ckptfs daemon, one rank, in the foreground (-f), default options."""

    def __init__(self, binpath, backing, opts):
        self.mnt = tempfile.mkdtemp(prefix="ckwriters-mnt-")
        self.logpath = self.mnt + ".log"
        self.log = open(self.logpath, "w")
        cmd = [binpath, "-f"] + (["-o", opts] if opts else []) + [backing, self.mnt]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + 60
        while not mounted(self.mnt):
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                sys.exit("ckptfs did not mount: " + open(self.logpath).read()[-2000:])
            time.sleep(0.05)

    def status(self, key):
        """A /proc/PID/status value in bytes (VmRSS, VmHWM)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        return None

    def reset_peak(self):
        """VmHWM := VmRSS (Linux >= 4.0); False where that is refused."""
        try:
            with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def cpu(self):
        with open(f"/proc/{self.proc.pid}/stat") as f:
            st = f.read().rsplit(")", 1)[1].split()
        return (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self):
        if mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", self.mnt], capture_output=True)
        try:
            rc = self.proc.wait(120)
        except subprocess.TimeoutExpired:
            subprocess.run(["fusermount3", "-uz", self.mnt], capture_output=True)
            self.proc.kill()
            rc = self.proc.wait()
        self.log.close()
        os.rmdir(self.mnt)
        return rc


# ---------------------------------------------------------------------------
# Rounds.
# ---------------------------------------------------------------------------

def commit(ck):
    fd = os.open(os.path.join(ck, ".commit"), os.O_WRONLY)
    try:
        os.write(fd, b"sync\n")       # one write(2): EIO/EEXIST if the save failed
    finally:
        os.close(fd)


def round_mount(daemon, write, state, name, settle):
    """One timed save into the mount, committed; then removed (untimed)."""
    ck = os.path.join(daemon.mnt, name)
    os.sync()
    reset = daemon.reset_peak()
    cpu0 = daemon.cpu()
    t0 = time.perf_counter()
    os.mkdir(ck)
    write(state, ck)
    tw = time.perf_counter() - t0
    commit(ck)
    dt = time.perf_counter() - t0
    with open(os.path.join(ck, ".status")) as f:
        st = f.read()
    if st.split("\n", 1)[0].strip() != "committed":
        raise RuntimeError(f"{name}: .status after the commit: {st!r}")
    cpu = daemon.cpu() - cpu0
    peak = daemon.status("VmHWM") if reset else None
    time.sleep(settle)
    after = daemon.status("VmRSS")
    shutil.rmtree(ck)
    return {"s": dt, "write_s": tw, "peak": peak, "after": after, "daemon_cpu_s": cpu}


def round_plain(plain, write, state, name):
    ck = os.path.join(plain, name)
    os.sync()
    t0 = time.perf_counter()
    os.mkdir(ck)
    write(state, ck)
    tw = time.perf_counter() - t0
    syncfs(plain)
    dt = time.perf_counter() - t0
    shutil.rmtree(ck)
    return {"s": dt, "write_s": tw}


def run_writer(args, wname):
    """All rounds of one writer on a fresh daemon: its result dict."""
    prep, write = WRITERS[wname]
    t = time.perf_counter()
    state, nbytes = prep(args.total)
    print(f"\n{wname}: {fmt_size(nbytes)} of data (prepared in {time.perf_counter() - t:.1f} s)",
          flush=True)
    warm = os.path.join(args.plain, f"{wname}-warmup")    # imports, lazy init: untimed
    os.mkdir(warm)
    write(state, warm)
    shutil.rmtree(warm)
    daemon = Daemon(args.bin, args.backing, args.opts)
    res = {"writer": wname, "bytes": nbytes, "mount": [], "plain": []}
    try:
        time.sleep(args.settle)
        res["idle_rss"] = daemon.status("VmRSS")
        for r in range(args.rounds):
            busy = wait_quiet(args.quiet_wait)
            # ABBA: which goes first alternates, as the second of a pair
            # finds the first's pages just freed (on a VM that reports
            # free pages to its host, older free memory is slower to fill)
            if r % 2 == 0:
                m = round_mount(daemon, write, state, f"{wname}-{r}", args.settle)
                p = round_plain(args.plain, write, state, f"{wname}-{r}")
            else:
                p = round_plain(args.plain, write, state, f"{wname}-{r}")
                m = round_mount(daemon, write, state, f"{wname}-{r}", args.settle)
            m["busy_before"] = round(busy, 2)
            res["mount"].append(m)
            res["plain"].append(p)
            print(f"  round {r}: mount {m['s']:.3f} s (write {m['write_s']:.3f})  plain "
                  f"{p['s']:.3f} s (write {p['write_s']:.3f})  {m['s'] / p['s']:.2f}x  "
                  f"daemon cpu {m['daemon_cpu_s']:.2f} s  "
                  f"peak {mib(m['peak'], res['idle_rss'])}  after {mib(m['after'], res['idle_rss'])}"
                  + (f"  (CPUs {busy:.0%} busy before it)" if busy >= 0.15 else ""),
                  flush=True)
    finally:
        rc = daemon.stop()
    with open(daemon.logpath) as f:
        res["daemon_log"] = f.read()[-4000:]
    if rc:
        print(f"  daemon exited {rc}: see {daemon.logpath}", flush=True)
    else:
        os.unlink(daemon.logpath)
    leftover = os.listdir(args.backing)
    res["backing_after"] = leftover
    return res


def mib(v, idle):
    return "-" if v is None or idle is None else f"{(v - idle) / MiB:+.0f} MiB"


# ---------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------

def summarize(res):
    """Medians, ranges, ratio and memory of one writer's rounds."""
    m = [x["s"] for x in res["mount"]]
    p = [x["s"] for x in res["plain"]]
    idle = res["idle_rss"]
    peaks = [x["peak"] for x in res["mount"] if x["peak"] is not None]
    afters = [x["after"] for x in res["mount"] if x["after"] is not None]
    s = {"mount_median": statistics.median(m), "mount_min": min(m), "mount_max": max(m),
         "plain_median": statistics.median(p), "plain_min": min(p), "plain_max": max(p),
         "idle_rss": idle,
         "peak_over_idle": max(peaks) - idle if peaks and idle else None,
         "after_over_idle": max(afters) - idle if afters and idle else None}
    s["ratio"] = s["mount_median"] / s["plain_median"]
    s["within"] = s["ratio"] <= GOAL
    return s


def table(results):
    rows = ["| writer | size | mount s, median [range] | plain + syncfs s, median [range] "
            "| ratio | within 1.2x? | daemon peak RSS over idle | after-commit RSS over idle |",
            "|---|--:|--:|--:|--:|:-:|--:|--:|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['writer']} | - | {r['error']} | | | | | |")
            continue
        s = r["summary"]
        rows.append(
            f"| {r['writer']} | {fmt_size(r['bytes'])} "
            f"| {s['mount_median']:.3f} [{s['mount_min']:.3f}-{s['mount_max']:.3f}] "
            f"| {s['plain_median']:.3f} [{s['plain_min']:.3f}-{s['plain_max']:.3f}] "
            f"| {s['ratio']:.2f}x | {'yes' if s['within'] else 'no'} "
            f"| {mib_abs(s['peak_over_idle'])} | {mib_abs(s['after_over_idle'])} |")
    return "\n".join(rows)


def mib_abs(v):
    return "-" if v is None else f"{v / MiB:+.0f} MiB"


def header(args):
    def git(*a):
        r = subprocess.run(["git", "-C", REPO] + list(a), capture_output=True, text=True)
        return r.stdout.strip()
    commit_id = git("rev-parse", "--short", "HEAD") + (" (dirty)" if git("status", "--porcelain",
                                                                          "--untracked-files=no") else "")
    return {"commit": commit_id, "fs": fs_type(args.dir), "dir": args.dir,
            "kernel": os.uname().release, "rounds": args.rounds, "size": args.total,
            "opts": args.opts or "(defaults)", "date": time.strftime("%Y-%m-%d %H:%M")}


# ---------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------

def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "bin", "ckptfs"))
    ap.add_argument("--dir", default="/var/tmp/ckwriters",
                    help="holds backing/ (the mount's BACKING_DIR) and plain/ (one filesystem)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", default="1G", help="safetensors' size; the others scale from it")
    ap.add_argument("--writers", default=",".join(WRITERS))
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds after the commit before reading VmRSS (and after mounting)")
    ap.add_argument("--quiet-wait", type=float, default=30,
                    help="seconds to wait before each round for the CPUs to be < 15%% busy")
    ap.add_argument("--opts", default="", help="-o for ckptfs (default: none, defaults)")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.total = parse_size(args.size)
    args.bin = os.path.abspath(args.bin)
    args.dir = os.path.abspath(args.dir)
    bad = [w for w in args.writers.split(",") if w not in WRITERS]
    if bad:
        ap.error(f"unknown writer(s) {bad}; known: {', '.join(WRITERS)}")
    return args


def setup_dirs(args):
    args.backing = os.path.join(args.dir, "backing")
    args.plain = os.path.join(args.dir, "plain")
    for d in (args.backing, args.plain):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    if os.stat(args.backing).st_dev != os.stat(args.plain).st_dev:
        sys.exit(f"{args.backing} and {args.plain} are on different filesystems")


def main(argv=None):
    if argv is not None:       # from bench.py --writers: as if run alone
        sys.argv = [os.path.abspath(__file__)] + list(argv)
    in_venv()
    args = parse_args()
    if not os.access(args.bin, os.X_OK):
        sys.exit(f"no ckptfs binary at {args.bin} (--bin)")
    setup_dirs(args)
    head = header(args)
    print("writers: " + ", ".join(f"{k} {v}" for k, v in head.items()), flush=True)
    results = []
    for w in args.writers.split(","):
        try:
            res = run_writer(args, w)
            res["summary"] = summarize(res)
        except Exception as e:  # noqa: BLE001 - one writer's failure is its row
            res = {"writer": w, "error": f"{type(e).__name__}: {e}"[:200]}
            print(f"  {w}: {res['error']}", flush=True)
        results.append(res)
    for d in (args.backing, args.plain):
        shutil.rmtree(d, ignore_errors=True)
    print(f"\n{head['fs']} ({args.dir}), ckptfs {head['commit']}, {args.rounds} rounds, "
          f"mount = write + sync commit, plain = write + syncfs\n")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "results": results}, f, indent=1)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
