/*
 * resolve.c - which save of a checkpoint NAME this mount serves: the one
 * truth of every mount and every tier.
 *
 * The rule (docs/committed.md, docs/tiers.md):
 *   1. BACKING_DIR/NAME holds the committed save of NAME (by save ID) for
 *      every mount; without a tier that is all.
 *   2. With a tier, this node's tier copy TIER/NAME is served instead
 *      only when it is that same save (a copy kept by tier_keep: a cache
 *      of one save ID), or when it is this node's unflushed save of NAME
 *      (a flush record names it) and BACKING_DIR/NAME is still what that
 *      commit replaced (the save keys its .metadata lists in "replaces",
 *      "none" for no checkpoint of that name, "earlier" for replace=: any
 *      save committed before it, by commit_ns).
 *   3. Anything else in the tier is served by nobody: a kept copy of a
 *      save NAME no longer is (removed, replaced or rewritten through
 *      another mount) is dropped at the next look (ckpt__tier_forget), an
 *      unflushed save whose NAME changed on BACKING_DIR after its commit
 *      is superseded: its flush publishes nothing (ckpt_store_publish_if,
 *      the compare-and-swap of the flush) and removes it, and NAME's
 *      .status says so ("superseded: ...").
 * "Later" is the order of the commits (each .metadata's commit_ns, the
 * coordinator's clock at the commit point; nodes' clocks synchronized):
 * any change of BACKING_DIR/NAME made after a tier commit (a commit, a
 * replace, a removal, through any mount) stays; of two tier commits on
 * two nodes the later one wins, whichever flush ends first.
 *
 * Window: a mount looks again at BACKING_DIR/NAME (one stat, and its save
 * ID where the tier has a copy) at each lookup the kernel sends (entries of
 * committed checkpoints are cached for COMMITTED_TIMEOUT, 1 s) and at each
 * listing older than CKPT_SCAN_MAX_AGE (1 s): a change made through
 * another mount is seen within about a second. An open file keeps reading
 * the save it opened.
 *
 * No lock is needed: everything is looked up in the directories; the
 * notes of superseded saves have their own leaf lock.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "read.h"

/* The save key and "replaces" of ROOT/NAME's .metadata: 0, -ENOENT (no
 * committed checkpoint there) or another -errno (unknown now). */
static int look(int root, const char *name, char id[CKPT_SAVE_ID_LEN + 1],
                char **replaces, int64_t *commit_ns) {
  id[0] = '\0';
  if (replaces)
    *replaces = NULL;
  int dfd = ckpt_store_open_dir(root, name, O_RDONLY);
  if (dfd < 0)
    return dfd == -ENOTDIR || dfd == -ELOOP ? -ENOENT : dfd;
  int rc = ckpt_store_save_look(dfd, id, replaces, commit_ns);
  close(dfd);
  return rc;
}

/* ------------------------------------------------------------------------
 * The last answers, by name: a lookup of a tier mount costs three stats
 * (TIER/NAME, BACKING_DIR/NAME, TIER/.flush) instead of two .metadata
 * loads and a listing while none of the three changed (identity, mtime
 * and ctime: a directory replaced, a .metadata removed in it, a record
 * added or dropped all change one).
 * ---------------------------------------------------------------------- */
#define CACHE_SLOTS 64
typedef struct {
  dev_t dev;
  ino_t ino;
  struct timespec mtime, ctime;
  bool there;
} ident_t;

static struct {
  pthread_mutex_t lock; /* a leaf */
  struct slot {
    const ckpt_fs_t *fs;
    char name[256];
    ident_t tier, shared, recs;
    ckpt_resolved_t r;
    uint64_t used;
  } slots[CACHE_SLOTS];
  uint64_t clock;
} cache = {.lock = PTHREAD_MUTEX_INITIALIZER};

static ident_t ident(int dirfd, const char *path) {
  struct stat st;
  ident_t id = {0};
  if (fstatat(dirfd, path, &st, AT_SYMLINK_NOFOLLOW) == 0)
    id = (ident_t){st.st_dev, st.st_ino, st.st_mtim, st.st_ctim, true};
  return id;
}

static bool same(const ident_t *a, const ident_t *b) {
  return a->there == b->there && a->dev == b->dev && a->ino == b->ino &&
         a->mtime.tv_sec == b->mtime.tv_sec &&
         a->mtime.tv_nsec == b->mtime.tv_nsec &&
         a->ctime.tv_sec == b->ctime.tv_sec &&
         a->ctime.tv_nsec == b->ctime.tv_nsec;
}

static bool cached(const ckpt_fs_t *fs, const char *name, const ident_t k[3],
                   ckpt_resolved_t *out) {
  bool hit = false;
  pthread_mutex_lock(&cache.lock);
  for (int i = 0; i < CACHE_SLOTS && !hit; i++) {
    struct slot *s = &cache.slots[i];
    if (s->fs == fs && !strcmp(s->name, name) && same(&s->tier, &k[0]) &&
        same(&s->shared, &k[1]) && same(&s->recs, &k[2])) {
      *out = s->r;
      s->used = ++cache.clock;
      hit = true;
    }
  }
  pthread_mutex_unlock(&cache.lock);
  return hit;
}

/* Was any of k changed less than RACY_S ago? Then a change in the same
 * tick of the filesystem's clock could leave its times as they are (the
 * "racy" case of git's index): not remembered. */
#define RACY_S 0.1
static bool racy(const ident_t k[3]) {
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  double t = (double)now.tv_sec + now.tv_nsec * 1e-9;
  for (int i = 0; i < 3; i++) {
    double m = (double)k[i].mtime.tv_sec + k[i].mtime.tv_nsec * 1e-9;
    double c = (double)k[i].ctime.tv_sec + k[i].ctime.tv_nsec * 1e-9;
    if (k[i].there && (t - m < RACY_S || t - c < RACY_S))
      return true;
  }
  return false;
}

static void remember(const ckpt_fs_t *fs, const char *name,
                     const ident_t k[3], const ckpt_resolved_t *r) {
  if (strlen(name) >= sizeof(cache.slots[0].name) || racy(k))
    return;
  pthread_mutex_lock(&cache.lock);
  struct slot *s = &cache.slots[0];
  for (int i = 0; i < CACHE_SLOTS; i++) {
    struct slot *c = &cache.slots[i];
    if (c->fs == fs && !strcmp(c->name, name)) {
      s = c;
      break;
    }
    if (c->used < s->used)
      s = c; /* the least recently used (or an empty one) */
  }
  s->fs = fs;
  snprintf(s->name, sizeof(s->name), "%s", name);
  s->tier = k[0];
  s->shared = k[1];
  s->recs = k[2];
  s->r = *r;
  s->used = ++cache.clock;
  pthread_mutex_unlock(&cache.lock);
}

/* The rule, looked up in the directories; definite: whether it may be
 * remembered (nothing that could not be read). */
static void resolve_now(ckpt_fs_t *fs, const char *name, ckpt_resolved_t *out,
                        bool *definite);

void ckpt__resolve(ckpt_fs_t *fs, const char *name, ckpt_resolved_t *out) {
  memset(out, 0, sizeof(*out));
  out->root = fs->backing_fd;
  if (fs->tier_fd < 0)
    return;
  ident_t k[3] = {ident(fs->tier_fd, name), ident(fs->backing_fd, name),
                  ident(fs->tier_fd, CKPT_FLUSH_DIR)};
  if (!k[0].there)
    return; /* nothing of NAME in the tier: BACKING_DIR's */
  if (cached(fs, name, k, out))
    return;
  bool definite = false;
  resolve_now(fs, name, out, &definite);
  if (definite)
    remember(fs, name, k, out);
}

static void resolve_now(ckpt_fs_t *fs, const char *name, ckpt_resolved_t *out,
                        bool *definite) {
  if (!ckpt_store_committed(fs->tier_fd, name, NULL))
    return;
  char tier[CKPT_SAVE_ID_LEN + 1], shared[CKPT_SAVE_ID_LEN + 1];
  char *replaces = NULL;
  int64_t tier_ns = 0, shared_ns = 0;
  int trc = look(fs->tier_fd, name, tier, &replaces, &tier_ns);
  if (trc) { /* gone meanwhile, or unreadable: the tier's own load says */
    free(replaces);
    if (trc != -ENOENT)
      out->root = fs->tier_fd;
    return;
  }
  int src = look(fs->backing_fd, name, shared, NULL, &shared_ns);
  *definite = src == 0 || src == -ENOENT;
  if (src && src != -ENOENT) {
    /* BACKING_DIR cannot be read now (out of descriptors, I/O error): the
     * tier's copy, as before this look */
    out->root = fs->tier_fd;
  } else if (src == 0 && !strcmp(shared, tier)) {
    out->root = fs->tier_fd; /* the same save: a cache of it */
  } else if (ckpt__flush_unflushed(fs, tier)) {
    /* this node's own unflushed save: NAME's until a later change of
     * BACKING_DIR/NAME (a save of an older ckptfs recorded none) */
    if (!replaces ||
        ckpt_store_replaces_ok(replaces, tier_ns, src ? "" : shared, shared_ns))
      out->root = fs->tier_fd;
    else {
      out->superseded = true;
      snprintf(out->superseded_id, sizeof(out->superseded_id), "%s", tier);
    }
  } else {
    snprintf(out->stale, sizeof(out->stale), "%s", tier);
  }
  free(replaces);
}

int ckpt__root_of(ckpt_fs_t *fs, const char *name) {
  ckpt_resolved_t r;
  ckpt__resolve(fs, name, &r);
  return r.root;
}

char *ckpt__resolve_replaces(ckpt_fs_t *fs, const char *name, bool replace) {
  if (fs->tier_fd < 0)
    return NULL;
  if (!replace) /* a plain commit replaces nothing */
    return strdup("none");
  char shared[CKPT_SAVE_ID_LEN + 1], tier[CKPT_SAVE_ID_LEN + 1];
  int src = -EAGAIN;
  for (int i = 0; i < 3 && src && src != -ENOENT; i++)
    src = look(fs->backing_fd, name, shared, NULL, NULL);
  ckpt_resolved_t r;
  ckpt__resolve(fs, name, &r);
  bool unflushed = r.root == fs->tier_fd &&
                   look(fs->tier_fd, name, tier, NULL, NULL) == 0 &&
                   (src || strcmp(tier, shared));
  /* BACKING_DIR/NAME's save, or none; and any save of NAME committed
   * before this one ("earlier": one that another node's tier flushes
   * later, say, or one BACKING_DIR would not show now: EIO, EMFILE) */
  const char *seen = src == 0 ? shared : src == -ENOENT ? "none" : "";
  return ckpt__strdup_printf("%s%s%s%searlier", seen,
                             *seen && unflushed ? " " : "",
                             unflushed ? tier : "",
                             *seen || unflushed ? " " : "");
}

/* ------------------------------------------------------------------------
 * Notes of superseded saves, for NAME's .status.
 * ---------------------------------------------------------------------- */
#define NOTES_MAX 64
static struct {
  pthread_mutex_t lock; /* a leaf: taken with any other lock held */
  struct note {
    char name[256];
    char *text;
    uint64_t seq;
  } notes[NOTES_MAX];
  uint64_t seq;
} notes = {.lock = PTHREAD_MUTEX_INITIALIZER};

void ckpt__resolve_superseded(ckpt_fs_t *fs, const char *name,
                              const char *save_id, const char *why) {
  (void)fs;
  char *text = ckpt__strdup_printf("superseded: save %s of %s, committed "
                                   "through this mount's tier, was not "
                                   "published: %s", save_id, name,
                                   why ? why : "NAME changed after its "
                                               "commit");
  if (!text)
    return;
  pthread_mutex_lock(&notes.lock);
  struct note *slot = &notes.notes[0];
  for (int i = 0; i < NOTES_MAX; i++) {
    struct note *n = &notes.notes[i];
    if (!strcmp(n->name, name)) {
      slot = n;
      break;
    }
    if (n->seq < slot->seq)
      slot = n; /* the oldest (or an empty one) */
  }
  free(slot->text);
  snprintf(slot->name, sizeof(slot->name), "%s", name);
  slot->text = text;
  slot->seq = ++notes.seq;
  pthread_mutex_unlock(&notes.lock);
}

char *ckpt__resolve_note(const char *name) {
  char *out = NULL;
  pthread_mutex_lock(&notes.lock);
  for (int i = 0; i < NOTES_MAX && !out; i++)
    if (notes.notes[i].text && !strcmp(notes.notes[i].name, name))
      out = strdup(notes.notes[i].text);
  pthread_mutex_unlock(&notes.lock);
  return out;
}

/* Committed in BACKING_DIR, or in the tier (not flushed yet, or kept). */
bool ckpt__already_committed(ckpt_fs_t *fs, const char *name) {
  /* a tier copy counts only when it is what this mount serves as NAME */
  return ckpt_store_committed(fs->backing_fd, name, NULL) ||
         (fs->tier_fd >= 0 && ckpt__root_of(fs, name) == fs->tier_fd);
}
