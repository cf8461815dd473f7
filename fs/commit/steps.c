/*
 * steps.c - the steps of a save that dist runs on every rank (local\n * plan, write, finish) and on the coordinator (global plan, publish,\n * discard), and what a save waits for.
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>
#include "catalog.h"
#include "failpoint.h"
#include "commit_int.h"
#include "metadb.h"


/* ------------------------------------------------------------------------
 * ckpt__cm_local_step: checksums and the local plan.
 * ---------------------------------------------------------------------- */

static const uint8_t zeros[64 * 1024];

static int hash_piece(void *arg, const void *p, size_t n, ckpt_walk_piece_t kind) {
  if (kind != CKPT_WALK_HOLE)
    return XXH3_64bits_update(arg, p, n) == XXH_OK ? 0 : -EIO;
  for (size_t k; n > 0; n -= k) {
    k = n < sizeof(zeros) ? n : sizeof(zeros);
    if (XXH3_64bits_update(arg, zeros, k) != XXH_OK)
      return -EIO;
  }
  return 0;
}

/* The checksum of staged file i: kept while it was written in order, else
 * computed now. */
static int hash_file(void *arg, uint32_t i) {
  ckpt_save_t *s = arg;
  /* the drain may be hashing a passthrough file: its result, not a
   * second pass */
  if (ckpt__sfile_checksum_wait(s->files[i]->u.sf, &s->checksums[i]) == 0)
    return 0;
  XXH3_state_t *st = XXH3_createState();
  if (!st)
    return -ENOMEM;
  XXH3_64bits_reset(st);
  const ckpt_sfile_t *sf = s->files[i]->u.sf;
  uint8_t *buf = sf->pt_fd >= 0 ? malloc(CKPT_SEG_SIZE) : NULL;
  int rc = sf->pt_fd < 0 ? ckpt__sfile_walk(s->files[i]->u.sf, hash_piece, st)
           : buf        ? ckpt__hash_sparse(sf->pt_fd, sf->size, st, buf,
                                            CKPT_SEG_SIZE)
                        : -ENOMEM;
  free(buf);
  s->checksums[i] = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return rc;
}

/* Describe staged file i in lp (or record why it cannot be saved; the
 * planner prefixes each recorded problem with "rank R: "). */
static int describe_file(ckpt_save_t *s, uint32_t i, ckpt_local_plan_t *lp) {
  ckpt_sfile_t *sf = s->files[i]->u.sf;
  const char *path = s->paths[i];
  char *const *x = sf->xattr;
  uint64_t len = sf->size;
  if (!x[CKPT_X_DTYPE]) {
    for (int k = CKPT_X_SHAPE; k <= CKPT_X_SIZES; k++)
      if (x[k])
        return ckpt_local_plan_add_error(
            lp, "%s: %s is set but user.ckpt.dtype is missing", path,
            ckpt__xattr_names[k]);
    return ckpt_local_plan_add_bytes(lp, path, len, s->checksums[i], i);
  }
  if (!x[CKPT_X_SHAPE])
    return ckpt_local_plan_add_error(
        lp, "%s: user.ckpt.dtype is set but user.ckpt.shape is missing",
        path);
  ckpt_dtype_t dt;
  ckpt_dims_t shape, offs, sizes;
  bool has_offs = x[CKPT_X_OFFSETS] != NULL, has_sizes = x[CKPT_X_SIZES];
  /* Values were validated by setxattr; parse them again for the plan. */
  if (ckpt_dtype_parse(x[CKPT_X_DTYPE], strlen(x[CKPT_X_DTYPE]), &dt) ||
      ckpt_dims_parse(x[CKPT_X_SHAPE], strlen(x[CKPT_X_SHAPE]), &shape) ||
      (has_offs && ckpt_dims_parse(x[CKPT_X_OFFSETS],
                                   strlen(x[CKPT_X_OFFSETS]), &offs)) ||
      (has_sizes &&
       ckpt_dims_parse(x[CKPT_X_SIZES], strlen(x[CKPT_X_SIZES]), &sizes)))
    return ckpt_local_plan_add_error(lp, "%s: invalid xattrs", path);
  bool nonzero = false;
  for (int k = 0; has_offs && k < offs.ndim; k++)
    nonzero |= offs.d[k] != 0;
  if (nonzero && !has_sizes)
    return ckpt_local_plan_add_error(
        lp, "%s: user.ckpt.offsets is %s but user.ckpt.sizes is missing",
        path, x[CKPT_X_OFFSETS]);
  if ((has_offs && offs.ndim != shape.ndim) ||
      (has_sizes && sizes.ndim != shape.ndim))
    return ckpt_local_plan_add_error(
        lp, "%s: offsets/sizes have %d/%d dimensions, shape %s has %d", path,
        has_offs ? offs.ndim : shape.ndim,
        has_sizes ? sizes.ndim : shape.ndim, x[CKPT_X_SHAPE], shape.ndim);
  return ckpt_local_plan_add_tensor(lp, path, dt, shape.ndim, shape.d,
                                    has_offs ? offs.d : NULL,
                                    has_sizes ? sizes.d : NULL, len,
                                    s->checksums[i], i);
}

int ckpt__cm_local_step(void *ctx, ckpt_dist_job_t *job, ckpt_buf_t *out,
                      char **err) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_t *s = job->user;
  ckpt_local_plan_t lp;
  ckpt__save_waiting(fs, job, NULL, 0);
  ckpt_local_plan_init(&lp, s->rank);
  lp.direct = s->direct; /* the coordinator checks that every rank agrees */
  s->checksums = calloc(s->nfiles ? s->nfiles : 1, sizeof(*s->checksums));
  int rc = s->checksums ? 0 : -ENOMEM;
  if (rc == 0)
    rc = ckpt__pool_run(fs->pool, s->nfiles, hash_file, s);
  for (uint32_t i = 0; rc == 0 && i < s->nfiles; i++) {
    uint32_t before = lp.n_items;
    rc = describe_file(s, i, &lp);
    ckpt_sfile_t *sf = s->files[i]->u.sf;
    /* user.ckpt.fqn: the item's exact FQN instead of the path's. */
    const char *fqn = sf->xattr[CKPT_X_FQN];
    if (rc == 0 && lp.n_items > before && fqn)
      rc = ckpt_local_plan_set_fqn(&lp, before, fqn, strlen(fqn));
    /* Written behind already: its bytes stay where they are (in the
     * tier: a direct save writes them anew, read from the stream) */
    if (rc == 0 && lp.n_items > before && sf->stream >= 0 && !s->direct)
      rc = ckpt_local_plan_pin(&lp, before, (uint32_t)sf->stream,
                               sf->stream_base);
  }
  /* Each stream holds its live files up to the end of the last one:
   * that much of data file K is written already. */
  uint32_t nstreams = s->ck->streams ? s->ck->streams->n : 0;
  s->stream_used = calloc(nstreams ? nstreams : 1, sizeof(*s->stream_used));
  if (!s->stream_used && rc == 0)
    rc = -ENOMEM;
  for (uint32_t i = 0; rc == 0 && i < s->nfiles; i++) {
    const ckpt_sfile_t *sf = s->files[i]->u.sf;
    if (sf->stream >= 0 && sf->stream_base + sf->size > s->stream_used[sf->stream])
      s->stream_used[sf->stream] = sf->stream_base + sf->size;
  }
  if (s->direct) /* nothing of its data files is written yet */
    memset(s->stream_used, 0, (nstreams ? nstreams : 1) * sizeof(*s->stream_used));
  for (uint32_t k = 0; rc == 0 && k < nstreams; k++)
    if (s->stream_used[k])
      rc = ckpt_local_plan_reserve(&lp, k, s->stream_used[k]);
  /* What the staged files and directories are: the commit keeps it. */
  for (uint32_t i = 0; rc == 0 && i < s->n_attrs; i++)
    rc = ckpt_local_plan_add_entry(&lp, &s->attrs[i]);
  if (rc == 0)
    rc = ckpt_msg_encode_local_plan(&lp, out);
  if (rc)
    *err = ckpt__strdup_printf("rank %d: building the local plan: %s",
                               s->rank, strerror(-rc));
  ckpt_local_plan_free(&lp);
  ckpt_failpoint("local_plan");
  return rc;
}

/* ------------------------------------------------------------------------
 * ckpt__cm_global_step (coordinator).
 * ---------------------------------------------------------------------- */

static char *new_save_id(void) {
  uint8_t r[16];
  if (getrandom(r, sizeof(r), 0) != (ssize_t)sizeof(r)) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    memcpy(r, &ts, sizeof(r) < sizeof(ts) ? sizeof(r) : sizeof(ts));
  }
  char *id = malloc(33);
  if (id)
    for (int i = 0; i < 16; i++)
      snprintf(id + 2 * i, 3, "%02x", r[i]);
  return id;
}

/* The item a client commits to abort a save on every rank (python/ckptfs
 * _abort_commit): ABORT_PATH at the checkpoint's top, a float32 tensor of
 * shape [1] with no bytes, which no save can hold (so that a ckptfs that
 * does not know it fails the save too); its user.ckpt.fqn, when given, is
 * the rank's reason. */
#define ABORT_PATH "_ckptfs_abort"
#define ABORT_REASON_MAX 300

static bool is_abort_item(const ckpt_write_item_t *it) {
  return it->kind == CKPT_ITEM_TENSOR && it->length == 0 &&
         it->dtype == CKPT_DTYPE_FLOAT32 && it->ndim == 1 &&
         strcmp(it->path, ABORT_PATH) == 0;
}

/* Why the save fails when some rank aborted it: "rank R aborted the save:
 * REASON", one line per such rank, the client's item never named (the
 * planner would say "_ckptfs_abort (...): rank R wrote 0 bytes, 4
 * expected"). NULL when no rank aborted (or out of memory). */
static char *aborted_by(const ckpt_local_plan_t *locals, int n) {
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  int rc = 0;
  for (int r = 0; r < n && rc == 0; r++) {
    for (uint32_t i = 0; i < locals[r].n_items; i++) {
      const ckpt_write_item_t *it = &locals[r].items[i];
      if (!is_abort_item(it))
        continue;
      char why[ABORT_REASON_MAX + 4] = "";
      if (it->fqn_explicit && it->fqn) {
        size_t k = 0;
        for (const char *c = it->fqn; *c && k < ABORT_REASON_MAX; c++, k++)
          why[k] = (unsigned char)*c < 0x20 || *c == 0x7f ? '?' : *c;
        if (it->fqn[k])
          memcpy(why + k, "...", 4);
        else
          why[k] = '\0';
      }
      rc = ckpt_buf_printf(&b, "%srank %d aborted the save: %s",
                           b.len ? "\n" : "", (int)locals[r].rank,
                           why[0] ? why : "it failed before its commit");
      break;
    }
  }
  if (rc || b.len == 0) {
    ckpt_buf_free(&b);
    return NULL;
  }
  return ckpt_buf_steal(&b);
}

int ckpt__cm_global_step(void *ctx, ckpt_dist_job_t *job, const ckpt_buf_t *plans,
                       int n, ckpt_buf_t *rank_plans, char **err) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_t *s = job->user;
  if (!s->replace && ckpt__already_committed(fs, job->name)) {
    int root = ckpt__root_of(fs, job->name);
    *err = ckpt__committed_elsewhere(root, root == fs->tier_fd ? fs->tier_path
                                                         : fs->backing_path,
                               job->name);
    return -EEXIST;
  }
  ckpt_local_plan_t *locals = calloc((size_t)n, sizeof(*locals));
  if (!locals)
    return -ENOMEM;
  int rc = 0;
  for (int r = 0; r < n && rc == 0; r++) {
    rc = ckpt_msg_decode_local_plan(plans[r].data, plans[r].len, &locals[r]);
    if (rc)
      *err = ckpt__strdup_printf("rank %d: malformed local plan", r);
    else if (locals[r].rank != r)
      rc = -EINVAL, *err = ckpt__strdup_printf(
                        "rank %d: local plan claims rank %d", r,
                        locals[r].rank);
  }
  ckpt_plan_opts_t opts = {.io_threads = fs->opts.io_threads,
                           .replica_check = fs->opts.replica_check};
  if (rc == 0 && (*err = aborted_by(locals, n)) != NULL)
    rc = -ECANCELED; /* not a refusal of what was staged: metrics "other" */
  /* Where the save goes is one decision: a direct save's files and a
   * tier save's would end up in two places */
  for (int r = 1; r < n && rc == 0; r++)
    if (locals[r].direct != locals[0].direct) {
      rc = -EINVAL;
      *err = ckpt__strdup_printf(
          "ranks 0 and %d wrote different level= words to .commit (%s and "
          "%s): every rank of a world commits with the same words; nothing "
          "was written", r, locals[0].direct ? "level=shared" : "none",
          locals[r].direct ? "level=shared" : "none");
    }
  if (rc == 0)
    rc = ckpt_plan_global(locals, n, &opts, &s->gp);
  if (rc == 0) {
    s->have_gp = true;
    if (s->gp.warnings)
      ckpt__log("%s: %s", job->name, s->gp.warnings);
    if (s->gp.errors) {
      *err = strdup(s->gp.errors);
      rc = -EINVAL;
    }
  }
  if (rc == 0) {
    s->gp.meta.name = strdup(job->name);
    s->gp.meta.save_id = new_save_id();
    s->gp.meta.created_at = (int64_t)time(NULL);
    if (!s->gp.meta.name || !s->gp.meta.save_id ||
        ckpt_metadata_set_retention(&s->gp.meta, &s->words))
      rc = -ENOMEM;
  }
  if (rc == 0 && (rc = ckpt_store_save_dir_hold(s->root_fd,
                                                s->gp.meta.save_id, true,
                                                &s->dirfd)) != 0)
    *err = ckpt__strdup_printf("rank 0: creating %s/%s/%s: %s",
                               s->root_path, CKPT_SAVES_DIR,
                               s->gp.meta.save_id, strerror(-rc));
  for (int r = 0; r < n && rc == 0; r++) {
    snprintf(s->gp.ranks[r].save_id, sizeof(s->gp.ranks[r].save_id), "%s",
             s->gp.meta.save_id);
    rc = ckpt_msg_encode_rank_plan(&s->gp.ranks[r], &rank_plans[r]);
  }
  for (int r = 0; r < n; r++)
    ckpt_local_plan_free(&locals[r]);
  free(locals);
  ckpt_failpoint("global_plan");
  return rc;
}

/* ------------------------------------------------------------------------
 * ckpt__cm_write_step: one worker per data file.
 * ---------------------------------------------------------------------- */

typedef struct {
  ckpt_save_t *s;
  int fd;
  const char *file;     /* name, for errors */
  bool fresh;           /* the file was empty: holes need no writes */
  struct iovec iov[IOV_MAX];
  int niov;
  uint64_t batch_off;   /* file offset of iov[0] */
  uint64_t batch_len;
  uint64_t counted;     /* bytes added to ck->bytes_done */
  int err;              /* errno of a failed write */
} writer_t;

/* Progress of .status: n more bytes of w's file are done. */
static void count_done(writer_t *w, uint64_t n) {
  w->counted += n;
  atomic_fetch_add(&w->s->ck->bytes_done, n);
}

/* A stream file already holds most of its bytes: they are done once they
 * are on disk. Sync it in steps so that .status moves meanwhile (the
 * fsync after it then has little left to do), or count them at once
 * without sync_files. */
#define STREAM_SYNC_STEP (64ULL << 20)
static int settle_stream(writer_t *w, uint64_t size, bool sync) {
  /* All of it queued for writeback at once (the drain may have started
   * it at the file's close), then waited for step by step: a wait per
   * step alone would let the disk's queue run dry between steps. */
  if (sync && size)
    (void)sync_file_range(w->fd, 0, (off_t)size, SYNC_FILE_RANGE_WRITE);
  for (uint64_t off = 0; off < size; off += STREAM_SYNC_STEP) {
    uint64_t len = size - off < STREAM_SYNC_STEP ? size - off : STREAM_SYNC_STEP;
    if (sync && sync_file_range(w->fd, (off_t)off, (off_t)len,
                                SYNC_FILE_RANGE_WAIT_BEFORE |
                                    SYNC_FILE_RANGE_WRITE |
                                    SYNC_FILE_RANGE_WAIT_AFTER) &&
        errno != ENOSYS && errno != EINVAL && errno != ESPIPE) {
      w->err = errno;
      return -errno;
    }
    if (!sync)
      len = size;
    uint64_t left = size > w->counted ? size - w->counted : 0;
    count_done(w, len < left ? len : left);
    if (!sync)
      break;
  }
  return 0;
}

static int flush_batch(writer_t *w) {
  uint64_t off = w->batch_off;
  struct iovec *iov = w->iov;
  int niov = w->niov;
  while (niov > 0) {
    ssize_t r = pwritev(w->fd, iov, niov, (off_t)off);
    if (r < 0) {
      if (errno == EINTR)
        continue;
      w->err = errno;
      return -errno;
    }
    if (r == 0) {
      w->err = EIO;
      return -EIO;
    }
    off += (uint64_t)r;
    count_done(w, (uint64_t)r);
    ckpt_failpoint("write_data");
    while (niov > 0 && (size_t)r >= iov->iov_len) {
      r -= (ssize_t)iov->iov_len;
      iov++, niov--;
    }
    if (niov > 0) {
      iov->iov_base = (char *)iov->iov_base + r;
      iov->iov_len -= (size_t)r;
    }
  }
  w->batch_off += w->batch_len;
  w->batch_len = 0;
  w->niov = 0;
  return 0;
}

/* Add n bytes at p to the batch, writing the batch first when full. */
static int append_iov(writer_t *w, const void *p, size_t n) {
  if (w->niov == IOV_MAX || w->batch_len >= WRITE_BATCH) {
    int rc = flush_batch(w);
    if (rc)
      return rc;
  }
  w->iov[w->niov].iov_base = (void *)p;
  w->iov[w->niov].iov_len = n;
  w->niov++;
  w->batch_len += n;
  return 0;
}

/* The next n bytes of a data file are zeros (a hole of a staged file):
 * skipped in a fresh file, which ftruncate extends with holes; written
 * over old bytes of a reused stream file. */
static int add_zeros(writer_t *w, size_t n) {
  if (w->fresh) {
    int rc = flush_batch(w);
    if (rc)
      return rc;
    w->batch_off += n;
    count_done(w, n);
    return 0;
  }
  for (size_t k; n > 0; n -= k) {
    k = n < sizeof(zeros) ? n : sizeof(zeros);
    int rc = append_iov(w, zeros, k);
    if (rc)
      return rc;
  }
  return 0;
}

static int add_piece(void *arg, const void *p, size_t n, ckpt_walk_piece_t kind) {
  writer_t *w = arg;
  if (kind == CKPT_WALK_HOLE)
    return add_zeros(w, n);
  int rc = append_iov(w, p, n);
  /* A spilled piece sits in a buffer reused for the next one. */
  return rc == 0 && kind == CKPT_WALK_TRANSIENT ? flush_batch(w) : rc;
}

/* Data file k (fd, written) is stream file k: the items streamed into it
 * are there, with the checksums the local step took (hashed from the
 * file itself for passthrough files: the drain, or hash_file; from the
 * very buffers written into it for the daemon's own writes), so a
 * verified read need not hash them again while the file stays as it is
 * now (store/known.c). Nobody else can have written it: a sealed, unnamed
 * staging file until the write step linked it here. */
static void remember_streamed(ckpt_save_t *s, uint32_t k, int fd) {
  struct stat st;
  if (fstat(fd, &st))
    return;
  for (uint32_t a = 0; a < s->rp.n_assign; a++) {
    const ckpt_assignment_t *as = &s->rp.assign[a];
    const ckpt_sfile_t *sf = s->files[as->local_id]->u.sf;
    if (as->file == k && as->length > 0 && sf->stream == (int32_t)k &&
        sf->stream_base == as->file_offset)
      ckpt_store_known_add(&st, as->file_offset, as->length,
                           s->checksums[as->local_id]);
  }
}

static int write_file(void *arg, uint32_t k) {
  ckpt_save_t *s = arg;
  ckpt_fs_t *fs = s->fs;
  char name[64];
  ckpt_data_file_name(s->rank, k, name, sizeof(name));
  writer_t *w = calloc(1, sizeof(*w));
  if (!w)
    return -ENOMEM;
  w->s = s;
  w->file = name;
  /* A stream file linked as this data file holds the pinned items. */
  bool streamed = s->ck->streams && k < s->ck->streams->n &&
                  s->stream_used[k] > 0; /* (never in a direct save) */
  /* The save's own directory: a data file there is ours or nothing. */
  int injected = ckpt_failpoint_error("write_open");
  if (injected)
    w->fd = -1, errno = -injected;
  else if ((w->fd = ckpt_open_beneath(s->dirfd, name,
                                      O_WRONLY |
                                          (streamed ? 0 : O_CREAT | O_EXCL),
                                      0600)) < 0)
    errno = -w->fd, w->fd = -1;
  w->fresh = !streamed;
  int rc = w->fd < 0 ? -(w->err = errno) : 0;
  for (uint32_t a = 0; rc == 0 && a < s->rp.n_assign; a++) {
    const ckpt_assignment_t *as = &s->rp.assign[a];
    const ckpt_sfile_t *sf = s->files[as->local_id]->u.sf;
    if (as->file != k || as->length == 0 ||
        (streamed && sf->stream == (int32_t)k &&
         sf->stream_base == as->file_offset))
      continue; /* nothing, or already there */
    if (as->file_offset != w->batch_off + w->batch_len &&
        (rc = flush_batch(w)) == 0)
      w->batch_off = as->file_offset;
    if (rc == 0)
      rc = ckpt__sfile_walk(s->files[as->local_id]->u.sf, add_piece, w);
  }
  if (rc == 0)
    rc = flush_batch(w);
  if (rc == 0 && ftruncate(w->fd, (off_t)s->rp.file_bytes[k]))
    rc = -(w->err = errno);
  if (rc == 0 && streamed)
    rc = settle_stream(w, s->rp.file_bytes[k], fs->opts.sync_files);
  if (rc == 0 && fs->opts.sync_files && fsync(w->fd))
    rc = -(w->err = errno);
  if (rc == 0 && streamed)
    remember_streamed(s, k, w->fd);
  if (w->fd >= 0 && close(w->fd) && rc == 0)
    rc = -(w->err = errno);
  if (rc) {
    ckpt__log("%s: writing %s: %s", s->job.name, name,
              strerror(w->err ? w->err : -rc));
    int none = -1;
    atomic_compare_exchange_strong(&s->failed_file, &none, (int)k);
  }
  int e = rc ? (w->err ? -w->err : rc) : 0;
  free(w);
  return e;
}

/* Why a commit into the tier cannot be: the tier is full (need: bytes
 * this rank still writes there), and what to do. */
static char *tier_full(ckpt_fs_t *fs, const ckpt_save_t *s, uint64_t need) {
  struct statvfs tv;
  uint64_t avail = fstatvfs(fs->tier_fd, &tv) == 0
                       ? (uint64_t)tv.f_bavail * tv.f_frsize
                       : 0;
  return ckpt__strdup_printf(
      "rank %d: the tier %s is full: %.1f MiB free, this rank writes %.1f "
      "MiB of %s there; not committed, nothing is lost: it stays staged. "
      "Commit it again with `sync level=shared` (written to BACKING_DIR "
      "directly, as a mount without the tier would), or make room in the "
      "tier (a lower tier_keep, or `ckptctl wait --level shared` until "
      "earlier checkpoints are flushed out of it) and commit again",
      s->rank, fs->tier_path, (double)avail / 1048576.0,
      (double)need / 1048576.0, s->job.name);
}

/* Is this rank on another node than the coordinator's (which publishes
 * the save in its own tier: the commit point)? */
bool ckpt__cm_remote_node(ckpt_fs_t *fs, const ckpt_dist_job_t *job) {
  return !job->solo && fs->world_size > 1 && fs->dist &&
         ckpt_dist_node_of(fs->dist, fs->rank) !=
             ckpt_dist_node_of(fs->dist, 0);
}

int ckpt__cm_write_step(void *ctx, ckpt_dist_job_t *job,
                      const ckpt_buf_t *plan, ckpt_buf_t *out, char **err) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_t *s = job->user;
  int rc = ckpt_msg_decode_rank_plan(plan->data, plan->len, &s->rp);
  if (rc) {
    *err = ckpt__strdup_printf("rank %d: malformed plan from the coordinator",
                               s->rank);
    return rc;
  }
  s->have_rp = true;
  for (uint32_t a = 0; a < s->rp.n_assign; a++)
    if (s->rp.assign[a].local_id >= s->nfiles ||
        s->rp.assign[a].file >= s->rp.n_files) {
      *err = ckpt__strdup_printf("rank %d: plan names an unknown item",
                                 s->rank);
      return -EINVAL;
    }
  uint64_t total = 0;
  for (uint32_t k = 0; k < s->rp.n_files; k++)
    total += s->rp.file_bytes[k];
  atomic_store(&s->ck->bytes_total, total);

  if (!ckpt_save_id_valid(s->rp.save_id)) {
    *err = ckpt__strdup_printf("rank %d: the plan names no save", s->rank);
    return -EINVAL;
  }
  /* The coordinator made and holds the save's directory (ckpt__cm_global_step);
   * every other rank joins it: one that does not see it has a BACKING_DIR
   * of its own. With a tier, each node has its own: the first rank of
   * the node to get here makes it. */
  if (s->dirfd < 0 &&
      (rc = ckpt_store_save_dir_hold(s->root_fd, s->rp.save_id,
                                     fs->tier_fd >= 0 && !s->direct,
                                     &s->dirfd)) != 0) {
    if (rc == -ENOENT)
      *err = ckpt__strdup_printf(
          "rank %d: BACKING_DIR %s is not the coordinator's (rank 0 made "
          "%s/%s there, this rank does not see it): every rank of a world "
          "must mount one BACKING_DIR shared by all nodes (and write the "
          "same level= word to .commit); nothing was "
          "written", s->rank, s->root_path, CKPT_SAVES_DIR,
          s->rp.save_id);
    else
      *err = ckpt__strdup_printf("rank %d: opening %s/%s/%s: %s", s->rank,
                                 s->root_path, CKPT_SAVES_DIR,
                                 s->rp.save_id, strerror(-rc));
    return rc == -ENOENT ? -EXDEV : rc;
  }
  /* A tier too full for this rank's files: said before anything is
   * written, with what to do (the rest of the node's ranks write there
   * too: a write that finds it full says the same) */
  uint64_t streamed = 0;
  for (uint32_t k = 0; s->ck->streams && !s->direct && k < s->ck->streams->n;
       k++)
    streamed += s->stream_used[k];
  struct statvfs tv;
  if (fs->tier_fd >= 0 && !s->direct && fstatvfs(fs->tier_fd, &tv) == 0 &&
      total > streamed &&
      (uint64_t)tv.f_bavail * tv.f_frsize < total - streamed) {
    *err = tier_full(fs, s, total - streamed);
    return -ENOSPC;
  }
  if (s->ck->streams && !s->direct &&
      (rc = ckpt__streams_link(s->ck->streams, s->stream_used, s->dirfd,
                               err)) != 0)
    return rc;
  ckpt_failpoint("write_begin");
  rc = ckpt__pool_run(fs->pool, s->rp.n_files, write_file, s);
  if (rc) {
    char name[64] = "data files";
    int k = atomic_load(&s->failed_file);
    if (k >= 0)
      ckpt_data_file_name(s->rank, (uint32_t)k, name, sizeof(name));
    *err = rc == -ENOSPC && fs->tier_fd >= 0 && !s->direct
               ? tier_full(fs, s, total - streamed)
               : ckpt__strdup_printf("rank %d: writing %s/%s/%s: %s",
                                     s->rank, s->root_path, job->name, name,
                                     strerror(-rc));
    return rc;
  }
  /* With a tier: this rank's files are to be flushed from now on, even if
   * this node never publishes the checkpoint (flush.c). */
  if (fs->tier_fd >= 0 && !s->direct &&
      (rc = ckpt__flush_record(fs, s->rp.save_id, s->rank, job->name,
                               s->replace, ckpt__cm_remote_node(fs, job), NULL,
                               err)) != 0)
    return rc;
  ckpt_failpoint("write_done");
  ckpt_write_result_t wr = {.rank = s->rank, .bytes_written = total};
  return ckpt_msg_encode_write_result(&wr, out);
}

/* ------------------------------------------------------------------------
 * ckpt__cm_finish_step (coordinator), ckpt__cm_discard_step, done.
 * ---------------------------------------------------------------------- */

/* *err names the held directory by /proc/self/fd/N: give its path. */
static void name_held_dir(char **err, const char *held, const char *dir) {
  char *at;
  while (!strstr(dir, held) && (at = strstr(*err, held)) != NULL) {
    char *named = ckpt__strdup_printf("%.*s%s%s", (int)(at - *err), *err, dir,
                                      at + strlen(held));
    if (!named)
      return;
    free(*err);
    *err = named;
  }
}

/* The .metadata in dirfd, appended to out (for the other nodes' tiers). */
static int read_metadata(int dirfd, ckpt_buf_t *out) {
  int fd = ckpt_store_open_file(dirfd, CKPT_METADATA_FILE);
  if (fd < 0)
    return fd;
  char buf[65536];
  ssize_t r;
  int rc = 0;
  while (rc == 0 && (r = read(fd, buf, sizeof(buf))) != 0)
    rc = r < 0 ? (errno == EINTR ? 0 : -errno)
               : ckpt_buf_append(out, buf, (size_t)r);
  close(fd);
  return rc;
}

/* Do ranks of other nodes than this one's take part in job? */
static bool other_nodes(ckpt_fs_t *fs, const ckpt_dist_job_t *job) {
  return !job->solo && fs->world_size > 1 && fs->dist &&
         ckpt_dist_nodes(fs->dist) > 1;
}

int ckpt__cm_finish_step(void *ctx, ckpt_dist_job_t *job,
                       const ckpt_buf_t *results, int n, ckpt_buf_t *outcome,
                       char **err) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_t *s = job->user;
  for (int r = 0; r < n; r++) {
    ckpt_write_result_t wr;
    int rc = ckpt_msg_decode_write_result(results[r].data, results[r].len,
                                          &wr);
    uint64_t want = 0;
    for (uint32_t k = 0; rc == 0 && k < s->gp.ranks[r].n_files; k++)
      want += s->gp.ranks[r].file_bytes[k];
    if (rc == 0 && (wr.rank != r || wr.bytes_written != want)) {
      *err = ckpt__strdup_printf("rank %d: wrote %llu bytes, %llu planned", r,
                                 (unsigned long long)wr.bytes_written,
                                 (unsigned long long)want);
      rc = -EIO;
    } else if (rc) {
      *err = ckpt__strdup_printf("rank %d: malformed write result", r);
    }
    ckpt_write_result_free(&wr);
    if (rc)
      return rc;
  }
  /* .metadata into the save's own directory, then the directory is
   * renamed to NAME without replacing anything: of concurrent saves of
   * one NAME, from any mount, exactly one gets there (the commit point). */
  char dir[PATH_MAX], held[64];
  snprintf(dir, sizeof(dir), "%s/%s/%s", s->root_path, CKPT_SAVES_DIR,
           s->gp.meta.save_id);
  /* Written through the held directory itself, not by its path: a symlink
   * put in place of .saves must not take .metadata elsewhere. */
  snprintf(held, sizeof(held), "/proc/self/fd/%d", s->dirfd);
  bool via_fd = s->dirfd >= 0 && access(held, F_OK) == 0;
  /* Into a tier: what it replaces, so that its flush publishes it only
   * while NAME on BACKING_DIR is still that (resolve.c) */
  free(s->gp.meta.replaces);
  s->gp.meta.replaces =
      s->direct ? NULL : ckpt__resolve_replaces(fs, job->name, s->replace);
  /* the commit point's time: of two saves of NAME, the later one stays */
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  s->gp.meta.commit_ns = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
  /* A tier copy of NAME that this mount does not serve (kept of a save
   * NAME is no more, or superseded): in the way of a plain commit, so
   * exchanged like a replace's (its flush record, if any, then finds it
   * gone and drops it). */
  ckpt_resolved_t was = {.root = fs->backing_fd};
  if (fs->tier_fd >= 0 && !s->direct)
    ckpt__resolve(fs, job->name, &was);
  int rc = ckpt_metadb_publish(via_fd ? held : dir, &s->gp.meta,
                               fs->opts.sync_files, err);
  if (rc && via_fd && *err)
    name_held_dir(err, held, dir);
  /* the other nodes publish the same bytes in their tiers */
  if (rc == 0 && fs->tier_fd >= 0 && !s->direct && other_nodes(fs, job) &&
      (rc = read_metadata(s->dirfd, outcome)) != 0)
    *err = ckpt__strdup_printf("reading %s/%s back: %s", dir,
                               CKPT_METADATA_FILE, strerror(-rc));
  if (rc == 0) {
    ckpt_publish_t p = {.root_fd = s->root_fd,
                        .root_path = s->root_path,
                        .held_fd = s->dirfd,
                        .save_id = s->gp.meta.save_id,
                        .name = job->name,
                        .replace = s->replace || was.stale[0] ||
                                   was.superseded};
    int lock = -1;
    if (fs->tier_fd >= 0) {
      pthread_mutex_lock(&fs->tier_publish);
      lock = ckpt__tier_lock(fs);
    }
    rc = ckpt__publish_save(fs, &p, err);
    if (fs->tier_fd >= 0) {
      ckpt__tier_unlock(lock);
      pthread_mutex_unlock(&fs->tier_publish);
    }
  }
  return rc;
}

/* held/.metadata from bytes: through .metadata.tmp.R (R: rank), synced,
 * linked (another rank of the node may have linked it first: the same
 * bytes). 0 or -errno. */
static int link_metadata(int held, int rank, const ckpt_buf_t *bytes,
                         bool sync) {
  char tmp[64];
  snprintf(tmp, sizeof(tmp), "%s.%d", CKPT_METADATA_TMP, rank);
  int fd = openat(held, tmp,
                  O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  int rc = fd < 0 ? -errno : 0;
  for (size_t off = 0; rc == 0 && off < bytes->len;) {
    ssize_t w = write(fd, bytes->data + off, bytes->len - off);
    if (w > 0)
      off += (size_t)w;
    else if (w == 0 || errno != EINTR)
      rc = w < 0 ? -errno : -ENOSPC;
  }
  if (rc == 0 && sync && fsync(fd))
    rc = -errno;
  if (fd >= 0)
    close(fd);
  if (rc == 0 && linkat(held, tmp, held, CKPT_METADATA_FILE, 0) &&
      errno != EEXIST)
    rc = -errno;
  unlinkat(held, tmp, 0);
  if (rc == 0 && sync && fsync(held))
    rc = -errno;
  return rc;
}

/* A node other than the coordinator's: publish the committed checkpoint
 * in this node's tier too, from the coordinator's .metadata (outcome), as
 * the coordinator did in its own: of the node's ranks the first does it
 * (under the node's lock; the others find TIER/NAME of this save). If it
 * fails, the flush records still flush this node's files (from
 * TIER/.saves/SAVE_ID); the log says so. */
void ckpt__cm_publish_step(void *ctx, ckpt_dist_job_t *job,
                         const ckpt_buf_t *outcome) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_t *s = job->user;
  if (fs->tier_fd < 0 || s->direct || s->dirfd < 0 || !s->have_rp ||
      !ckpt__cm_remote_node(fs, job))
    return; /* the coordinator published in this node's tier */
  ckpt_failpoint("tier_publish");
  char *err = NULL, id[CKPT_SAVE_ID_LEN + 1] = "";
  int rc = outcome->len ? 0 : -EBADMSG; /* no .metadata in the OUTCOME */
  ckpt_resolved_t was; /* a tier copy not served is exchanged (ckpt__cm_finish_step) */
  ckpt__resolve(fs, job->name, &was);
  pthread_mutex_lock(&fs->tier_publish);
  int lock = ckpt__tier_lock(fs);
  int dfd = rc ? -1 : ckpt_store_open_dir(fs->tier_fd, job->name, O_RDONLY);
  bool done = dfd >= 0 && ckpt_store_save_id(dfd, id) == 0 &&
              !strcmp(id, s->rp.save_id);
  if (dfd >= 0)
    close(dfd);
  if (rc == 0 && !done)
    rc = link_metadata(s->dirfd, s->rank, outcome, fs->opts.sync_files);
  if (rc == 0 && !done) {
    ckpt_publish_t p = {.root_fd = fs->tier_fd,
                        .root_path = fs->tier_path,
                        .held_fd = s->dirfd,
                        .save_id = s->rp.save_id,
                        .name = job->name,
                        .replace = s->replace || was.stale[0] ||
                                   was.superseded};
    rc = ckpt__publish_save(fs, &p, &err);
  }
  ckpt__tier_unlock(lock);
  pthread_mutex_unlock(&fs->tier_publish);
  if (rc)
    ckpt__log("tier: %s: committed, but not published in this node's tier "
              "%s: %s; its files are flushed from %s/%s/%s", job->name,
              fs->tier_path, err ? err : strerror(-rc), fs->tier_path,
              CKPT_SAVES_DIR, s->rp.save_id);
  free(err);
}

void ckpt__cm_discard_step(void *ctx, ckpt_dist_job_t *job, bool all_done) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_t *s = job->user;
  ckpt_failpoint("discard");
  if (!all_done) {
    if (s->ck->streams && s->dirfd >= 0 && !s->direct) /* kept aside for
                                                          the retry */
      ckpt__streams_unlink(s->ck->streams, s->dirfd);
    for (uint32_t k = 0; s->have_rp && s->dirfd >= 0 && k < s->rp.n_files;
         k++) {
      char name[64];
      ckpt_data_file_name(s->rank, k, name, sizeof(name));
      unlinkat(s->dirfd, name, 0);
    }
    ckpt__partner_discard(fs, &s->partner_rx, s->dirfd, s->rp.save_id);
    if (fs->tier_fd >= 0 && !s->direct && s->have_rp) {
      ckpt__flush_unrecord(fs, s->rp.save_id, s->rank);
      /* another node's save directory: its last rank removes it */
      char path[CKPT_SAVE_ID_LEN + 16];
      snprintf(path, sizeof(path), "%s/%s", CKPT_SAVES_DIR, s->rp.save_id);
      if (s->rank != 0)
        unlinkat(fs->tier_fd, path, AT_REMOVEDIR);
    }
    return;
  }
  /* Coordinator, every rank done: the save's own directory goes (never
   * anything by the checkpoint's name: that is someone else's). */
  if (s->have_gp && s->gp.meta.save_id) {
    ckpt_store_save_dir_remove(s->root_fd, s->gp.meta.save_id);
    if (fs->opts.sync_files)
      fsync(s->root_fd);
  }
}

void ckpt__save_waiting(void *ctx, ckpt_dist_job_t *job, const char *what,
                        double until) {
  ckpt_fs_t *fs = ctx;
  ckpt_save_t *s = job->user;
  char *copy = what ? strdup(what) : NULL;
  pthread_mutex_lock(&fs->lock);
  free(s->ck->waiting);
  s->ck->waiting = copy;
  s->ck->waiting_until = copy ? until : 0;
  pthread_mutex_unlock(&fs->lock);
}

/* This mount's commit of NAME lost to a save of another mount (EEXIST):
 * NAME is that checkpoint now, here as on every other mount (SPEC: a
 * checkpoint committed through any mount is seen by every other). Its
 * staged files are discarded, as rm -r NAME would (keeping them under
 * NAME would serve them as NAME, and rm -r NAME of the committed one
 * would then remove the winner's for every mount); .status ("lost:") and
 * the log say so. False when NAME in BACKING_DIR is not a committed
 * checkpoint (a file, an unfinished save): then it stays staged, failed,
 * for the trainer to commit again. */
bool ckpt__cm_yield_to_winner(ckpt_fs_t *fs, ckpt_ckpt_t *ck, const char *name,
                            const char *reason) {
  if (strcmp(ck->name, name) || !ckpt__already_committed(fs, name))
    return false;
  uint64_t files, bytes;
  pthread_mutex_lock(&fs->lock);
  ckpt__ckpt_staged_size(ck, &files, &bytes);
  pthread_mutex_unlock(&fs->lock);
  char *note = ckpt__strdup_printf(
      "this mount's commit of %s failed: %s; its staged files of %s (%llu "
      "files, %llu bytes) were discarded, and %s shows that checkpoint",
      name, reason, name, (unsigned long long)files,
      (unsigned long long)bytes, name);
  char *copy = note ? strdup(note) : NULL;
  char *err = NULL;
  int rc = ckpt__fs_load_instead(fs, ck, copy, &err);
  pthread_mutex_lock(&fs->lock);
  bool discarded = ck->dir == NULL; /* else it stays staged, failed */
  if (discarded) { /* an open .status of it says the same */
    ck->state = CKPT_FAILED;
    free(ck->reason);
    ck->reason = note ? note : strdup(reason);
    note = NULL;
  }
  pthread_mutex_unlock(&fs->lock);
  free(note);
  if (discarded)
    ckpt__log("%s: this mount's staged files (%llu files, %llu bytes) were "
              "discarded: %s; %s", name, (unsigned long long)files,
              (unsigned long long)bytes, reason,
              rc ? "that checkpoint cannot be shown either"
                 : "showing that checkpoint");
  if (rc)
    ckpt__log("%s: not showing the checkpoint committed elsewhere: %s", name,
              err ? err : strerror(-rc));
  free(err);
  return discarded;
}
