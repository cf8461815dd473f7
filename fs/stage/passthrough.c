/*
 * passthrough.c - staged files written by FUSE passthrough: the kernel writes\n * a backing file of the file's own (write once); the daemon holds it\n * read-only and knows by a read lease whether anyone can write it.
 */
#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>
#include <xxhash.h>

#include "stage_int.h"

/* ------------------------------------------------------------------------
 * FUSE passthrough (write once): the file's bytes live in a file of its
 * own in BACKING_DIR/.staging (O_TMPFILE), which the kernel writes and
 * reads directly (fi->backing_id): the daemon sees no data request and
 * copies nothing. At commit that file is linked as the file's data file
 * (ckpt__stream_own): the trainer's write was the only one.
 *
 * The daemon holds it read-only (pt_fd), so that "is anyone able to
 * write it?" has an exact answer from the kernel: a read lease
 * (F_SETLEASE F_RDLCK) is refused while any open file description of it
 * can write, which includes the kernel's backing files of open handles
 * and a writable shared mapping that outlives its file's close. A file
 * nobody can write is "sealed": hashed by the drain, or frozen for a
 * commit. An open for writing unseals it (pt_gen counts those), and a
 * commit that finds a writer fails with EBUSY, naming the process.
 * ---------------------------------------------------------------------- */

/* One more backing file, within the budget (a staged file past it takes
 * the daemon's path: its bytes go into segments or a stream). */
static bool pt_fd_take(ckpt_staging_t *b) {
  if (atomic_fetch_add(&b->pt_files, 1) < b->pt_max)
    return true;
  atomic_fetch_sub(&b->pt_files, 1);
  bool was = false;
  if (atomic_compare_exchange_strong(&b->pt_full_said, &was, true))
    ckpt__log("passthrough: %u staged files hold a backing file each (half "
              "the open files limit): further ones go through the daemon "
              "until some are committed or removed", b->pt_max);
  return false;
}

void ckpt__stg_pt_fd_give(ckpt_staging_t *b) { atomic_fetch_sub(&b->pt_files, 1); }

/* fd reopened with flags through /proc (an unnamed file has no other
 * name): a descriptor or -errno. */
static int reopen(int fd, int flags) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
  int r = open(path, flags | O_CLOEXEC);
  return r >= 0 ? r : -errno;
}

static _Atomic bool low_space_said;

/* Enough room in BACKING_DIR (the tier, with -o tier) to write a new
 * file there? At least
 * CKPT_PT_MIN_FREE (or staging_mem, if smaller) must be free: on a nearly
 * full backing a staged file goes through the daemon into staging
 * memory, so that running out of space fails the commit (which can be
 * retried), not the trainer's write. */
static bool room_to_write(ckpt_staging_t *b) {
  struct statvfs v;
  if (fstatvfs(b->backing_fd, &v))
    return true; /* the write will say */
  uint64_t free = (uint64_t)v.f_bavail * (uint64_t)v.f_frsize;
  uint64_t want = b->limit < CKPT_PT_MIN_FREE ? b->limit : CKPT_PT_MIN_FREE;
  bool was = false;
  if (free < want &&
      atomic_compare_exchange_strong(&low_space_said, &was, true))
    ckpt__log("passthrough: the staging directory's filesystem (BACKING_DIR, "
              "or the tier) has %llu MiB free, less than %llu MiB: new "
              "staged files go through the daemon while so",
              (unsigned long long)(free >> 20),
              (unsigned long long)(want >> 20));
  return free >= want;
}

#define PT_POOL_MAX 256u

void ckpt__staging_pt_recycle(ckpt_staging_t *b, int fd) {
  int rw = reopen(fd, O_RDWR);
  bool ok = rw >= 0 && ftruncate(rw, 0) == 0;
  if (rw >= 0)
    close(rw);
  pthread_mutex_lock(&b->lock);
  if (ok && !b->pt_pool)
    b->pt_pool = malloc(PT_POOL_MAX * sizeof(*b->pt_pool));
  if (ok && b->pt_pool && b->pt_npool < PT_POOL_MAX) {
    /* marked (O_NOATIME, in /proc/PID/fdinfo) as no file's yet */
    fcntl(fd, F_SETFL, O_NOATIME);
    b->pt_pool[b->pt_npool++] = fd;
    fd = -1;
  }
  pthread_mutex_unlock(&b->lock);
  if (fd >= 0)
    close(fd);
}

int ckpt__sfile_pt_start(ckpt_sfile_t *sf) {
  ckpt_staging_t *b = sf->budget;
  if (!room_to_write(b))
    return -ENOSPC;
  if (!pt_fd_take(b))
    return -EMFILE;
  int fd = -1;
  pthread_mutex_lock(&b->lock);
  if (b->pt_npool > 0)
    fd = b->pt_pool[--b->pt_npool];
  pthread_mutex_unlock(&b->lock);
  if (fd >= 0) { /* a reused one: new now */
    fcntl(fd, F_SETFL, 0);
    futimens(fd, NULL);
  } else {
    int rw = ckpt__staging_tmpfile(b->backing_fd);
    fd = rw >= 0 ? reopen(rw, O_RDONLY) : rw;
    if (rw >= 0)
      close(rw);
  }
  if (fd < 0) {
    ckpt__stg_pt_fd_give(b);
    return fd;
  }
  struct stat st;
  pthread_mutex_lock(&sf->lock);
  sf->pt_fd = fd;
  if (fstat(fd, &st) == 0)
    sf->pt_ctim_seen = st.st_ctim;
  sf->hash_broken = true; /* hashed after its close (drain.c) */
  pthread_mutex_unlock(&sf->lock);
  return 0;
}

void ckpt__sfile_pt_abandon(ckpt_sfile_t *sf) {
  pthread_mutex_lock(&sf->lock);
  if (sf->pt_fd >= 0 && sf->size == 0) {
    close(sf->pt_fd);
    sf->pt_fd = -1;
    sf->hash_broken = false;
    ckpt__stg_pt_fd_give(sf->budget);
  }
  pthread_mutex_unlock(&sf->lock);
}

/* The size as the kernel left it. sf->lock held. */
int ckpt__stg_pt_refresh(ckpt_sfile_t *sf) {
  CKPT_HELD(&sf->lock);
  struct stat st;
  if (fstat(sf->pt_fd, &st))
    return -errno;
  sf->size = (uint64_t)st.st_size;
  atomic_store_explicit(&sf->size_seen, sf->size, memory_order_relaxed);
  return 0;
}

static _Atomic bool no_leases_said;

/* Can anyone write the backing file? 0 when nobody can, -EBUSY when some
 * open file description can (a handle, a writable shared mapping).
 * Where the kernel grants no lease (fs.leases-enable=0), the handles
 * passed through are all it can tell: mappings go unseen (logged once).
 * sf->lock held. */
static int pt_writers(ckpt_sfile_t *sf) {
  CKPT_HELD(&sf->lock);
  /* a handle counted by the daemon may not be the kernel's yet (the open
   * reply not sent): it counts first */
  if (sf->pt_wopens > 0)
    return -EBUSY;
  if (fcntl(sf->pt_fd, F_SETLEASE, F_RDLCK) == 0) {
    fcntl(sf->pt_fd, F_SETLEASE, F_UNLCK);
    return 0;
  }
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EBUSY)
    return -EBUSY;
  bool was = false;
  if (atomic_compare_exchange_strong(&no_leases_said, &was, true))
    ckpt__log("passthrough: no read lease on a staged file's backing file "
              "(%s): a writable shared mapping left after a file's close "
              "cannot be seen at commit", strerror(errno));
  return 0;
}

bool ckpt__sfile_pt_writable(ckpt_sfile_t *sf) {
  if (atomic_load(&sf->pt_fd) < 0)
    return false;
  pthread_mutex_lock(&sf->lock);
  bool w = sf->pt_fd >= 0 && !sf->pt_sealed &&
           (sf->pt_wopens > 0 || pt_writers(sf) != 0);
  pthread_mutex_unlock(&sf->lock);
  return w;
}

int ckpt__sfile_pt_seal(ckpt_sfile_t *sf) {
  CKPT_HELD(&sf->lock);
  int rc = 0;
  if (sf->pt_fd >= 0 && !sf->pt_sealed) {
    rc = pt_writers(sf);
    if (rc == 0)
      sf->pt_sealed = true;
  }
  if (sf->pt_fd >= 0 && rc == 0)
    rc = ckpt__stg_pt_refresh(sf);
  /* the kernel's writes know no CKPT_MAX_FILE: checked here */
  if (rc == 0 && sf->pt_fd >= 0 && sf->size > CKPT_MAX_FILE)
    rc = -EFBIG;
  return rc;
}

int ckpt__sfile_pt_freeze(ckpt_sfile_t *sf) {
  pthread_mutex_lock(&sf->lock);
  int rc = ckpt__sfile_pt_seal(sf);
  pthread_mutex_unlock(&sf->lock);
  return rc;
}

void ckpt__sfile_pt_thaw(ckpt_sfile_t *sf) {
  CKPT_HELD(&sf->lock);
  if (sf->pt_fd < 0 || !sf->pt_sealed)
    return;
  sf->pt_sealed = false;
  sf->pt_gen++;          /* a hash being computed is stale */
  sf->hash_broken = true;
}

/* The backing file, writable, for a change the daemon makes itself
 * (truncate, a write not passed through): a descriptor to close, or
 * -errno. sf->lock held. */
int ckpt__stg_pt_rw(ckpt_sfile_t *sf) {
  CKPT_HELD(&sf->lock);
  if (ckpt__sfile_pt_committed(sf))
    return -EROFS;
  ckpt__sfile_pt_thaw(sf);
  return reopen(sf->pt_fd, O_RDWR);
}

bool ckpt__sfile_pt_committed(const ckpt_sfile_t *sf) {
  CKPT_HELD(&sf->lock);
  return sf->stream >= 0 && sf->streams &&
         atomic_load(&sf->streams->committed);
}

/* /proc/PID/comm of pid, into buf ("?" when gone). A process names
 * itself: anything but printable ASCII becomes '?'. */
static void comm_of(pid_t pid, char *buf, size_t cap) {
  char path[64];
  snprintf(path, sizeof(path), "/proc/%d/comm", (int)pid);
  FILE *f = fopen(path, "re");
  if (!f || !fgets(buf, (int)cap, f))
    snprintf(buf, cap, "?");
  if (f)
    fclose(f);
  buf[strcspn(buf, "\n")] = '\0';
  for (char *c = buf; *c; c++)
    if (*c < 0x20 || *c > 0x7e)
      *c = '?';
}

/* How a shared mapping holds the file, best first. */
enum { MAPPER_NONE, MAPPER_RO_UNKNOWN, MAPPER_RO_WRITABLE_FD, MAPPER_WRITABLE };

/* For a read-only shared mapping [start, end) of process pid:
 * MAPPER_RO_WRITABLE_FD when the open file description it maps is open for
 * writing (an mprotect can make the mapping writable, and a lease sees the
 * file held writable), MAPPER_NONE when it is not (or the mapping is gone),
 * MAPPER_RO_UNKNOWN when /proc cannot say. The mode of
 * /proc/PID/map_files/START-END (Linux >= 4.3; a lookup needs the right to
 * ptrace-read the process, which root has) shows the description's
 * FMODE_READ and FMODE_WRITE as S_IRUSR and S_IWUSR. */
static int ro_mapping_kind(long pid, unsigned long start, unsigned long end) {
  char path[96];
  struct stat st;
  snprintf(path, sizeof(path), "/proc/%ld/map_files/%lx-%lx", pid, start,
           end);
  if (lstat(path, &st) != 0)
    return errno == ENOENT && access("/proc/self/map_files", F_OK) == 0
               ? MAPPER_NONE
               : MAPPER_RO_UNKNOWN;
  return (st.st_mode & S_IWUSR) ? MAPPER_RO_WRITABLE_FD : MAPPER_NONE;
}

/* A process with a shared mapping of the backing file (dev, ino) or of the
 * mount's file (inode fino of the FUSE mount, on an anonymous device: what
 * /proc/PID/maps shows for a mapping made through the mount) that can
 * write it, from /proc/PID/maps (only read, and believed only for a name):
 * its pid, or 0, and *how it maps it. A writable mapping is searched
 * first; else a read-only one of a descriptor open for writing (PROT_READ
 * and MAP_SHARED of an O_RDWR file: its description still holds the file
 * writable); else one /proc cannot tell about. */
static pid_t find_mapper(dev_t dev, ino_t ino, uint64_t fino,
                         const char **how) {
  DIR *d = opendir("/proc");
  if (!d)
    return 0;
  pid_t found = 0;
  int best = MAPPER_NONE;
  char line[512], path[64];
  for (struct dirent *e;
       best != MAPPER_WRITABLE && (e = readdir(d)) != NULL;) {
    char *end;
    long pid = strtol(e->d_name, &end, 10);
    if (*end || pid <= 0)
      continue;
    snprintf(path, sizeof(path), "/proc/%ld/maps", pid);
    FILE *f = fopen(path, "re");
    while (f && best != MAPPER_WRITABLE && fgets(line, sizeof(line), f)) {
      /* a line longer than the buffer (a long path): its rest is skipped,
       * never read as a line of its own */
      if (!strchr(line, '\n'))
        for (int c; (c = getc(f)) != EOF && c != '\n';)
          ;
      char perms[8];
      unsigned maj, min;
      unsigned long start, stop;
      unsigned long long off, inode;
      if (sscanf(line, "%lx-%lx %7s %llx %x:%x %llu", &start, &stop, perms,
                 &off, &maj, &min, &inode) != 7 ||
          strlen(perms) < 4 || perms[3] != 's' ||
          !((inode == (unsigned long long)ino && makedev(maj, min) == dev) ||
            (inode == fino && maj == 0)))
        continue;
      int kind = perms[1] == 'w' ? MAPPER_WRITABLE
                                 : ro_mapping_kind(pid, start, stop);
      if (kind > best) {
        best = kind;
        found = (pid_t)pid;
      }
    }
    if (f)
      fclose(f);
  }
  closedir(d);
  if (best == MAPPER_WRITABLE)
    *how = "mapped writable and shared";
  else if (best == MAPPER_RO_WRITABLE_FD)
    *how = "mapped shared from a descriptor open for writing";
  else if (best == MAPPER_RO_UNKNOWN)
    *how = "mapped shared (read-only, perhaps from a descriptor open for "
           "writing)";
  return found;
}

/* The process of thread tid (the pid of a FUSE request is its thread's). */
static pid_t tgid_of(pid_t tid) {
  char path[64], line[128];
  snprintf(path, sizeof(path), "/proc/%d/status", (int)tid);
  FILE *f = fopen(path, "re");
  pid_t out = tid;
  while (f && fgets(line, sizeof(line), f))
    if (sscanf(line, "Tgid: %d", &out) == 1)
      break;
  if (f)
    fclose(f);
  return out;
}

char *ckpt__sfile_pt_who(ckpt_sfile_t *sf, uint64_t fino) {
  pthread_mutex_lock(&sf->lock);
  pid_t pid = sf->pt_wopens > 0 ? sf->pt_wpid : 0;
  struct stat st;
  bool have = sf->pt_fd >= 0 && fstat(sf->pt_fd, &st) == 0;
  pthread_mutex_unlock(&sf->lock);
  const char *how = "open for writing";
  if (!pid && have)
    pid = find_mapper(st.st_dev, st.st_ino, fino, &how);
  if (!pid)
    return strdup("open for writing (by a process not found: a descriptor "
                  "passed on, or a mapping of a process that ended)");
  pid = tgid_of(pid);
  char comm[64];
  comm_of(pid, comm, sizeof(comm));
  return ckpt__strdup_printf("%s by process %d (%s)", how, (int)pid, comm);
}

void ckpt__sfile_pt_ctime(ckpt_sfile_t *sf, const struct stat *st,
                          struct timespec *ctime) {
  CKPT_HELD(&sf->lock);
  if (st->st_ctim.tv_sec == sf->pt_ctim_seen.tv_sec &&
      st->st_ctim.tv_nsec == sf->pt_ctim_seen.tv_nsec)
    return;
  sf->pt_ctim_seen = st->st_ctim;
  /* Past both: the backing file's clock may be coarser than the
   * daemon's (before Linux 6.13, or another host's on NFS), so its time
   * alone could fall before a change the daemon made just before. */
  struct timespec next = *ctime;
  if (++next.tv_nsec >= 1000000000L)
    next.tv_sec++, next.tv_nsec = 0;
  bool later = st->st_ctim.tv_sec > next.tv_sec ||
               (st->st_ctim.tv_sec == next.tv_sec &&
                st->st_ctim.tv_nsec > next.tv_nsec);
  *ctime = later ? st->st_ctim : next;
}

void ckpt__sfile_pt_times(ckpt_sfile_t *sf, struct timespec *mtime,
                          struct timespec *ctime) {
  if (atomic_load(&sf->pt_fd) < 0)
    return;
  struct stat st; /* under the lock: a thaw may close the descriptor */
  pthread_mutex_lock(&sf->lock);
  if (sf->pt_fd >= 0 && fstat(sf->pt_fd, &st) == 0) {
    *mtime = st.st_mtim;
    /* sealed: the commit links or renames the backing file, which moves
     * its ctime but is no change of the user's */
    if (ctime && !sf->pt_sealed)
      ckpt__sfile_pt_ctime(sf, &st, ctime);
  }
  pthread_mutex_unlock(&sf->lock);
}

void ckpt__sfile_pt_set_mtime(ckpt_sfile_t *sf, const struct timespec *t) {
  if (atomic_load(&sf->pt_fd) < 0)
    return;
  struct stat st;
  pthread_mutex_lock(&sf->lock);
  if (sf->pt_fd >= 0 &&
      futimens(sf->pt_fd, (struct timespec[2]){{.tv_nsec = UTIME_OMIT}, *t}) ==
          0 &&
      fstat(sf->pt_fd, &st) == 0)
    sf->pt_ctim_seen = st.st_ctim; /* the daemon's own change */
  pthread_mutex_unlock(&sf->lock);
}

uint64_t ckpt__sfile_size_seen(ckpt_sfile_t *sf) {
  if (atomic_load(&sf->pt_fd) >= 0) {
    /* Passed through: the kernel wrote it. Its lock is never held for
     * long (no data request takes it), unlike a streamed file's. */
    struct stat st;
    pthread_mutex_lock(&sf->lock);
    uint64_t n = sf->size;
    if (sf->pt_fd >= 0 && !sf->pt_sealed && fstat(sf->pt_fd, &st) == 0)
      n = (uint64_t)st.st_size;
    pthread_mutex_unlock(&sf->lock);
    return n;
  }
  return atomic_load_explicit(&sf->size_seen, memory_order_relaxed);
}

bool ckpt__sfile_pt_open(ckpt_sfile_t *sf) {
  if (atomic_load(&sf->pt_fd) < 0)
    return false;
  pthread_mutex_lock(&sf->lock);
  bool open = sf->pt_fd >= 0 && sf->pt_opens > 0;
  pthread_mutex_unlock(&sf->lock);
  return open;
}

int ckpt__sfile_pt_detach(ckpt_sfile_t *sf) {
  CKPT_HELD(&sf->lock);
  int fd = sf->pt_fd;
  sf->pt_fd = -1;
  sf->pt_sealed = false;
  if (fd >= 0)
    ckpt__stg_pt_fd_give(sf->budget);
  return fd;
}

int ckpt__data_extent(int fd, uint64_t pos, uint64_t end, uint64_t *from,
                      uint64_t *to) {
  off_t d = lseek(fd, (off_t)pos, SEEK_DATA);
  if (d < 0 && errno == ENXIO) { /* a hole to the end of the file */
    struct stat st;
    if (fstat(fd, &st))
      return -errno;
    if ((uint64_t)st.st_size < end)
      return -ESTALE;
    *from = *to = end;
    return 0;
  }
  if (d < 0 && errno != EINVAL && errno != EOPNOTSUPP)
    return -errno;
  if (d < 0) { /* no SEEK_DATA here: all of it is data */
    *from = pos;
    *to = end;
    return 0;
  }
  off_t h = lseek(fd, d, SEEK_HOLE);
  *from = (uint64_t)d < end ? (uint64_t)d : end;
  *to = h > d && (uint64_t)h < end ? (uint64_t)h : end;
  return 0;
}
