#!/usr/bin/env bash
# Example Slurm prolog for ckptfs jobs: runs as root on every node of an
# allocation before the job starts, and prepares the job's MOUNTROOT there,
# a local directory owned by the job's user. The job then runs, on its
# first node:
#
#   ckpt-mount -n "$SLURM_NTASKS" /shared/ckpt "/local/ckpt/$SLURM_JOB_ID"
#
# and ckpt-mount creates MOUNTROOT/rankR on the node of each rank R (a
# short mpirun job with the daemons' mapping). Set CKPT_PRECREATE_RANKS=N
# to also create rank0..rank<N-1> here, on every node.
#
# slurm.conf:
#   Prolog=/etc/slurm/ckptfs-prolog.sh
#   Epilog=/etc/slurm/ckptfs-epilog.sh
#   PrologFlags=Alloc   # prolog on every node at allocation time, before
#                       # the batch script (not at each node's first step)
#
# Needs on every node: fuse3 (fusermount3, setuid root, lets the user
# mount), /dev/fuse, and the ckptfs binary and mount-scripts at one path.
# A prolog that exits non-zero drains the node: fail only when the node
# really cannot serve the job.
set -u

base=${CKPT_MOUNT_BASE:-/local/ckpt}
job=${SLURM_JOB_ID:?not run by Slurm: no SLURM_JOB_ID}
uid=${SLURM_JOB_UID:?no SLURM_JOB_UID}
gid=${SLURM_JOB_GID:-$(id -g "$uid" 2>/dev/null || echo "$uid")}
root=$base/$job

if [[ ! -c /dev/fuse ]]; then
  echo "ckptfs prolog: /dev/fuse missing on $(hostname)" >&2
  exit 1
fi
mkdir -p -- "$base" && chmod 755 -- "$base" || exit 1
# A directory left from an earlier job with this id (a node reboot): only
# empty directories are removed, never anything under a live mount.
if [[ -e $root ]]; then
  rmdir -- "$root"/rank* 2>/dev/null
  rm -f -- "$root"/.ckpt-mount.*
  rmdir -- "$root" 2>/dev/null
fi
install -d -m 700 -o "$uid" -g "$gid" -- "$root" || exit 1

n=${CKPT_PRECREATE_RANKS:-0}
if [[ $n =~ ^[0-9]+$ ]] && ((n > 0)); then
  for ((r = 0; r < n; r++)); do
    install -d -m 700 -o "$uid" -g "$gid" -- "$root/rank$r" || exit 1
  done
fi
exit 0
