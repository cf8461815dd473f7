/*
 * removal.c - removing one entry inside a committed checkpoint: a new
 * version of the checkpoint, published as a replace is (store.h,
 * ckpt_store_remove_entry).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "catalog.h"
#include "failpoint.h"
#include "metadb.h"
#include "store_int.h"

/* A byte range of one data file: (rank, file) as a key, then the range. */
typedef struct {
  int64_t key;
  uint64_t off, len;
} span_t;

static int64_t file_key(int32_t rank, uint32_t file) {
  return (int64_t)rank << 32 | file;
}

static int by_key(const void *a, const void *b) {
  const span_t *x = a, *y = b;
  if (x->key != y->key)
    return (x->key > y->key) - (x->key < y->key);
  return (x->off > y->off) - (x->off < y->off);
}

/* The save ID of a new version: the first half is the original save's
 * (every version of one commit shares it: a whole removal through a
 * mount that still shows an earlier version removes the later one, never
 * another save's checkpoint), the second half random. */
static void new_id(const char *prev, char out[CKPT_SAVE_ID_LEN + 1]) {
  uint8_t r[16];
  if (getrandom(r, sizeof(r), 0) != (ssize_t)sizeof(r)) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    memset(r, 0, sizeof(r));
    memcpy(r, &ts, sizeof(ts) < sizeof(r) ? sizeof(ts) : sizeof(r));
    r[15] ^= (uint8_t)getpid();
  }
  for (int i = 0; i < 16; i++)
    snprintf(out + 2 * i, 3, "%02x", r[i]);
  if (ckpt_save_id_valid(prev) && strlen(prev) == CKPT_SAVE_ID_LEN)
    memcpy(out, prev, CKPT_SAVE_ID_LEN / 2);
}

/* The plan of a removal from version m: the byte ranges of the items that
 * stay (live) and of the one that goes (gone), each sorted by file. */
typedef struct {
  span_t *live, *gone;
  size_t nlive, ngone;
  bool found; /* r is an entry of m */
} plan_t;

static int plan(const ckpt_metadata_t *m, const bool *removed,
                const ckpt_removal_t *r, plan_t *p) {
  memset(p, 0, sizeof(*p));
  p->live = calloc((size_t)m->n_chunks + m->n_blobs + 1, sizeof(*p->live));
  p->gone = calloc((size_t)m->n_chunks + m->n_blobs + 1, sizeof(*p->gone));
  if (!p->live || !p->gone)
    return -ENOMEM;
  for (uint32_t t = 0; t < m->n_tensors; t++) {
    const ckpt_tensor_meta_t *tm = &m->tensors[t];
    bool target = !r->dir && !r->blob && !strcmp(tm->fqn, r->fqn);
    if (removed && removed[t] && !target)
      continue;
    if (target && removed && removed[t])
      continue; /* gone already */
    p->found |= target;
    for (uint32_t c = tm->first_chunk; c < tm->first_chunk + tm->n_chunks;
         c++) {
      const ckpt_chunk_meta_t *ch = &m->chunks[c];
      span_t s = {file_key(ch->rank, ch->file), ch->file_offset, ch->length};
      if (target)
        p->gone[p->ngone++] = s;
      else
        p->live[p->nlive++] = s;
    }
  }
  for (uint32_t b = 0; b < m->n_blobs; b++) {
    const ckpt_blob_meta_t *bm = &m->blobs[b];
    bool target = !r->dir && r->blob && !strcmp(bm->fqn, r->fqn);
    if (removed && removed[m->n_tensors + b])
      continue;
    p->found |= target;
    span_t s = {file_key(bm->rank, bm->file), bm->file_offset, bm->length};
    if (target)
      p->gone[p->ngone++] = s;
    else
      p->live[p->nlive++] = s;
  }
  if (r->dir)
    p->found = ckpt_metadata_entry(m, r->path) != NULL;
  qsort(p->live, p->nlive, sizeof(*p->live), by_key);
  qsort(p->gone, p->ngone, sizeof(*p->gone), by_key);
  return 0;
}

static void plan_free(plan_t *p) {
  free(p->live);
  free(p->gone);
}

/* Link every data file the new version uses into it (ndfd). */
static int link_live(const plan_t *p, int odfd, int ndfd, char **err) {
  for (size_t i = 0; i < p->nlive; i++) {
    if (i && p->live[i].key == p->live[i - 1].key)
      continue;
    char name[64];
    ckpt_data_file_name((int32_t)(p->live[i].key >> 32),
                        (uint32_t)p->live[i].key, name, sizeof(name));
    if (linkat(odfd, name, ndfd, name, 0)) {
      int e = errno;
      *err = ckpt__strdup_printf("linking %s into the new version: %s", name,
                                 strerror(e));
      return -e;
    }
  }
  return 0;
}

/* Does [off, off+len) of file key meet a live range? */
static bool meets_live(const plan_t *p, int64_t key, uint64_t off,
                       uint64_t len) {
  for (size_t i = 0; i < p->nlive; i++)
    if (p->live[i].key == key && p->live[i].off < off + len &&
        off < p->live[i].off + p->live[i].len)
      return true;
  return false;
}

/* Free the removed item's bytes in the data files the new version still
 * uses (ndfd): a hole where the filesystem can punch one (best effort; a
 * range that meets a live one is left). */
static void punch_gone(const plan_t *p, int ndfd) {
  for (size_t i = 0; i < p->ngone; i++) {
    const span_t *g = &p->gone[i];
    if (g->len == 0 || meets_live(p, g->key, g->off, g->len))
      continue;
    char name[64];
    ckpt_data_file_name((int32_t)(g->key >> 32), (uint32_t)g->key, name,
                        sizeof(name));
    int fd = openat(ndfd, name, O_WRONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
      continue; /* not linked: unused, freed with the old version */
    if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                  (off_t)g->off, (off_t)g->len) &&
        errno != EOPNOTSUPP)
      ckpt__log("punching %s [%llu, +%llu): %s", name,
                (unsigned long long)g->off, (unsigned long long)g->len,
                strerror(errno));
    close(fd);
  }
}

/* Open BACKING_DIR/name and hold it exclusively, checking that the name
 * still is the directory held (a removal or replace of another mount may
 * have exchanged it while this one waited). dfd or -errno. */
static int hold_current(int backing_fd, const char *name) {
  for (int attempt = 0; attempt < 100; attempt++) {
    int dfd = ckpt_store_open_dir(backing_fd, name, O_RDONLY);
    if (dfd < 0)
      return dfd;
    if (flock(dfd, LOCK_EX) && errno != EINVAL && errno != ENOLCK &&
        errno != EOPNOTSUPP && errno != ENOSYS) {
      int e = errno;
      close(dfd);
      return -e;
    }
    struct stat held, named;
    if (fstat(dfd, &held) == 0 &&
        fstatat(backing_fd, name, &named, AT_SYMLINK_NOFOLLOW) == 0 &&
        held.st_dev == named.st_dev && held.st_ino == named.st_ino) {
      if (ckpt_store_has_metadata(dfd))
        return dfd;
      close(dfd); /* being removed as a whole: gone */
      return -ENOENT;
    }
    close(dfd);
    if (fstatat(backing_fd, name, &named, AT_SYMLINK_NOFOLLOW) && errno ==
        ENOENT)
      return -ENOENT;
  }
  return -EAGAIN;
}

static int exchange(int backing_fd, const char *id, const char *name) {
  int rc = ckpt_store_unreplace(backing_fd, id, name);
  if (rc == -EINVAL || rc == -ENOSYS || rc == -ENOTSUP)
    return -EOPNOTSUPP;
  return rc;
}

/* Build version id from held directory odfd (its metadata m) in ndfd. */
static int build(int odfd, int ndfd, const char *id, const char *display,
                 const plan_t *p, const ckpt_metadata_t *m,
                 const ckpt_removal_t *r, bool sync, char **err) {
  int rc = link_live(p, odfd, ndfd, err);
  if (rc)
    return rc;
  /* ckptctl protect's marker stays with the checkpoint (catalog.h). */
  if (linkat(odfd, CKPT_PROTECT_FILE, ndfd, CKPT_PROTECT_FILE, 0) &&
      errno != ENOENT) {
    int e = errno;
    *err = ckpt__strdup_printf("linking %s into the new version: %s",
                               CKPT_PROTECT_FILE, strerror(e));
    return -e;
  }
  ckpt_failpoint("remove_linked");
  ckpt_metadb_drop_t d = {
      .tensor_fqn = !r->dir && !r->blob ? r->fqn : NULL,
      .blob_fqn = !r->dir && r->blob ? r->fqn : NULL,
      .entry_path = r->path,
      .has_entries = m->n_entries > 0,
  };
  rc = ckpt_metadb_rewrite(odfd, ndfd, display, id, &d, sync, err);
  if (rc == 0)
    ckpt_failpoint("remove_metadata");
  return rc;
}

int ckpt_store_remove_entry(int backing_fd, const ckpt_stored_t *s,
                            const bool *removed, const ckpt_removal_t *r,
                            bool sync, ckpt_version_t *out, char **err) {
  *err = NULL;
  int odfd = hold_current(backing_fd, s->name);
  if (odfd < 0)
    return odfd == -ENOENT ? -ENOENT : odfd;
  /* The version this mount shows, or a later one (another mount removed
   * or replaced meanwhile): then its own metadata says what is there. */
  int same = ckpt_stored_same_dir(s, odfd);
  ckpt_metadata_t fresh;
  memset(&fresh, 0, sizeof(fresh));
  const ckpt_metadata_t *m = s->meta;
  int rc = 0;
  if (same == -ESTALE) {
    removed = NULL;
    m = &fresh;
    rc = ckpt_metadb_load_at(odfd, s->name, &fresh, err);
  } else if (same) {
    rc = same;
  }
  plan_t p;
  memset(&p, 0, sizeof(p));
  if (rc == 0)
    rc = plan(m, removed, r, &p);
  char id[CKPT_SAVE_ID_LEN + 1], display[300];
  new_id(m == &fresh ? fresh.save_id : s->save_id, id);
  snprintf(display, sizeof(display), "%s/%s/%s", CKPT_SAVES_DIR, id,
           CKPT_METADATA_FILE);
  int ndfd = -1;
  if (rc == 0 && !p.found) /* gone already, by another mount */
    rc = 1;
  if (rc == 0)
    rc = ckpt_store_save_dir_hold(backing_fd, id, true, &ndfd);
  if (rc == 0)
    rc = build(odfd, ndfd, id, display, &p, m, r, sync, err);
  if (rc == 0)
    rc = exchange(backing_fd, id, s->name);
  if (rc == 0)
    ckpt_failpoint("remove_exchanged");
  if (rc == 0 && sync &&
      (fsync(backing_fd) || ckpt_store_sync_saves(backing_fd))) {
    rc = -errno;
    exchange(backing_fd, id, s->name); /* back: nothing half-done */
  }
  if (rc == 1) {
    /* nothing to do */
  } else if (rc == 0) {
    struct stat st;
    fstat(ndfd, &st);
    out->dev = st.st_dev;
    out->ino = st.st_ino;
    ckpt_store_dir_handle(ndfd, "", &out->handle);
    ckpt__save_key(id, out->save_id);
    ckpt_failpoint("remove_old");
    /* The old version, now .saves/ID: removed like an unfinished save
     * (readers holding its files open keep them); then the removed
     * item's bytes in files the new version shares. */
    ckpt_store_save_dir_remove(backing_fd, id); /* a crash: the next
                                                    mount's cleanup */
    punch_gone(&p, ndfd);
    rc = same == -ESTALE ? 1 : 0;
  } else {
    if (!*err)
      *err = ckpt__strdup_printf("%s", strerror(-rc));
    if (ndfd >= 0)
      ckpt_store_save_dir_remove(backing_fd, id);
  }
  if (ndfd >= 0)
    close(ndfd);
  plan_free(&p);
  ckpt_metadata_free(&fresh);
  close(odfd);
  return rc;
}
