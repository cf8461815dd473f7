"""ckptfs.abort - one rank's failure fails the save on every rank.

A commit waits for every rank's (up to commit_timeout, 600 s by default).
A rank that fails before it commits therefore commits anyway, with an
item ckptfs refuses (ABORT_ITEM): the commit fails on every rank within
seconds, each rank discards what it staged, and the others raise
CommitError saying another rank failed. ckpt.save, ckptfs.async_save and
ckptfs.dcp.Writer all do this. A solo save has no other rank to tell.
The item's user.ckpt.fqn is the rank's reason: the daemon fails the save
with "rank R aborted the save: REASON" (fs/commit/save.c, aborted_by), never
naming the item (a daemon older than that names it:
"_ckptfs_abort (...): rank R wrote 0 bytes, 4 expected")."""

import os
import re
import sys

from .errors import CkptfsError, CommitError
from .protocol import commit_dir, discard_uncommitted, status_of

ABORT_ITEM = "_ckptfs_abort"   # the item a rank commits to abort a save (abort_commit)
ABORTED = re.compile(r"^rank \d+ aborted the save: ", re.M)
ABORT_REASON_MAX = 300


def abort_reason(reason=None):
    """The reason an abort gives the other ranks: reason, else the error
    being handled (sys.exc_info), one line of at most ABORT_REASON_MAX
    bytes of UTF-8 (the daemon cuts a longer one)."""
    if reason is None:
        err = sys.exc_info()[1]
        if err is None:
            reason = "it failed before its commit"
        else:
            text = str(err).strip().splitlines()
            reason = f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
    reason = "".join(c if c >= " " and c != "\x7f" else "?" for c in reason)
    raw = reason.encode("utf-8", "replace")
    if len(raw) > ABORT_REASON_MAX:
        reason = raw[:ABORT_REASON_MAX - 3].decode("utf-8", "ignore") + "..."
    return reason


def abort_commit(ckdir, name, words=(), reason=None):
    """Fail this save on every rank now rather than at commit_timeout:
    commit a chunk ckptfs refuses (a float32 of shape [1] with no bytes,
    its user.ckpt.fqn the reason: abort_reason), with the save's own
    words (replace=NAME: the ranks match by NAME). Returns once the commit
    failed (when every rank committed)."""
    if "solo" in words:
        return
    why = abort_reason(reason)
    try:
        if not os.path.isdir(ckdir) or status_of(ckdir)[0] != "staging":
            return
        path = os.path.join(ckdir, ABORT_ITEM)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.setxattr(fd, "user.ckpt.dtype", b"float32")
            os.setxattr(fd, "user.ckpt.shape", b"1")
            try:
                os.setxattr(fd, "user.ckpt.fqn", why.encode("utf-8", "replace"))
            except OSError:
                pass  # the save fails all the same, the reason unsaid
        finally:
            os.close(fd)
        try:
            commit_dir(ckdir, name, "sync", words)
        except (CkptfsError, OSError):
            pass
    except OSError:
        pass


def abort_save(ckdir, name, words=()):
    """This rank's save into ckdir failed before its commit: fail it on
    every rank now (abort_commit), then discard what this rank staged. The
    error being raised (sys.exc_info) gets a note saying so."""
    abort_commit(ckdir, name, words)
    gone = discard_uncommitted(ckdir)
    err = sys.exc_info()[1]
    if err is not None and hasattr(err, "add_note"):  # Python >= 3.11
        where = "" if "solo" in words else " was aborted on every rank"
        err.add_note(f"ckptfs: the save of {name!r}{where}"
                     + (" and this rank's staged files discarded" if gone else ""))


def aborted_elsewhere(err, ckdir, name, api="client"):
    """err: this rank's CommitError. When another rank aborted the save
    (abort_commit), discard this rank's staged files and return the
    CommitError to raise instead; else None."""
    if not ABORTED.search(err.status) and ABORT_ITEM not in err.status:
        return None
    discard_uncommitted(ckdir)
    return CommitError(name, err.status + "\nanother rank failed before its commit "
                       "(while staging its items): its own error says why", ckdir,
                       discarded=True, api=api)


