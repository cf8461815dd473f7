"""Kill points of the crash-restart jobs (dcp_job.py train_restart and
restart_*_job.py): KILL is "RANKS:WHEN:STEP" (RANKS "all" or a rank; WHEN
the job's own moment names) or "none"."""

import os
import signal
import sys

RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))


def kill_when(kill, step):
    """WHEN this rank dies at the save of step under KILL, else None."""
    if kill == "none":
        return None
    ranks, when, at = kill.split(":")
    if int(at) != step or (ranks != "all" and int(ranks) != RANK):
        return None
    return when


def die(why=""):
    """SIGKILL this process, saying why (the tests look for it)."""
    if why:
        print(f"ckpt-kill rank {RANK}: {why}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
