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
#
# CKPT_MOUNT_BASE must be a directory that only root can change (root's,
# not writable by group or others, under directories of root's that only
# root can write, or sticky ones as /tmp; a symbolic link on the way must
# be root's); the prolog creates it so when it is missing, and refuses any
# other (exit 1): a user who can change it could plant BASE/JOB as a link,
# and root would give its target to the job's user. The job's directory is
# made anew, root's until it is filled, then given to the job's user; one
# left by an earlier job with this id that is not empty is moved aside to
# BASE/.ckpt-old.JOB.TIME (never handed to the new job, never followed).
set -u

base=${CKPT_MOUNT_BASE:-/local/ckpt}
job=${SLURM_JOB_ID:?not run by Slurm: no SLURM_JOB_ID}
uid=${SLURM_JOB_UID:?no SLURM_JOB_UID}
gid=${SLURM_JOB_GID:-$(id -g "$uid" 2>/dev/null || echo "$uid")}

fail() { echo "ckptfs prolog: $*" >&2; exit 1; }

# trusted PATH STICKY [LAX], make_trusted PATH STICKY: as in ckpt-mount
# (walk PATH from /: can only root change where it leads? make_trusted
# also creates what is missing, mode 0755; else tp_why says what is wrong).
trust_fail() {
  [[ -n $tp_why && ${2:-} != link ]] || tp_why=$1
  [[ ${2:-} == link ]] && tp_link=1
  [[ -z ${2:-} ]] && ((tp_lax))
}
trusted() {
  local rest=$1 cur=/ c next t u m links=0
  tp_real="" tp_missing="" tp_why="" tp_link="" tp_lax=${3:-0}
  [[ $rest == /* ]] || rest=$PWD/$rest
  while :; do
    while [[ $rest == /* ]]; do rest=${rest#/}; done
    [[ -n $rest ]] || break
    c=${rest%%/*}
    rest=${rest#"$c"}
    case $c in
      .) continue ;;
      ..) cur=${cur%/*}; cur=${cur:-/}; continue ;;
    esac
    read -r u m < <(stat -c "%u %a" -- "$cur" 2>/dev/null) ||
      trust_fail "cannot stat $cur" fatal || return 1
    ((u == 0 || u == EUID)) || trust_fail "$cur belongs to uid $u" || return 1
    (((8#$m & 8#022) == 0 || (8#$m & 8#1000) != 0)) ||
      trust_fail "$cur is writable by others than its owner (mode $m)" || return 1
    next=${cur%/}/$c
    if [[ -L $next ]]; then
      u=$(stat -c %u -- "$next" 2>/dev/null) || trust_fail "cannot stat $next" fatal || return 1
      ((u == 0 || u == EUID)) ||
        trust_fail "$next is a symbolic link that belongs to uid $u" link || return 1
      ((++links <= 40)) || trust_fail "$1: too many levels of symbolic links" link || return 1
      t=$(readlink -- "$next")
      [[ $t == /* ]] && cur=/
      rest=$t/$rest
      continue
    fi
    if [[ ! -e $next ]]; then
      tp_missing=$next
      tp_real=$(realpath -m -s -- "$next/$rest")
      [[ -z $tp_why ]]
      return
    fi
    [[ -d $next ]] || trust_fail "$next is not a directory" fatal || return 1
    cur=$next
  done
  tp_real=$cur
  read -r u m < <(stat -c "%u %a" -- "$cur" 2>/dev/null) ||
    trust_fail "cannot stat $cur" fatal || return 1
  ((u == 0 || u == EUID)) || trust_fail "$cur belongs to uid $u" || return 1
  (((8#$m & 8#022) == 0 || ($2 == 1 && (8#$m & 8#1000) != 0))) ||
    trust_fail "$cur is writable by others than its owner (mode $m)" || return 1
  [[ -z $tp_why ]]
}
make_trusted() {
  local i e
  for ((i = 0; i < 100; i++)); do
    trusted "$1" "$2" || return 1
    [[ -n $tp_missing ]] || return 0
    if ! e=$(mkdir -m 0755 -- "$tp_missing" 2>&1) && [[ ! -e $tp_missing && ! -L $tp_missing ]]; then
      tp_why="cannot create $tp_missing: ${e##*: }"
      return 1
    fi
  done
  tp_why="cannot create $1"
  return 1
}

if [[ ! -c /dev/fuse ]]; then
  fail "/dev/fuse missing on $(hostname)"
fi
make_trusted "$base" 0 ||
  fail "CKPT_MOUNT_BASE $base: $tp_why; it must be a directory that only root can" \
    "change: root's, mode 0755 (mkdir -m 0755 $base), under directories that only" \
    "root can write (or sticky ones, as /tmp); or a missing one, which this prolog" \
    "creates so"
base=$tp_real
root=$base/$job
chmod 755 -- "$base" || exit 1
# A directory left from an earlier job with this id (a node reboot): only
# empty directories are removed, never anything under a live mount. One
# that is not empty (its user's files: maybe another user's, maybe links)
# is moved aside, as it is.
if [[ -e $root || -L $root ]]; then
  if [[ -d $root && ! -L $root ]]; then
    rmdir -- "$root"/rank* 2>/dev/null
    rm -f -- "$root"/.ckpt-mount.*
    rmdir -- "$root" 2>/dev/null
  fi
  if [[ -e $root || -L $root ]]; then
    old=$base/.ckpt-old.$job.$(date +%Y%m%dT%H%M%S).$$
    mv -T -- "$root" "$old" || fail "cannot move $root away"
    echo "ckptfs prolog: $root, left by an earlier job with this id, is not empty:" \
      "moved to $old (look at it, then remove it)" >&2
  fi
fi
# Made root's (nobody else can enter it while it is filled), given to the
# job's user last.
mkdir -m 700 -- "$root" || exit 1
n=${CKPT_PRECREATE_RANKS:-0}
if [[ $n =~ ^[0-9]+$ ]] && ((n > 0)); then
  for ((r = 0; r < n; r++)); do
    mkdir -m 700 -- "$root/rank$r" && chown -h -- "$uid:$gid" "$root/rank$r" || exit 1
  done
fi
chown -h -- "$uid:$gid" "$root" || exit 1
exit 0
