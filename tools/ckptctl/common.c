/*
 * common.c - what ckptctl's commands share (ckptctl.h): messages, times
 * and sizes, loading checkpoints from a backing directory, and reading
 * whole tensors from the data files, every chunk's checksum verified on
 * the way (export, diff --content).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "ckptctl.h"
#include "metadb.h"

void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s: ", prog);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

/* ------------------------------------------------------------------------
 * Times, sizes.
 * ---------------------------------------------------------------------- */

/* "2026-12-02T17:40:00Z" */
const char *iso_time(int64_t t, char *buf, size_t cap) {
  time_t tt = (time_t)t;
  struct tm tm;
  if (!gmtime_r(&tt, &tm) ||
      strftime(buf, cap, "%Y-%m-%dT%H:%M:%SZ", &tm) == 0)
    snprintf(buf, cap, "%" PRId64, t);
  return buf;
}

/* "512 B", "1.5 KiB", "3.0 GiB" */
const char *human_bytes(uint64_t n, char *buf, size_t cap) {
  static const char *const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB",
                                      "EiB"};
  if (n < 1024) {
    snprintf(buf, cap, "%" PRIu64 " B", n);
    return buf;
  }
  double v = (double)n / 1024;
  size_t u = 0;
  while (v >= 1024 && u + 1 < sizeof(units) / sizeof(units[0]))
    v /= 1024, u++;
  snprintf(buf, cap, "%.1f %s", v, units[u]);
  return buf;
}

/* "[4096,1024]" */
const char *dims_text(const int64_t *d, int n, char *buf, size_t cap) {
  ckpt_dims_format(d, n, CKPT_DIMS_JSON, buf, cap);
  return buf;
}

/* ------------------------------------------------------------------------
 * Loading checkpoints.
 * ---------------------------------------------------------------------- */

char *mountinfo_unescape(char *s) {
  char *o = s;
  for (char *p = s; *p; p++) {
    if (p[0] == '\\' && p[1] >= '0' && p[1] <= '3' && p[2] >= '0' &&
        p[2] <= '7' && p[3] >= '0' && p[3] <= '7') {
      *o++ = (char)((p[1] - '0') * 64 + (p[2] - '0') * 8 + (p[3] - '0'));
      p += 3;
    } else {
      *o++ = *p;
    }
  }
  *o = '\0';
  return s;
}

/* Is path itself a ckptfs mount? Then *source (malloc'd) is what it
 * mounts, its BACKING_DIR. */
static bool is_ckptfs_mount(const char *path, char **source) {
  char *real = realpath(path, NULL);
  FILE *f = real ? fopen("/proc/self/mountinfo", "re") : NULL;
  bool found = false;
  char *line = NULL;
  size_t cap = 0;
  while (f && !found && getline(&line, &cap, f) > 0) {
    /* ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [TAGS...] - TYPE SOURCE */
    char *save = NULL, *tok = strtok_r(line, " \n", &save), *mp = NULL;
    for (int i = 0; tok && i < 4; i++)
      mp = tok = strtok_r(NULL, " \n", &save);
    while (tok && strcmp(tok, "-"))
      tok = strtok_r(NULL, " \n", &save);
    char *type = tok ? strtok_r(NULL, " \n", &save) : NULL;
    char *src = type ? strtok_r(NULL, " \n", &save) : NULL;
    if (!mp || !type || !src || strcmp(type, "fuse.ckptfs"))
      continue;
    mountinfo_unescape(mp);
    if (!strcmp(mp, real)) {
      mountinfo_unescape(src);
      *source = strdup(src);
      found = true;
    }
  }
  free(line);
  if (f)
    fclose(f);
  free(real);
  return found;
}

int open_backing(const char *path) {
  char *source = NULL;
  if (is_ckptfs_mount(path, &source)) {
    fail("%s is a ckptfs mount, not a backing directory: give its "
         "BACKING_DIR, %s", path, source ? source : "(unknown)");
    free(source);
    return -1;
  }
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    fail("cannot open BACKING_DIR %s: %s (give the directory the mounts "
         "store into, the BACKING_DIR of `ckptfs BACKING_DIR MOUNTPOINT`)",
         path, strerror(errno));
  return fd;
}

int load_named(int backing_fd, const char *backing, const char *name,
               ckpt_metadata_t *m) {
  if (!ckpt_name_valid(name)) {
    fail("'%s' is not a checkpoint name (1-255 bytes, no '/', not "
         "starting with '.'); `%s ls %s` lists them",
         name, prog, backing);
    return -1;
  }
  struct stat st;
  if (fstatat(backing_fd, name, &st, AT_SYMLINK_NOFOLLOW) ||
      !S_ISDIR(st.st_mode)) {
    fail("no checkpoint %s in %s; `%s ls %s` lists them", name, backing,
         prog, backing);
    return -1;
  }
  char rel[300];
  snprintf(rel, sizeof(rel), "%s/%s", name, CKPT_METADATA_FILE);
  if (faccessat(backing_fd, rel, F_OK, AT_SYMLINK_NOFOLLOW)) {
    fail("%s is not committed (no %s: a save in flight or interrupted); "
         "wait for its commit, or let the next mount remove it",
         name, CKPT_METADATA_FILE);
    return -1;
  }
  char path[PATH_MAX];
  snprintf(path, sizeof(path), "%s/%s/%s", backing, name, CKPT_METADATA_FILE);
  char *err = NULL;
  int dfd = ckpt_store_open_dir(backing_fd, name, O_RDONLY);
  int rc = dfd < 0 ? dfd : ckpt_metadb_load_at(dfd, path, m, &err);
  if (dfd >= 0)
    close(dfd);
  if (rc) {
    fail("%s: damaged %s: %s; run ckptfs-fsck %s %s", name,
         CKPT_METADATA_FILE, err ? err : strerror(-rc), backing, name);
    free(err);
    return -1;
  }
  return 0;
}

uint64_t stored_bytes(const ckpt_metadata_t *m) {
  uint64_t sum = 0;
  for (uint32_t i = 0; i < m->n_chunks; i++)
    sum += m->chunks[i].length;
  for (uint32_t i = 0; i < m->n_blobs; i++)
    sum += m->blobs[i].length;
  return sum;
}

/* ------------------------------------------------------------------------
 * Reading whole tensors from the data files (see window_t in ckptctl.h).
 * ---------------------------------------------------------------------- */

/* Per chunk while it is read: its hash and how far. */
typedef struct {
  XXH3_state_t *hash;  /* NULL until its first window */
  uint64_t used;       /* chunk bytes read and hashed */
} chunk_read_t;

/* Read exactly n bytes at off: 0, -ENODATA when the file ends first, or
 * -errno. */
static int read_full(int fd, void *buf, size_t n, uint64_t off) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = pread(fd, (char *)buf + got, n - got, (off_t)(off + got));
    if (r < 0 && errno == EINTR)
      continue;
    if (r < 0)
      return -errno;
    if (r == 0)
      return -ENODATA;
    got += (size_t)r;
  }
  return 0;
}

int df_open(data_files_t *df, int bfd, const ckpt_metadata_t *m) {
  int dfd = ckpt_store_open_dir(bfd, df->name, O_RDONLY);
  if (dfd < 0) {
    fail("cannot open %s/%s: %s", df->backing, df->name, strerror(-dfd));
    return -1;
  }
  int rc = ckpt_fdcache_new(bfd, 0, &df->cache);
  if (rc == 0)
    rc = ckpt_stored_init(&df->s, df->cache, df->name, dfd, m, false);
  close(dfd);
  if (rc) {
    fail("%s: %s", df->name, strerror(-rc));
    return -1;
  }
  df->open = true;
  return 0;
}

void df_close(data_files_t *df) {
  if (df->open)
    ckpt_stored_destroy(&df->s);
  ckpt_fdcache_free(df->cache);
  df->cache = NULL;
  df->open = false;
}

/* What a chunk is called in messages: "tensor FQN chunk at [OFFSETS]
 * (rank R, __R_K.distcp)". */
static void chunk_what(const ckpt_tensor_meta_t *t, const ckpt_chunk_meta_t *ch,
                       char *buf, size_t cap) {
  char offs[512], file[64];
  ckpt_dims_format(ch->dims, t->ndim, CKPT_DIMS_JSON, offs, sizeof(offs));
  ckpt_data_file_name(ch->rank, ch->file, file, sizeof(file));
  snprintf(buf, cap, "tensor %s chunk at %s (rank %d, %s)", t->fqn, offs,
           ch->rank, file);
}

/* The part of chunk ch of tensor t that window [at, at + len) needs: read
 * (continuing where cr left off), hashed into cr, copied into place in
 * w->win. 0 (also when the chunk is not in the window), or -errno with
 * the reason printed. */
static int window_chunk(data_files_t *df, const ckpt_tensor_meta_t *t,
                        const ckpt_chunk_meta_t *ch, chunk_read_t *cr,
                        window_t *w, uint64_t at, size_t len) {
  size_t isz = ckpt_dtype_size(t->dtype);
  const int64_t *offs = ch->dims, *sizes = ch->dims + t->ndim;
  uint64_t lo, hi;
  ckpt_layout_span(t->ndim, t->shape, offs, sizes, isz, at, len, &lo, &hi);
  if (lo >= hi)
    return 0; /* not in this window */
  char what[PATH_MAX + 700];
  chunk_what(t, ch, what, sizeof(what));
  if (lo != cr->used || hi > ch->length) {
    fail("%s: %s: its length (%" PRIu64 " bytes) does not match its "
         "sizes; the checkpoint is damaged", df->name, what, ch->length);
    return -EIO;
  }
  if (!cr->hash) {
    if (!(cr->hash = XXH3_createState()) ||
        XXH3_64bits_reset(cr->hash) != XXH_OK) {
      fail("out of memory");
      return -ENOMEM;
    }
  }
  ckpt_fdref_t ref;
  int fd = ckpt_stored_fd(&df->s, ch->rank, ch->file, &ref);
  if (fd == 0)
    fd = ref.fd;
  size_t n = (size_t)(hi - lo);
  int rc = fd < 0 ? fd : read_full(fd, w->src, n, ch->file_offset + lo);
  ckpt_fdref_put(&ref);
  if (rc) {
    fail("%s: %s: %s; the checkpoint is damaged, nothing exported "
         "(ckptfs-fsck %s %s lists every problem)",
         df->name, what,
         rc == -ENODATA ? "the data file is truncated"
         : fd < 0       ? (rc == -ENOENT ? "cannot open the data file: "
                                           "it is missing"
                                         : "cannot open the data file")
                        : strerror(-rc),
         df->backing, df->name);
    return rc;
  }
  XXH3_64bits_update(cr->hash, w->src, n);
  cr->used = hi;
  ckpt_layout_copy(t->ndim, t->shape, offs, sizes, isz, at, len, w->src, lo,
                   w->win);
  return 0;
}

/* Every chunk of t read whole (cr): its length and checksum checked. Each
 * mismatch is reported; returns how many. */
static int check_chunks(const data_files_t *df, const ckpt_metadata_t *m,
                        const ckpt_tensor_meta_t *t, const chunk_read_t *cr) {
  char what[PATH_MAX + 700];
  int bad = 0;
  for (uint32_t i = 0; i < t->n_chunks; i++) {
    const ckpt_chunk_meta_t *ch = &m->chunks[t->first_chunk + i];
    chunk_what(t, ch, what, sizeof(what));
    uint64_t got = XXH3_64bits(NULL, 0);
    if (cr[i].hash)
      got = XXH3_64bits_digest(cr[i].hash);
    if (cr[i].used != ch->length) {
      fail("%s: %s: its length (%" PRIu64 " bytes) does not match its "
           "sizes; the checkpoint is damaged", df->name, what, ch->length);
      bad++;
    } else if (got != ch->checksum) {
      fail("%s: %s at %" PRIu64 ": checksum mismatch (stored %016" PRIx64
           ", data %016" PRIx64 "); the checkpoint is damaged, nothing "
           "exported (ckptfs-fsck %s %s lists every problem)",
           df->name, what, ch->file_offset, ch->checksum, got, df->backing,
           df->name);
      bad++;
    }
  }
  return bad;
}

int assemble_tensor(data_files_t *df, const ckpt_metadata_t *m,
                    const ckpt_tensor_meta_t *t, window_t *w, sink_fn sink,
                    void *arg) {
  size_t isz = ckpt_dtype_size(t->dtype);
  uint64_t numel = 0;
  ckpt_dims_numel(t->shape, t->ndim, &numel);
  uint64_t total = numel * isz;
  chunk_read_t *cr = calloc(t->n_chunks ? t->n_chunks : 1, sizeof(*cr));
  int rc = cr ? 0 : -ENOMEM, bad = 0;
  if (rc)
    fail("out of memory");
  for (uint64_t at = 0; rc == 0 && at < total; at += EXPORT_WINDOW) {
    size_t len = total - at < EXPORT_WINDOW ? (size_t)(total - at)
                                            : EXPORT_WINDOW;
    for (uint32_t i = 0; rc == 0 && i < t->n_chunks; i++)
      rc = window_chunk(df, t, &m->chunks[t->first_chunk + i], &cr[i], w, at,
                        len);
    if (rc == 0 && sink(arg, w->win, len, at))
      rc = -EIO;
  }
  if (rc == 0)
    bad = check_chunks(df, m, t, cr);
  for (uint32_t i = 0; cr && i < t->n_chunks; i++)
    XXH3_freeState(cr[i].hash);
  free(cr);
  return rc || bad ? -1 : 0;
}
