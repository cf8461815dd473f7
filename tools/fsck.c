/*
 * fsck.c - ckptfs-fsck, the offline checker of a backing directory.
 *
 *   ckptfs-fsck BACKING_DIR [NAME...]
 *
 * Without a mount: loads each committed checkpoint's .metadata (with every
 * consistency check a mount makes), then reads every chunk and blob from
 * its data file and compares its XXH3-64 with the stored one. Each problem
 * is one line naming the checkpoint, the FQN (and the chunk's offsets),
 * the rank and the data file. Exit status: 0 all checked checkpoints are
 * intact, 1 something is damaged or missing, 2 usage or BACKING_DIR
 * unreadable. Directories without .metadata (a save that was interrupted;
 * the next mount removes them) are listed, not counted as damage.
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
#include <unistd.h>

#include "catalog.h"
#include "metadb.h"
#include "store.h"

#define EXIT_DAMAGED 1
#define EXIT_USAGE 2

typedef struct {
  const char *name;  /* checkpoint */
  ckpt_stored_t s;   /* its data files, through the store's reader */
  uint32_t problems;
  uint64_t bytes;    /* checked */
  char last_bad[64]; /* the last data file that could not be opened */
} check_t;

static void usage(FILE *to) {
  fprintf(to,
          "usage: ckptfs-fsck BACKING_DIR [NAME...]\n"
          "\n"
          "Check committed checkpoints in BACKING_DIR without mounting: the\n"
          ".metadata of each, and the XXH3-64 of every chunk and blob in its\n"
          "data files. Without NAME, every checkpoint there. Exit status 0:\n"
          "intact; 1: a problem was found (each is printed); 2: usage or\n"
          "BACKING_DIR unreadable.\n");
}

static void problem(check_t *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void problem(check_t *c, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("%s: ", c->name);
  vprintf(fmt, ap);
  putchar('\n');
  va_end(ap);
  c->problems++;
}

/* Data file K of rank R (named name) into *ref: 0, or < 0 when it
 * cannot be opened (reported, once per file in a row). */
static int data_file(check_t *c, int32_t rank, uint32_t k, const char *name,
                     const char *what, ckpt_fdref_t *ref) {
  int rc = ckpt_stored_fd(&c->s, rank, k, ref);
  if (rc < 0 && strcmp(c->last_bad, name) != 0) {
    problem(c, "%s: %s: %s%s", what, name, strerror(-rc),
            rc == -ELOOP    ? " (a symbolic link: refused)"
            : rc == -EINVAL ? " (not a regular file: refused)"
            : rc == -ESTALE ? " (the directory was replaced)"
                            : "");
    snprintf(c->last_bad, sizeof(c->last_bad), "%s", name);
  } else if (rc < 0) {
    c->problems++;
  }
  return rc;
}

/* Check one chunk or blob; what names it ("FQN [offsets], rank R"). */
static void check_stored(check_t *c, const char *what, int32_t rank,
                         uint32_t file, uint64_t pos, uint64_t len,
                         uint64_t want) {
  char name[64];
  ckpt_data_file_name(rank, file, name, sizeof(name));
  ckpt_fdref_t ref;
  if (data_file(c, rank, file, name, what, &ref) < 0)
    return;
  int fd = ref.fd;
  uint64_t got = 0;
  int rc = ckpt__stored_checksum(fd, pos, len, &got);
  if (rc == -ENODATA) {
    struct stat st;
    problem(c, "%s: %s: truncated: the chunk is bytes %" PRIu64 "..%" PRIu64
               ", the file has %lld",
            what, name, pos, pos + len,
            fstat(fd, &st) ? -1LL : (long long)st.st_size);
  } else if (rc) {
    problem(c, "%s: %s: read error: %s", what, name, strerror(-rc));
  } else if (got != want) {
    problem(c, "%s: %s at %" PRIu64 ": checksum mismatch (stored %016" PRIx64
               ", data %016" PRIx64 ")",
            what, name, pos, want, got);
  } else {
    c->bytes += len;
  }
  ckpt_fdref_put(&ref);
}

/* 0 intact, 1 damaged. */
static int check_checkpoint(int backing_fd, const char *backing,
                            ckpt_fdcache_t *cache, const char *name) {
  check_t c = {.name = name};
  char path[PATH_MAX];
  int dfd = ckpt_store_open_dir(backing_fd, name, O_RDONLY);
  if (dfd == -ELOOP || dfd == -ENOTDIR) {
    struct stat st;
    if (fstatat(backing_fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISLNK(st.st_mode)) {
      problem(&c, "a symbolic link, not a checkpoint directory: refused "
                  "(remove it by hand)");
      return 1;
    }
  }
  if (dfd < 0) {
    printf("%s: no such checkpoint in %s\n", name, backing);
    return 1;
  }
  snprintf(path, sizeof(path), "%s/%s/%s", backing, name,
           CKPT_METADATA_FILE);
  if (!ckpt_store_has_metadata(dfd)) {
    printf("%s: not committed (no %s: an interrupted save, removed by the "
           "next mount)\n", name, CKPT_METADATA_FILE);
    close(dfd);
    return 0;
  }
  ckpt_metadata_t m = {0};
  char *err = NULL;
  if (ckpt_metadb_check_at(dfd, path, &err) ||
      ckpt_metadb_load_at(dfd, path, &m, &err)) {
    problem(&c, "%s is damaged: %s; a mount does not show it and nothing "
                "removes it", CKPT_METADATA_FILE,
            err ? err : "cannot be read");
    free(err);
    close(dfd);
    return 1;
  }
  int rc = ckpt_stored_init(&c.s, cache, name, dfd, &m, false);
  close(dfd);
  if (rc) {
    problem(&c, "cannot check: %s", strerror(-rc));
    ckpt_metadata_free(&m);
    return 1;
  }
  char what[PATH_MAX + 600], offs[512];
  for (uint32_t t = 0; t < m.n_tensors; t++) {
    const ckpt_tensor_meta_t *tm = &m.tensors[t];
    for (uint32_t i = 0; i < tm->n_chunks; i++) {
      const ckpt_chunk_meta_t *ch = &m.chunks[tm->first_chunk + i];
      ckpt_dims_format(ch->dims, tm->ndim, CKPT_DIMS_JSON, offs,
                       sizeof(offs));
      snprintf(what, sizeof(what), "tensor %s chunk %s, rank %d", tm->fqn,
               offs, ch->rank);
      check_stored(&c, what, ch->rank, ch->file, ch->file_offset, ch->length,
                   ch->checksum);
    }
  }
  for (uint32_t b = 0; b < m.n_blobs; b++) {
    const ckpt_blob_meta_t *bm = &m.blobs[b];
    snprintf(what, sizeof(what), "blob %s, rank %d", bm->fqn, bm->rank);
    check_stored(&c, what, bm->rank, bm->file, bm->file_offset, bm->length,
                 bm->checksum);
  }
  if (c.problems == 0)
    printf("%s: ok: %u tensors in %u chunks, %u blobs, world size %d, %" PRIu64
           " bytes checked\n",
           name, m.n_tensors, m.n_chunks, m.n_blobs, m.world_size, c.bytes);
  else
    printf("%s: DAMAGED: %u problems\n", name, c.problems);
  ckpt_stored_destroy(&c.s);
  ckpt_metadata_free(&m);
  return c.problems ? 1 : 0;
}

int main(int argc, char **argv) {
  if (argc >= 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
    usage(stdout);
    return EXIT_SUCCESS;
  }
  if (argc < 2 || argv[1][0] == '-') {
    usage(stderr);
    return EXIT_USAGE;
  }
  const char *backing = argv[1];
  int backing_fd = open(backing, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (backing_fd < 0) {
    fprintf(stderr, "ckptfs-fsck: cannot open BACKING_DIR %s: %s\n", backing,
            strerror(errno));
    return EXIT_USAGE;
  }
  ckpt_fdcache_t *cache;
  if (ckpt_fdcache_new(backing_fd, 0, &cache)) {
    fprintf(stderr, "ckptfs-fsck: out of memory\n");
    close(backing_fd);
    return EXIT_USAGE;
  }
  int damaged = 0;
  if (argc > 2) {
    for (int i = 2; i < argc; i++) {
      if (!ckpt_name_valid(argv[i])) {
        printf("%s: not a checkpoint name\n", argv[i]);
        damaged = 1;
        continue;
      }
      damaged |= check_checkpoint(backing_fd, backing, cache, argv[i]);
    }
  } else {
    char **names;
    size_t n;
    int rc = ckpt__catalog_names(backing_fd, &names, &n);
    if (rc) {
      fprintf(stderr, "ckptfs-fsck: cannot list %s: %s\n", backing,
              strerror(-rc));
      ckpt_fdcache_free(cache);
      close(backing_fd);
      return EXIT_USAGE;
    }
    for (size_t i = 0; i < n; i++)
      damaged |= check_checkpoint(backing_fd, backing, cache, names[i]);
    ckpt__catalog_names_free(names, n);
    if (n == 0)
      printf("%s: no checkpoints\n", backing);
  }
  ckpt_fdcache_free(cache);
  close(backing_fd);
  return damaged ? EXIT_DAMAGED : EXIT_SUCCESS;
}
