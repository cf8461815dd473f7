#!/usr/bin/env python3
"""A history test with a checker, in the manner of Jepsen's register tests
(issue 36): one truth per checkpoint name, on every mount and every tier.

Four one-rank mounts of ONE BACKING_DIR:

    m0  no tier, -o keep=last:4
    m1  a private tmpfs tier, -o tier=T1,tier_keep=1,keep=last:4
    m2  another private tmpfs tier, -o tier=T2,flush_rate=2M (a slow flush)
    m3  no tier, no options

For CKPT_HISTORY_SECONDS (default 100; the README's test command sets 45) writer threads run random
operations: commits (`sync`/`async`, `replace=NAME`, `solo`, `step=`,
`protect`, now and then `level=shared` on a tier mount) of the registers
ra, rb, rc (every commit a new version, staged under a working name and
published with replace=), plain commits of fresh names k-N (which `keep=`
rotates out), `rm -r NAME`, removal of one entry (`rm NAME/e/x1`); reader
threads read whole files with fresh opens and with handles held across
changes; every ~20 s one mount's daemon is SIGKILLed and restarted on the
same directories. Each version's every file carries its version id
(`ckv:VID:FILE:` repeated), and the version has an entry `vVID`, so that
any read, and the BACKING_DIR monitor (a thread reading
BACKING_DIR/NAME/.metadata every ~25 ms), names exactly the version it saw.
A log thread timestamps the daemons' log lines.

Everything is recorded (time.monotonic() at invocation and completion,
the operation, its result), and check_history() then judges the history
by the rules of issue 36, each failing the test:

  STALE      a read of V (a file of it) when V could not have been NAME's on
             that mount at any moment in [invocation - WINDOW, completion]:
             V left BACKING_DIR's NAME (the monitor saw it there, or its
             sync commit returned, and later saw it gone), or a commit of
             NAME invoked after V's commit had returned was in BACKING_DIR
             (its sync commit returned, or the monitor saw it), or the same
             mount had committed such a later version; or V's entry was
             removed (the monitor saw V without it); or V's commit failed,
             or V is another name's.
  UNDONE     a read of V that BACKING_DIR itself held again at the time,
             though V was no longer NAME's by the rule above (the reads
             that an ORDER violation makes every mount serve).
  ORDER      BACKING_DIR's NAME went from V to U (no removal in between)
             although U's commit had returned before V's was invoked: a
             later commit undone (issue 36, case 1).
  LOST       a committed version (sync returned 0, async seen committed)
             left NAME with no operation that could explain it (a later or
             concurrent commit of NAME, an rm -r, a keep= line of the log)
             and no log or .status line naming NAME with supersed/lost/
             flush failed/not published (or its save ID).
  ENOENT     a fresh open of NAME/F failed with ENOENT although the monitor
             saw NAME with F throughout [invocation - WINDOW, completion]
             (samples at most SAMPLE_GAP apart) and no removal of NAME or F
             (any outcome) came near it: a replace never makes a name
             vanish for a new open.
  HELD       a handle held open read another version's bytes (a held handle
             reads the version it opened, or zeros/an error once removed).
  CORRUPT    a read's bytes are no version's file exactly.
  ZEROS      a fresh open read only zeros (a hole: no version's bytes).
  LEFTOVER   after everything settled (flush records drained, WINDOW x 2
             of quiet): entries in BACKING_DIR/.saves or .staging, a NAME
             without .metadata, flush records, .saves or .staging entries in
             a tier, a tier copy of a name BACKING_DIR does not hold with the
             same save ID.

Reads while a mount's daemon was being killed or restarted are left out
(each mount has an epoch). The seed is printed; CKPT_HISTORY_SEED=N
repeats the run's random choices (the threads' interleaving is the
machine's). A summary line ends the run: operations, reads checked,
versions committed, kills, violations by kind; on failure the first few
violations in full.

    python3 tests/integration/test_history.py --bin build/bin/ckptfs
    CKPT_HISTORY_SECONDS=1800 CKPT_HISTORY_SEED=7 python3 tests/integration/test_history.py ...

Needs root (the tiers are tmpfs mounts in the test's directory).
Python standard library only.
"""

import errno
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from bisect import bisect_left, bisect_right
from operator import itemgetter

from ckpttest.util import CkptfsTestCase, main, write_file, write_tensor

# A change made through any mount is seen by every other within about a
# second (SPEC, docs/committed.md): what the checker allows a mount to lag.
WINDOW = 2.0
# Monitor samples further apart than this do not count as "seen throughout".
SAMPLE_GAP = 0.3
SECONDS = float(os.environ.get("CKPT_HISTORY_SECONDS", "100"))
KILL_EVERY = (14.0, 24.0)   # seconds between two kills, drawn
REGISTERS = ("ra", "rb", "rc")
FILES = ("w", "tag", "e/x1", "e/x2")
ENTRIES = ("e/x1", "e/x2")    # what removals of one entry take
KB = 1024
WRITERS, READERS = 3, 3
MAX_HELD = 6
SHOW = 6                      # violations described in full on failure

# errors a commit or removal gets because its daemon was killed: the
# outcome is unknown
KILLED = {errno.ENOTCONN, errno.ECONNABORTED, errno.ENODEV, errno.EINTR}


# ---- what a version holds --------------------------------------------------

def content(vid, f, size):
    """The bytes of file f of version vid: its header repeated."""
    head = b"ckv:%08d:%s:" % (vid, f.encode())
    block = head + bytes(range(32, 127)) + b"\n"
    return (block * (size // len(block) + 1))[:size]


def file_size(v, f):
    return v["size"] if f == "w" else 200


HEAD = re.compile(rb"ckv:(\d{8}):([^:]*):")


def classify(data, f, versions):
    """('ok', vid) | ('zeros',) | ('corrupt', why) for bytes read of file f."""
    if not data.strip(b"\0"):
        return ("zeros",)
    m = HEAD.match(data)
    if not m:
        return ("corrupt", f"no version header ({len(data)} bytes: {data[:40]!r})")
    vid = int(m.group(1))
    v = versions.get(vid)
    if v is None:
        return ("corrupt", f"version {vid} never written")
    if m.group(2).decode(errors="replace") != f:
        return ("corrupt", f"file {m.group(2)!r} of version {vid} read as {f}")
    want = content(vid, f, file_size(v, f))
    if data != want:
        return ("corrupt", f"version {vid}'s {f}: {len(data)} bytes, not its "
                           f"{len(want)} (first difference at "
                           f"{next((i for i, (a, b) in enumerate(zip(data, want)) if a != b), min(len(data), len(want)))})")
    return ("ok", vid)


def close_quietly(fd):
    try:
        os.close(fd)
    except OSError:   # its daemon was killed
        pass


def same_or_zeros(data, want):
    """A held handle's bytes: the version it opened, where not punched out."""
    if len(data) > len(want):
        return False
    for i in range(0, len(data), 4096):
        a = data[i:i + 4096]
        if a != want[i:i + 4096] and a.strip(b"\0"):
            return False
    return True


# ---- BACKING_DIR, as it is -------------------------------------------------

def read_meta(d):
    """State of checkpoint directory d: None (absent, no .metadata),
    (vid or None, frozenset of paths, save_id), or 'err'."""
    meta = os.path.join(d, ".metadata")
    if not os.path.exists(meta):
        return None
    try:
        db = sqlite3.connect(f"file:{meta}?mode=ro&immutable=1", uri=True, timeout=1)
        try:
            paths = {r[0] for r in db.execute("select path from blobs")}
            paths |= {r[0] for r in db.execute("select path from tensors")}
            sid = db.execute("select value from checkpoint where key='save_id'").fetchone()
        finally:
            db.close()
    except (sqlite3.Error, OSError):
        return None if not os.path.exists(meta) else "err"
    vid = None
    for p in paths:
        if re.fullmatch(r"v\d{8}", p):
            vid = int(p[1:])
    return (vid, frozenset(paths), sid[0] if sid else None)


def save_id_of(d):
    st = read_meta(d)
    return st[2] if isinstance(st, tuple) else None


def tier_leftovers(tier, backing):
    """What a tier holds that it should not once everything settled."""
    out = []
    for sub in (".flush", ".saves", ".staging"):
        p = os.path.join(tier, sub)
        if os.path.isdir(p):
            left = sorted(n for n in os.listdir(p) if not n.startswith("."))
            if left:
                out.append(f"{p}: {left[:8]}{' ...' if len(left) > 8 else ''}")
            if sub == ".flush":
                for n in left[:4]:   # what each record is of
                    try:
                        with open(os.path.join(p, n), "rb") as f:
                            out.append(f"  record {n}: {f.read(300)!r}")
                    except OSError:
                        pass
    for n in sorted(os.listdir(tier)):
        if n.startswith(".") or n == "lost+found":
            continue
        mine, theirs = save_id_of(os.path.join(tier, n)), save_id_of(os.path.join(backing, n))
        if mine is None:
            out.append(f"{tier}/{n}: no .metadata in the tier")
        elif theirs is None:
            out.append(f"{tier}/{n}: a tier copy (save {mine}) of a name BACKING_DIR does "
                       f"not hold")
        elif theirs != mine:
            out.append(f"{tier}/{n}: a tier copy of save {mine}, BACKING_DIR's {n} is "
                       f"save {theirs}")
    return out


def backing_leftovers(backing):
    out = []
    for sub in (".saves", ".staging"):
        p = os.path.join(backing, sub)
        if os.path.isdir(p):
            left = sorted(os.listdir(p))
            if left:
                out.append(f"{p}: {left[:8]}{' ...' if len(left) > 8 else ''}")
    for n in sorted(os.listdir(backing)):
        if not n.startswith(".") and not os.path.exists(os.path.join(backing, n, ".metadata")):
            out.append(f"{backing}/{n}: no .metadata (an unfinished save)")
    return out


# ---- the checker -------------------------------------------------------------

INF = float("inf")
# what a name is made of: it is one of these in a text that names it
TOKEN = re.compile(r"[\w.-]+")
LOSS_WORDS = re.compile(r"supersed|lost|not published|flush failed")


class History:
    """What the run recorded (filled by the test's threads, read by the
    checker): versions {vid: dict}, ops [dict], monitor samples
    {name: [(inv, comp, state)]}, log lines [(seen, line)], mounts
    {mount: {"tier": bool}}, kills [(mount, t0, t1)]."""

    def __init__(self):
        self.lock = threading.Lock()
        self.versions, self.ops, self.samples = {}, [], {}
        self.log, self.mounts, self.kills = [], {}, []
        self.reports = []   # .status texts read at the end
        self.leftovers = []  # what was left once everything settled

    def op(self, **kw):
        with self.lock:
            self.ops.append(kw)


def _fmt(t, t0):
    return f"{t - t0:.3f}" if t not in (None, INF) else str(t)


def check_history(h, window=WINDOW, gap=SAMPLE_GAP):
    """The violations of history h: [(kind, text)], and counts.

    Indexed so that a long history is checked in about n log n: each
    name's monitor samples are in time order (one monitor thread appends
    them, inv and comp both nondecreasing: checked here), so the samples
    of a time range are found by bisection; a version's sightings are kept
    as runs of its name's samples; commits, removals and keep= lines are
    sorted per name with prefix/suffix extrema for "any later/earlier ...".
    Same violations, in the same order, as the plain scans it replaces."""
    vs, t0 = h.versions, min([o["inv"] for o in h.ops] or [0])
    viol = []
    T = lambda t: _fmt(t, t0)
    samples = h.samples
    inv_of, comp_of = itemgetter(0), itemgetter(1)

    # sightings of each version in BACKING_DIR, as runs of samples: vid ->
    # [(name, lo, hi)], samples[name][lo:hi] all showing vid (in the order
    # of samples' names, then time)
    seen = {}
    for name, ss in samples.items():
        prev, lo = None, 0
        p_inv = p_comp = -INF
        for i, (inv, comp, st) in enumerate(ss):
            if inv < p_inv or comp < p_comp:
                raise AssertionError(f"monitor samples of {name} out of time order at {i}")
            p_inv, p_comp = inv, comp
            vid = st[0] if isinstance(st, tuple) else None
            if vid != prev:
                if prev is not None:
                    seen.setdefault(prev, []).append((name, lo, i))
                prev, lo = vid, i
        if prev is not None:
            seen.setdefault(prev, []).append((name, lo, len(ss)))

    def name_re(name):
        return re.compile(r"(?<![\w.-])" + re.escape(name) + r"(?![\w.-])")

    def first_sight(vid):
        n, lo, _ = seen[vid][0]
        return samples[n][lo]

    def last_sight(vid):
        n, _, hi = seen[vid][-1]
        return samples[n][hi - 1]

    def next_change(ss, t, vid=None):
        """The first of ss invoked after t that is not 'err' (nor shows vid)."""
        i = bisect_right(ss, t, key=inv_of)
        while i < len(ss):
            st = ss[i][2]
            if st != "err" and not (vid is not None and isinstance(st, tuple) and st[0] == vid):
                return ss[i]
            i += 1
        return None

    def committed(v):
        return v.get("outcome") == "ok"

    def in_s_evidence(v):
        """Earliest time V is known to have been BACKING_DIR's NAME."""
        e = INF
        if committed(v) and not h.mounts[v["mount"]]["tier"]:
            e = v["c_comp"]
        if v["vid"] in seen:
            e = min(e, first_sight(v["vid"])[1])
        return e

    ev = {vid: in_s_evidence(v) for vid, v in vs.items()}

    by_name = {}
    for v in vs.values():
        by_name.setdefault(v["name"], []).append(v)

    def by_c_inv(us, keep):
        """[(c_inv, k, u)] of the u of us that keep takes, by c_inv (k: u's
        place in us, which breaks ties)."""
        return sorted(((u["c_inv"], k, u) for k, u in enumerate(us) if keep(u)),
                      key=itemgetter(0, 1))

    def suffix_min(cs, val):
        """suf[j] = the least (val(u), k) of cs[j:] ((INF, -1) if none)."""
        suf = [(INF, -1)] * (len(cs) + 1)
        for j in range(len(cs) - 1, -1, -1):
            c = (val(cs[j][2]), cs[j][1])
            suf[j] = c if c < suf[j + 1] else suf[j + 1]
        return suf

    # per name, its commits by c_inv, and the least ev of those invoked after
    # a time (the first of them, in by_name's order, on a tie)
    later = {}
    for name, us in by_name.items():
        cs = by_c_inv(us, lambda u: u["c_inv"] is not None)
        later[name] = ([c[0] for c in cs], suffix_min(cs, lambda u: ev[u["vid"]]), cs)

    s_end, s_end_why = {}, {}
    for vid, v in vs.items():
        end, why = INF, ""
        e = ev[vid]
        if e < INF:
            s = next_change(samples.get(v["name"], []), e, vid)
            if s is not None:
                inv, comp, st = s
                if comp < end:
                    what = "absent" if st is None else f"version {st[0]}"
                    end, why = comp, f"the monitor saw {v['name']} {what} at {T(comp)}"
        if v.get("c_comp") is not None and v.get("outcome") in ("ok", "unknown"):
            # the versions of NAME whose commit began after V's returned
            # (V itself is not: its c_inv <= its c_comp)
            c_invs, suf, cs = later[v["name"]]
            m, k = suf[bisect_right(c_invs, v["c_comp"])]
            if k >= 0 and m < end:
                u = by_name[v["name"]][k]
                end = m
                why = (f"version {u['vid']} (committed on {u['mount']} at "
                       f"{T(u['c_inv'])}..{T(u['c_comp'])}, after this one's commit "
                       f"returned at {T(v['c_comp'])}) was in BACKING_DIR at {T(end)}")
        s_end[vid], s_end_why[vid] = end, why

    # per (name, mount), its committed versions by c_inv, and the earliest
    # c_comp of those invoked after a time
    mine = {}
    for name, us in by_name.items():
        for mount in {u["mount"] for u in us}:
            cs = by_c_inv(us, lambda u: u["mount"] == mount and committed(u))
            mine[name, mount] = ([c[0] for c in cs], suffix_min(cs, itemgetter("c_comp")))

    def mount_end(v, mount):
        """The mount committed a later version of NAME: it shows that one."""
        end, why = INF, ""
        if v.get("c_comp") is None or (v["name"], mount) not in mine:
            return end, why
        c_invs, suf = mine[v["name"], mount]
        m, k = suf[bisect_right(c_invs, v["c_comp"])]
        if k >= 0 and m < end:
            u = by_name[v["name"]][k]
            end = m
            why = f"{mount} itself committed version {u['vid']} of {v['name']} at {T(end)}"
        return end, why

    entry_ends = {}

    def entry_end(vid, f):
        if (vid, f) not in entry_ends:
            entry_ends[vid, f] = INF
            for n, lo, hi in seen.get(vid, []):
                ss = samples[n]
                i = next((i for i in range(lo, hi) if f not in ss[i][2][1]), None)
                if i is not None:
                    entry_ends[vid, f] = ss[i][1]
                    break
        return entry_ends[vid, f]

    def seen_between(vid, a, b):
        """A sighting of vid with comp >= a and inv <= b."""
        for n, lo, hi in seen.get(vid, []):
            ss = samples[n]
            i = bisect_left(ss, a, lo, hi, key=comp_of)
            if i < hi and ss[i][0] <= b:
                return True
        return False

    # removals, per name (rm -r: any outcome, an rm -r may fail with ENOENT
    # after removing .metadata) and per (name, entry) (not ENOENT): sorted by
    # inv, with the latest comp so far
    def overlaps_index(os_):
        os_ = sorted(os_, key=itemgetter("inv"))
        pmax, m = [], -INF
        for o in os_:
            m = max(m, o["comp"])
            pmax.append(m)
        return [o["inv"] for o in os_], pmax

    def overlaps(ix, a, b):
        """An operation of index ix with inv <= b and comp >= a."""
        if ix is None:
            return False
        k = bisect_right(ix[0], b)
        return k > 0 and ix[1][k - 1] >= a

    rm_r, rm_entry = {}, {}
    for o in h.ops:
        if o["kind"] == "rm_r":
            rm_r.setdefault(o["name"], []).append(o)
        elif o["kind"] == "rm_entry" and o["res"] != "enoent":
            rm_entry.setdefault((o["name"], o["file"]), []).append(o)
    rm_r = {k: overlaps_index(x) for k, x in rm_r.items()}
    rm_entry = {k: overlaps_index(x) for k, x in rm_entry.items()}

    # a name matches NAME_RE(name) in a text iff it is one of the text's
    # TOKENs (a name made of [\w.-] only); other names are searched for
    # (": removing NAME" is said before the removal: a daemon killed
    # during it still said why)
    keep_lines = [(t, re.split(r": remov(?:ed|ing) ", ln, maxsplit=1)[1]) for t, ln in h.log
                  if "keep=" in ln and (": removed " in ln or ": removing " in ln)]
    keep_at = {}   # token -> [time of a keep= line removing it]
    for t, tail in keep_lines:
        for tok in set(TOKEN.findall(tail)):
            keep_at.setdefault(tok, []).append(t)
    keep_at = {tok: sorted(ts) for tok, ts in keep_at.items()}

    def kept_at(name):
        if name not in keep_at and not TOKEN.fullmatch(name):
            rx = name_re(name)
            keep_at[name] = sorted(t for t, tail in keep_lines if rx.search(tail))
        return keep_at.get(name, [])

    def removal_near(name, a, b, f=None):
        """Whether a removal of NAME (or of its entry f) or a keep= line
        removing it came near [a, b]."""
        if overlaps(rm_r.get(name), a, b):
            return True
        if f is not None and overlaps(rm_entry.get((name, f)), a, b):
            return True
        ts = kept_at(name)
        k = bisect_left(ts, a)
        return k < len(ts) and ts[k] - 1.0 <= b

    # -- reads
    reads = [o for o in h.ops if o["kind"] in ("read", "held") and o["valid"]]
    stats = {"reads": len(reads), "read_ok": 0, "enoent": 0, "zeros": 0, "errors": 0,
             "errnos": {}}
    for r in reads:
        res = r["res"]
        where = (f"{r['kind']} of {r['name']}/{r['file']} on {r['mount']} "
                 f"at {T(r['inv'])}..{T(r['comp'])}")
        if res[0] == "corrupt":
            viol.append(("CORRUPT", f"{where}: {res[1]}"))
            continue
        if res[0] == "zeros":
            stats["zeros"] += 1
            if r["kind"] == "read":  # a fresh open never reads a hole
                viol.append(("ZEROS", f"{where}: read zeros through a fresh open"))
            continue
        if res[0] == "err":
            stats["errors"] += 1
            key = f"{r['kind']} {errno.errorcode.get(res[1], res[1])}"
            stats["errnos"][key] = stats["errnos"].get(key, 0) + 1
            continue
        if r["kind"] == "held":
            if res[0] == "ok" and res[1] != r["opened"]:
                viol.append(("HELD", f"{where}: opened version {r['opened']}, read "
                                     f"version {res[1]} through the same handle"))
            elif res[0] == "mismatch":
                viol.append(("HELD", f"{where}: opened version {r['opened']}, read other "
                                     f"bytes: {res[1]}"))
            continue
        if res[0] == "enoent":
            stats["enoent"] += 1
            a, b = r["inv"] - window, r["comp"]
            # the samples with comp >= a - gap and inv <= b + gap: a range
            all_ss = samples.get(r["name"], [])
            ss = all_ss[bisect_left(all_ss, a - gap, key=comp_of):
                        bisect_right(all_ss, b + gap, key=inv_of)]
            if not ss or ss[0][1] > a or ss[-1][0] < b:
                continue
            if any(not isinstance(st, tuple) or r["file"] not in st[1] for _, _, st in ss):
                continue
            if any(ss[i + 1][0] - ss[i][1] > gap for i in range(len(ss) - 1)):
                continue
            if removal_near(r["name"], a - 1.0, b + 1.0, r["file"]):
                continue
            vids = sorted({st[0] for _, _, st in ss})
            viol.append(("ENOENT", f"{where}: ENOENT, but BACKING_DIR held {r['name']} with "
                                   f"{r['file']} throughout [{T(a)}, {T(b)}] (versions {vids}, "
                                   f"{len(ss)} samples) and nothing removed it"))
            continue
        stats["read_ok"] += 1
        vid = res[1]
        v = vs[vid]
        if v["name"] != r["name"]:
            viol.append(("STALE", f"{where}: read version {vid}, a version of {v['name']}"))
            continue
        if v.get("c_inv") is None or v.get("outcome") == "fail":
            viol.append(("STALE", f"{where}: read version {vid}, whose commit "
                                  f"{'never ran' if v.get('c_inv') is None else 'failed: ' + str(v.get('err'))}"))
            continue
        if v["c_inv"] > r["comp"]:
            viol.append(("STALE", f"{where}: read version {vid} before its commit began "
                                  f"at {T(v['c_inv'])}"))
            continue
        end, why = s_end[vid], s_end_why[vid]
        m_end, m_why = mount_end(v, r["mount"])
        if m_end < end:
            end, why = m_end, m_why
        if end < r["inv"] - window and seen_between(vid, r["inv"] - window, r["comp"]):
            viol.append(("UNDONE", f"{where}: read version {vid}, which BACKING_DIR held "
                                   f"again then, though no longer {r['name']}'s since "
                                   f"{T(end)}: {why} (BACKING_DIR went back: see ORDER)"))
            continue
        if end < r["inv"] - window:
            viol.append(("STALE", f"{where}: read version {vid} (committed on {v['mount']} at "
                                  f"{T(v['c_inv'])}..{T(v['c_comp'])}), no longer "
                                  f"{r['name']}'s since {T(end)} ({r['inv'] - end:.2f} s "
                                  f"before the read): {why}"))
            continue
        if r["file"] in ENTRIES:
            fe = entry_end(vid, r["file"])
            if fe < r["inv"] - window:
                viol.append(("STALE", f"{where}: read {r['file']} of version {vid}, removed "
                                      f"from it in BACKING_DIR by {T(fe)} "
                                      f"({r['inv'] - fe:.2f} s before the read)"))

    # -- order of BACKING_DIR's NAME against the commits' real-time order
    for name, ss in samples.items():
        since_absent = {}   # vid -> time first seen since the last absence
        # since_absent's committed versions: their c_inv, sorted, and their
        # places in since_absent (so those invoked after a time, in order)
        order, c_invs, places = [], [], []
        reported = set()
        # a version u shown again with since_absent unchanged finds nothing
        # new: its pairs were reported or a removal came near (and a
        # removal near [when, comp] is near [when, a later comp])
        state, last = 0, None

        def add(vid, when):
            if vid in since_absent:
                return
            since_absent[vid] = when
            v = vs.get(vid)
            if v is not None and v.get("c_inv") is not None:
                k = bisect_right(c_invs, v["c_inv"])
                c_invs.insert(k, v["c_inv"])
                places.insert(k, len(order))
            order.append(vid)

        for inv, comp, st in ss:
            if st is None:
                if since_absent:
                    since_absent, order, c_invs, places = {}, [], [], []
                state += 1
                continue
            if not isinstance(st, tuple) or st[0] is None:
                continue
            u = vs.get(st[0])
            if u is None or u.get("c_comp") is None:
                add(st[0], inv)
                continue
            if (state, len(since_absent), u["vid"]) != last:
                last = (state, len(since_absent), u["vid"])
                for p in sorted(places[bisect_right(c_invs, u["c_comp"]):]):
                    vid = order[p]
                    when = since_absent[vid]
                    v = vs[vid]
                    if vid == u["vid"]:
                        continue
                    if (u["vid"], vid) not in reported and not removal_near(name, when, comp):
                        reported.add((u["vid"], vid))
                        viol.append(("ORDER", f"{name}: BACKING_DIR held version {vid} (committed on "
                                              f"{v['mount']} at {T(v['c_inv'])}..{T(v['c_comp'])}, "
                                              f"{v['outcome']}) at {T(when)}, then version {u['vid']} "
                                              f"at {T(comp)}, whose commit (on {u['mount']}) returned "
                                              f"at {T(u['c_comp'])}, before {vid}'s began: "
                                              f"a later commit undone"))
            add(u["vid"], inv)

    # -- committed versions lost without a word
    texts = [ln for _, ln in h.log] + h.reports
    joined = "\n".join(texts)
    flagged = [t for t in texts if LOSS_WORDS.search(t)]
    flagged_tokens = {tok for t in flagged for tok in TOKEN.findall(t)}

    def said_of(name, sid):
        """A log or .status line with sid in it, or naming NAME with
        supersed|lost|not published|flush failed."""
        if sid and (sid in joined if "\n" not in sid else any(sid in t for t in texts)):
            return True
        if TOKEN.fullmatch(name):
            return name in flagged_tokens
        rx = name_re(name)
        return any(rx.search(t) for t in flagged)

    # per (name, on a tier mount), the commits that did not fail, by c_inv,
    # with the two latest c_comps so far (the latest and which version's)
    others = {}
    for name, us in by_name.items():
        for tier in (False, True):
            cs = by_c_inv(us, lambda u: u["c_inv"] is not None and u.get("outcome") != "fail"
                          and bool(h.mounts[u["mount"]]["tier"]) == tier)
            top, m1, u1, m2 = [], -INF, None, -INF
            for _, _, u in cs:
                if u["c_comp"] > m1:
                    m1, u1, m2 = u["c_comp"], u, m1
                elif u["c_comp"] > m2:
                    m2 = u["c_comp"]
                top.append((m1, u1, m2))
            others[name, tier] = ([c[0] for c in cs], top)

    def commit_after(v, tier, a, b):
        """Another commit of NAME invoked by b that returned at or after
        a (and after V was invoked)."""
        c_invs, top = others[v["name"], tier]
        k = bisect_right(c_invs, b)
        if k == 0:
            return False
        m1, u1, m2 = top[k - 1]
        return (m1 if u1 is not v else m2) >= a

    for v in vs.values():
        if not committed(v):
            continue
        name, ss = v["name"], samples.get(v["name"], [])
        sights = seen.get(v["vid"], [])
        final = ss[-1][2] if ss else None
        if isinstance(final, tuple) and final[0] == v["vid"]:
            continue
        if sights:
            a, last_comp, _ = last_sight(v["vid"])
            s = next_change(ss, last_comp)
            b = s[1] if s is not None else INF
        elif not h.mounts[v["mount"]]["tier"]:
            a = v["c_inv"]
            s = next_change(ss, v["c_comp"])
            b = s[1] if s is not None else INF
        else:
            a, b = v["c_inv"], INF
        # a later or concurrent commit of NAME (not entirely before V): one
        # on a tier mount invoked by b, or one elsewhere that returned after a
        if commit_after(v, True, v["c_inv"], b) or commit_after(v, False, max(v["c_inv"], a), b):
            continue
        if removal_near(name, a, b):
            continue
        sid = next((samples[n][lo][2][2] for n, lo, _ in sights if n == name), None)
        if said_of(name, sid):
            continue
        viol.append(("LOST", f"{name}: version {v['vid']} (committed on {v['mount']} with "
                             f"'{v['words']}' at {T(v['c_inv'])}..{T(v['c_comp'])}) "
                             f"{'seen in BACKING_DIR until ' + T(a) if sights else 'never seen in BACKING_DIR'}"
                             f", gone by {T(b)}; no later commit or removal of {name} explains it "
                             f"and no log or .status line says why"))
    for what in h.leftovers:
        viol.append(("LEFTOVER", what))
    return viol, stats


# ---- the test ------------------------------------------------------------------

class Slot:
    """One mount of the run: its Mount, whether it has a tier, and an
    epoch that a kill and a restart advance (an operation that spans a
    change of epoch has no definite outcome)."""

    def __init__(self, label, mount, tier):
        self.label, self.m, self.tier = label, mount, tier
        self.epoch, self.up = 0, True
        self.lock = threading.Lock()

    def begin(self):
        with self.lock:
            return self.epoch if self.up else None

    def still(self, epoch):
        with self.lock:
            return self.up and self.epoch == epoch

    def path(self, *parts):
        return os.path.join(self.m.mnt, *parts)


class RegisterHistory(CkptfsTestCase):
    def setUp(self):
        super().setUp()
        self.tiers = []
        for k in (1, 2):
            t = os.path.join(self.dir, f"tier{k}")
            os.makedirs(t)
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,size=512m", "tmpfs", t],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, f"cannot mount a tier's tmpfs: {r.stderr}")
            self.addCleanup(subprocess.run, ["umount", "-l", t], capture_output=True)
            self.tiers.append(t)

    # -- the recorder's helpers
    def now(self):
        return time.monotonic()

    def new_vid(self):
        with self.h.lock:
            self.next_vid += 1
            return self.next_vid

    def pick_slot(self, rnd, tier=None):
        ups = [s for s in self.slots if s.up and (tier is None or s.tier == tier)]
        return rnd.choice(ups) if ups else None

    def stage(self, d, v):
        os.mkdir(d)
        vid = v["vid"]
        write_file(os.path.join(d, f"v{vid:08d}"), b"%d\n" % vid)
        write_file(os.path.join(d, "tag"), content(vid, "tag", 200))
        os.mkdir(os.path.join(d, "e"))
        for f in ENTRIES:
            write_file(os.path.join(d, f), content(vid, f, 200))
        write_tensor(os.path.join(d, "w"), "uint8", [v["size"]], content(vid, "w", v["size"]))

    def remove_staged(self, slot, d):
        try:
            with open(os.path.join(d, ".status")) as f:
                st = f.readline().strip()
        except OSError:
            return
        if st in ("staging", "failed"):
            shutil.rmtree(d, ignore_errors=True)

    # -- operations
    def op_commit(self, rnd, slot, register):
        vid = self.new_vid()
        if register:
            name = rnd.choice(REGISTERS)
            d = slot.path(f"w-{vid}")
            words = rnd.choice(["sync", "sync", "async"]) + f" replace={name} protect step={vid}"
        else:
            name = f"k-{vid}"
            d = slot.path(name)
            words = rnd.choice(["sync", "sync", "async"]) + f" step={vid}"
            with self.h.lock:
                self.k_names.append(name)
        if rnd.random() < 0.3:
            words += " solo"
        if slot.tier and words.startswith("sync") and rnd.random() < 0.15:
            words += " level=shared"
        v = {"vid": vid, "name": name, "mount": slot.label, "words": words,
             "size": rnd.randrange(32 * KB, 1536 * KB), "c_inv": None, "c_comp": None,
             "outcome": None}
        with self.h.lock:
            self.h.versions[vid] = v
        epoch = slot.begin()
        if epoch is None:
            return
        v["stage_inv"] = self.now()
        try:
            self.stage(d, v)
        except OSError as e:
            v["err"] = f"staging: {e}"
            self.remove_staged(slot, d)
            return
        v["c_inv"] = self.now()
        try:
            fd = os.open(os.path.join(d, ".commit"), os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(fd, (words + "\n").encode())
            finally:
                os.close(fd)
        except OSError as e:
            v["c_comp"] = self.now()
            v["err"] = f"{errno.errorcode.get(e.errno, e.errno)} {e.strerror}"
            v["outcome"] = "unknown" if (e.errno in KILLED or e.errno == errno.EIO
                                         or not slot.still(epoch)) else "fail"
            self.count(f"commit_{v['outcome']}")
            if v["outcome"] == "fail":
                self.remove_staged(slot, d)
            self.h.op(kind="commit", mount=slot.label, name=name, vid=vid, inv=v["c_inv"],
                      comp=v["c_comp"], res=v["outcome"], words=words)
            return
        if words.startswith("sync"):
            v["c_comp"], v["outcome"] = self.now(), "ok"
        else:
            # follow the staged name's .status: committed, failed, or gone
            # (a replace= leaves the mount once published)
            deadline = self.now() + 120
            while True:
                t = self.now()
                try:
                    with open(os.path.join(d, ".status")) as f:
                        s = f.read()
                except OSError as e:
                    s = None if e.errno == errno.ENOENT else e
                if s is None or isinstance(s, str) and s.startswith("committed"):
                    # gone: a replace= published (its working name leaves
                    # the mount); a plain commit's NAME gone already (keep=,
                    # rm -r) says nothing of the commit
                    v["c_comp"] = t
                    if not slot.still(epoch) or (s is None and not register):
                        v["outcome"] = "unknown"
                    elif s is not None and "lost:" in s:
                        v["outcome"], v["err"] = "fail", "lost: " + s.split("lost:", 1)[1].strip()
                    else:
                        v["outcome"] = "ok"
                    break
                if isinstance(s, str) and s.startswith("failed"):
                    v["c_comp"], v["outcome"], v["err"] = t, "fail", s.strip()
                    self.remove_staged(slot, d)
                    break
                if isinstance(s, OSError) or t > deadline or not slot.still(epoch):
                    v["c_comp"], v["outcome"], v["err"] = t, "unknown", str(s)
                    break
                time.sleep(0.02)
        self.count(f"commit_{v['outcome']}")
        self.h.op(kind="commit", mount=slot.label, name=name, vid=vid, inv=v["c_inv"],
                  comp=v["c_comp"], res=v["outcome"], words=words)
        if v["outcome"] == "ok" and not register:
            with self.h.lock:
                self.k_committed.append(name)

    def op_rm(self, rnd, slot, name, entry=None):
        epoch = slot.begin()
        if epoch is None:
            return
        inv = self.now()
        try:
            if entry:
                os.unlink(slot.path(name, entry))
            else:
                shutil.rmtree(slot.path(name))
            res = "ok"
        except OSError as e:
            res = "enoent" if (e.errno == errno.ENOENT and slot.still(epoch)) else \
                errno.errorcode.get(e.errno, str(e.errno))
        comp = self.now()
        self.count(f"{'rm_entry' if entry else 'rm_r'}_{res}")
        self.h.op(kind="rm_entry" if entry else "rm_r", mount=slot.label, name=name,
                  file=entry, inv=inv, comp=comp, res=res)

    def read_fresh(self, slot, name, f):
        epoch = slot.begin()
        if epoch is None:
            return
        inv = self.now()
        try:
            with open(slot.path(name, f), "rb") as fh:
                data = fh.read()
            res = classify(data, f, self.h.versions)
        except OSError as e:
            res = ("enoent",) if e.errno == errno.ENOENT else ("err", e.errno)
        comp = self.now()
        self.h.op(kind="read", mount=slot.label, name=name, file=f, inv=inv, comp=comp,
                  res=res, valid=slot.still(epoch))

    def read_held(self, held):
        slot, epoch, name, f, fd, vid = held
        inv = self.now()
        try:
            want = content(vid, f, file_size(self.h.versions[vid], f))
            data = os.pread(fd, len(want) + 64, 0)
            if data == want:
                res = ("ok", vid)
            elif same_or_zeros(data, want):
                res = ("zeros",)
            else:
                c = classify(data, f, self.h.versions)
                res = c if c[0] == "ok" else ("mismatch", c[1] if len(c) > 1 else c[0])
        except OSError as e:
            res = ("err", e.errno)
        comp = self.now()
        self.h.op(kind="held", mount=slot.label, name=name, file=f, inv=inv, comp=comp,
                  res=res, opened=vid, valid=slot.still(epoch))

    def count(self, what):
        with self.h.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    # -- threads
    def writer(self, k):
        rnd = random.Random(f"{self.seed}/writer/{k}")
        while self.now() < self.stop_at and not self.failed_thread:
            slot = self.pick_slot(rnd)
            if slot is None:
                time.sleep(0.05)
                continue
            x = rnd.random()
            with self.h.lock:
                ks = list(self.k_committed)
            try:
                if x < 0.50:
                    self.op_commit(rnd, slot, register=True)
                elif x < 0.66:
                    self.op_commit(rnd, slot, register=False)
                elif x < 0.72:
                    self.op_rm(rnd, slot, rnd.choice(REGISTERS))
                elif x < 0.77 and ks:
                    self.op_rm(rnd, slot, rnd.choice(ks[-6:]))
                elif x < 0.95:
                    name = rnd.choice(REGISTERS + tuple(ks[-4:]))
                    self.op_rm(rnd, slot, name, entry=rnd.choice(ENTRIES))
                else:
                    time.sleep(rnd.uniform(0.05, 0.4))
            except Exception as e:  # a bug of the test: stop and say so
                self.failed_thread = f"writer {k}: {e!r}"
                raise
            time.sleep(rnd.uniform(0, 0.15))

    def reader(self, k):
        rnd = random.Random(f"{self.seed}/reader/{k}")
        held = []
        try:
            while self.now() < self.stop_at and not self.failed_thread:
                slot = self.pick_slot(rnd)
                if slot is None:
                    time.sleep(0.05)
                    continue
                with self.h.lock:
                    ks = list(self.k_committed)
                name = rnd.choice(REGISTERS) if not ks or rnd.random() < 0.7 else \
                    rnd.choice(ks[-8:])
                f = rnd.choice(FILES)
                x = rnd.random()
                if x < 0.12 and len(held) < MAX_HELD:
                    epoch = slot.begin()
                    if epoch is not None:
                        try:
                            fd = os.open(slot.path(name, f), os.O_RDONLY)
                        except OSError:
                            fd = None
                        if fd is not None:
                            try:
                                head = os.pread(fd, 64, 0)
                                m = HEAD.match(head)
                                if m and int(m.group(1)) in self.h.versions and slot.still(epoch):
                                    held.append((slot, epoch, name, f, fd, int(m.group(1))))
                                    fd = None
                            except OSError:
                                pass
                            if fd is not None:   # the mount may be killed by now
                                close_quietly(fd)
                elif x < 0.30 and held:
                    hd = rnd.choice(held)
                    if not hd[0].still(hd[1]):
                        held.remove(hd)
                        close_quietly(hd[4])
                        continue
                    self.read_held(hd)
                    if rnd.random() < 0.2:
                        held.remove(hd)
                        close_quietly(hd[4])
                else:
                    self.read_fresh(slot, name, f)
                time.sleep(rnd.uniform(0, 0.03))
        except Exception as e:
            self.failed_thread = f"reader {k}: {e!r}"
            raise
        finally:
            for hd in held:
                close_quietly(hd[4])

    def monitor(self):
        """BACKING_DIR's NAMEs every ~25 ms."""
        while not self.monitor_stop.is_set():
            inv = self.now()
            try:
                listed = set(os.listdir(self.backing))
            except OSError:
                listed = set()
            with self.h.lock:
                names = list(REGISTERS) + list(self.k_names)
            states = {n: (read_meta(os.path.join(self.backing, n)) if n in listed else None)
                      for n in names}
            comp = self.now()
            with self.h.lock:
                for n, st in states.items():
                    self.h.samples.setdefault(n, []).append((inv, comp, st))
            time.sleep(0.025)

    def log_tail(self):
        pos = 0
        buf = b""
        while True:
            stop = self.monitor_stop.is_set()
            try:
                with open(self.log, "rb") as f:
                    f.seek(pos)
                    data = f.read()
            except OSError:
                data = b""
            pos += len(data)
            buf += data
            t = self.now()
            *lines, buf = buf.split(b"\n")
            with self.h.lock:
                self.h.log += [(t, ln.decode(errors="replace")) for ln in lines]
            if stop:
                return
            time.sleep(0.05)

    def killer(self):
        rnd = random.Random(f"{self.seed}/killer")
        while True:
            wait = rnd.uniform(*KILL_EVERY)
            if self.now() + wait > self.stop_at - 3:
                return
            time.sleep(wait)
            if self.failed_thread:
                return
            slot = rnd.choice(self.slots)
            t0 = self.now()
            with slot.lock:
                slot.up = False
                slot.epoch += 1
            os.kill(slot.m.proc.pid, signal.SIGKILL)
            rc = slot.m.wait(30)
            subprocess.run(["fusermount3", "-uz", slot.m.mnt], capture_output=True)
            time.sleep(rnd.uniform(0.1, 1.0))
            try:
                slot.m.start()
            except Exception as e:
                self.failed_thread = f"restart of {slot.label} after SIGKILL (rc {rc}): {e}"
                return
            with slot.lock:
                slot.up = True
                slot.epoch += 1
            t1 = self.now()
            with self.h.lock:
                self.h.kills.append((slot.label, t0, t1))
            print(f"  [history] {t1 - self.t_start:6.1f} s: killed and restarted "
                  f"{slot.label} ({t1 - t0:.2f} s)", file=sys.stderr)

    # -- the run
    def test_history(self):
        self.seed = int(os.environ.get("CKPT_HISTORY_SEED") or
                        random.SystemRandom().randrange(1 << 31))
        print(f"\n  [history] seed {self.seed} (CKPT_HISTORY_SEED={self.seed} repeats "
              f"its choices), {SECONDS:.0f} s, window {WINDOW} s", file=sys.stderr)
        self.h = History()
        self.counts, self.next_vid = {}, 0
        self.k_names, self.k_committed = [], []
        self.failed_thread = None
        specs = [("m0", None, "keep=last:4"),
                 ("m1", self.tiers[0], f"tier={self.tiers[0]},tier_keep=1,keep=last:4"),
                 ("m2", self.tiers[1], f"tier={self.tiers[1]},flush_rate=2M"),
                 ("m3", None, None)]
        self.slots = []
        for label, tier, opts in specs:
            m = self.mount(opts=opts, mnt=os.path.join(self.dir, label))
            self.slots.append(Slot(label, m, tier is not None))
            self.h.mounts[label] = {"tier": tier is not None, "opts": opts}
        self.monitor_stop = threading.Event()
        mon = [threading.Thread(target=self.monitor, daemon=True),
               threading.Thread(target=self.log_tail, daemon=True)]
        for t in mon:
            t.start()
        self.t_start = self.now()
        self.stop_at = self.t_start + SECONDS
        work = ([threading.Thread(target=self.writer, args=(k,), daemon=True) for k in range(WRITERS)]
                + [threading.Thread(target=self.reader, args=(k,), daemon=True) for k in range(READERS)]
                + [threading.Thread(target=self.killer, daemon=True)])
        for t in work:
            t.start()
        for t in work:
            t.join(SECONDS + 300)
            self.assertFalse(t.is_alive(), "a worker thread hangs")
        self.assertIsNone(self.failed_thread, self.failed_thread)
        self.settle()
        # final reads: every name through every mount, fresh
        for slot in self.slots:
            for name in list(REGISTERS) + self.k_names[-12:]:
                for f in FILES:
                    self.read_fresh(slot, name, f)
        for slot in self.slots:
            for name in REGISTERS:
                try:
                    with open(slot.path(name, ".status")) as f:
                        self.h.reports.append(f"{name} on {slot.label}: " + f.read())
                except OSError:
                    pass
        self.h.leftovers = self.leftovers()
        time.sleep(0.2)
        self.monitor_stop.set()
        for t in mon:
            t.join(30)
        dump = os.environ.get("CKPT_HISTORY_DUMP")
        if dump:   # the recorded history, for check_history() offline
            import pickle
            with open(dump, "wb") as f:
                pickle.dump(self.h.__dict__ | {"lock": None}, f)
        viol, stats = check_history(self.h)
        self.report(viol, stats)

    def settle(self):
        """Staged leftovers of failed commits removed; every tier's flush
        records drained (up to 60 s: a record left then is a leftover);
        then WINDOW x 2 of quiet."""
        for slot in self.slots:
            for n in os.listdir(slot.m.mnt):
                if n not in REGISTERS and not n.startswith("k-"):
                    self.remove_staged(slot, slot.path(n))
        deadline = self.now() + 60
        def records():
            out = []
            for t in self.tiers:
                d = os.path.join(t, ".flush")
                if os.path.isdir(d):
                    out += [n for n in os.listdir(d) if not n.startswith(".")]
            return out
        while records() and self.now() < deadline:
            time.sleep(0.2)
        time.sleep(2 * WINDOW)

    def leftovers(self):
        """What is left once settled, looked at for up to 10 s (a removal's
        tail may still run)."""
        deadline = self.now() + 10
        while True:
            out = backing_leftovers(self.backing)
            for t in self.tiers:
                out += tier_leftovers(t, self.backing)
            if not out or self.now() > deadline:
                return out
            time.sleep(0.5)

    def report(self, viol, stats):
        kinds = {}
        for k, _ in viol:
            kinds[k] = kinds.get(k, 0) + 1
        ops = len(self.h.ops)
        committed = sum(1 for v in self.h.versions.values() if v.get("outcome") == "ok")
        summary = (f"history seed {self.seed}: {ops} operations, {stats['reads']} reads checked "
                   f"({stats['read_ok']} of a version, {stats['enoent']} ENOENT, "
                   f"{stats['zeros']} zeros, {stats['errors']} other errors), {committed} "
                   f"versions committed, {len(self.h.kills)} kills, {len(viol)} violations"
                   + (f" ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))})"
                      if viol else ""))
        print(f"  [history] ops by outcome: {dict(sorted(self.counts.items()))}", file=sys.stderr)
        print(f"  [history] read errors (other than ENOENT): {stats['errnos']}", file=sys.stderr)
        print(f"  [history] {summary}", file=sys.stderr)
        if viol:
            shown, per = [], {}
            for k, text in viol:   # the first few of each kind
                if per.get(k, 0) < 3 and len(shown) < SHOW * 2:
                    per[k] = per.get(k, 0) + 1
                    shown.append(f"{k}: {text}")
            self.fail(summary + "\n  " + "\n  ".join(shown) + self.log_of(viol)
                      + f"\n(times in s from the first operation; CKPT_HISTORY_SEED={self.seed})")

    def log_of(self, viol):
        """The daemons' log lines that name a save a leftover names (what
        became of it), for the report."""
        ids = {i for k, text in viol if k == "LEFTOVER"
               for i in re.findall(r"[0-9a-f]{32}", text)}
        names = {n for k, text in viol if k == "LEFTOVER"
                 for n in re.findall(r"name (\w+)", text) +
                 re.findall(r"/backing/(\w+): no \.metadata", text)}
        of_id = [f"{t:8.2f} {ln}" for t, ln in self.h.log
                 if any(i in ln or i[:16] in ln for i in ids)]
        of_name = [f"{t:8.2f} {ln}" for t, ln in self.h.log
                   if any(f"tier: {n}" in ln or f" {n}:" in ln or f" {n} " in ln
                          or ln.endswith(f" {n}") for n in names)]
        lines = of_id[:30] + ["(the last lines naming the checkpoint:)"] + of_name[-20:]
        return ("\n  the daemons' log of those saves:\n    " + "\n    ".join(lines)
                if of_id or of_name else "")


if __name__ == "__main__":
    main()
