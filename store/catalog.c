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
#include "store.h"
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
  DIR *d = ckpt_opendir_at(backing_fd);
  if (!d)
    return -errno;
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
  DIR *d = ckpt_opendir_at(dfd);
  if (!d)
    return 0;
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

static void describe(int backing_fd, bool full,
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
  en->mtime = st.st_mtim;
  char display[300];
  snprintf(display, sizeof(display), "%s/%s", en->name, CKPT_METADATA_FILE);
  char *err = NULL;
  int rc = full ? ckpt_metadb_load_at(dfd, display, &en->meta, &err)
                : ckpt_metadb_load_header_at(dfd, display, &en->meta, &err);
  int mark = rc ? -1 : ckpt__protect_read(dfd);
  close(dfd);
  if (rc) {
    en->state = CKPT_CAT_DAMAGED;
    en->error = err ? err : strdup(strerror(-rc));
  } else {
    en->state = CKPT_CAT_COMMITTED;
    en->step = en->meta.has_step ? en->meta.step
                                 : ckpt_step_from_name(en->name);
    en->is_protected = mark >= 0 ? mark == 1 : en->meta.protect;
  }
}

int ckpt__catalog_scan(int backing_fd, bool full,
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
    describe(backing_fd, full, en);
  }
  free(names);
  return 0;
}

int ckpt__catalog_saves(int backing_fd, ckpt_catalog_t *c) {
  int sfd = openat(backing_fd, CKPT_SAVES_DIR,
                   O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (sfd < 0)
    return errno == ENOENT ? 0 : -errno;
  DIR *d = ckpt_opendir_at(sfd);
  if (!d) {
    int e = errno;
    close(sfd);
    return -e;
  }
  int rc = 0;
  struct dirent *e;
  while (rc == 0 && (e = readdir(d)) != NULL) {
    if (!ckpt_save_id_valid(e->d_name))
      continue;
    int dfd = openat(sfd, e->d_name,
                     O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0)
      continue; /* gone meanwhile, or not a directory */
    ckpt_cat_entry_t *grown = realloc(c->e, (c->n + 1) * sizeof(*grown));
    if (!grown) {
      close(dfd);
      rc = -ENOMEM;
      break;
    }
    c->e = grown;
    ckpt_cat_entry_t *en = &c->e[c->n];
    memset(en, 0, sizeof(*en));
    if (!(en->name = ckpt__strdup_printf("%s/%s", CKPT_SAVES_DIR,
                                         e->d_name))) {
      close(dfd);
      rc = -ENOMEM;
      break;
    }
    c->n++;
    en->state = CKPT_CAT_UNFINISHED;
    struct stat st;
    if (fstat(dfd, &st) == 0)
      en->mtime = st.st_mtim;
    en->disk_bytes = dir_bytes(dfd);
    if (flock(dfd, LOCK_EX | LOCK_NB))
      en->held = errno == EWOULDBLOCK;
    else
      flock(dfd, LOCK_UN);
    close(dfd);
  }
  closedir(d);
  close(sfd);
  return rc;
}

void ckpt__catalog_free(ckpt_catalog_t *c) {
  for (size_t i = 0; i < c->n; i++) {
    free(c->e[i].name);
    free(c->e[i].error);
    free(c->e[i].mount);
    free(c->e[i].mount_state);
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

/* Oldest first by step (none first), then created_at, .metadata's mtime
 * and name: the order of a retention policy. */
static int by_step(const void *pa, const void *pb) {
  const ckpt_cat_entry_t *a = *(const ckpt_cat_entry_t *const *)pa;
  const ckpt_cat_entry_t *b = *(const ckpt_cat_entry_t *const *)pb;
  if (a->step != b->step)
    return a->step < b->step ? -1 : 1;
  return -newer_first(pa, pb);
}

/* best: values in the order that puts the best first (lowest; a metric
 * to maximize is negated), ties: the later in step order. */
typedef struct {
  double v;
  size_t at; /* index in step order */
} ranked_t;
static int better_first(const void *pa, const void *pb) {
  const ranked_t *a = pa, *b = pb;
  if (a->v != b->v)
    return a->v < b->v ? -1 : 1;
  return a->at > b->at ? -1 : 1;
}

const char *ckpt__catalog_why_text(unsigned why, char *buf, size_t cap) {
  static const char *const names[] = {"last",      "every",   "best",
                                      "unranked",  "protected", "current",
                                      "no policy"};
  size_t len = 0;
  if (cap)
    buf[0] = '\0';
  for (unsigned b = 0; b < sizeof(names) / sizeof(names[0]); b++)
    if (why & (1u << b) && len < cap)
      len += (size_t)snprintf(buf + len, cap - len, "%s%s", len ? "+" : "",
                              names[b]);
  return buf;
}

/* The best p->best of v[0..nv) by p->metric: their why gets BEST, those
 * without a value UNRANKED. */
static void mark_best(const ckpt_cat_entry_t **v, size_t nv,
                      const ckpt_keep_policy_t *p, unsigned *why) {
  ranked_t *r = calloc(nv ? nv : 1, sizeof(*r));
  if (!r) { /* out of memory: every one kept */
    for (size_t j = 0; j < nv; j++)
      why[j] |= CKPT_KEPT_UNRANKED;
    return;
  }
  size_t nr = 0;
  for (size_t j = 0; j < nv; j++) {
    if (ckpt_metadata_metric(&v[j]->meta, p->metric, &r[nr].v)) {
      if (p->maximize)
        r[nr].v = -r[nr].v;
      r[nr++].at = j;
    } else {
      why[j] |= CKPT_KEPT_UNRANKED;
    }
  }
  qsort(r, nr, sizeof(*r), better_first);
  for (size_t j = 0; j < nr && j < p->best; j++)
    why[r[j].at] |= CKPT_KEPT_BEST;
  free(r);
}

size_t ckpt__catalog_select_policy(const ckpt_catalog_t *c,
                                   const ckpt_keep_policy_t *p,
                                   const char *keep_name, bool *remove,
                                   unsigned *why_out) {
  for (size_t i = 0; i < c->n; i++) {
    remove[i] = false;
    if (why_out)
      why_out[i] = 0;
  }
  const ckpt_cat_entry_t **v = calloc(c->n ? c->n : 1, sizeof(*v));
  unsigned *why = calloc(c->n ? c->n : 1, sizeof(*why));
  if (!v || !why) { /* out of memory: remove nothing */
    free(v), free(why);
    return 0;
  }
  size_t nv = 0;
  for (size_t i = 0; i < c->n; i++)
    if (c->e[i].state == CKPT_CAT_COMMITTED)
      v[nv++] = &c->e[i];
  qsort(v, nv, sizeof(*v), by_step);
  bool active = ckpt_keep_policy_active(p);
  for (size_t j = 0; j < nv; j++) {
    if (!active)
      why[j] |= CKPT_KEPT_NO_POLICY;
    if (p->last && nv - j <= p->last)
      why[j] |= CKPT_KEPT_LAST;
    if (p->every && v[j]->step >= 0 && (uint64_t)v[j]->step % p->every == 0)
      why[j] |= CKPT_KEPT_EVERY;
    if (v[j]->is_protected)
      why[j] |= CKPT_KEPT_PROTECTED;
    if (keep_name && !strcmp(v[j]->name, keep_name))
      why[j] |= CKPT_KEPT_CURRENT;
  }
  if (p->best)
    mark_best(v, nv, p, why);
  size_t selected = 0;
  for (size_t j = 0; j < nv; j++) {
    size_t i = (size_t)(v[j] - c->e);
    if (why_out)
      why_out[i] = why[j];
    if (!why[j]) {
      remove[i] = true;
      selected++;
    }
  }
  free(v);
  free(why);
  return selected;
}

size_t ckpt__catalog_select_prunable(int backing_fd, ckpt_catalog_t *c,
                                     const ckpt_keep_policy_t *p,
                                     const char *keep_name, bool *remove,
                                     unsigned *why) {
  for (;;) {
    size_t n = ckpt__catalog_select_policy(c, p, keep_name, remove, why);
    bool refused = false;
    for (size_t i = 0; i < c->n; i++) {
      ckpt_cat_entry_t *en = &c->e[i];
      if (!remove[i] || en->meta.n_tensors || en->meta.n_chunks ||
          en->meta.n_blobs)
        continue; /* not selected, or loaded whole already */
      int dfd = ckpt_store_open_dir(backing_fd, en->name, O_RDONLY);
      char display[300], *err = NULL;
      snprintf(display, sizeof(display), "%s/%s", en->name,
               CKPT_METADATA_FILE);
      ckpt_metadata_t whole;
      int rc = dfd < 0 ? dfd
                       : ckpt_metadb_load_at(dfd, display, &whole, &err);
      if (dfd >= 0)
        close(dfd);
      if (rc == 0) {
        ckpt_metadata_free(&en->meta);
        en->meta = whole;
        continue;
      }
      /* Refused: damaged, never removed by a policy; select again
       * without it (it does not count as one of the keep either). */
      en->state = CKPT_CAT_DAMAGED;
      free(en->error);
      en->error = err ? err : strdup(strerror(-rc));
      refused = true;
    }
    if (!refused)
      return n;
  }
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
  /* Through the directory held: by its name, a replace may have
   * exchanged another checkpoint in meanwhile (never removed). */
  rc = ckpt__remove_held_tree(backing_fd, name, dfd);
  close(dfd); /* the flock is held until the directory is gone */
  fsync(backing_fd);
  return rc;
}

int ckpt__protect_read(int dfd) {
  int fd = openat(dfd, CKPT_PROTECT_FILE, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0)
    return -1;
  char c = 0;
  ssize_t n = read(fd, &c, 1);
  close(fd);
  return n == 1 && (c == '0' || c == '1') ? c - '0' : -1;
}

/* Write "1\n" or "0\n" into dfd/.protected.tmp, fsynced, and rename it
 * to .protected, fsyncing dfd. */
static int write_marker(int dfd, bool on) {
  static const char tmp[] = CKPT_PROTECT_FILE ".tmp";
  int fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW |
                                O_CLOEXEC, 0644);
  if (fd < 0)
    return -errno;
  int rc = 0;
  if (write(fd, on ? "1\n" : "0\n", 2) != 2)
    rc = errno ? -errno : -ENOSPC;
  if (rc == 0 && fsync(fd))
    rc = -errno;
  close(fd);
  if (rc == 0 && renameat(dfd, tmp, dfd, CKPT_PROTECT_FILE))
    rc = -errno;
  if (rc == 0 && fsync(dfd))
    rc = -errno;
  if (rc)
    unlinkat(dfd, tmp, 0);
  return rc;
}

int ckpt__checkpoint_protect(int backing_fd, const char *name, bool on) {
  for (int attempt = 0; attempt < 100; attempt++) {
    int dfd = ckpt_store_open_dir(backing_fd, name, O_RDONLY);
    if (dfd < 0)
      return dfd;
    if (flock(dfd, LOCK_EX)) {
      int e = errno;
      close(dfd);
      return -e;
    }
    /* Still the checkpoint of that name (a removal or replace may have
     * exchanged another one in while this waited)? */
    struct stat held, named;
    bool same = fstat(dfd, &held) == 0 &&
                fstatat(backing_fd, name, &named, AT_SYMLINK_NOFOLLOW) == 0 &&
                held.st_dev == named.st_dev && held.st_ino == named.st_ino;
    int rc = !same ? 1
             : !ckpt_store_has_metadata(dfd) ? -ENOENT
                                             : write_marker(dfd, on);
    close(dfd);
    if (rc != 1)
      return rc;
  }
  return -EAGAIN;
}

/* Does an entry of records (n names) name save_id: SAVE_ID or SAVE_ID.R? */
static bool recorded(char **records, size_t n, const char *save_id) {
  size_t len = strlen(save_id);
  for (size_t i = 0; i < n; i++)
    if (!strncmp(records[i], save_id, len) &&
        (records[i][len] == '\0' || records[i][len] == '.'))
      return true;
  return false;
}

/* The names in tier_fd/dir (none when it does not exist). 0 or -errno. */
static int list_records(int tier_fd, const char *dir, char ***names,
                        size_t *n) {
  *names = NULL;
  *n = 0;
  int fd = openat(tier_fd, dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW |
                                    O_CLOEXEC);
  if (fd < 0)
    return errno == ENOENT ? 0 : -errno;
  DIR *d = fdopendir(fd);
  if (!d) {
    close(fd);
    return -ENOMEM;
  }
  int rc = 0;
  struct dirent *e;
  while (rc == 0 && (e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    char **grown = realloc(*names, (*n + 1) * sizeof(*grown));
    if (!grown || !(grown[*n] = strdup(e->d_name))) {
      if (grown)
        *names = grown;
      rc = -ENOMEM;
      break;
    }
    *names = grown;
    (*n)++;
  }
  closedir(d);
  return rc;
}

/* Where tier entry en stands: */
typedef enum {
  TIER_OTHER,   /* not committed, or a flush record names it: left alone */
  TIER_FLUSHED, /* no record, and BACKING_DIR/NAME the same save */
  TIER_STALE,   /* no record, and BACKING_DIR/NAME another save or none:
                   a copy of a save NAME is no more (fs/read/resolve.c) */
} tier_entry_t;

static tier_entry_t tier_entry(const ckpt_cat_entry_t *en, int backing_fd,
                               char **records, size_t nrec) {
  if (en->state != CKPT_CAT_COMMITTED || !en->meta.save_id ||
      recorded(records, nrec, en->meta.save_id))
    return TIER_OTHER;
  char id[CKPT_SAVE_ID_LEN + 1];
  int dfd = ckpt_store_open_dir(backing_fd, en->name, O_RDONLY);
  int rc = dfd < 0 ? dfd
           : ckpt_store_has_metadata(dfd) ? ckpt_store_save_id(dfd, id)
                                          : -ENOENT;
  if (dfd >= 0)
    close(dfd);
  if (rc == 0)
    return strcmp(id, en->meta.save_id) ? TIER_STALE : TIER_FLUSHED;
  /* unknown now (EMFILE, EIO): left for the next look */
  return rc == -ENOENT || rc == -ENOTDIR ? TIER_STALE : TIER_OTHER;
}

int ckpt__tier_evict(int tier_fd, int backing_fd, const char *records_dir,
                     uint32_t keep, char ***removed, size_t *n_removed) {
  if (removed)
    *removed = NULL;
  *n_removed = 0;
  char **records;
  size_t nrec;
  int rc = list_records(tier_fd, records_dir, &records, &nrec);
  if (rc) {
    ckpt__catalog_names_free(records, nrec);
    return rc;
  }
  ckpt_catalog_t cat;
  if ((rc = ckpt__catalog_scan(tier_fd, false, &cat))) {
    ckpt__catalog_names_free(records, nrec);
    return rc;
  }
  /* Only the flushed ones take part: the others become UNFINISHED here,
   * which a policy never counts nor selects; the stale ones go. */
  bool *rm = calloc(cat.n ? cat.n : 1, sizeof(*rm));
  bool *stale = calloc(cat.n ? cat.n : 1, sizeof(*stale));
  char **out = calloc(cat.n ? cat.n : 1, sizeof(*out));
  if (!rm || !out || !stale) {
    free(rm), free(out), free(stale);
    ckpt__catalog_names_free(records, nrec);
    ckpt__catalog_free(&cat);
    return -ENOMEM;
  }
  for (size_t i = 0; i < cat.n; i++) {
    tier_entry_t t = tier_entry(&cat.e[i], backing_fd, records, nrec);
    stale[i] = t == TIER_STALE;
    if (t != TIER_FLUSHED && cat.e[i].state == CKPT_CAT_COMMITTED)
      cat.e[i].state = CKPT_CAT_UNFINISHED;
  }
  ckpt__catalog_names_free(records, nrec);
  ckpt_keep_policy_t p = {.last = keep};
  bool all = keep == 0; /* tier_keep=0: no flushed one stays */
  ckpt__catalog_select_policy(&cat, &p, NULL, rm, NULL);
  for (size_t i = 0; i < cat.n; i++) {
    if (!stale[i] && !(all ? cat.e[i].state == CKPT_CAT_COMMITTED : rm[i]))
      continue;
    int r = ckpt__checkpoint_remove(tier_fd, cat.e[i].name, false);
    if (r == 0)
      out[(*n_removed)++] = cat.e[i].name, cat.e[i].name = NULL;
    else if (rc == 0)
      rc = r; /* the first failure; the others are still tried */
  }
  free(rm);
  free(stale);
  ckpt__catalog_free(&cat);
  if (removed && *n_removed)
    *removed = out;
  else
    ckpt__catalog_names_free(out, *n_removed);
  return rc;
}
