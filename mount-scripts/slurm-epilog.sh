#!/usr/bin/env bash
# Example Slurm epilog for ckptfs jobs: runs as root on every node of an
# allocation after the job ends, and removes what the job's ckptfs ranks
# left on this node (the job should have run `ckpt-umount MOUNTROOT`
# itself; see slurm-prolog.sh for the set-up).
#
# By now Slurm has killed the job's processes, daemons included, so a rank
# mount left behind is dead ("Transport endpoint is not connected"):
# ckpt-umount --local detaches it. The checkpoints themselves are in the
# shared BACKING_DIR and stay there.
#
# Directories are removed with rmdir only, never rm -r: through a mount
# still alive, rm -r would delete checkpoints from BACKING_DIR.
# An epilog that exits non-zero drains the node, so this one reports
# problems on stderr (the slurmd log) and exits 0.
#
# The job's .ckpt-mount.log (every daemon's output: why a commit failed,
# what an unmount discarded) is kept, as CKPT_LOG_DIR/ckpt-mount.JOB.HOST.log
# (default /var/log/ckptfs; a shared directory collects every node's),
# readable by the job's user only; logs older than CKPT_LOG_DAYS (30)
# days are deleted there. CKPT_LOG_DIR=none drops them with the job.
# CKPT_KEEP_LOGS=DIR, the older name, still works.
set -u

base=${CKPT_MOUNT_BASE:-/local/ckpt}
scripts=${CKPT_SCRIPTS:-$(dirname -- "$(readlink -f -- "$0")")}
job=${SLURM_JOB_ID:?not run by Slurm: no SLURM_JOB_ID}
root=$base/$job

[[ -d $root ]] || exit 0

logdir=${CKPT_LOG_DIR:-${CKPT_KEEP_LOGS:-/var/log/ckptfs}}
days=${CKPT_LOG_DAYS:-30}
[[ $days =~ ^[0-9]+$ ]] || days=30

# keep_log FILE: move the job's log to logdir. The job's user owns FILE
# (and could have made it a link): it is moved first, into a directory
# only root writes, and checked there.
keep_log() {
  [[ $logdir != none && -f $1 && ! -L $1 && -s $1 ]] || return 0
  local dst
  dst=$logdir/ckpt-mount.$job.$(hostname -s 2>/dev/null || uname -n).log
  if ! { mkdir -p -m 755 -- "$logdir" && mv -fT -- "$1" "$dst"; }; then
    echo "ckptfs epilog: job $job: cannot keep $1 in $logdir" >&2
    return 0
  fi
  if [[ -L $dst || ! -f $dst ]]; then
    rm -f -- "$dst"
    return 0
  fi
  chmod 600 -- "$dst"
  find "$logdir" -maxdepth 1 -type f -name 'ckpt-mount.*.log' -mtime +"$days" \
    -delete 2>/dev/null
}

# Unmount on this node only: the other nodes run their own epilog. The job
# is over, so staged data that was never committed is discarded: ckpt-umount
# names each such checkpoint ("discarding ...") on stderr, the slurmd log
# (a daemon still alive to be asked; a killed one lost it with the job).
if ! "$scripts/ckpt-umount" --local --discard --quiet --busy-timeout 5 --timeout 30 "$root"; then
  echo "ckptfs epilog: job $job: ckpt-umount $root reported problems" >&2
fi

# Anything still mounted under root (not a rankN mount): detach it too.
awk -v r="$root/" 'index($5, r) == 1 {print $5}' /proc/self/mountinfo |
  while read -r mp; do
    fusermount3 -uz -- "$mp" 2>/dev/null || umount -l -- "$mp" 2>/dev/null
  done

rmdir -- "$root"/rank* 2>/dev/null
rm -f -- "$root"/.ckpt-mount.pid "$root"/.ckpt-mount.state "$root"/.ckpt-mount.rc \
  "$root"/.ckpt-mount.made
keep_log "$root/.ckpt-mount.log"
rm -f -- "$root/.ckpt-mount.log"
if ! rmdir -- "$root" 2>/dev/null; then
  echo "ckptfs epilog: job $job: $root is not empty, left in place" >&2
fi
exit 0
