/*
 * cmd_export.c - `ckptctl export BACKING_DIR NAME --safetensors FILE`: one
 * committed checkpoint as one consolidated safetensors file, every tensor
 * assembled whole from its chunks with each chunk's checksum verified
 * (common.c); written to FILE.tmp, synced, renamed to FILE.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt_views.h"
#include "ckptctl.h"
#include "json.h"
#include "metadb.h"

static int write_full(int fd, const void *p, size_t n, uint64_t off) {
  const char *c = p;
  while (n > 0) {
    ssize_t r = pwrite(fd, c, n, (off_t)off);
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      return -errno;
    if (r == 0)
      return -EIO;
    c += r, n -= (size_t)r, off += (uint64_t)r;
  }
  return 0;
}

typedef struct {
  int fd;
  uint64_t base;    /* the tensor's byte 0 in the file */
  const char *file; /* for messages */
} write_sink_t;

static int write_sink(void *arg, const uint8_t *p, size_t n, uint64_t at) {
  write_sink_t *ws = arg;
  int rc = write_full(ws->fd, p, n, ws->base + at);
  if (rc)
    fail("writing %s: %s", ws->file, strerror(-rc));
  return rc ? -1 : 0;
}

/* fsync the directory holding path. */
static int sync_parent(const char *path) {
  char dir[PATH_MAX];
  snprintf(dir, sizeof(dir), "%s", path);
  char *slash = strrchr(dir, '/');
  if (!slash)
    snprintf(dir, sizeof(dir), ".");
  else if (slash == dir)
    dir[1] = '\0';
  else
    *slash = '\0';
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  int rc = fsync(fd) ? -errno : 0;
  close(fd);
  return rc;
}

/* Lay out the safetensors file of checkpoint name (m) into plan, st
 * (n_tensors of m) its tensors: 0, or -1 with the reason printed. */
static int plan_export(const char *name, const ckpt_metadata_t *m,
                       ckpt_st_tensor_t *st, ckpt_st_plan_t *plan) {
  for (uint32_t i = 0; i < m->n_tensors; i++)
    st[i] = (ckpt_st_tensor_t){.name = m->tensors[i].fqn,
                               .dtype = m->tensors[i].dtype,
                               .ndim = m->tensors[i].ndim,
                               .shape = m->tensors[i].shape};
  int rc = ckpt_st_plan(st, m->n_tensors, 0, plan);
  if (rc) {
    fail("%s: cannot lay out a safetensors file: %s", name, strerror(-rc));
    return -1;
  }
  return 0;
}

/* The file's contents into out_fd (tmp, for messages): the header, the
 * size, every tensor the plan keeps, then fsync. 0, or -1 with the reason
 * printed. */
static int fill_file(int out_fd, const char *tmp, data_files_t *df,
                     const ckpt_metadata_t *m, const ckpt_st_plan_t *plan,
                     window_t *w) {
  const ckpt_st_shard_t *sh = &plan->shards[0];
  int rc;
  if ((rc = write_full(out_fd, sh->header, (size_t)sh->header_len, 0)) ||
      (ftruncate(out_fd, (off_t)sh->file_size) && (rc = -errno))) {
    fail("writing %s: %s", tmp, strerror(-rc));
    return -1;
  }
  for (size_t k = 0; k < plan->n_kept; k++) {
    size_t i = plan->order[k];
    write_sink_t ws = {.fd = out_fd, .base = plan->place[i].offset,
                       .file = tmp};
    if (assemble_tensor(df, m, &m->tensors[i], w, write_sink, &ws))
      return -1;
  }
  if (fsync(out_fd)) {
    fail("syncing %s: %s", tmp, strerror(errno));
    return -1;
  }
  return 0;
}

static void remove_partial(const char *tmp) {
  if (unlink(tmp) == 0)
    fprintf(stderr, "%s: removed the partial %s\n", prog, tmp);
}

/* Write file as FILE.tmp, sync it, rename it to file, sync the directory:
 * 0, or -1 with the reason printed and FILE.tmp removed. */
static int write_safetensors(const char *file, data_files_t *df,
                             const ckpt_metadata_t *m,
                             const ckpt_st_plan_t *plan, window_t *w) {
  char tmp[PATH_MAX];
  if (snprintf(tmp, sizeof(tmp), "%s.tmp", file) >= (int)sizeof(tmp)) {
    fail("%s: name too long", file);
    return -1;
  }
  int out_fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out_fd < 0) {
    fail("cannot create %s: %s", tmp, strerror(errno));
    return -1;
  }
  if (fill_file(out_fd, tmp, df, m, plan, w)) {
    close(out_fd);
    remove_partial(tmp);
    return -1;
  }
  int rc = close(out_fd) ? -errno : 0;
  if (rc || rename(tmp, file)) {
    fail("%s %s: %s", rc ? "closing" : "renaming to", rc ? tmp : file,
         strerror(rc ? -rc : errno));
    remove_partial(tmp);
    return -1;
  }
  sync_parent(file);
  return 0;
}

/* What was written, and what was left out. */
static void report_export(const args_t *a, const ckpt_metadata_t *m,
                          const ckpt_st_plan_t *plan) {
  const char *name = a->pos[1], *file = a->safetensors;
  const ckpt_st_shard_t *sh = &plan->shards[0];
  uint64_t blob_bytes = 0;
  for (uint32_t i = 0; i < m->n_blobs; i++)
    blob_bytes += m->blobs[i].length;
  if (a->json) {
    json_t j;
    j_begin(&j);
    j_open(&j, '{');
    j_key(&j, "name"), j_str(&j, name);
    j_key(&j, "file"), j_str(&j, file);
    j_key(&j, "format"), j_str(&j, "safetensors");
    j_key(&j, "bytes"), j_u64(&j, sh->file_size);
    j_key(&j, "header_bytes"), j_u64(&j, sh->header_len);
    j_key(&j, "tensors"), j_u64(&j, plan->n_kept);
    j_key(&j, "left_out");
    j_open(&j, '[');
    for (uint32_t i = 0; i < m->n_tensors; i++)
      if (plan->place[i].shard == CKPT_ST_LEFT_OUT)
        j_str(&j, m->tensors[i].fqn);
    j_close(&j, ']');
    j_key(&j, "blobs_left_out");
    j_open(&j, '[');
    for (uint32_t i = 0; i < m->n_blobs; i++)
      j_str(&j, m->blobs[i].fqn);
    j_close(&j, ']');
    j_close(&j, '}');
    j_end(&j);
    return;
  }
  char b[32];
  printf("%s: wrote %s: %zu tensors, %s (%" PRIu64 " bytes), every chunk's "
         "checksum verified\n",
         name, file, plan->n_kept, human_bytes(sh->file_size, b, sizeof(b)),
         sh->file_size);
  for (uint32_t i = 0; i < m->n_tensors; i++)
    if (plan->place[i].shard == CKPT_ST_LEFT_OUT)
      printf("left out: tensor %s (%s has no safetensors dtype, or the "
             "name is not UTF-8)\n",
             m->tensors[i].fqn, ckpt_dtype_name(m->tensors[i].dtype));
  if (m->n_blobs)
    printf("left out: %u blobs, %" PRIu64 " bytes (safetensors holds "
           "tensors only; read them through a mount)\n",
           m->n_blobs, blob_bytes);
}

int cmd_export(const args_t *a, int bfd) {
  const char *backing = a->pos[0], *name = a->pos[1];
  ckpt_metadata_t m;
  if (load_named(bfd, backing, name, &m))
    return EXIT_NO;
  if (a->dcp) {
    ckpt_metadata_free(&m);
    return export_dcp(a);
  }
  int status = EXIT_NO;
  data_files_t df = {.backing = backing, .name = name};
  window_t w = {.win = malloc(EXPORT_WINDOW), .src = malloc(EXPORT_WINDOW)};
  ckpt_st_tensor_t *st = calloc(m.n_tensors ? m.n_tensors : 1, sizeof(*st));
  ckpt_st_plan_t plan = {0};
  if (!w.win || !w.src || !st) {
    fail("out of memory");
  } else if (df_open(&df, bfd, &m) == 0 &&
             plan_export(name, &m, st, &plan) == 0 &&
             write_safetensors(a->safetensors, &df, &m, &plan, &w) == 0) {
    status = 0;
    report_export(a, &m, &plan);
  }
  df_close(&df);
  ckpt_st_plan_free(&plan);
  free(st);
  free(w.win);
  free(w.src);
  ckpt_metadata_free(&m);
  return status;
}
