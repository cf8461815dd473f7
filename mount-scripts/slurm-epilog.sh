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
#
# As root, it trusts nothing the job's user could have planted: nothing is
# done in a CKPT_MOUNT_BASE that another user can change (the prolog
# refuses one too), the log is kept only in a CKPT_LOG_DIR that only root
# can change (created so when missing), and a mount left under MOUNTROOT
# is detached as the job's user (fusermount3: only that user's own FUSE
# mounts), never by a path that user's directories lead elsewhere.
set -u

base=${CKPT_MOUNT_BASE:-/local/ckpt}
scripts=${CKPT_SCRIPTS:-$(dirname -- "$(readlink -f -- "$0")")}
job=${SLURM_JOB_ID:?not run by Slurm: no SLURM_JOB_ID}

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

if ! trusted "$base" 0; then
  echo "ckptfs epilog: job $job: CKPT_MOUNT_BASE $base: $tp_why: nothing done there" \
    "(the prolog refuses it too)" >&2
  exit 0
fi
[[ -z $tp_missing ]] || exit 0
root=$tp_real/$job

[[ -d $root && ! -L $root ]] || exit 0

logdir=${CKPT_LOG_DIR:-${CKPT_KEEP_LOGS:-/var/log/ckptfs}}
days=${CKPT_LOG_DAYS:-30}
[[ $days =~ ^[0-9]+$ ]] || days=30

# keep_log FILE: move the job's log to logdir. The job's user owns FILE
# (and could have made it a link, a FIFO, a hard link): it is moved first,
# into a directory only root can change (else it is not kept), and
# checked there.
keep_log() {
  [[ $logdir != none && -f $1 && ! -L $1 && -s $1 ]] || return 0
  local dir dst
  if ! make_trusted "$logdir" 0; then
    echo "ckptfs epilog: job $job: cannot keep the log in $logdir: $tp_why" \
      "(CKPT_LOG_DIR must be a directory that only root can change)" >&2
    return 0
  fi
  dir=$tp_real
  dst=$dir/ckpt-mount.$job.$(hostname -s 2>/dev/null || uname -n).log
  if ! mv -fT -- "$1" "$dst"; then
    echo "ckptfs epilog: job $job: cannot keep $1 in $logdir" >&2
    return 0
  fi
  if [[ -L $dst || ! -f $dst ]] || [[ $(stat -c %h -- "$dst") != 1 ]]; then
    rm -f -- "$dst"
    return 0
  fi
  chmod 600 -- "$dst"
  find "$dir" -maxdepth 1 -type f -name 'ckpt-mount.*.log' -mtime +"$days" \
    -delete 2>/dev/null
}

# Unmount on this node only: the other nodes run their own epilog. The job
# is over, so staged data that was never committed is discarded: ckpt-umount
# names each such checkpoint ("discarding ...") on stderr, the slurmd log
# (a daemon still alive to be asked; a killed one lost it with the job).
if ! "$scripts/ckpt-umount" --local --discard --quiet --busy-timeout 5 --timeout 30 "$root"; then
  echo "ckptfs epilog: job $job: ckpt-umount $root reported problems" >&2
fi

# Anything still mounted under root (not a rankN mount): detach it too, as
# the job's user. Its path runs through that user's directories, and the
# user could have made one a link to any other mount (or named one with
# the \040 that mountinfo shows for a space): as that user, fusermount3
# unmounts only the user's own FUSE mounts, wherever the path leads.
juid=${SLURM_JOB_UID:-$(stat -c %u -- "$root")}
jgid=${SLURM_JOB_GID:-$(stat -c %g -- "$root")}
as_user=()
[[ $juid =~ ^[0-9]+$ && $jgid =~ ^[0-9]+$ ]] || juid=65534 jgid=65534
((juid == 0)) || as_user=(setpriv --reuid="$juid" --regid="$jgid" --clear-groups --)
left=()
while read -r _ _ _ _ mp _; do
  mp=${mp//\\040/ }
  mp=${mp//\\011/$'\t'}
  mp=${mp//\\012/$'\n'}
  mp=${mp//\\134/\\}
  [[ $mp == "$root"/* ]] && left+=("$mp")
done </proc/self/mountinfo
if ((${#left[@]})); then
  mapfile -t left < <(printf '%s\n' "${left[@]}" | sort -r) # the deepest first
  for mp in "${left[@]}"; do
    "${as_user[@]}" fusermount3 -uz -- "$mp" 2>/dev/null
  done
fi

rmdir -- "$root"/rank* 2>/dev/null
# Open MPI's session directories of the scripts' jobs (ckpt-mount gives
# each its own there): a killed job leaves files in them. Removed by their
# owner, the job's user (or root, for a ckpt-mount run as root), nothing
# mounted under them by now; rm -r follows no link.
mpi_dir=$root/.ckpt-mpi
if [[ -d $mpi_dir && ! -L $mpi_dir ]]; then
  case $(stat -c %u -- "$mpi_dir") in
    "$juid") "${as_user[@]}" rm -rf --one-file-system -- "$mpi_dir" 2>/dev/null ;;
    0) rm -rf --one-file-system -- "$mpi_dir" 2>/dev/null ;;
  esac
fi
rm -f -- "$root"/.ckpt-mount.pid "$root"/.ckpt-mount.state "$root"/.ckpt-mount.rc \
  "$root"/.ckpt-mount.made
keep_log "$root/.ckpt-mount.log"
rm -f -- "$root/.ckpt-mount.log"
if ! rmdir -- "$root" 2>/dev/null; then
  echo "ckptfs epilog: job $job: $root is not empty, left in place" >&2
fi
exit 0
