"""This process as a job of its ckptfs mounts: after a crash, nothing it
left half-saved blocks the restarted job.

    ckptfs.job.declare("/mnt/ckpt/rank0")   # the integrations do it for you

A process that declared itself a job of a mount (setxattr MOUNT
user.ckpt.job LABEL) is watched by the mount's daemon. When it exits
without ending cleanly (SIGKILL, a crash, an uncaught exception), each of
its saves on that mount that is not committed is abandoned: a staged one
is discarded at once, its name free for the restarted job; a committing
one fails on every rank unless every rank had committed it (then it
completes). The log of each daemon says so ("abandoned: the job that wrote
it is gone").

At a clean exit (the interpreter ends without an uncaught exception)
end() runs for every mount declared: the process's saves are then left as
they are (an async commit under way completes). Call end() yourself to end
earlier; a process that never declares itself (cp, a shell script) leaves
its saves as they are whatever happens to it.

LABEL names the job in the daemons' logs: the scheduler's job and restart
(SLURM_JOB_ID, SLURM_RESTART_COUNT, TORCHELASTIC_RUN_ID,
TORCHELASTIC_RESTART_COUNT), the rank and the pid.
"""

import atexit
import os
import sys
import threading

XATTR = "user.ckpt.job"
LABEL_MAX = 127

_lock = threading.Lock()
_declared = {}  # mount -> the pid that declared it (a forked child is not it)
_atexit_set = False

_LABEL_VARS = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
               "TORCHELASTIC_RESTART_COUNT", "RANK")


def label():
    """What the daemons' logs call this job."""
    parts = [f"{k}={os.environ[k]}" for k in _LABEL_VARS if os.environ.get(k)]
    parts.append(f"pid={os.getpid()}")
    text = " ".join(parts)
    return "".join(c if " " <= c < "\x7f" else "?" for c in text)[:LABEL_MAX]


def declare(mount):
    """Declare this process a job of the ckptfs mount at mount (its root);
    once per process and mount. True when the daemon watches it; False
    when it cannot (a daemon older than this, or not a ckptfs mount: the
    callers check the mount themselves)."""
    global _atexit_set
    mount = os.path.abspath(os.fspath(mount))
    with _lock:
        if _declared.get(mount) == os.getpid():
            return True
        try:
            os.setxattr(mount, XATTR, label().encode())
        except OSError:
            # an older daemon (ENOTSUP), no pidfd on this kernel (ENOSYS),
            # not a ckptfs mount: saving works as before, unwatched
            return False
        _declared[mount] = os.getpid()
        if not _atexit_set:
            atexit.register(_at_exit)
            _atexit_set = True
    return True


def end(mount=None):
    """This process ends cleanly on mount (None: every mount it declared):
    its saves there are left as they are when it exits."""
    with _lock:
        mounts = [m for m, pid in _declared.items()
                  if pid == os.getpid() and (mount is None or
                                             m == os.path.abspath(os.fspath(mount)))]
        for m in mounts:
            try:
                os.setxattr(m, XATTR, b"end")
            except OSError:
                pass  # the mount is gone: nothing of ours is left to keep
            del _declared[m]


def _at_exit():
    # An uncaught exception (sys.last_value, set before atexit runs) is a
    # crash: the saves it left are abandoned, as after a kill.
    if getattr(sys, "last_value", None) is None:
        end()
