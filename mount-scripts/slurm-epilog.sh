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
set -u

base=${CKPT_MOUNT_BASE:-/local/ckpt}
scripts=${CKPT_SCRIPTS:-$(dirname -- "$(readlink -f -- "$0")")}
job=${SLURM_JOB_ID:?not run by Slurm: no SLURM_JOB_ID}
root=$base/$job

[[ -d $root ]] || exit 0

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
rm -f -- "$root"/.ckpt-mount.pid "$root"/.ckpt-mount.state "$root"/.ckpt-mount.rc
# keep the log of a failed start for the user: move it beside the job's
# other output if asked to, else drop it with the directory
if [[ -n ${CKPT_KEEP_LOGS:-} && -f $root/.ckpt-mount.log ]]; then
  mkdir -p -- "$CKPT_KEEP_LOGS" &&
    mv -f -- "$root/.ckpt-mount.log" "$CKPT_KEEP_LOGS/ckpt-mount.$job.$(hostname).log"
fi
rm -f -- "$root/.ckpt-mount.log"
if ! rmdir -- "$root" 2>/dev/null; then
  echo "ckptfs epilog: job $job: $root is not empty, left in place" >&2
fi
exit 0
