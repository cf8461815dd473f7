/*
 * status.c - NAME/.status: what a checkpoint is doing, as text.
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "catalog.h"
#include "metadb.h"
#include "ops_int.h"

/* ------------------------------------------------------------------------
 * .status
 * ---------------------------------------------------------------------- */

/* The .status text of ck. fs->lock held. */
/* Seconds a write of the flush may take before .status calls the store
 * stalled. */
#define FLUSH_STALL_S 5.0

/* .status of a committed checkpoint with -o tier: where it is, how far
 * its flush got and what it waits for (docs/tiers.md). fs->lock held. */
static const char *tier_lines(const ckpt_ckpt_t *ck, char *buf, size_t n) {
  if (!ck->tier.tiered)
    return "";
  char stalled[160] = "";
  uint64_t busy = atomic_load(&ck->tier.busy_since);
  double for_s = busy ? ckpt__mono_now() - (double)busy * 1e-9 : 0;
  if (!ck->tier.why && for_s >= FLUSH_STALL_S)
    snprintf(stalled, sizeof(stalled),
             "flush waiting: BACKING_DIR has not answered a write for %.0f s "
             "(slow, full or down); the copy goes on when it does\n", for_s);
  snprintf(buf, n, "location %s\nflush bytes %llu of %llu\n%s%s%s",
           atomic_load(&ck->tier.flushed) ? "shared"
           : ck->tier.partner             ? "partner"
                                          : "local",
           (unsigned long long)atomic_load(&ck->tier.done),
           (unsigned long long)atomic_load(&ck->tier.total),
           ck->tier.why ? ck->tier.why : "", ck->tier.why ? "\n" : "",
           stalled);
  return buf;
}

/* fs->lock held. */
char *ckpt__op_status_text(ckpt_fs_t *fs, const ckpt_ckpt_t *ck) {
  CKPT_HELD(&fs->lock);
  char lines[1200];
  switch (ck->state) {
  case CKPT_STAGING: {
    uint64_t files = 0, bytes = 0;
    if (ck->dir) /* NULL: removed (rmdir), while .status was open */
      ckpt__count_staged(ck->dir, &files, &bytes);
    /* who stages it: a job process alive (a dead one's saves are gone);
     * no line when no job declared itself (ckpt-umount's advice differs) */
    char job[CKPT_JOB_LABEL_MAX + 64] = "";
    char label[CKPT_JOB_LABEL_MAX];
    if (ck->job && ckpt__job_label(fs, ck->job, label, sizeof(label)))
      snprintf(job, sizeof(job), "job %d alive%s%s\n", (int)ck->job,
               *label ? ": " : "", label);
    /* a full tier: staged writes fail (ENOSPC); say what to do */
    char full[CKPT_TIER_FULL_MAX] = "";
    ckpt__tier_full_line(fs, full, sizeof(full));
    return ckpt__strdup_printf("staging\nfiles %llu\nbytes %llu\n%s%s",
                               (unsigned long long)files,
                               (unsigned long long)bytes, job, full);
  }
  case CKPT_COMMITTING: {
    char left[48] = "";
    if (ck->waiting && ck->waiting_until > 0) {
      double s = ck->waiting_until - ckpt__mono_now();
      snprintf(left, sizeof(left), ", %.0f s left", s > 0 ? s : 0);
    }
    return ckpt__strdup_printf(
        "committing\nbytes %llu of %llu\n%s%s%s%s",
        (unsigned long long)atomic_load(&ck->bytes_done),
        (unsigned long long)atomic_load(&ck->bytes_total),
        ck->waiting ? "waiting for " : "", ck->waiting ? ck->waiting : "",
        left, ck->waiting ? "\n" : "");
  }
  case CKPT_COMMITTED:
    if (ck->removing) /* the first line stays one of the four states */
      return strdup("committed\nremoving: the checkpoint was removed as a "
                    "whole (its .metadata), so it is gone for every other "
                    "mount; rmdir NAME (rm -r) removes its data\n");
    uint32_t t = ck->meta ? ck->meta->n_tensors : 0, nt = t;
    uint32_t nb = ck->meta ? ck->meta->n_blobs : 0;
    for (uint32_t i = 0, all = t + nb; ck->removed && i < all; i++) {
      if (ck->removed[i] && i < t) /* removed inside it since loaded */
        nt--;
      else if (ck->removed[i])
        nb--;
    }
    char *note = ck->tier.tiered ? ckpt__resolve_note(ck->name) : NULL;
    char *text = ckpt__strdup_printf(
        "committed\ntensors %u\nblobs %u\nworld_size %d\n%s%s%s%s%s%s",
        nt, nb,
        ck->meta ? ck->meta->world_size : 0, ck->lost ? "lost: " : "",
        ck->lost ? ck->lost : "", ck->lost ? "\n" : "",
        tier_lines(ck, lines, sizeof(lines)), note ? note : "",
        note ? "\n" : "");
    free(note);
    return text;
  case CKPT_FAILED:
    return ckpt__strdup_printf("failed\n%s\n",
                               ck->reason ? ck->reason : "unknown error");
  }
  return NULL;
}
