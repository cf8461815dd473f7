/*
 * failpoint.c - see failpoint.h.
 */
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "failpoint.h"

static const char *const names[] = {
    "local_plan",   "global_plan",     "write_begin",     "write_open",
    "write_data",
    "write_done",   "metadata_tmp",    "metadata_rename", "metadata_synced",
    "committed",    "discard",         "reader_init",     "replace_remove",
    /* removal of one entry inside a committed checkpoint (removal.c) */
    "remove_linked", "remove_metadata", "remove_exchanged", "remove_old",
    "flush_copy",   "flush_marked",    "flush_published",
    "tier_publish",
    /* partner copies (fs/commit/partner.c, -o tier_level=partner) */
    "partner_open", "partner_synced",
};

static const char *armed;      /* the point's name, NULL when none */
static atomic_long remaining;  /* passes left before it fires */
static int fail_errno;         /* =ERR: fail with it instead of dying */

static bool parse_uint(const char *s, const char *end, long *out);

static int parse_errno(const char *s) {
  static const struct {
    const char *name;
    int e;
  } known[] = {{"EIO", EIO},       {"ENOSPC", ENOSPC}, {"EISDIR", EISDIR},
               {"EACCES", EACCES}, {"EROFS", EROFS}};
  for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
    if (!strcmp(s, known[i].name))
      return known[i].e;
  long v;
  return parse_uint(s, s + strlen(s), &v) && v > 0 && v < 4096 ? (int)v : 0;
}

static bool parse_uint(const char *s, const char *end, long *out) {
  if (s == end || end - s > 9)
    return false;
  long v = 0;
  for (; s < end; s++) {
    if (*s < '0' || *s > '9')
      return false;
    v = v * 10 + (*s - '0');
  }
  *out = v;
  return true;
}

int ckpt_failpoint_setup(int rank, const char **why) {
  const char *spec = getenv("CKPTFS_FAILPOINT");
  armed = NULL;
  if (!spec || !*spec)
    return 0;
  size_t len = strcspn(spec, ":@=");
  const char *name = NULL;
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
    if (strlen(names[i]) == len && strncmp(spec, names[i], len) == 0)
      name = names[i];
  long count = 1, only_rank = -1;
  const char *p = spec + len;
  bool ok = name != NULL;
  if (ok && *p == ':') {
    const char *e = p + 1 + strcspn(p + 1, "@=");
    ok = parse_uint(p + 1, e, &count) && count > 0;
    p = e;
  }
  if (ok && *p == '@') {
    const char *e = p + 1 + strcspn(p + 1, "=");
    ok = parse_uint(p + 1, e, &only_rank);
    p = e;
  }
  int err = 0;
  if (ok && *p == '=') {
    err = parse_errno(p + 1);
    ok = err != 0;
    p += strlen(p);
  }
  if (!ok || *p) {
    *why = "CKPTFS_FAILPOINT: expected NAME[:N][@RANK][=ERR] with a known "
           "NAME (see store/failpoint.h)";
    return -EINVAL;
  }
  if (only_rank < 0 || only_rank == rank) {
    atomic_store(&remaining, count);
    fail_errno = err;
    armed = name;
  }
  return 0;
}

void ckpt_failpoint(const char *name) {
  if (!armed || fail_errno || strcmp(armed, name) != 0)
    return;
  if (atomic_fetch_sub(&remaining, 1) == 1) {
    static const char msg[] = "ckptfs: failpoint reached: SIGKILL\n";
    ssize_t r = write(STDERR_FILENO, msg, sizeof(msg) - 1);
    (void)r;
    kill(getpid(), SIGKILL);
  }
}

int ckpt_failpoint_error(const char *name) {
  if (!armed || !fail_errno || strcmp(armed, name) != 0)
    return 0;
  return atomic_fetch_sub(&remaining, 1) == 1 ? -fail_errno : 0;
}
