/*
 * catalog.c - the checkpoints of a backing directory: listing, choosing
 * the old ones to prune, removing one durably (catalog.h).
 *
 * Workload: a backing directory holds tens to thousands of checkpoints; a
 * scan stats each directory and reads each .metadata's header (one small
 * SQLite table), or the whole of it when asked (ckptctl ls, show).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "catalog.h"
#include "fs_int.h"
#include "metadb.h"

static int by_name(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

void ckpt__catalog_names_free(char **names, size_t n) {
  for (size_t i = 0; i < n; i++)
    free(names[i]);
  free(names);
}

int ckpt__catalog_names(int backing_fd, char ***names, size_t *n) {
  *names = NULL;
  *n = 0;
  /* Our own open: a dup of backing_fd would share its directory position. */
  int fd = openat(backing_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
  if (!d) {
    int e = errno;
    if (fd >= 0)
      close(fd);
    return -e;
  }
  char **v = NULL;
  size_t len = 0, cap = 0;
  int rc = 0;
  struct dirent *e;
  while (rc == 0 && (e = readdir(d)) != NULL) {
    struct stat st;
    if (!ckpt_name_valid(e->d_name) ||
        fstatat(backing_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) ||
        !S_ISDIR(st.st_mode))
      continue;
    if (len == cap) {
      size_t ncap = cap ? cap * 2 : 16;
      char **grown = realloc(v, ncap * sizeof(*v));
      if (!grown) {
        rc = -ENOMEM;
        break;
      }
      v = grown, cap = ncap;
    }
    if ((v[len] = strdup(e->d_name)) == NULL)
      rc = -ENOMEM;
    else
      len++;
  }
  closedir(d);
  if (rc) {
    ckpt__catalog_names_free(v, len);
    return rc;
  }
  if (len)
    qsort(v, len, sizeof(*v), by_name);
  *names = v;
  *n = len;
  return 0;
}

/* Sizes of the regular files in BACKING_DIR/name. */
static uint64_t dir_bytes(int dfd) {
  int fd = openat(dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *d = fd >= 0 ? fdopendir(fd) : NULL;
  if (!d) {
    if (fd >= 0)
      close(fd);
    return 0;
  }
  uint64_t sum = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    struct stat st;
    if (fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISREG(st.st_mode))
      sum += (uint64_t)st.st_size;
  }
  closedir(d);
  return sum;
}

static void describe(int backing_fd, const char *backing_path, bool full,
                     ckpt_cat_entry_t *en) {
  int dfd = openat(backing_fd, en->name,
                   O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0) { /* removed meanwhile, or unreadable */
    en->state = CKPT_CAT_DAMAGED;
    en->error = ckpt__strdup_printf("cannot open: %s", strerror(errno));
    return;
  }
  if (full)
    en->disk_bytes = dir_bytes(dfd);
  struct stat st;
  if (fstatat(dfd, CKPT_METADATA_FILE, &st, AT_SYMLINK_NOFOLLOW)) {
    en->state = CKPT_CAT_UNFINISHED;
    /* A save in flight holds a shared flock while it writes. */
    if (flock(dfd, LOCK_EX | LOCK_NB))
      en->held = errno == EWOULDBLOCK;
    else
      flock(dfd, LOCK_UN);
    close(dfd);
    return;
  }
  close(dfd);
  en->mtime = st.st_mtim;
  char path[PATH_MAX];
  snprintf(path, sizeof(path), "%s/%s/%s", backing_path, en->name,
           CKPT_METADATA_FILE);
  char *err = NULL;
  int rc = full ? ckpt_metadb_load(path, &en->meta, &err)
                : ckpt_metadb_load_header(path, &en->meta, &err);
  if (rc) {
    en->state = CKPT_CAT_DAMAGED;
    en->error = err ? err : strdup(strerror(-rc));
  } else {
    en->state = CKPT_CAT_COMMITTED;
  }
}

int ckpt__catalog_scan(int backing_fd, const char *backing_path, bool full,
                       ckpt_catalog_t *out) {
  out->n = 0;
  out->e = NULL;
  char **names;
  size_t n;
  int rc = ckpt__catalog_names(backing_fd, &names, &n);
  if (rc)
    return rc;
  out->e = calloc(n ? n : 1, sizeof(*out->e));
  if (!out->e) {
    ckpt__catalog_names_free(names, n);
    return -ENOMEM;
  }
  for (size_t i = 0; i < n; i++) {
    ckpt_cat_entry_t *en = &out->e[out->n++];
    en->name = names[i]; /* moved */
    describe(backing_fd, backing_path, full, en);
  }
  free(names);
  return 0;
}

void ckpt__catalog_free(ckpt_catalog_t *c) {
  for (size_t i = 0; i < c->n; i++) {
    free(c->e[i].name);
    free(c->e[i].error);
    ckpt_metadata_free(&c->e[i].meta);
  }
  free(c->e);
  c->e = NULL;
  c->n = 0;
}

/* Newest first: created_at, then .metadata's mtime, then name. */
static int newer_first(const void *pa, const void *pb) {
  const ckpt_cat_entry_t *a = *(const ckpt_cat_entry_t *const *)pa;
  const ckpt_cat_entry_t *b = *(const ckpt_cat_entry_t *const *)pb;
  if (a->meta.created_at != b->meta.created_at)
    return a->meta.created_at > b->meta.created_at ? -1 : 1;
  if (a->mtime.tv_sec != b->mtime.tv_sec)
    return a->mtime.tv_sec > b->mtime.tv_sec ? -1 : 1;
  if (a->mtime.tv_nsec != b->mtime.tv_nsec)
    return a->mtime.tv_nsec > b->mtime.tv_nsec ? -1 : 1;
  return -strcmp(a->name, b->name);
}

size_t ckpt__catalog_select_old(const ckpt_catalog_t *c, uint32_t keep,
                                const char *keep_name, bool *remove) {
  for (size_t i = 0; i < c->n; i++)
    remove[i] = false;
  if (keep == 0)
    return 0;
  const ckpt_cat_entry_t **v = calloc(c->n ? c->n : 1, sizeof(*v));
  if (!v)
    return 0; /* out of memory: remove nothing */
  size_t nv = 0;
  uint32_t kept = 0;
  for (size_t i = 0; i < c->n; i++) {
    if (c->e[i].state != CKPT_CAT_COMMITTED)
      continue;
    if (keep_name && !strcmp(c->e[i].name, keep_name))
      kept++; /* always kept, one of the keep */
    else
      v[nv++] = &c->e[i];
  }
  qsort(v, nv, sizeof(*v), newer_first);
  size_t selected = 0;
  for (size_t j = 0; j < nv; j++) {
    if (kept < keep) {
      kept++;
      continue;
    }
    remove[v[j] - c->e] = true;
    selected++;
  }
  free(v);
  return selected;
}

int ckpt__checkpoint_remove(int backing_fd, const char *name, bool if_idle) {
  int dfd = openat(backing_fd, name,
                   O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (dfd < 0)
    return errno == ENOENT ? 0 : -errno;
  int rc = 0;
  if (if_idle && flock(dfd, LOCK_EX | LOCK_NB))
    rc = errno == EWOULDBLOCK ? -EBUSY : -errno;
  /* .metadata first and durably: from here on the checkpoint is gone for
   * every mount, and a crash leaves only an unfinished save behind. */
  if (rc == 0 && unlinkat(dfd, CKPT_METADATA_FILE, 0) && errno != ENOENT)
    rc = -errno;
  if (rc == 0 && fsync(dfd))
    rc = -errno;
  if (rc) {
    close(dfd);
    return rc;
  }
  rc = ckpt__remove_tree(backing_fd, name);
  close(dfd); /* the flock is held until the directory is gone */
  fsync(backing_fd);
  return rc;
}

/* ------------------------------------------------------------------------
 * The data files of one checkpoint.
 * ---------------------------------------------------------------------- */

void ckpt__data_files_init(ckpt_data_files_t *df, int dirfd) {
  memset(df, 0, sizeof(*df));
  df->dirfd = dirfd;
}

static void close_open_files(ckpt_data_files_t *df) {
  for (int32_t r = 0; r < df->nranks; r++)
    for (uint32_t k = 0; k < df->by_rank[r].n; k++)
      if (df->by_rank[r].fd[k] >= 0) {
        close(df->by_rank[r].fd[k]);
        df->by_rank[r].fd[k] = CKPT_DATA_FILE_UNOPENED;
      }
  df->nopen = 0;
}

int ckpt__data_files_get(ckpt_data_files_t *df, int32_t rank, uint32_t k,
                         bool *first) {
  *first = false;
  if (rank < 0 || k > (1u << 20))
    return -EINVAL;
  if (rank >= df->nranks) {
    struct ckpt_rank_files *v =
        realloc(df->by_rank, ((size_t)rank + 1) * sizeof(*v));
    if (!v)
      return -ENOMEM;
    memset(v + df->nranks, 0, ((size_t)rank + 1 - (size_t)df->nranks) *
                                  sizeof(*v));
    df->by_rank = v;
    df->nranks = rank + 1;
  }
  struct ckpt_rank_files *rf = &df->by_rank[rank];
  if (k >= rf->n) {
    int *v = realloc(rf->fd, ((size_t)k + 1) * sizeof(*v));
    if (!v)
      return -ENOMEM;
    for (uint32_t i = rf->n; i <= k; i++)
      v[i] = CKPT_DATA_FILE_UNOPENED;
    rf->fd = v;
    rf->n = k + 1;
  }
  if (rf->fd[k] != CKPT_DATA_FILE_UNOPENED)
    return rf->fd[k];
  if (df->nopen >= CKPT_DATA_FILES_OPEN)
    close_open_files(df);
  char name[64];
  ckpt_data_file_name(rank, k, name, sizeof(name));
  int fd = openat(df->dirfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0 && (errno == EMFILE || errno == ENFILE) && df->nopen > 0) {
    close_open_files(df); /* a low RLIMIT_NOFILE: make room, once */
    fd = openat(df->dirfd, name, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  }
  if (fd < 0) {
    rf->fd[k] = -errno;
    *first = true;
    return rf->fd[k];
  }
  df->nopen++;
  return rf->fd[k] = fd;
}

void ckpt__data_files_close(ckpt_data_files_t *df) {
  close_open_files(df);
  for (int32_t r = 0; r < df->nranks; r++)
    free(df->by_rank[r].fd);
  free(df->by_rank);
  df->by_rank = NULL;
  df->nranks = 0;
}
