"""ckptfs.protocol - a checkpoint's commit protocol as files of the mount:
NAME/.status (its state: staging, committing, committed, failed, and why),
NAME/.commit (the commit word: sync or async, and solo, replace=NAME,
step=, metric=, protect), wait for an async commit, the newest committed
checkpoint, leftovers of a killed run and their discarding (rm -r of a
staged checkpoint on this rank), and the working names a save replacing a
committed NAME stages under (docs/saving.md)."""

import errno
import hashlib
import math
import os
import re
import time
import uuid

from .errors import CkptfsError, CommitError
from .world import check_dir, refuse_mismatch, trainer_world

# the directory of ckptfs.save's manifests in a checkpoint (client.py)
MANIFEST_DIR = "_ckptfs"


def read_text(path):
    with open(path) as f:
        return f.read()


def status(mount, name):
    """(state, text) of checkpoint name: state is the first line of
    NAME/.status (staging, committing, committed, failed)."""
    text = read_text(os.path.join(mount, name, ".status"))
    return text.split("\n", 1)[0].strip(), text


def latest(mount, prefix=""):
    """The name of the newest committed checkpoint in mount (whose name
    starts with prefix), or None: newest by the step retention sees
    (user.ckpt.step: recorded at commit, else the digits of the name),
    then by time. Never a staged, committing or failed one: what a resumed
    job loads."""
    best, best_key = None, None
    for name in os.listdir(mount):
        if name.startswith(".") or not name.startswith(prefix):
            continue
        ckdir = os.path.join(mount, name)
        if status_of(ckdir)[0] != "committed":
            continue
        try:
            step = int(os.getxattr(ckdir, "user.ckpt.step"))
        except (OSError, ValueError):
            step = -1
        try:
            when = os.stat(ckdir).st_mtime_ns
        except OSError:
            continue
        key = (step, when, name)
        if best_key is None or key > best_key:
            best, best_key = name, key
    return best


JOB_ALIVE = re.compile(r"^job \d+ alive\b", re.M)


def leftovers(mount, match=None):
    """[(name, state)] of the checkpoints of mount (those whose name
    match(name) accepts; all when None) that are staged or failed with no
    live job writing them: no `job PID alive` line in their .status (the
    daemon shows one while a process that declared itself a job of the
    mount, ckptfs.job, stages it). A killed run's unfinished save, or one
    written by a process that never declared itself (cp, a shell)."""
    out = []
    try:
        names = sorted(os.listdir(mount))
    except OSError:
        return out
    for name in names:
        if name.startswith(".") or (match is not None and not match(name)):
            continue
        st, text = status_of(os.path.join(mount, name))
        if st in ("staging", "failed") and not JOB_ALIVE.search(text):
            out.append((name, st))
    return out


def discard_leftovers(mount, match=None):
    """Discard each of leftovers(mount, match) on this rank (rm -r of a
    staged checkpoint: other mounts keep their own parts); [(name,
    state)] of those discarded."""
    return [(name, st) for name, st in leftovers(mount, match)
            if discard_uncommitted(os.path.join(mount, name))]


def status_of(ckdir):
    """status() of the checkpoint directory ckdir; ("", "") if unreadable."""
    try:
        text = read_text(os.path.join(ckdir, ".status"))
    except OSError:
        return "", ""
    return text.split("\n", 1)[0].strip(), text


def discard_staged(ckdir):
    """rm -r of a staged (never committed) checkpoint: discards it on this
    rank only. Never called on a committed one (that would delete it)."""
    for root, dirs, files in os.walk(ckdir, topdown=False):
        for f in files:
            os.unlink(os.path.join(root, f))
        for d in dirs:  # a symbolic link to a directory is listed here
            p = os.path.join(root, d)
            os.unlink(p) if os.path.islink(p) else os.rmdir(p)
    os.rmdir(ckdir)


def discard_uncommitted(ckdir):
    """Discard ckdir on this rank if it is staged or failed (never a
    committed one); True if it was."""
    try:
        if os.path.isdir(ckdir) and status_of(ckdir)[0] in ("staging", "failed"):
            discard_staged(ckdir)
            return True
    except OSError:
        pass
    return False


# ---- replacing a committed checkpoint ---------------------------------------------
#
# A new version of a committed NAME is staged under a working name
# (working_prefix(NAME) + a token) and committed with "replace=NAME":
# ckptfs publishes it as NAME over the committed one in one atomic step,
# for every mount, and the working name disappears (SPEC, Committing).
# Every rank of the world gives the same NAME; each may stage under a
# working name of its own. ckptfs.save and ckptfs.dcp.Writer both do this.

TOKEN_CHARS = 12


def replaceable(name):
    """Whether name can follow replace= in a commit word (the word ends at
    a space)."""
    return " " not in name and "\n" not in name


def unreplaceable(name):
    return (f"checkpoint {name!r} is committed and cannot be replaced: a name "
            "holding a space cannot follow replace= in a commit word; save "
            "under another name, or remove it first with rm -r")


def working_prefix(name):
    """How the working names of saves replacing NAME begin: NAME.replace-,
    or replace-<sha1 of NAME>- where that would make a name too long."""
    prefix = f"{name}.replace-"
    if len(prefix.encode("utf-8", "surrogateescape")) + TOKEN_CHARS > 255:
        digest = hashlib.sha1(name.encode("utf-8", "surrogateescape")).hexdigest()
        prefix = f"replace-{digest[:20]}-"
    return prefix


def make_working_dir(mount, name, token=None):
    """Create a working directory in mount for a save replacing NAME: the
    given token (TOKEN_CHARS hex digits) when that name is free, else a
    random one; its path."""
    for _ in range(3):
        token = token or uuid.uuid4().hex[:TOKEN_CHARS]
        path = os.path.join(mount, working_prefix(name) + token)
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            token = None
        except OSError as e:
            raise CkptfsError(f"cannot create {path} to replace checkpoint "
                              f"{name!r}: {e.strerror}") from e
    raise CkptfsError(f"cannot find a free working name to replace {name!r} in {mount}")


def replacing(mount, name):
    """This mount's working directories of saves replacing NAME whose
    commit is running or failed: [(path, state, .status text)]."""
    prefix = working_prefix(name)
    try:
        names = [n for n in os.listdir(mount) if n.startswith(prefix)]
    except OSError:
        return []
    out = []
    for n in names:
        path = os.path.join(mount, n)
        st, text = status_of(path)
        if st in ("committing", "failed"):
            out.append((path, st, text))
    return out


METRIC_KEY = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def retention_words(step=None, metrics=None, protect=False):
    """The commit words retention reads (docs/saving.md, "Retention"):
    step=N, metric=KEY:VALUE per item of metrics (a dict), protect."""
    words = ()
    if step is not None:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step={step!r}: a whole number >= 0")
        words += (f"step={step}",)
    for key, value in (metrics or {}).items():
        value = float(value)
        if not METRIC_KEY.fullmatch(key) or not math.isfinite(value):
            raise ValueError(f"metric {key!r}={value!r}: a key of letters, digits, "
                             "_ . - (up to 64) and a finite number")
        words += (f"metric={key}:{value!r}",)
    return words + (("protect",) if protect else ())


def commit(mount, name, mode="sync", replace=None, solo=False, step=None,
           metrics=None, protect=False):
    """Write mode to NAME/.commit (what save() does last). replace=TARGET:
    publish the staged NAME as TARGET, over a committed TARGET; solo: this
    rank alone, as a world of one (SPEC, Committing). step, metrics
    ({"loss": 0.25}) and protect are recorded for retention (-o keep=,
    ckptctl prune)."""
    check_dir(mount)
    if not solo:  # as save() checks: the trainer's world is the mount's
        refuse_mismatch(mount, *trainer_world(), saving=True)
    words = ("solo",) if solo else ()
    if replace is not None:
        if not replaceable(replace):
            raise ValueError(f"replace={replace!r}: a name holding a space cannot "
                             "follow replace= in a commit word")
        words += (f"replace={replace}",)
    words += retention_words(step, metrics, protect)
    commit_dir(os.path.join(mount, name), name, mode, words)


def commit_dir(ckdir, name, mode="sync", words=()):
    """Write mode and words (modifiers: "solo", "replace=NAME") to
    ckdir/.commit; CommitError with .status's reason when the commit
    fails."""
    try:
        fd = os.open(os.path.join(ckdir, ".commit"), os.O_WRONLY | os.O_TRUNC)
    except OSError as e:
        raise CkptfsError(f"cannot open {ckdir}/.commit: {e.strerror} (is "
                          f"{os.path.dirname(ckdir)} a ckptfs mount?)") from e
    word = " ".join((mode,) + tuple(words))
    try:
        os.write(fd, word.encode() + b"\n")
    except OSError as e:
        st, text = status_of(ckdir)
        if st == "failed" or (st == "committed" and "\nlost: " in text):
            raise CommitError(name, text, ckdir) from e
        older = (f" (the daemon refused {word!r}: a ckptfs older than the words "
                 "solo and replace=?)" if words and e.errno == errno.EINVAL else "")
        raise CkptfsError(f"commit of {name!r} failed: {e.strerror}{older}"
                          + (f"; .status: {text.strip()}" if text else "")) from e
    finally:
        os.close(fd)


def saved_by(ckdir):
    """Whose save the staged checkpoint ckdir is, for CommitError's advice:
    "client" (save() writes its manifest there) or "dcp" (an async commit
    of ckptfs.dcp.Writer, the other caller of wait)."""
    return "client" if os.path.isdir(os.path.join(ckdir, MANIFEST_DIR)) else "dcp"


def wait(mount, name, timeout=None, poll=0.05):
    """Wait until an async commit of name is committed (return its .status
    text) or failed, or lost to another mount's commit of name (raise
    CommitError); TimeoutError after timeout s. An async save that
    replaces a committed name (overwrite) is followed under its working
    name on this mount until it is published as name or fails (its
    working directory is then discarded)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        pending = replacing(mount, name)
        for path, st, text in pending:
            if st == "failed":
                api = saved_by(path)
                raise CommitError(name, text, path, discarded=discard_uncommitted(path),
                                  api=api)
        if pending:
            st, text = "committing", pending[0][2]
        else:
            st, text = status(mount, name)
        # "lost:": this mount's commit lost to another save of the name,
        # which NAME is now (its staged files were discarded)
        if st == "committed" and "\nlost: " not in text:
            return text
        if st in ("failed", "committed"):
            path = os.path.join(mount, name)
            raise CommitError(name, text, path, api=saved_by(path))
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint {name!r} is still {st} after "
                               f"{timeout} s: {text.strip()}")
        time.sleep(poll)


