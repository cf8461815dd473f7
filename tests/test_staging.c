/*
 * test_staging.c - fs/stage/staging.c without a mount: a staged file's
 * 1 MiB segments (writes and reads at unaligned offsets across segment
 * boundaries, reads past the end, truncate both ways, zeroed ranges that
 * become holes again), the staging_mem budget and the spill file beyond
 * it (in BACKING_DIR/.staging of a temporary directory), the largest file
 * (EFBIG), the walk a commit hashes and copies with, the running hash,
 * and the user.ckpt.* xattrs' validation, listing and removal.
 *
 * Every file is checked against a model: a plain array of the bytes it
 * should hold.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <xxhash.h>

#include "stage.h"

#define SEG CKPT_SEG_SIZE
#define MiB ((uint64_t)1 << 20)

/* ------------------------------------------------------------------------
 * A staging budget over a temporary BACKING_DIR.
 * ---------------------------------------------------------------------- */

typedef struct {
  char dir[64];
  int fd;             /* BACKING_DIR */
  ckpt_staging_t st;
} fixture_t;

static int fixture_setup(void **state, uint64_t limit) {
  fixture_t *fx = calloc(1, sizeof(*fx));
  if (!fx)
    return -1;
  snprintf(fx->dir, sizeof(fx->dir), "/tmp/ckpt-staging-XXXXXX");
  if (!mkdtemp(fx->dir)) {
    free(fx);
    return -1;
  }
  fx->fd = open(fx->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fx->fd < 0) {
    rmdir(fx->dir);
    free(fx);
    return -1;
  }
  ckpt__staging_init(&fx->st, limit, fx->fd);
  *state = fx;
  return 0;
}

/* 64 MiB of RAM: nothing spills. */
static int setup_roomy(void **state) { return fixture_setup(state, 64 * MiB); }
/* One segment of RAM: the rest spills. */
static int setup_tight(void **state) { return fixture_setup(state, SEG); }
/* No RAM at all: every segment spills, segment 0 of a small file too. */
static int setup_no_ram(void **state) { return fixture_setup(state, 0); }

/* Names in BACKING_DIR/.staging (-1: no such directory). */
static int staging_names(int backing_fd) {
  int dfd = openat(backing_fd, CKPT_STAGING_DIR,
                   O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0)
    return -1;
  DIR *d = fdopendir(dfd);
  if (!d) {
    close(dfd);
    return -1;
  }
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
      n++;
  closedir(d);
  return n;
}

/* The budget goes; nothing is left in BACKING_DIR (the spill file is an
 * unnamed file, .staging is tidied): the directory removes as empty. */
static int teardown(void **state) {
  fixture_t *fx = *state;
  int rc = 0;
  if (staging_names(fx->fd) > 0) {
    fprintf(stderr, "named files left in %s/.staging\n", fx->dir);
    rc = -1;
  }
  ckpt__staging_destroy(&fx->st);
  ckpt__staging_tidy(fx->fd);
  close(fx->fd);
  if (rmdir(fx->dir) != 0) {
    fprintf(stderr, "%s not empty: %s\n", fx->dir, strerror(errno));
    rc = -1;
  }
  free(fx);
  return rc;
}

/* ------------------------------------------------------------------------
 * The model: the bytes the file should hold.
 * ---------------------------------------------------------------------- */

typedef struct {
  uint8_t *b;
  uint64_t size, cap;
} model_t;

static void model_init(model_t *m, uint64_t cap) {
  m->b = calloc(1, cap);
  assert_non_null(m->b);
  m->size = 0;
  m->cap = cap;
}

/* The byte written at pos by a write tagged seed: no period of 256, and
 * never the same for two seeds. */
static uint8_t pat(uint64_t pos, unsigned seed) {
  uint64_t x = (pos + 1) * 0x9E3779B97F4A7C15ull + seed * 0x2545F4914F6CDD1Dull;
  return (uint8_t)(x >> 56);
}

static uint8_t *pattern(uint64_t off, size_t n, unsigned seed) {
  uint8_t *p = malloc(n ? n : 1);
  assert_non_null(p);
  for (size_t i = 0; i < n; i++)
    p[i] = pat(off + i, seed);
  return p;
}

/* Write [off, off+n) of pattern seed to sf and the model, in pieces of
 * `piece` bytes (each write must take all of its bytes). */
static void put(ckpt_sfile_t *sf, model_t *m, uint64_t off, size_t n,
                unsigned seed, size_t piece) {
  uint8_t *p = pattern(off, n, seed);
  assert_true(off + n <= m->cap);
  for (size_t done = 0; done < n;) {
    size_t k = n - done < piece ? n - done : piece;
    assert_int_equal(ckpt__sfile_write(sf, p + done, k, off + done),
                     (ssize_t)k);
    done += k;
  }
  memcpy(m->b + off, p, n);
  if (off + n > m->size)
    m->size = off + n;
  free(p);
}

static void model_truncate(model_t *m, uint64_t size) {
  assert_true(size <= m->cap);
  if (size < m->size)
    memset(m->b + size, 0, m->size - size);
  m->size = size;
}

static void model_zero(model_t *m, uint64_t off, uint64_t len) {
  uint64_t end = off + len < m->size ? off + len : m->size;
  if (off < end)
    memset(m->b + off, 0, end - off);
}

/* Fail with where a read first differs from the model. */
static void assert_same(const uint8_t *got, const uint8_t *want, size_t n,
                        uint64_t off) {
  if (memcmp(got, want, n) == 0)
    return;
  size_t i = 0;
  while (got[i] == want[i])
    i++;
  fail_msg("byte %llu: got 0x%02x, expected 0x%02x",
           (unsigned long long)(off + i), got[i], want[i]);
}

/* Read [off, off+n) and compare with the model (a read past the end gets
 * only the bytes up to it). */
static void check_read(ckpt_sfile_t *sf, const model_t *m, uint64_t off,
                       size_t n) {
  uint8_t *buf = malloc(n ? n : 1);
  assert_non_null(buf);
  memset(buf, 0xEE, n);
  size_t want = off >= m->size ? 0
                : m->size - off < n ? (size_t)(m->size - off)
                                    : n;
  assert_int_equal(ckpt__sfile_read(sf, buf, n, off), (ssize_t)want);
  assert_same(buf, m->b + off, want, off);
  /* nothing written beyond what the read returned */
  for (size_t i = want; i < n; i++)
    assert_int_equal(buf[i], 0xEE);
  free(buf);
}

/* The whole file at once, and windows around every segment boundary. */
static void check_model(ckpt_sfile_t *sf, const model_t *m) {
  assert_int_equal(ckpt__sfile_size(sf), m->size);
  assert_int_equal(ckpt__sfile_size_seen(sf), m->size);
  check_read(sf, m, 0, (size_t)m->size + 4096);
  for (uint64_t b = SEG; b <= m->size + SEG; b += SEG) {
    if (b - 1 < m->cap)
      check_read(sf, m, b - 1, 3);
    if (b - 4097 < m->cap)
      check_read(sf, m, b - 4097, 8192 + 5);
  }
  check_read(sf, m, m->size, 100); /* at the end: 0 bytes */
}

/* ------------------------------------------------------------------------
 * Walks.
 * ---------------------------------------------------------------------- */

typedef struct {
  uint8_t *buf;   /* the pieces put together */
  uint64_t cap;
  uint64_t pos;
  int n;          /* pieces */
  uint64_t len[64];
  ckpt_walk_piece_t kind[64];
  int stop_at;    /* return 7 on this piece (1-based), 0: never */
} walk_t;

static int collect(void *arg, const void *p, size_t n,
                   ckpt_walk_piece_t kind) {
  walk_t *w = arg;
  if (w->n < 64) {
    w->len[w->n] = n;
    w->kind[w->n] = kind;
  }
  w->n++;
  if (w->pos + n > w->cap)
    return -99;
  if (kind == CKPT_WALK_HOLE) {
    if (p != NULL)
      return -98;
    memset(w->buf + w->pos, 0, n);
  } else {
    if (p == NULL || n == 0)
      return -97;
    memcpy(w->buf + w->pos, p, n);
  }
  w->pos += n;
  return w->stop_at && w->n == w->stop_at ? 7 : 0;
}

/* Walk sf: its pieces, in order, must make the model's bytes. */
static void walk_model(ckpt_sfile_t *sf, const model_t *m, walk_t *w) {
  memset(w, 0, sizeof(*w));
  w->cap = m->size;
  w->buf = malloc(m->size ? m->size : 1);
  assert_non_null(w->buf);
  memset(w->buf, 0xEE, m->size);
  assert_int_equal(ckpt__sfile_walk(sf, collect, w), 0);
  assert_int_equal(w->pos, m->size);
  assert_same(w->buf, m->b, m->size, 0);
  free(w->buf);
  w->buf = NULL;
}

/* ------------------------------------------------------------------------
 * Data.
 * ---------------------------------------------------------------------- */

/* Writes at unaligned offsets spanning several segments read back at any
 * offset; the range before the first write reads as zeros. */
static void unaligned_round_trip_across_segments(void **state) {
  fixture_t *fx = *state;
  ckpt_sfile_t *sf = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(sf);
  model_t m;
  model_init(&m, 6 * MiB);
  /* [1 MiB - 1000, 3 MiB + 2000): segments 0 to 3, in odd-sized pieces */
  put(sf, &m, SEG - 1000, 2 * SEG + 3000, 1, 4099);
  assert_int_equal(ckpt__sfile_size(sf), 3 * SEG + 2000);
  check_model(sf, &m);
  /* one write straddling two boundaries over the first, at once */
  put(sf, &m, 2 * SEG - 7, SEG + 14, 2, SIZE_MAX);
  /* and a write past the end, leaving a hole in segment 4 */
  put(sf, &m, 4 * SEG + 333, 1111, 3, SIZE_MAX);
  assert_int_equal(ckpt__sfile_size(sf), 4 * SEG + 1444);
  check_model(sf, &m);
  /* single bytes at a boundary */
  uint8_t b = 0;
  assert_int_equal(ckpt__sfile_read(sf, &b, 1, 2 * SEG - 8), 1);
  assert_int_equal(b, pat(2 * SEG - 8, 1));
  assert_int_equal(ckpt__sfile_read(sf, &b, 1, 2 * SEG - 7), 1);
  assert_int_equal(b, pat(2 * SEG - 7, 2));
  assert_int_equal(ckpt__sfile_read(sf, &b, 1, 3 * SEG + 7), 1);
  assert_int_equal(b, pat(3 * SEG + 7, 1));
  assert_int_equal(ckpt__sfile_read(sf, &b, 1, 3 * SEG + 2000), 1);
  assert_int_equal(b, 0); /* the hole between the writes */
  /* the budget holds the RAM of the five segments, no spill */
  assert_int_equal(atomic_load(&fx->st.used), 5 * SEG);
  assert_int_equal(fx->st.spill_fd, -1);
  ckpt__sfile_free(sf);
  free(m.b);
}

/* A small file's segment 0 grows as written, and whole when the file
 * grows past it: its bytes stay. */
static void small_file_grows_past_segment_zero(void **state) {
  fixture_t *fx = *state;
  ckpt_sfile_t *sf = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(sf);
  model_t m;
  model_init(&m, 4 * MiB);
  put(sf, &m, 0, 5, 1, SIZE_MAX);
  assert_int_equal(atomic_load(&fx->st.used), 64); /* SEG0_MIN */
  check_model(sf, &m);
  put(sf, &m, 100, 200, 2, SIZE_MAX); /* to 300: segment 0 of 512 bytes */
  assert_int_equal(atomic_load(&fx->st.used), 512);
  check_model(sf, &m);
  put(sf, &m, 3 * SEG + 7, 100, 3, SIZE_MAX);
  assert_int_equal(atomic_load(&fx->st.used), 2 * SEG);
  check_model(sf, &m);
  ckpt__sfile_free(sf);
  /* the two full segments are pooled, still counted */
  assert_int_equal(atomic_load(&fx->st.used), 2 * SEG);
  assert_int_equal(fx->st.npool, 2);
  free(m.b);
}

/* Reads at and past the end return what is there, nothing more. */
static void reads_past_eof(void **state) {
  fixture_t *fx = *state;
  ckpt_sfile_t *sf = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(sf);
  uint8_t buf[256];
  memset(buf, 0xEE, sizeof(buf));
  /* an empty file */
  assert_int_equal(ckpt__sfile_size(sf), 0);
  assert_int_equal(ckpt__sfile_read(sf, buf, sizeof(buf), 0), 0);
  assert_int_equal(ckpt__sfile_read(sf, buf, sizeof(buf), 12345), 0);
  model_t m;
  model_init(&m, 2 * MiB);
  put(sf, &m, 0, SEG + 50, 1, 65536);
  assert_int_equal(ckpt__sfile_read(sf, buf, 100, SEG + 40), 10);
  assert_same(buf, m.b + SEG + 40, 10, SEG + 40);
  assert_int_equal(buf[10], 0xEE);
  assert_int_equal(ckpt__sfile_read(sf, buf, 100, SEG + 50), 0);
  assert_int_equal(ckpt__sfile_read(sf, buf, 100, SEG + 51), 0);
  assert_int_equal(ckpt__sfile_read(sf, buf, 100, CKPT_MAX_FILE), 0);
  assert_int_equal(ckpt__sfile_read(sf, buf, 100, UINT64_MAX - 10), 0);
  /* a read of 0 bytes */
  assert_int_equal(ckpt__sfile_read(sf, buf, 0, 10), 0);
  check_model(sf, &m);
  ckpt__sfile_free(sf);
  free(m.b);
}

/* truncate: shrinking drops the bytes past the end; growing again reads
 * zeros there, not the old bytes. */
static void truncate_shrinks_and_grows_with_zeros(void **state) {
  fixture_t *fx = *state;
  ckpt_sfile_t *sf = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(sf);
  model_t m;
  model_init(&m, 6 * MiB);
  put(sf, &m, 0, 3 * SEG + 100, 1, 1 << 20);
  check_model(sf, &m);
  /* into segment 1: segments 2 and 3 go */
  uint64_t cut = SEG + SEG / 2 + 17;
  assert_int_equal(ckpt__sfile_truncate(sf, cut), 0);
  model_truncate(&m, cut);
  assert_int_equal(ckpt__sfile_size(sf), cut);
  check_model(sf, &m);
  assert_int_equal(atomic_load(&fx->st.used), 4 * SEG); /* 2 pooled */
  assert_int_equal(fx->st.npool, 2);
  /* grown again: zeros from the cut on */
  assert_int_equal(ckpt__sfile_truncate(sf, 4 * SEG + 1), 0);
  model_truncate(&m, 4 * SEG + 1);
  check_model(sf, &m);
  uint8_t z[64];
  assert_int_equal(ckpt__sfile_read(sf, z, sizeof(z), cut), sizeof(z));
  for (size_t i = 0; i < sizeof(z); i++)
    assert_int_equal(z[i], 0);
  /* grown by truncate only: no RAM taken for it */
  assert_int_equal(fx->st.npool, 2);
  /* at a boundary */
  assert_int_equal(ckpt__sfile_truncate(sf, SEG), 0);
  model_truncate(&m, SEG);
  check_model(sf, &m);
  /* to the same size: nothing changes */
  assert_int_equal(ckpt__sfile_truncate(sf, SEG), 0);
  check_model(sf, &m);
  /* to 0 and written again */
  assert_int_equal(ckpt__sfile_truncate(sf, 0), 0);
  model_truncate(&m, 0);
  check_model(sf, &m);
  put(sf, &m, 10, 20, 2, SIZE_MAX);
  check_model(sf, &m);
  /* a small segment 0: cut inside it, then grown */
  assert_int_equal(ckpt__sfile_truncate(sf, 15), 0);
  model_truncate(&m, 15);
  assert_int_equal(ckpt__sfile_truncate(sf, 2 * SEG), 0);
  model_truncate(&m, 2 * SEG);
  check_model(sf, &m);
  ckpt__sfile_free(sf);
  free(m.b);
}

/* zero(): the range reads as zeros, whole segments become holes again
 * (their RAM back in the pool), the file keeps its size, and nothing
 * past the end is zeroed or added. */
static void zero_punches_whole_segments(void **state) {
  fixture_t *fx = *state;
  ckpt_sfile_t *sf = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(sf);
  model_t m;
  model_init(&m, 5 * MiB);
  put(sf, &m, 0, 4 * SEG, 1, 1 << 20);
  assert_int_equal(fx->st.npool, 0);
  /* [1 MiB - 5, 2 MiB + 5): the tail of 0, all of 1, the head of 2 */
  assert_int_equal(ckpt__sfile_zero(sf, SEG - 5, SEG + 10), 0);
  model_zero(&m, SEG - 5, SEG + 10);
  check_model(sf, &m);
  assert_int_equal(fx->st.npool, 1); /* segment 1's RAM */
  walk_t w;
  walk_model(sf, &m, &w);
  assert_int_equal(w.n, 4);
  assert_int_equal(w.kind[0], CKPT_WALK_KEPT);
  assert_int_equal(w.len[0], SEG);
  assert_int_equal(w.kind[1], CKPT_WALK_HOLE);
  assert_int_equal(w.len[1], SEG);
  assert_int_equal(w.kind[2], CKPT_WALK_KEPT);
  assert_int_equal(w.kind[3], CKPT_WALK_KEPT);
  /* a range running past the end: zeroed up to it, the size stays */
  assert_int_equal(ckpt__sfile_zero(sf, 4 * SEG - 10, 1000), 0);
  model_zero(&m, 4 * SEG - 10, 1000);
  assert_int_equal(ckpt__sfile_size(sf), 4 * SEG);
  check_model(sf, &m);
  /* wholly past the end, and empty: nothing */
  assert_int_equal(ckpt__sfile_zero(sf, 4 * SEG + 10, SEG), 0);
  assert_int_equal(ckpt__sfile_zero(sf, 100, 0), 0);
  assert_int_equal(ckpt__sfile_size(sf), 4 * SEG);
  check_model(sf, &m);
  /* the whole file: all holes */
  assert_int_equal(ckpt__sfile_zero(sf, 0, 4 * SEG), 0);
  model_zero(&m, 0, 4 * SEG);
  check_model(sf, &m);
  assert_int_equal(fx->st.npool, 4);
  walk_model(sf, &m, &w);
  assert_int_equal(w.n, 4);
  for (int i = 0; i < 4; i++)
    assert_int_equal(w.kind[i], CKPT_WALK_HOLE);
  /* a hole written again */
  put(sf, &m, SEG + 3, 10, 2, SIZE_MAX);
  check_model(sf, &m);
  /* a small segment 0: zeroed inside */
  ckpt_sfile_t *small = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(small);
  model_t s;
  model_init(&s, 4096);
  put(small, &s, 0, 100, 3, SIZE_MAX);
  assert_int_equal(ckpt__sfile_zero(small, 10, 20), 0);
  model_zero(&s, 10, 20);
  check_model(small, &s);
  ckpt__sfile_free(small);
  ckpt__sfile_free(sf);
  free(s.b);
  free(m.b);
}

/* The walk's pieces cover the file in order: RAM as KEPT, never-written
 * ranges as HOLEs, a small segment 0's unallocated tail as a HOLE; a
 * non-zero return stops it. */
/* SEEK_DATA and SEEK_HOLE, and the bytes allocated: a segment never
 * written (or zeroed whole) is a hole, the end of the file is one. */
static void holes_seek_and_allocation(void **state) {
  fixture_t *fx = *state;
  ckpt_sfile_t *sf = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(sf);
  model_t m;
  model_init(&m, 6 * MiB);
  put(sf, &m, 0, SEG, 1, 1 << 20);           /* segment 0 */
  put(sf, &m, 3 * SEG + 7, 100, 2, 100);     /* in segment 3 */
  assert_int_equal(ckpt__sfile_truncate(sf, 5 * SEG), 0);
  model_truncate(&m, 5 * SEG);
  check_model(sf, &m);
  assert_int_equal(ckpt__sfile_allocated(sf), 2 * SEG);
  assert_int_equal(ckpt__sfile_seek(sf, 0, SEEK_DATA), 0);
  assert_int_equal(ckpt__sfile_seek(sf, 10, SEEK_HOLE), SEG);
  assert_int_equal(ckpt__sfile_seek(sf, SEG + 1, SEEK_DATA), 3 * SEG);
  assert_int_equal(ckpt__sfile_seek(sf, 3 * SEG + 9, SEEK_DATA), 3 * SEG + 9);
  assert_int_equal(ckpt__sfile_seek(sf, 3 * SEG, SEEK_HOLE), 4 * SEG);
  assert_int_equal(ckpt__sfile_seek(sf, 4 * SEG, SEEK_DATA), -ENXIO);
  assert_int_equal(ckpt__sfile_seek(sf, 4 * SEG, SEEK_HOLE), 4 * SEG);
  assert_int_equal(ckpt__sfile_seek(sf, 5 * SEG, SEEK_HOLE), -ENXIO);
  assert_int_equal(ckpt__sfile_seek(sf, 0, SEEK_SET), -EINVAL);
  /* zeroing segment 0 whole makes it a hole too */
  assert_int_equal(ckpt__sfile_zero(sf, 0, SEG), 0);
  assert_int_equal(ckpt__sfile_allocated(sf), SEG);
  assert_int_equal(ckpt__sfile_seek(sf, 0, SEEK_DATA), 3 * SEG);
  assert_int_equal(ckpt__sfile_seek(sf, 0, SEEK_HOLE), 0);
  ckpt__sfile_free(sf);
  free(m.b);
}

static void walk_pieces_cover_file_in_order(void **state) {
  fixture_t *fx = *state;
  ckpt_sfile_t *sf = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(sf);
  model_t m;
  model_init(&m, 4 * MiB);
  walk_t w;
  walk_model(sf, &m, &w); /* empty: no piece */
  assert_int_equal(w.n, 0);
  put(sf, &m, 2 * SEG + 5, 100, 1, SIZE_MAX);
  walk_model(sf, &m, &w);
  assert_int_equal(w.n, 3);
  assert_int_equal(w.kind[0], CKPT_WALK_HOLE);
  assert_int_equal(w.len[0], SEG);
  assert_int_equal(w.kind[1], CKPT_WALK_HOLE);
  assert_int_equal(w.len[1], SEG);
  assert_int_equal(w.kind[2], CKPT_WALK_KEPT);
  assert_int_equal(w.len[2], 105);
  /* stopped at the second piece: its return value */
  memset(&w, 0, sizeof(w));
  w.cap = m.size;
  w.buf = malloc(m.size);
  assert_non_null(w.buf);
  w.stop_at = 2;
  assert_int_equal(ckpt__sfile_walk(sf, collect, &w), 7);
  assert_int_equal(w.n, 2);
  free(w.buf);
  ckpt__sfile_free(sf);
  /* a small file grown by truncate: its bytes, then a hole */
  sf = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(sf);
  model_t s;
  model_init(&s, 3 * MiB);
  put(sf, &s, 0, 40, 2, SIZE_MAX);
  assert_int_equal(ckpt__sfile_truncate(sf, SEG + 10), 0);
  model_truncate(&s, SEG + 10);
  walk_model(sf, &s, &w);
  assert_int_equal(w.n, 3);
  assert_int_equal(w.kind[0], CKPT_WALK_KEPT);
  assert_int_equal(w.len[0], 64); /* SEG0_MIN */
  assert_int_equal(w.kind[1], CKPT_WALK_HOLE);
  assert_int_equal(w.len[1], SEG - 64);
  assert_int_equal(w.kind[2], CKPT_WALK_HOLE);
  assert_int_equal(w.len[2], 10);
  ckpt__sfile_free(sf);
  free(s.b);
  free(m.b);
}

/* Beyond staging_mem segments spill into the unnamed spill file in
 * BACKING_DIR/.staging; all of it reads, walks, truncates and zeroes as
 * in RAM, and the spill file empties when its last slot is freed. */
static void spill_beyond_staging_mem(void **state) {
  fixture_t *fx = *state;
  ckpt_sfile_t *sf = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(sf);
  model_t m;
  model_init(&m, 6 * MiB);
  /* 300001 bytes, then more: segment 0 (512 KiB of RAM) cannot become a
   * full segment within the 1 MiB budget and spills; segment 1 takes the
   * budget's one segment; 2 to 4 spill. */
  put(sf, &m, 0, 4 * SEG + 123, 1, 300001);
  assert_int_equal(atomic_load(&fx->st.used), SEG);
  assert_true(fx->st.spill_fd >= 0);
  assert_int_equal(fx->st.spill_used, 4 * SEG);
  assert_true(sf->segs[0].spill >= 0 && sf->segs[0].mem == NULL);
  assert_true(sf->segs[1].spill < 0 && sf->segs[1].mem != NULL);
  for (int i = 2; i <= 4; i++)
    assert_true(sf->segs[i].spill >= 0 && sf->segs[i].mem == NULL);
  /* the spill file is unnamed: .staging exists and lists nothing */
  assert_int_equal(staging_names(fx->fd), 0);
  check_model(sf, &m);
  walk_t w;
  walk_model(sf, &m, &w);
  assert_int_equal(w.n, 5);
  assert_int_equal(w.kind[0], CKPT_WALK_TRANSIENT);
  assert_int_equal(w.kind[1], CKPT_WALK_KEPT);
  assert_int_equal(w.kind[2], CKPT_WALK_TRANSIENT);
  assert_int_equal(w.kind[4], CKPT_WALK_TRANSIENT);
  assert_int_equal(w.len[4], 123);
  /* overwritten across a RAM / spill boundary */
  put(sf, &m, 2 * SEG - 77, 200, 2, SIZE_MAX);
  check_model(sf, &m);
  /* cut inside spilled segment 2: 3 and 4 freed, 2's tail punched */
  assert_int_equal(ckpt__sfile_truncate(sf, 2 * SEG + 5), 0);
  model_truncate(&m, 2 * SEG + 5);
  assert_int_equal(fx->st.spill_used, 2 * SEG);
  assert_int_equal(ckpt__sfile_truncate(sf, 3 * SEG), 0);
  model_truncate(&m, 3 * SEG);
  check_model(sf, &m);
  /* zeroed: part of spilled segment 0, all of spilled segment 2 */
  assert_int_equal(ckpt__sfile_zero(sf, 1000, 5000), 0);
  model_zero(&m, 1000, 5000);
  assert_int_equal(ckpt__sfile_zero(sf, 2 * SEG, SEG), 0);
  model_zero(&m, 2 * SEG, SEG);
  assert_int_equal(fx->st.spill_used, SEG);
  check_model(sf, &m);
  /* a second file in the same budget spills into a freed slot */
  ckpt_sfile_t *sf2 = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(sf2);
  model_t m2;
  model_init(&m2, 2 * MiB);
  put(sf2, &m2, 0, SEG + 9, 3, 65536);
  assert_int_equal(fx->st.spill_used, 3 * SEG);
  assert_true(fx->st.spill_end <= 5 * (int64_t)SEG);
  check_model(sf, &m);
  check_model(sf2, &m2);
  ckpt__sfile_free(sf);
  check_model(sf2, &m2);
  ckpt__sfile_free(sf2);
  /* every slot free: the spill file gives its space back */
  assert_int_equal(fx->st.spill_used, 0);
  struct stat st;
  assert_int_equal(fstat(fx->st.spill_fd, &st), 0);
  assert_int_equal(st.st_size, 0);
  assert_true(atomic_load(&fx->st.used) <= fx->st.limit);
  free(m2.b);
  free(m.b);
}

/* With no RAM at all even a small file's segment 0 spills; its bytes,
 * truncates and zeroes still read back. */
static void spill_small_files_without_ram(void **state) {
  fixture_t *fx = *state;
  ckpt_sfile_t *a = ckpt__sfile_new(&fx->st, NULL);
  ckpt_sfile_t *b = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(a);
  assert_non_null(b);
  model_t ma, mb;
  model_init(&ma, 4096);
  model_init(&mb, 4096);
  put(a, &ma, 5, 10, 1, SIZE_MAX);
  put(b, &mb, 0, 3, 2, SIZE_MAX);
  assert_int_equal(atomic_load(&fx->st.used), 0);
  assert_int_equal(fx->st.spill_used, 2 * SEG);
  check_model(a, &ma);
  check_model(b, &mb);
  assert_int_equal(ckpt__sfile_truncate(a, 9), 0);
  model_truncate(&ma, 9);
  assert_int_equal(ckpt__sfile_truncate(a, 20), 0);
  model_truncate(&ma, 20);
  check_model(a, &ma);
  assert_int_equal(ckpt__sfile_zero(a, 6, 1), 0);
  model_zero(&ma, 6, 1);
  check_model(a, &ma);
  put(a, &ma, 15, 100, 3, 7);
  check_model(a, &ma);
  walk_t w;
  walk_model(a, &ma, &w);
  assert_int_equal(w.n, 1);
  assert_int_equal(w.kind[0], CKPT_WALK_TRANSIENT);
  ckpt__sfile_free(a);
  assert_int_equal(fx->st.spill_used, SEG);
  check_model(b, &mb);
  ckpt__sfile_free(b);
  assert_int_equal(fx->st.spill_used, 0);
  free(ma.b);
  free(mb.b);
}

/* Nothing is written at or past CKPT_MAX_FILE (1 TiB): EFBIG, the file
 * unchanged; its last byte can be written. */
static void efbig_beyond_max_file(void **state) {
  fixture_t *fx = *state;
  ckpt_sfile_t *sf = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(sf);
  const uint8_t x[2] = {0x5A, 0xA5};
  assert_int_equal(ckpt__sfile_write(sf, x, 1, CKPT_MAX_FILE), -EFBIG);
  assert_int_equal(ckpt__sfile_write(sf, x, 2, CKPT_MAX_FILE - 1), -EFBIG);
  assert_int_equal(ckpt__sfile_write(sf, x, 1, CKPT_MAX_FILE + 1), -EFBIG);
  assert_int_equal(ckpt__sfile_write(sf, x, 2, UINT64_MAX - 1), -EFBIG);
  assert_int_equal(ckpt__sfile_write(sf, x, 1, UINT64_MAX), -EFBIG);
  assert_int_equal(ckpt__sfile_truncate(sf, CKPT_MAX_FILE + 1), -EFBIG);
  assert_int_equal(ckpt__sfile_truncate(sf, UINT64_MAX), -EFBIG);
  assert_int_equal(ckpt__sfile_size(sf), 0);
  assert_int_equal(sf->nsegs, 0);
  assert_int_equal(atomic_load(&fx->st.used), 0);
  /* a write of nothing anywhere: nothing, no error */
  assert_int_equal(ckpt__sfile_write(sf, x, 0, UINT64_MAX), 0);
  /* the largest file: its last byte */
  assert_int_equal(ckpt__sfile_write(sf, x, 1, CKPT_MAX_FILE - 1), 1);
  assert_int_equal(ckpt__sfile_size(sf), CKPT_MAX_FILE);
  uint8_t got[4] = {0xEE, 0xEE, 0xEE, 0xEE};
  assert_int_equal(ckpt__sfile_read(sf, got, 4, CKPT_MAX_FILE - 2), 2);
  assert_int_equal(got[0], 0);
  assert_int_equal(got[1], 0x5A);
  assert_int_equal(got[2], 0xEE);
  assert_int_equal(ckpt__sfile_truncate(sf, CKPT_MAX_FILE), 0);
  assert_int_equal(ckpt__sfile_write(sf, x, 1, CKPT_MAX_FILE), -EFBIG);
  assert_int_equal(ckpt__sfile_size(sf), CKPT_MAX_FILE);
  ckpt__sfile_free(sf);
}

/* Written front to back, the file's XXH3-64 is ready without a walk; an
 * out-of-order write asks for the walk (-EAGAIN) until truncated to 0. */
static void running_hash_of_in_order_writes(void **state) {
  fixture_t *fx = *state;
  ckpt_sfile_t *sf = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(sf);
  uint64_t h = 0;
  assert_int_equal(ckpt__sfile_checksum(sf, &h), 0);
  assert_int_equal(h, XXH3_64bits(NULL, 0));
  model_t m;
  model_init(&m, 4 * MiB);
  put(sf, &m, 0, 2 * SEG + 12345, 1, 77777);
  assert_int_equal(ckpt__sfile_checksum(sf, &h), 0);
  assert_int_equal(h, XXH3_64bits(m.b, m.size));
  put(sf, &m, 100, 10, 2, SIZE_MAX); /* out of order */
  assert_int_equal(ckpt__sfile_checksum(sf, &h), -EAGAIN);
  assert_int_equal(ckpt__sfile_truncate(sf, 0), 0);
  model_truncate(&m, 0);
  put(sf, &m, 0, SEG + 1, 3, 4096);
  assert_int_equal(ckpt__sfile_checksum(sf, &h), 0);
  assert_int_equal(h, XXH3_64bits(m.b, m.size));
  /* a hole written after the end: not in order */
  assert_int_equal(ckpt__sfile_truncate(sf, SEG + 100), 0);
  assert_int_equal(ckpt__sfile_checksum(sf, &h), -EAGAIN);
  ckpt__sfile_free(sf);
  free(m.b);
}

/* A file written front to back from offset 0 goes into a write-behind
 * stream (no RAM), reads and walks from there; a file written out of
 * order, truncated or zeroed leaves it, its bytes copied into segments.
 * The next file in a released stream starts at the next 4 KiB. */
static void write_behind_stream_and_back(void **state) {
  fixture_t *fx = *state;
  ckpt_streams_t *streams = ckpt__streams_new(fx->fd, 0, "ck", 1);
  assert_non_null(streams);
  ckpt_sfile_t *a = ckpt__sfile_new(&fx->st, streams);
  ckpt_sfile_t *b = ckpt__sfile_new(&fx->st, streams);
  ckpt_sfile_t *c = ckpt__sfile_new(&fx->st, streams);
  assert_true(a && b && c);
  model_t ma, mb, mc;
  model_init(&ma, 4 * MiB);
  model_init(&mb, 1 * MiB);
  model_init(&mc, 1 * MiB);
  put(a, &ma, 0, 3 * SEG + 5, 1, 128 << 10);
  assert_int_equal(a->stream, 0);
  assert_int_equal(a->stream_base, 0);
  assert_int_equal(a->nsegs, 0);
  assert_int_equal(atomic_load(&fx->st.used), 0);
  check_model(a, &ma);
  walk_t w;
  walk_model(a, &ma, &w);
  assert_int_equal(w.n, 4);
  assert_int_equal(w.kind[0], CKPT_WALK_TRANSIENT);
  assert_int_equal(w.len[3], 5);
  uint64_t h = 0;
  assert_int_equal(ckpt__sfile_checksum(a, &h), 0);
  assert_int_equal(h, XXH3_64bits(ma.b, ma.size));
  /* the only stream is a's: b stages in RAM (a segment 0 of 128 KiB) */
  put(b, &mb, 0, 100 << 10, 2, SIZE_MAX);
  assert_int_equal(b->stream, -1);
  assert_int_equal(atomic_load(&fx->st.used), 128 << 10);
  /* a is closed: c takes the stream after it, 4 KiB aligned */
  ckpt__sfile_end_stream(a);
  put(c, &mc, 0, 70000, 3, SIZE_MAX);
  assert_int_equal(c->stream, 0);
  assert_int_equal(c->stream_base, 3 * SEG + 4096);
  check_model(a, &ma);
  check_model(c, &mc);
  /* c truncated to 0 while it owns the stream: written again in place */
  assert_int_equal(ckpt__sfile_truncate(c, 0), 0);
  model_truncate(&mc, 0);
  put(c, &mc, 0, 65536, 4, SIZE_MAX);
  assert_int_equal(c->stream, 0);
  check_model(c, &mc);
  /* a written out of order: its bytes leave the stream */
  put(a, &ma, 2 * SEG - 10, 20, 5, SIZE_MAX);
  assert_int_equal(a->stream, -1);
  assert_int_equal(atomic_load(&fx->st.used), 4 * SEG + (128 << 10));
  check_model(a, &ma);
  assert_int_equal(ckpt__sfile_checksum(a, &h), -EAGAIN);
  /* c zeroed: the same */
  assert_int_equal(ckpt__sfile_zero(c, 5, 10), 0);
  model_zero(&mc, 5, 10);
  assert_int_equal(c->stream, -1);
  check_model(c, &mc);
  check_model(b, &mb);
  ckpt__sfile_free(a);
  ckpt__sfile_free(b);
  ckpt__sfile_free(c);
  ckpt__streams_free(streams);
  free(ma.b);
  free(mb.b);
  free(mc.b);
}

/* ------------------------------------------------------------------------
 * xattrs.
 * ---------------------------------------------------------------------- */

static void xattr_names_and_indexes(void **state) {
  (void)state;
  assert_int_equal(ckpt__xattr_index("user.ckpt.dtype"), CKPT_X_DTYPE);
  assert_int_equal(ckpt__xattr_index("user.ckpt.shape"), CKPT_X_SHAPE);
  assert_int_equal(ckpt__xattr_index("user.ckpt.offsets"), CKPT_X_OFFSETS);
  assert_int_equal(ckpt__xattr_index("user.ckpt.sizes"), CKPT_X_SIZES);
  assert_int_equal(ckpt__xattr_index("user.ckpt.fqn"), CKPT_X_FQN);
  assert_int_equal(ckpt__xattr_index(CKPT_XATTR_META), -1);
  assert_int_equal(ckpt__xattr_index("user.ckpt.dtyp"), -1);
  assert_int_equal(ckpt__xattr_index("user.ckpt.dtype2"), -1);
  assert_int_equal(ckpt__xattr_index("user.other"), -1);
  assert_int_equal(ckpt__xattr_index(""), -1);
  for (int i = 0; i < CKPT_X_COUNT; i++)
    assert_int_equal(ckpt__xattr_index(ckpt__xattr_names[i]), i);
}

static int set(ckpt_sfile_t *sf, const char *name, const char *val) {
  return ckpt__sfile_setxattr(sf, name, val, strlen(val), 0);
}

/* The value of name, or "(ENODATA)". */
static const char *get(ckpt_sfile_t *sf, const char *name) {
  static char buf[5000];
  int n = ckpt__sfile_getxattr(sf, name, buf, sizeof(buf) - 1);
  if (n == -ENODATA)
    return "(ENODATA)";
  assert_true(n >= 0);
  buf[n] = '\0';
  return buf;
}

/* Bad values are refused (EINVAL) and leave the old ones; good ones are
 * stored as given; each is checked against the others set. */
static void xattr_validation(void **state) {
  fixture_t *fx = *state;
  ckpt_sfile_t *sf = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(sf);
  /* dtype */
  assert_int_equal(set(sf, "user.ckpt.dtype", "float33"), -EINVAL);
  assert_int_equal(set(sf, "user.ckpt.dtype", ""), -EINVAL);
  assert_string_equal(get(sf, "user.ckpt.dtype"), "(ENODATA)");
  assert_int_equal(set(sf, "user.ckpt.dtype", "F32"), 0);
  assert_string_equal(get(sf, "user.ckpt.dtype"), "F32");
  assert_int_equal(set(sf, "user.ckpt.dtype", "bogus"), -EINVAL);
  assert_string_equal(get(sf, "user.ckpt.dtype"), "F32");
  assert_int_equal(set(sf, "user.ckpt.dtype", "torch.bfloat16"), 0);
  assert_string_equal(get(sf, "user.ckpt.dtype"), "torch.bfloat16");
  /* shape */
  assert_int_equal(set(sf, "user.ckpt.shape", "4,-1"), -EINVAL);
  assert_int_equal(set(sf, "user.ckpt.shape", "4,x"), -EINVAL);
  assert_int_equal(set(sf, "user.ckpt.shape", "4,,8"), -EINVAL);
  /* 2^32 * 2^32 elements: more than 64 bits */
  assert_int_equal(set(sf, "user.ckpt.shape", "4294967296,4294967296"),
                   -EINVAL);
  assert_string_equal(get(sf, "user.ckpt.shape"), "(ENODATA)");
  assert_int_equal(set(sf, "user.ckpt.shape", "[4, 8]"), 0);
  assert_string_equal(get(sf, "user.ckpt.shape"), "[4, 8]");
  /* offsets within the shape, as many as its dimensions */
  assert_int_equal(set(sf, "user.ckpt.offsets", "0,9"), -EINVAL);
  assert_int_equal(set(sf, "user.ckpt.offsets", "0"), -EINVAL);
  assert_int_equal(set(sf, "user.ckpt.offsets", "0,4,0"), -EINVAL);
  assert_int_equal(set(sf, "user.ckpt.offsets", "0,-4"), -EINVAL);
  assert_string_equal(get(sf, "user.ckpt.offsets"), "(ENODATA)");
  assert_int_equal(set(sf, "user.ckpt.offsets", "0,8"), 0); /* at the edge */
  assert_int_equal(set(sf, "user.ckpt.offsets", "0,4"), 0);
  /* sizes within the shape past the offsets */
  assert_int_equal(set(sf, "user.ckpt.sizes", "4,5"), -EINVAL);
  assert_int_equal(set(sf, "user.ckpt.sizes", "5,4"), -EINVAL);
  assert_int_equal(set(sf, "user.ckpt.sizes", "4"), -EINVAL);
  assert_int_equal(set(sf, "user.ckpt.sizes", "4,4"), 0);
  /* a shape the offsets and sizes no longer fit: refused, the old stays */
  assert_int_equal(set(sf, "user.ckpt.shape", "4,6"), -EINVAL);
  assert_int_equal(set(sf, "user.ckpt.shape", "4"), -EINVAL);
  assert_string_equal(get(sf, "user.ckpt.shape"), "[4, 8]");
  assert_int_equal(set(sf, "user.ckpt.shape", "4,8"), 0);
  /* fqn: any bytes but NUL, not empty */
  assert_int_equal(set(sf, "user.ckpt.fqn", ""), -EINVAL);
  assert_int_equal(set(sf, "user.ckpt.fqn", "model.layers.0/w;x=y"), 0);
  assert_string_equal(get(sf, "user.ckpt.fqn"), "model.layers.0/w;x=y");
  /* a NUL inside, a value over 4096 bytes */
  assert_int_equal(ckpt__sfile_setxattr(sf, "user.ckpt.fqn", "a\0b", 3, 0),
                   -EINVAL);
  char big[4098];
  memset(big, 'a', sizeof(big));
  assert_int_equal(ckpt__sfile_setxattr(sf, "user.ckpt.fqn", big, 4097, 0),
                   -EINVAL);
  assert_int_equal(ckpt__sfile_setxattr(sf, "user.ckpt.fqn", big, 4096, 0),
                   0);
  assert_int_equal(strlen(get(sf, "user.ckpt.fqn")), 4096);
  /* names that are not ours: other user.* ones are kept, as given */
  assert_int_equal(set(sf, "trusted.other", "1"), -ENOTSUP);
  assert_int_equal(set(sf, "user.ckpt.dtypes", "F32"), -ENOTSUP);
  assert_int_equal(ckpt__sfile_setxattr(sf, "user.other", "a\0b", 3, 0), 0);
  char v[8];
  assert_int_equal(ckpt__sfile_getxattr(sf, "user.other", v, sizeof(v)), 3);
  assert_memory_equal(v, "a\0b", 3);
  assert_int_equal(ckpt__sfile_getxattr(sf, "user.other", v, 2), -ERANGE);
  static char huge[CKPT_XATTR_VALUE_MAX + 1];
  assert_int_equal(ckpt__sfile_setxattr(sf, "user.big", huge,
                                        sizeof(huge), 0), -E2BIG);
  assert_int_equal(ckpt__sfile_setxattr(sf, "user.big", huge,
                                        CKPT_XATTR_VALUE_MAX, 0), 0);
  assert_int_equal(ckpt__sfile_setxattr(sf, "user.big2", huge,
                                        CKPT_XATTR_VALUE_MAX, 0), -ENOSPC);
  char name[32];
  int rc = 0, kept = 2;
  for (; rc == 0 && kept < CKPT_XATTR_COUNT_MAX + 1; kept++) {
    snprintf(name, sizeof(name), "user.n%d", kept);
    rc = ckpt__sfile_setxattr(sf, name, "", 0, 0);
  }
  assert_int_equal(rc, -ENOSPC);
  assert_int_equal(kept - 1, CKPT_XATTR_COUNT_MAX); /* the 65th is refused */
  assert_int_equal(ckpt__sfile_removexattr(sf, "user.other"), 0);
  assert_int_equal(ckpt__sfile_removexattr(sf, "user.other"), -ENODATA);
  assert_int_equal(ckpt__sfile_setxattr(sf, "user.big", "", 0,
                                        XATTR_CREATE), -EEXIST);
  /* XATTR_CREATE and XATTR_REPLACE */
  assert_int_equal(ckpt__sfile_setxattr(sf, "user.ckpt.dtype", "F16", 3,
                                        XATTR_CREATE),
                   -EEXIST);
  assert_string_equal(get(sf, "user.ckpt.dtype"), "torch.bfloat16");
  assert_int_equal(ckpt__sfile_setxattr(sf, "user.ckpt.dtype", "F16", 3,
                                        XATTR_REPLACE),
                   0);
  assert_string_equal(get(sf, "user.ckpt.dtype"), "F16");
  assert_int_equal(ckpt__sfile_removexattr(sf, "user.ckpt.dtype"), 0);
  assert_int_equal(ckpt__sfile_setxattr(sf, "user.ckpt.dtype", "F16", 3,
                                        XATTR_REPLACE),
                   -ENODATA);
  assert_int_equal(ckpt__sfile_setxattr(sf, "user.ckpt.dtype", "F16", 3,
                                        XATTR_CREATE),
                   0);
  ckpt__sfile_free(sf);
}

/* getxattr's and listxattr's sizes; the list in listxattr's format
 * (names NUL-terminated, one after the other); a removed xattr is gone
 * (ENODATA) from both. */
static void xattr_get_list_remove(void **state) {
  fixture_t *fx = *state;
  ckpt_sfile_t *sf = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(sf);
  char buf[256];
  assert_int_equal(ckpt__sfile_listxattr(sf, NULL, 0), 0);
  assert_int_equal(ckpt__sfile_listxattr(sf, buf, sizeof(buf)), 0);
  /* set out of their order: listed in index order */
  assert_int_equal(set(sf, "user.ckpt.fqn", "m.w"), 0);
  assert_int_equal(set(sf, "user.ckpt.shape", "2,3"), 0);
  assert_int_equal(set(sf, "user.ckpt.dtype", "int8"), 0);
  static const char want[] = "user.ckpt.dtype\0user.ckpt.shape\0"
                             "user.ckpt.fqn";
  assert_int_equal(ckpt__sfile_listxattr(sf, NULL, 0), sizeof(want));
  assert_int_equal(ckpt__sfile_listxattr(sf, buf, sizeof(want) - 1),
                   -ERANGE);
  memset(buf, 0xEE, sizeof(buf));
  assert_int_equal(ckpt__sfile_listxattr(sf, buf, sizeof(buf)), sizeof(want));
  assert_memory_equal(buf, want, sizeof(want));
  /* getxattr: size 0 for the length; too small: ERANGE; no NUL added */
  assert_int_equal(ckpt__sfile_getxattr(sf, "user.ckpt.shape", NULL, 0), 3);
  assert_int_equal(ckpt__sfile_getxattr(sf, "user.ckpt.shape", buf, 2),
                   -ERANGE);
  memset(buf, 0xEE, sizeof(buf));
  assert_int_equal(ckpt__sfile_getxattr(sf, "user.ckpt.shape", buf, 3), 3);
  assert_memory_equal(buf, "2,3", 3);
  assert_int_equal((uint8_t)buf[3], 0xEE);
  assert_int_equal(ckpt__sfile_getxattr(sf, "user.ckpt.sizes", buf, 10),
                   -ENODATA);
  assert_int_equal(ckpt__sfile_getxattr(sf, "user.other", buf, 10),
                   -ENODATA);
  /* removed */
  assert_int_equal(ckpt__sfile_removexattr(sf, "user.ckpt.shape"), 0);
  assert_int_equal(ckpt__sfile_removexattr(sf, "user.ckpt.shape"), -ENODATA);
  assert_int_equal(ckpt__sfile_getxattr(sf, "user.ckpt.shape", buf, 10),
                   -ENODATA);
  assert_int_equal(ckpt__sfile_removexattr(sf, "user.ckpt.sizes"), -ENODATA);
  assert_int_equal(ckpt__sfile_removexattr(sf, "user.other"), -ENODATA);
  static const char want2[] = "user.ckpt.dtype\0user.ckpt.fqn";
  assert_int_equal(ckpt__sfile_listxattr(sf, buf, sizeof(buf)),
                   sizeof(want2));
  assert_memory_equal(buf, want2, sizeof(want2));
  assert_int_equal(ckpt__sfile_removexattr(sf, "user.ckpt.dtype"), 0);
  assert_int_equal(ckpt__sfile_removexattr(sf, "user.ckpt.fqn"), 0);
  assert_int_equal(ckpt__sfile_listxattr(sf, buf, sizeof(buf)), 0);
  ckpt__sfile_free(sf);
}

/* user.ckpt.meta sets several at once, all or none; fqn's value runs to
 * the end; meta itself is never stored or listed. */
static void xattr_meta_all_or_none(void **state) {
  fixture_t *fx = *state;
  ckpt_sfile_t *sf = ckpt__sfile_new(&fx->st, NULL);
  assert_non_null(sf);
  assert_int_equal(set(sf, CKPT_XATTR_META,
                       "dtype=F32;shape=4,8;offsets=0,4;sizes=4,4;"
                       "fqn=a;b=c"),
                   0);
  assert_string_equal(get(sf, "user.ckpt.dtype"), "F32");
  assert_string_equal(get(sf, "user.ckpt.shape"), "4,8");
  assert_string_equal(get(sf, "user.ckpt.offsets"), "0,4");
  assert_string_equal(get(sf, "user.ckpt.sizes"), "4,4");
  assert_string_equal(get(sf, "user.ckpt.fqn"), "a;b=c");
  assert_string_equal(get(sf, CKPT_XATTR_META), "(ENODATA)");
  char buf[256];
  static const char want[] = "user.ckpt.dtype\0user.ckpt.shape\0"
                             "user.ckpt.offsets\0user.ckpt.sizes\0"
                             "user.ckpt.fqn";
  assert_int_equal(ckpt__sfile_listxattr(sf, buf, sizeof(buf)), sizeof(want));
  assert_memory_equal(buf, want, sizeof(want));
  /* one bad field: nothing changes */
  assert_int_equal(set(sf, CKPT_XATTR_META, "dtype=F64;shape=4,2"), -EINVAL);
  assert_int_equal(set(sf, CKPT_XATTR_META, "dtype=nope;shape=8,8"), -EINVAL);
  assert_string_equal(get(sf, "user.ckpt.dtype"), "F32");
  assert_string_equal(get(sf, "user.ckpt.shape"), "4,8");
  /* a field twice, an unknown key, no '=', nothing */
  assert_int_equal(set(sf, CKPT_XATTR_META, "dtype=F64;dtype=F16"), -EINVAL);
  assert_int_equal(set(sf, CKPT_XATTR_META, "colour=red"), -EINVAL);
  assert_int_equal(set(sf, CKPT_XATTR_META, "dtype"), -EINVAL);
  assert_int_equal(set(sf, CKPT_XATTR_META, ""), -EINVAL);
  assert_string_equal(get(sf, "user.ckpt.dtype"), "F32");
  /* consistent together though not one by one: a larger shape and
   * offsets past the old one */
  assert_int_equal(set(sf, CKPT_XATTR_META, "shape=16,16;offsets=12,12"), 0);
  assert_string_equal(get(sf, "user.ckpt.shape"), "16,16");
  assert_string_equal(get(sf, "user.ckpt.offsets"), "12,12");
  /* XATTR_CREATE over a set one */
  assert_int_equal(ckpt__sfile_setxattr(sf, CKPT_XATTR_META, "dtype=F16", 9,
                                        XATTR_CREATE),
                   -EEXIST);
  assert_string_equal(get(sf, "user.ckpt.dtype"), "F32");
  /* a NUL inside */
  assert_int_equal(ckpt__sfile_setxattr(sf, CKPT_XATTR_META, "dtype=F16\0",
                                        10, 0),
                   -EINVAL);
  ckpt__sfile_free(sf);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(unaligned_round_trip_across_segments,
                                      setup_roomy, teardown),
      cmocka_unit_test_setup_teardown(small_file_grows_past_segment_zero,
                                      setup_roomy, teardown),
      cmocka_unit_test_setup_teardown(reads_past_eof, setup_roomy, teardown),
      cmocka_unit_test_setup_teardown(truncate_shrinks_and_grows_with_zeros,
                                      setup_roomy, teardown),
      cmocka_unit_test_setup_teardown(zero_punches_whole_segments,
                                      setup_roomy, teardown),
      cmocka_unit_test_setup_teardown(holes_seek_and_allocation, setup_roomy,
                                      teardown),
      cmocka_unit_test_setup_teardown(walk_pieces_cover_file_in_order,
                                      setup_roomy, teardown),
      cmocka_unit_test_setup_teardown(spill_beyond_staging_mem, setup_tight,
                                      teardown),
      cmocka_unit_test_setup_teardown(spill_small_files_without_ram,
                                      setup_no_ram, teardown),
      cmocka_unit_test_setup_teardown(efbig_beyond_max_file, setup_roomy,
                                      teardown),
      cmocka_unit_test_setup_teardown(running_hash_of_in_order_writes,
                                      setup_roomy, teardown),
      cmocka_unit_test_setup_teardown(write_behind_stream_and_back,
                                      setup_roomy, teardown),
      cmocka_unit_test(xattr_names_and_indexes),
      cmocka_unit_test_setup_teardown(xattr_validation, setup_roomy,
                                      teardown),
      cmocka_unit_test_setup_teardown(xattr_get_list_remove, setup_roomy,
                                      teardown),
      cmocka_unit_test_setup_teardown(xattr_meta_all_or_none, setup_roomy,
                                      teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
