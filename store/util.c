/*
 * util.c - the small helpers every part of ckptfs uses (store.h).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <syslog.h>
#include <time.h>
#include <unistd.h>

#include "store.h"
#include "store_int.h"

char *ckpt__strdup_printf(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char *s = NULL;
  if (vasprintf(&s, fmt, ap) < 0)
    s = NULL;
  va_end(ap);
  return s;
}

static int log_fd = -1;        /* the log file, or -1 */
static bool log_syslog = false;
static int log_rank = -1;

int ckpt__log_to(const char *path, bool use_syslog, int rank) {
  if (path) {
    /* A root daemon never writes through a name another user planted: no
     * symlink, FIFO (O_NONBLOCK: never waits for a reader) or socket, and
     * no file of another user's (a character device of root's, such as
     * /dev/null, is fine). */
    int fd = open(path,
                  O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY |
                      O_NOFOLLOW | O_NONBLOCK,
                  0600);
    if (fd < 0)
      return -errno;
    struct stat st;
    int e = fstat(fd, &st) ? errno : 0;
    if (!e && !S_ISREG(st.st_mode) && !S_ISCHR(st.st_mode)) /* /dev/null */
      e = EINVAL;
    else if (!e && st.st_uid != geteuid() && st.st_uid != 0)
      e = EPERM;
    if (e) {
      close(fd);
      return -e;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
      fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    if (log_fd >= 0)
      close(log_fd);
    log_fd = fd;
  } else if (use_syslog) {
    openlog("ckptfs", LOG_PID, LOG_DAEMON);
    log_syslog = true;
  }
  log_rank = rank;
  return 0;
}

/* The prefix every line of a log message starts with. */
static void log_prefix(char *out, size_t size) {
  if (log_fd < 0) {
    snprintf(out, size, "ckptfs: ");
    return;
  }
  struct timespec ts;
  struct tm tm;
  clock_gettime(CLOCK_REALTIME, &ts);
  gmtime_r(&ts.tv_sec, &tm);
  char when[32];
  strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm);
  char who[32] = "";
  if (log_rank >= 0)
    snprintf(who, sizeof(who), " rank %d", log_rank);
  snprintf(out, size, "%s.%03ldZ ckptfs[%ld]%s: ", when, ts.tv_nsec / 1000000,
           (long)getpid(), who);
}

/* A message of several lines (a commit's reason names each problem on a
 * line) is logged as that many lines, each with the prefix, so that every
 * line of the log says when and who; all of them in one write. */
void ckpt__log(const char *fmt, ...) {
  char msg[4096];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (n < 0)
    return;
  if ((size_t)n >= sizeof(msg))
    n = sizeof(msg) - 1;
  while (n > 0 && msg[n - 1] == '\n')
    msg[--n] = '\0';
  if (log_syslog && log_fd < 0) {
    for (char *line = msg, *next; line; line = next) {
      next = strchr(line, '\n');
      if (next)
        *next++ = '\0';
      if (log_rank >= 0)
        syslog(LOG_NOTICE, "rank %d: %s", log_rank, line);
      else
        syslog(LOG_NOTICE, "%s", line);
    }
    return;
  }
  char prefix[96];
  log_prefix(prefix, sizeof(prefix));
  size_t plen = strlen(prefix), lines = 1;
  for (int i = 0; i < n; i++)
    lines += msg[i] == '\n';
  char stack[8192];
  size_t cap = (size_t)n + lines * (plen + 1) + 1;
  char *out = cap <= sizeof(stack) ? stack : malloc(cap);
  if (!out)
    return;
  size_t len = 0;
  for (char *line = msg, *next; line; line = next) {
    next = strchr(line, '\n');
    size_t l = next ? (size_t)(next - line) : strlen(line);
    memcpy(out + len, prefix, plen);
    memcpy(out + len + plen, line, l);
    len += plen + l;
    out[len++] = '\n';
    next = next ? next + 1 : NULL;
  }
  ssize_t w = write(log_fd >= 0 ? log_fd : STDERR_FILENO, out, len);
  (void)w;
  if (out != stack)
    free(out);
}

int ckpt__pread_full(int fd, void *buf, size_t n, uint64_t off) {
  size_t done = 0;
  while (done < n) {
    ssize_t r = pread(fd, (char *)buf + done, n - done, (off_t)(off + done));
    if (r < 0) {
      if (errno == EINTR)
        continue;
      return -errno;
    }
    if (r == 0)
      return -EIO;
    done += (size_t)r;
  }
  return 0;
}

/* openat2(2)'s argument and flags, for headers older than Linux 5.6. */
struct ckpt_open_how {
  uint64_t flags, mode, resolve;
};
#define CKPT_RESOLVE_NO_SYMLINKS 0x04
#define CKPT_RESOLVE_BENEATH 0x08
#ifndef SYS_openat2
#define SYS_openat2 437 /* the same number on every architecture */
#endif

/* 0 until openat2 was found missing (ENOSYS, or EPERM from a seccomp
 * filter that does not know it): then the walk serves every open. */
static atomic_bool no_openat2;

void ckpt__open_beneath_force_walk(bool on) { atomic_store(&no_openat2, on); }

/* The walk: each component but the last opened O_PATH|O_DIRECTORY|
 * O_NOFOLLOW from the one before, the last with flags|O_NOFOLLOW. */
static int open_walk(int dirfd, const char *relpath, int flags, mode_t mode) {
  char comp[256];
  int cur = dirfd;
  const char *p = relpath;
  for (;;) {
    const char *slash = strchr(p, '/');
    size_t len = slash ? (size_t)(slash - p) : strlen(p);
    if (len >= sizeof(comp)) {
      if (cur != dirfd)
        close(cur);
      return -ENAMETOOLONG;
    }
    memcpy(comp, p, len);
    comp[len] = '\0';
    int fd = slash ? openat(cur, comp,
                            O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
                   : openat(cur, comp, flags | O_NOFOLLOW, mode);
    int e = errno;
    if (cur != dirfd)
      close(cur);
    if (fd < 0)
      return -e;
    if (!slash)
      return fd;
    cur = fd;
    p = slash + 1;
  }
}

DIR *ckpt_opendir_at(int dirfd) {
  int fd = openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
  if (!d && fd >= 0) {
    int e = errno;
    close(fd);
    errno = e;
  }
  return d;
}

static int open_beneath(int dirfd, const char *relpath, int flags,
                        mode_t mode);

/* Is directory relpath beneath dirfd one that was removed (no link left,
 * still open here)? */
static bool dir_removed(int dirfd, const char *relpath) {
  int fd = open_walk(dirfd, relpath, O_PATH | O_DIRECTORY | O_CLOEXEC, 0);
  struct stat st;
  bool removed = fd >= 0 && fstat(fd, &st) == 0 && st.st_nlink == 0;
  if (fd >= 0)
    close(fd);
  return removed;
}

int ckpt_open_beneath(int dirfd, const char *relpath, int flags, mode_t mode) {
  int fd = open_beneath(dirfd, relpath, flags, mode);
  /* An unnamed file (O_TMPFILE) in a directory removed meanwhile (another
   * mount's rmdir of an empty BACKING_DIR/.staging between our open of it
   * and this one): ext4 answers EPERM (__ext4_new_inode: no file in a
   * deleted directory) where the VFS answers ENOENT for a name made there
   * and tmpfs makes the file. ENOENT here too, so that the callers' "the
   * directory went meanwhile: again" (ckpt__staging_tmpfile) sees it and
   * no EPERM reads as a refusal. */
  if (fd == -EPERM && (flags & O_TMPFILE) == O_TMPFILE &&
      dir_removed(dirfd, relpath))
    fd = -ENOENT;
  return fd;
}

static int open_beneath(int dirfd, const char *relpath, int flags,
                        mode_t mode) {
  /* Checked here, so that the walk needs no RESOLVE_BENEATH: no absolute
   * path, no empty, "." or ".." component (a directory itself is "."
   * only when it is the whole path). */
  if (!relpath || !*relpath || relpath[0] == '/')
    return -EINVAL;
  if (strcmp(relpath, ".") != 0) {
    for (const char *p = relpath; p;) {
      const char *slash = strchr(p, '/');
      size_t len = slash ? (size_t)(slash - p) : strlen(p);
      if (len == 0 || (len == 1 && p[0] == '.') ||
          (len == 2 && p[0] == '.' && p[1] == '.'))
        return -EINVAL;
      p = slash ? slash + 1 : NULL;
    }
  }
  flags |= O_CLOEXEC;
  if (!atomic_load(&no_openat2)) {
    struct ckpt_open_how how = {
        .flags = (uint64_t)(unsigned)flags,
        /* openat2 refuses a mode without O_CREAT or O_TMPFILE. */
        .mode = (flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE
                    ? (uint64_t)mode
                    : 0,
        .resolve = CKPT_RESOLVE_BENEATH | CKPT_RESOLVE_NO_SYMLINKS,
    };
    long fd;
    do
      fd = syscall(SYS_openat2, dirfd, relpath, &how, sizeof(how));
    while (fd < 0 && errno == EINTR);
    if (fd >= 0)
      return (int)fd;
    if (errno != ENOSYS && errno != EPERM)
      return -errno;
    /* EPERM may also be the file's own answer (O_NOATIME, a lease): the
     * walk then gives it again. Where the walk opens what openat2 did
     * not, a filter refused openat2 itself. */
    bool nosys = errno == ENOSYS;
    int fd2 = open_walk(dirfd, relpath, flags, mode);
    if (nosys || fd2 >= 0)
      atomic_store(&no_openat2, true);
    return fd2;
  }
  return open_walk(dirfd, relpath, flags, mode);
}

bool ckpt__same_version(const struct stat *a, const struct stat *b) {
  return a->st_dev == b->st_dev && a->st_ino == b->st_ino &&
         a->st_size == b->st_size &&
         a->st_mtim.tv_sec == b->st_mtim.tv_sec &&
         a->st_mtim.tv_nsec == b->st_mtim.tv_nsec &&
         a->st_ctim.tv_sec == b->st_ctim.tv_sec &&
         a->st_ctim.tv_nsec == b->st_ctim.tv_nsec;
}
