/*
 * identity.c - is a directory of BACKING_DIR still the checkpoint a mount
 * loaded? Not its inode number alone (a filesystem reuses the number of a
 * removed directory): its kernel file handle, and the save ID in its
 * .metadata. Used by the reader, the descriptor cache and the removal.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "metadb.h"
#include "store_int.h"

/* The save ID as compared: itself (every ckptfs save's is 32 hex digits),
 * or one that does not fit (another tool's) by its XXH3-64, "#" first. */
void ckpt__save_key(const char *save_id, char out[CKPT_SAVE_ID_LEN + 1]) {
  if (!save_id)
    save_id = "";
  size_t len = strlen(save_id);
  if (len <= CKPT_SAVE_ID_LEN)
    memcpy(out, save_id, len + 1);
  else
    snprintf(out, CKPT_SAVE_ID_LEN + 1, "#%016llx",
             (unsigned long long)XXH3_64bits(save_id, len));
}

void ckpt_store_dir_handle(int dirfd, const char *name,
                           ckpt_dir_handle_t *out) {
  union {
    struct file_handle fh;
    unsigned char buf[sizeof(struct file_handle) + CKPT_HANDLE_MAX];
  } u;
  int mount_id;
  memset(out, 0, sizeof(*out));
  u.fh.handle_bytes = CKPT_HANDLE_MAX;
  if (name_to_handle_at(dirfd, name, &u.fh, &mount_id,
                        name[0] ? 0 : AT_EMPTY_PATH) == 0 &&
      u.fh.handle_bytes <= CKPT_HANDLE_MAX) {
    out->len = u.fh.handle_bytes;
    out->type = u.fh.handle_type;
    memcpy(out->b, u.fh.f_handle, out->len);
  }
}

bool ckpt_dir_handle_same(const ckpt_dir_handle_t *a,
                          const ckpt_dir_handle_t *b) {
  return a->len == b->len && a->type == b->type &&
         !memcmp(a->b, b->b, a->len);
}

/* The save IDs last read, by the version of their .metadata file
 * (ckpt__same_version: device, inode, size, mtime, ctime). Every data
 * file a mount opens compares its directory's save ID (twice: a later
 * version, the same one), and reading it is an SQLite open and query, a
 * millisecond's CPU on a fresh mount's first reads. A .metadata is never
 * written in place (a new file renamed over it), so a file of the same
 * version holds the same ID; one whose ctime is within RACY_SECONDS of
 * now is not remembered (a file made in the same clock tick in a reused
 * inode, of the same size, could not be told apart: git's racy rule;
 * the rule takes this host's clock for the file's, as on a local
 * filesystem). A remembered ID is returned without reading the file
 * again: a .metadata that became unreadable since, its stat unchanged,
 * still answers its ID (its data files' reads are verified as ever). */
#define ID_CACHE 64
#define RACY_SECONDS 2
static struct {
  struct stat st;
  char id[CKPT_SAVE_ID_LEN + 1];
} id_cache[ID_CACHE];
static size_t id_cache_n, id_cache_next; /* under id_cache_lock */
static pthread_mutex_t id_cache_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_ulong id_reads;

unsigned long ckpt__save_id_reads(void) { return atomic_load(&id_reads); }

static bool cached_id(const struct stat *st, char out[CKPT_SAVE_ID_LEN + 1]) {
  bool hit = false;
  pthread_mutex_lock(&id_cache_lock);
  for (size_t i = 0; i < id_cache_n && !hit; i++)
    if (ckpt__same_version(&id_cache[i].st, st)) {
      memcpy(out, id_cache[i].id, CKPT_SAVE_ID_LEN + 1);
      hit = true;
    }
  pthread_mutex_unlock(&id_cache_lock);
  return hit;
}

static void remember_id(const struct stat *st,
                        const char id[CKPT_SAVE_ID_LEN + 1]) {
  struct timespec now;
  if (clock_gettime(CLOCK_REALTIME, &now) ||
      (int64_t)(now.tv_sec - st->st_ctim.tv_sec) * 1000000000 +
              (now.tv_nsec - st->st_ctim.tv_nsec) <
          (int64_t)RACY_SECONDS * 1000000000)
    return;
  pthread_mutex_lock(&id_cache_lock);
  size_t i = id_cache_n < ID_CACHE ? id_cache_n++ : id_cache_next;
  id_cache_next = (i + 1) % ID_CACHE;
  id_cache[i].st = *st;
  memcpy(id_cache[i].id, id, CKPT_SAVE_ID_LEN + 1);
  pthread_mutex_unlock(&id_cache_lock);
}

int ckpt_store_save_id(int dirfd, char out[CKPT_SAVE_ID_LEN + 1]) {
  struct stat st, after;
  int fd = ckpt_store_open_file(dirfd, CKPT_METADATA_FILE);
  bool known = fd >= 0 && fstat(fd, &st) == 0;
  if (known && cached_id(&st, out)) {
    close(fd);
    return 0;
  }
  atomic_fetch_add(&id_reads, 1);
  int rc = ckpt_store_save_look(dirfd, out, NULL, NULL);
  /* remembered if the name held that one version before and after the
   * read (the file read was opened by name in between) */
  if (rc == 0 && known &&
      fstatat(dirfd, CKPT_METADATA_FILE, &after, AT_SYMLINK_NOFOLLOW) == 0 &&
      ckpt__same_version(&st, &after))
    remember_id(&st, out);
  if (fd >= 0)
    close(fd);
  return rc;
}

int ckpt_store_save_look(int dirfd, char out[CKPT_SAVE_ID_LEN + 1],
                         char **replaces, int64_t *commit_ns) {
  ckpt_metadata_t m;
  char *err = NULL;
  memset(&m, 0, sizeof(m));
  if (replaces)
    *replaces = NULL;
  int rc = ckpt_metadb_load_header_at(dirfd, CKPT_METADATA_FILE, &m, &err);
  if (rc == 0)
    ckpt__save_key(m.save_id, out);
  if (rc == 0 && replaces) {
    *replaces = m.replaces;
    m.replaces = NULL;
  }
  if (rc == 0 && commit_ns) /* an older save's: to the second */
    *commit_ns = m.commit_ns ? m.commit_ns : m.created_at * 1000000000;
  free(err);
  ckpt_metadata_free(&m);
  return rc == 0 || rc == -ENOENT || rc == -ENOMEM || rc == -EMFILE ||
                 rc == -ENFILE
             ? rc
             : -EIO;
}

/* A removal inside a checkpoint binds its reader to the new version
 * (ckpt_stored_rebind) while other threads may compare: the identity is
 * read and changed under this lock. */
static pthread_mutex_t id_lock = PTHREAD_MUTEX_INITIALIZER;

void ckpt__stored_set_identity(ckpt_stored_t *s, const ckpt_version_t *v) {
  pthread_mutex_lock(&id_lock);
  s->dev = v->dev;
  s->ino = v->ino;
  s->handle = v->handle;
  memcpy(s->save_id, v->save_id, sizeof(s->save_id));
  pthread_mutex_unlock(&id_lock);
}

int ckpt_stored_same_dir(const ckpt_stored_t *s, int dirfd) {
  struct stat st;
  if (fstat(dirfd, &st))
    return -errno;
  pthread_mutex_lock(&id_lock);
  dev_t dev = s->dev;
  ino_t ino = s->ino;
  char want[CKPT_SAVE_ID_LEN + 1];
  memcpy(want, s->save_id, sizeof(want));
  pthread_mutex_unlock(&id_lock);
  if (st.st_dev != dev || st.st_ino != ino) {
    ckpt__log("%s: the directory was replaced since it was loaded",
              s->name);
    return -ESTALE;
  }
  /* The same inode number is not the same directory: a filesystem
   * reuses the number of a removed one. Its save ID says. */
  char id[CKPT_SAVE_ID_LEN + 1];
  int rc = ckpt_store_save_id(dirfd, id);
  if (rc == -ENOENT || rc == -EIO || (rc == 0 && strcmp(id, want))) {
    ckpt__log("%s: the checkpoint was replaced since it was loaded (save "
              "%s, now %s)", s->name, want,
              rc == 0 ? id : rc == -ENOENT ? "none" : "unreadable");
    return -ESTALE;
  }
  return rc;
}

/* Is directory dirfd s's version or a later one (made by removals inside
 * it, store/removal.c: the first half of the save ID is kept)? */
static bool later_version(const ckpt_stored_t *s, int dirfd) {
  char want[CKPT_SAVE_ID_LEN + 1], id[CKPT_SAVE_ID_LEN + 1];
  pthread_mutex_lock(&id_lock);
  memcpy(want, s->save_id, sizeof(want));
  pthread_mutex_unlock(&id_lock);
  return strlen(want) == CKPT_SAVE_ID_LEN && want[0] != '#' &&
         ckpt_store_save_id(dirfd, id) == 0 &&
         strlen(id) == CKPT_SAVE_ID_LEN &&
         !memcmp(want, id, CKPT_SAVE_ID_LEN / 2);
}

int ckpt_stored_same_lineage(const ckpt_stored_t *s, int dirfd) {
  return later_version(s, dirfd) ? 0 : ckpt_stored_same_dir(s, dirfd);
}

int ckpt_store_unpublish(int backing_fd, const ckpt_stored_t *s) {
  int dfd = ckpt_store_open_dir(backing_fd, s->name, O_RDONLY);
  if (dfd < 0)
    return dfd == -ENOENT ? 0 : dfd;
  /* One at a time with removals inside it and replaces (removal.c). */
  flock(dfd, LOCK_EX);
  int rc = ckpt_stored_same_dir(s, dfd);
  if (rc == -ESTALE && later_version(s, dfd))
    rc = 0;
  if (rc == 0 && unlinkat(dfd, CKPT_METADATA_FILE, 0) && errno != ENOENT)
    rc = -errno;
  if (rc == 0 && fsync(dfd))
    rc = -errno;
  close(dfd);
  return rc;
}

