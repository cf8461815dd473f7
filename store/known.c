/*
 * known.c - chunks whose checksum is known to match their data file as it
 * is now, so that a verified read (reader.c) need not hash them again:
 *
 *  - hashed by this process's commit from the data file's own bytes (the
 *    files streamed into it as the trainer wrote them: fs/commit/steps.c),
 *  - or hashed by a verified read, here or by another daemon of this node
 *    since it booted (shared through a directory of the node's: below),
 *
 * each remembered with the data file's identity when it was hashed
 * (device, inode, size, mtime, ctime). Any change of the file since (a
 * write, a truncate, a punched hole, a replacement) moves its ctime, and
 * its chunks are hashed again at their next read: each chunk is hashed
 * once per change of its data file, not once per mount.
 *
 * In this process: a small direct-mapped table (a slot taken by another
 * chunk only means that chunk is hashed again). Shared with the node's
 * other daemons (ckpt_store_known_share): a directory private to the
 * daemon's user (mode 0700), named by the boot (a record never outlives
 * a reboot, after which every byte comes from the disk again), holding
 * one file per data file version, named by its identity, of 32-byte
 * records (pos, len, checksum, a check word of the three) appended by
 * every daemon that hashed a chunk of it; a record that fails its check
 * (a short append shifts the ones after it) is skipped.
 *
 * What this gives up (docs/mounting.md, verify_shared): a chunk checked
 * once is not hashed again, within the boot, when its bytes come back
 * from the disk after the page cache dropped them; damage on the disk
 * that leaves the file's ctime alone is then found by a mount with
 * verify_shared=none, or by ckptfs-fsck, which always hash.
 *
 * A change within the clock tick of the fstat that identified the file
 * could leave its ctime as it was (kernels before 6.13, which lack
 * multigrain timestamps): a verified read records nothing of a file
 * changed in the last RACY_SECONDS (as git's racy index rule). The
 * commit's records are of its own sealed, unnamed staging files, which
 * nobody else can write.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "store.h"
#include "store_int.h"

#define KNOWN_SLOTS 16384u /* 2.9 MiB mapped at the first add; resident:
                              the pages of the slots used */
#define SHARE_MAX_FILES 65536   /* more: the shared directory starts over */
#define SHARE_MAX_RECORDS 65536 /* read of one file's records */
#define RACY_SECONDS 2

typedef struct {
  struct stat file; /* the data file's version when it was hashed */
  uint64_t pos, len, sum;
  bool used;
} known_t;

static pthread_mutex_t known_lock = PTHREAD_MUTEX_INITIALIZER;
static known_t *known;        /* KNOWN_SLOTS, allocated at the first add */
/* the node's shared directory, or -1; a descriptor once shared stays open
 * for the process's life (a thread may be using it: closed, its number
 * could name another directory) */
static _Atomic int share_fd = -1;

static size_t slot_of(const struct stat *st, uint64_t pos, uint64_t len) {
  uint64_t key[4] = {(uint64_t)st->st_dev, (uint64_t)st->st_ino, pos, len};
  return (size_t)(XXH3_64bits(key, sizeof(key)) % KNOWN_SLOTS);
}

static void remember(const struct stat *st, uint64_t pos, uint64_t len,
                     uint64_t sum) {
  pthread_mutex_lock(&known_lock);
  if (!known)
    known = calloc(KNOWN_SLOTS, sizeof(*known));
  if (known)
    known[slot_of(st, pos, len)] = (known_t){
        .file = *st, .pos = pos, .len = len, .sum = sum, .used = true};
  pthread_mutex_unlock(&known_lock);
}

/* The shared file of the data file version st describes. */
static void share_name(const struct stat *st, char *buf, size_t cap) {
  snprintf(buf, cap,
           "%" PRIx64 "-%" PRIx64 "-%" PRIx64 "-%" PRId64 ".%09ld-%" PRId64
           ".%09ld",
           (uint64_t)st->st_dev, (uint64_t)st->st_ino, (uint64_t)st->st_size,
           (int64_t)st->st_mtim.tv_sec, st->st_mtim.tv_nsec,
           (int64_t)st->st_ctim.tv_sec, st->st_ctim.tv_nsec);
}

/* One shared record: its check word is the XXH3 of the other three. */
typedef struct {
  uint64_t pos, len, sum, check;
} record_t;

static uint64_t record_check(const record_t *r) {
  return XXH3_64bits(r, 3 * sizeof(uint64_t)) ^ 0x636b7074666b6e77ull;
}

static void share_add(const struct stat *st, uint64_t pos, uint64_t len,
                      uint64_t sum) {
  int dir = atomic_load(&share_fd);
  if (dir < 0)
    return;
  char name[160];
  share_name(st, name, sizeof(name));
  /* O_NONBLOCK: a FIFO there (it cannot be: the directory is private)
   * would not hold the thread */
  int fd = openat(dir, name,
                  O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_NONBLOCK |
                      O_CLOEXEC,
                  0600);
  if (fd < 0)
    return;
  struct stat fs;
  record_t r = {pos, len, sum, 0};
  r.check = record_check(&r);
  if (fstat(fd, &fs) == 0 && S_ISREG(fs.st_mode)) {
    ssize_t w = write(fd, &r, sizeof(r)); /* one write: appended whole */
    (void)w; /* a record lost is a chunk hashed again */
  }
  close(fd);
}

/* Is (pos, len, sum) among the shared records of the file st describes?
 * Every record of that file is remembered in this process as it is read
 * (its other chunks then need no second read). Only a regular file of
 * this user that no other can write is read (the directory is private:
 * this is a second look). */
static bool share_has(const struct stat *st, uint64_t pos, uint64_t len,
                      uint64_t sum) {
  int dir = atomic_load(&share_fd);
  if (dir < 0)
    return false;
  char name[160];
  share_name(st, name, sizeof(name));
  int fd = openat(dir, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    return false;
  struct stat fs;
  bool yes = false;
  if (fstat(fd, &fs) == 0 && S_ISREG(fs.st_mode) &&
      fs.st_uid == geteuid() && !(fs.st_mode & 022)) {
    record_t rec[128];
    for (size_t done = 0; done < SHARE_MAX_RECORDS;) {
      ssize_t r = pread(fd, rec, sizeof(rec), (off_t)(done * sizeof(*rec)));
      size_t n = r > 0 ? (size_t)r / sizeof(*rec) : 0;
      for (size_t i = 0; i < n; i++) {
        if (rec[i].check != record_check(&rec[i]))
          continue; /* shifted by a short append before it, or torn */
        remember(st, rec[i].pos, rec[i].len, rec[i].sum);
        yes = yes || (rec[i].pos == pos && rec[i].len == len &&
                      rec[i].sum == sum);
      }
      if (n == 0)
        break; /* the end, or a record still being appended */
      done += n;
    }
  }
  close(fd);
  return yes;
}

void ckpt_store_known_add(const struct stat *st, uint64_t pos, uint64_t len,
                          uint64_t sum) {
  remember(st, pos, len, sum);
  share_add(st, pos, len, sum);
}

void ckpt_store_known_hashed(const struct stat *st, uint64_t pos,
                             uint64_t len, uint64_t sum) {
  struct timespec now;
  if (clock_gettime(CLOCK_REALTIME, &now) ||
      now.tv_sec - st->st_ctim.tv_sec < RACY_SECONDS)
    return; /* changed too recently for its ctime to tell the next change */
  ckpt_store_known_add(st, pos, len, sum);
}

bool ckpt_store_known(int fd, uint64_t pos, uint64_t len, uint64_t sum) {
  struct stat st;
  if (fstat(fd, &st))
    return false;
  pthread_mutex_lock(&known_lock);
  const known_t *k = known ? &known[slot_of(&st, pos, len)] : NULL;
  bool yes = k && k->used && k->pos == pos && k->len == len &&
             k->sum == sum && ckpt__same_version(&k->file, &st);
  pthread_mutex_unlock(&known_lock);
  if (!yes && share_has(&st, pos, len, sum)) {
    remember(&st, pos, len, sum);
    yes = true;
  }
  return yes;
}

void ckpt_store_known_forget(void) {
  pthread_mutex_lock(&known_lock);
  if (known)
    memset(known, 0, KNOWN_SLOTS * sizeof(*known));
  pthread_mutex_unlock(&known_lock);
}

/* Make (or open) directory name under dirfd, private to this user: its
 * descriptor, or -errno with *why. */
static int private_dir(int dirfd, const char *name, const char *path,
                       char **why) {
  if (mkdirat(dirfd, name, 0700) && errno != EEXIST) {
    int e = errno;
    *why = ckpt__strdup_printf("creating %s: %s", path, strerror(e));
    return -e;
  }
  int fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    *why = ckpt__strdup_printf("opening %s: %s", path, strerror(e));
    return -e;
  }
  int rc = ckpt_store_check_private(fd, path, false, why);
  struct stat st;
  /* nor by the daemon's group: records are trusted as this user's */
  if (rc == 0 && (fstat(fd, &st) || (st.st_mode & 077))) {
    *why = ckpt__strdup_printf("%s is open to other users (mode %04o): "
                               "chmod 0700 %s", path,
                               (unsigned)(st.st_mode & 07777), path);
    rc = -EPERM;
  }
  if (rc) {
    close(fd);
    return rc;
  }
  return fd;
}

/* The boot's ID (/proc/sys/kernel/random/boot_id), 36 characters. */
static int boot_id(char out[40]) {
  int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  ssize_t r = read(fd, out, 36);
  close(fd);
  if (r != 36)
    return -EIO;
  out[36] = '\0';
  for (int i = 0; i < 36; i++)
    if (!((out[i] >= '0' && out[i] <= '9') ||
          (out[i] >= 'a' && out[i] <= 'f') || out[i] == '-'))
      return -EIO;
  return 0;
}

/* Entries of dirfd's directory: removes them all when there are more than
 * SHARE_MAX_FILES (data files come and go; the records of the old ones
 * are never read again). */
static void share_bound(int dirfd) {
  DIR *d = ckpt_opendir_at(dirfd);
  if (!d)
    return;
  size_t n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    n += e->d_name[0] != '.';
  if (n > SHARE_MAX_FILES) {
    rewinddir(d);
    for (struct dirent *e; (e = readdir(d)) != NULL;)
      if (e->d_name[0] != '.')
        unlinkat(dirfd, e->d_name, 0);
  }
  closedir(d);
}

int ckpt_store_known_share(const char *dir, char **why) {
  char boot[40], name[64];
  int rc = boot_id(boot);
  if (rc) {
    *why = ckpt__strdup_printf("reading the boot ID: %s", strerror(-rc));
    return rc;
  }
  int top = private_dir(AT_FDCWD, dir, dir, why);
  if (top < 0)
    return top;
  snprintf(name, sizeof(name), "verified-%s", boot);
  char *path = ckpt__strdup_printf("%s/%s", dir, name);
  int fd = path ? private_dir(top, name, path, why) : -ENOMEM;
  free(path);
  if (fd >= 0) {
    /* earlier boots' records: never read again */
    DIR *d = ckpt_opendir_at(top);
    for (struct dirent *e; d && (e = readdir(d)) != NULL;)
      if (strncmp(e->d_name, "verified-", 9) == 0 &&
          strcmp(e->d_name, name) != 0)
        ckpt__remove_tree(top, e->d_name);
    if (d)
      closedir(d);
    share_bound(fd);
  }
  close(top);
  if (fd < 0)
    return fd;
  atomic_store(&share_fd, fd);
  return 0;
}

void ckpt_store_known_unshare(void) { atomic_store(&share_fd, -1); }
