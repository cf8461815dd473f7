/*
 * publish.c - the flush's publish of a tier's save on BACKING_DIR by
 * compare-and-swap (fs/read/resolve.c states the rule): NAME is exchanged with
 * the save only while it is one of the saves the save's commit replaced
 * (its .metadata's "replaces" and commit_ns).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "store.h"
#include "store_int.h"

bool ckpt_store_replaces_has(const char *replaces, const char *key) {
  const char *want = key[0] ? key : "none";
  size_t n = strlen(want);
  for (const char *p = replaces; p && *p;) {
    while (*p == ' ')
      p++;
    size_t len = strcspn(p, " ");
    if (len == n && !strncmp(p, want, n))
      return true;
    p += len;
  }
  return false;
}

bool ckpt_store_replaces_ok(const char *replaces, int64_t commit_ns,
                            const char *now, int64_t now_ns) {
  return ckpt_store_replaces_has(replaces, now) ||
         (now[0] && now_ns > 0 && now_ns < commit_ns &&
          ckpt_store_replaces_has(replaces, "earlier"));
}

int ckpt_store_publish_if(int backing_fd, const char *save_id,
                          const char *name, const char *replaces,
                          int64_t commit_ns, bool *replaced,
                          char now[CKPT_SAVE_ID_LEN + 1]) {
  *replaced = false;
  now[0] = '\0';
  if (!ckpt_save_id_valid(save_id) || !ckpt_name_valid(name))
    return -EINVAL;
  for (int attempt = 0; attempt < 100; attempt++) {
    int nfd = ckpt_store_open_dir(backing_fd, name, O_RDONLY);
    if (nfd == -ENOENT) {
      if (!ckpt_store_replaces_has(replaces, ""))
        return -ESTALE; /* removed after this save's commit */
      int rc = ckpt_store_publish(backing_fd, save_id, name);
      if (rc != -EEXIST)
        return rc;
      continue; /* committed meanwhile: look at that one */
    }
    if (nfd < 0)
      return nfd == -ENOTDIR || nfd == -ELOOP ? -EEXIST : nfd;
    flock(nfd, LOCK_EX);
    /* a removal inside may have exchanged a new version in meanwhile */
    struct stat held, named;
    if (fstat(nfd, &held) || fstatat(backing_fd, name, &named,
                                     AT_SYMLINK_NOFOLLOW) ||
        held.st_dev != named.st_dev || held.st_ino != named.st_ino) {
      close(nfd);
      continue;
    }
    int64_t now_ns = 0;
    int rc = ckpt_store_save_look(nfd, now, NULL, &now_ns);
    if (rc == -ENOENT && attempt < 99) { /* no .metadata: being removed */
      close(nfd);
      struct timespec ts = {0, 10 * 1000 * 1000};
      nanosleep(&ts, NULL);
      continue;
    }
    if (rc == -ENOENT) {
      /* still none a second later: a removal that stopped half-way (the
       * next mount's cleanup finishes it), no checkpoint; removed after
       * this save's commit unless it replaced none: then it takes the
       * place of the remains (removed with the replaced version) */
      now[0] = '\0';
      rc = ckpt_store_replaces_has(replaces, "") ? 0 : -ESTALE;
      if (rc) {
        close(nfd);
        return rc;
      }
    }
    if (rc) {
      close(nfd);
      return rc;
    }
    if (!strcmp(now, save_id)) { /* published already */
      close(nfd);
      return 0;
    }
    if (!ckpt_store_replaces_ok(replaces, commit_ns, now, now_ns)) {
      close(nfd);
      return -ESTALE;
    }
    int sfd = ckpt_open_beneath(backing_fd, CKPT_SAVES_DIR,
                                O_RDONLY | O_DIRECTORY, 0);
    rc = sfd < 0 ? sfd
                 : renameat2(sfd, save_id, backing_fd, name, RENAME_EXCHANGE)
                       ? -errno
                       : 0;
    if (sfd >= 0)
      close(sfd);
    close(nfd);
    if (rc == -EINVAL || rc == -ENOSYS || rc == -ENOTSUP)
      return -EOPNOTSUPP;
    if (rc == -ENOENT)
      continue; /* removed meanwhile */
    if (rc == 0)
      *replaced = true;
    return rc;
  }
  return -EAGAIN;
}

