/*
 * util.c - the small helpers every part of ckptfs uses (store.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <syslog.h>
#include <time.h>
#include <unistd.h>

#include "store.h"

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
    int fd = open(path,
                  O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY |
                      O_NOFOLLOW,
                  0600);
    if (fd < 0)
      return -errno;
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

void ckpt__log(const char *fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (n < 0)
    return;
  if (log_syslog && log_fd < 0) {
    if (log_rank >= 0)
      syslog(LOG_NOTICE, "rank %d: %s", log_rank, msg);
    else
      syslog(LOG_NOTICE, "%s", msg);
    return;
  }
  char line[2200];
  int len;
  if (log_fd >= 0) {
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    char when[32];
    strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm);
    char who[32] = "";
    if (log_rank >= 0)
      snprintf(who, sizeof(who), " rank %d", log_rank);
    len = snprintf(line, sizeof(line), "%s.%03ldZ ckptfs[%ld]%s: %s\n", when,
                   ts.tv_nsec / 1000000, (long)getpid(), who, msg);
  } else {
    len = snprintf(line, sizeof(line), "ckptfs: %s\n", msg);
  }
  if (len < 0)
    return;
  if ((size_t)len >= sizeof(line))
    len = sizeof(line) - 1, line[len - 1] = '\n';
  ssize_t w = write(log_fd >= 0 ? log_fd : STDERR_FILENO, line, (size_t)len);
  (void)w;
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
