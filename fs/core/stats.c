/*
 * stats.c - the mount's counters (ckpt_metrics_t): atomics bumped where
 * things happen (save, ops, views, blocks; verify failures in the store's
 * reader), no lock; daemon/metrics.c writes them out. And the one
 * monotonic clock of the daemon.
 */
#include <errno.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "fs.h"

/* The upper bounds of ckptfs_commit_duration_seconds, in seconds. */
const double ckpt__duration_le[CKPT_DURATION_BUCKETS] = {
    0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600};

uint64_t ckpt__mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

double ckpt__mono_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

ckpt_fail_reason_t ckpt__metrics_classify(int rc, const char *reason) {
  switch (rc) {
  case -ETIMEDOUT:
    return CKPT_FAIL_TIMEOUT;
  case -ENOSPC:
  case -EDQUOT:
    return CKPT_FAIL_NO_SPACE;
  case -EINVAL:
    return CKPT_FAIL_INVALID;
  case -EEXIST:
    return CKPT_FAIL_EXISTS;
  case -EIO:
    break; /* dist's word for any failure: the reason tells more */
  case 0:
    break;
  default:
    return CKPT_FAIL_OTHER;
  }
  /* Another rank's failure reaches this one as its reason's words. */
  const char *r = reason ? reason : "";
  if (strstr(r, "(commit_timeout)") || strstr(r, "no answer from the"))
    return CKPT_FAIL_TIMEOUT;
  if (strstr(r, strerror(ENOSPC)) || strstr(r, strerror(EDQUOT)))
    return CKPT_FAIL_NO_SPACE;
  /* the planner's refusals of what the ranks staged (planner/plan.c) */
  static const char *const refused[] = {"user.ckpt.", "invalid xattrs",
                                        "expected (sizes", "overlap",
                                        "differ: "};
  for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++)
    if (strstr(r, refused[i]))
      return CKPT_FAIL_INVALID;
  if (strstr(r, "already committed elsewhere"))
    return CKPT_FAIL_EXISTS;
  if (rc == -EIO || strstr(r, strerror(EIO)))
    return CKPT_FAIL_IO;
  return CKPT_FAIL_OTHER;
}

void ckpt__metrics_commit(ckpt_fs_t *fs, ckpt_commit_outcome_t outcome,
                          ckpt_fail_reason_t reason, double seconds) {
  ckpt_metrics_t *m = &fs->metrics;
  atomic_fetch_add(&m->commits[outcome], 1);
  if (outcome == CKPT_COMMIT_FAILED)
    atomic_fetch_add(&m->failures[reason], 1);
  if (seconds < 0)
    return;
  int b = 0;
  while (b < CKPT_DURATION_BUCKETS && seconds > ckpt__duration_le[b])
    b++;
  atomic_fetch_add(&m->duration[b], 1);
  atomic_fetch_add(&m->duration_us, (uint64_t)(seconds * 1e6 + 0.5));
}

void ckpt__metrics_read(fuse_req_t req, uint64_t n) {
  ckpt_fs_t *fs = fuse_req_userdata(req);
  atomic_fetch_add_explicit(&fs->metrics.bytes_read, n, memory_order_relaxed);
}

void ckpt__metrics_request(fuse_req_t req, ckpt_fuse_op_t op) {
  ckpt_fs_t *fs = fuse_req_userdata(req);
  atomic_fetch_add_explicit(&fs->metrics.requests[op], 1,
                            memory_order_relaxed);
}
