"""ckptfs.errors - the exceptions of the ckptfs package: CkptfsError (a save
or load that cannot go on), CkptfsIOError (a failed read or write of a
ckptfs file, an OSError too) and CommitError (a failed commit, with the
reason ckptfs gave in NAME/.status and advice in the caller's terms)."""

import re

class CkptfsError(Exception):
    """A ckptfs save or load that cannot go on; the message says why."""


class CkptfsIOError(CkptfsError, OSError):
    """A read or write of a ckptfs file failed: an OSError too (errno
    kept, e.g. EIO for a damaged chunk), with the file in the message."""


class CommitError(CkptfsError):
    """A commit failed; .status holds the reason ckptfs gave. discarded:
    the staged checkpoint was discarded (a save that another rank aborted,
    or ckptfs.dcp's saves), else it stays staged for a fix and a retry.
    api: whose save it was ("client": ckptfs.save and friends; "dcp":
    ckptfs.dcp.Writer), for advice that applies to the caller."""

    def __init__(self, name, status_text, path=None, discarded=False, api="client"):
        self.name = name
        self.status = status_text
        self.path = path
        self.discarded = discarded
        self.api = api
        lines = [ln for ln in status_text.splitlines() if ln.strip()]
        reason = "; ".join(lines[1:]) if len(lines) > 1 else status_text.strip()
        where = f" ({path})" if path else ""
        what = "checkpoint_id" if api == "dcp" else "name"
        if status_text.startswith("committed\n"):
            # lost to another save of the name: that one is NAME now, on
            # this mount too (rm -r would remove it for every mount)
            lost = [ln[len("lost: "):] for ln in lines if ln.startswith("lost: ")]
            super().__init__(f"commit of checkpoint {name!r} failed{where}: "
                             f"{lost[0] if lost else reason}. Save under another {what}.")
            return
        if discarded:
            then = ("the staged checkpoint was discarded on every rank, so the "
                    f"same {what} can be saved again.")
        elif api == "dcp":
            then = ("this rank's staged checkpoint stays (failed); the next "
                    "dcp.save of this checkpoint_id discards it first.")
        else:
            then = ("the checkpoint stays staged on every rank: fix what the "
                    "reason names and save again with exist_ok=True, or discard "
                    "it with rm -r.")
        super().__init__(f"commit of checkpoint {name!r} failed{where}: {reason}. "
                         f"Nothing was published; {then}{_advice(reason, api)}")

    def __reduce__(self):
        # DCP pickles a rank's exception to send it to the coordinator: keep
        # the constructor's arguments, not the formatted message.
        return (type(self), (self.name, self.status, self.path, self.discarded, self.api))


# ckptfs's reason for replicas of one item whose bytes differ (planner/plan.c)
_REPLICAS_DIFFER = re.compile(r"\breplicas (of chunk .*)?differ: ")


def _advice(reason, api):
    """What the caller can do about the reason of a failed commit, in the
    terms of its own API ("" when there is nothing particular to say)."""
    if not _REPLICAS_DIFFER.search(reason):
        return ""
    why = (" Every rank that saves a key saves a replica of it, and ckptfs "
           "stores a replicated item once, only when every copy has the same "
           "bytes: give a value that differs by rank a key of its own on each "
           'rank (e.g. f"rank{rank}.x")')
    if api == "dcp":
        return (why + ', or save with ckptfs.dcp.Writer(mount, replicas="dedup") '
                "to store only the copy DCP's planner picks, as stock DCP does "
                "(or mount with -o replica_check=warn).")
    return (why + ", or put such a key in one rank's state dict only (or mount "
            "with -o replica_check=warn).")

