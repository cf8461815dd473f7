/*
 * jobs.c - the trainer processes of this mount, and what their exit
 * leaves behind.
 *
 * A process declares itself a job of the mount with
 * setxattr(MOUNTPOINT, "user.ckpt.job", LABEL) (the integrations do, at
 * their creation; LABEL says which job, for the log: a Slurm job, a
 * torchrun run and restart). From then on the checkpoints it creates
 * (mkdir NAME) or commits (.commit) on this mount are its saves, and the
 * daemon watches it (a pidfd). When it exits (killed, crashed, or gone
 * without a word), each of its saves that is not committed yet is
 * abandoned on this rank (save.c, ckpt__jobs_gone): a staged one is
 * discarded at once, as rm -r NAME would, its name free for the restarted
 * job; a committing one fails on every rank if some rank's plan is not
 * in yet (dist's cancel), and goes on to its commit if every rank's is.
 *
 * "user.ckpt.job" = "end" (or removexattr) says the process ends cleanly:
 * its saves are then left as they are when it exits (an async commit
 * finishes, a staged checkpoint stays staged). A process that never
 * declared itself (cp, a shell) is no job: its saves never are abandoned.
 *
 * jobs->lock is a leaf: nothing else is taken while it is held.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "commit.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434 /* the same number on every architecture */
#endif

typedef struct job_proc {
  pid_t tgid;
  int pidfd;
  bool ended;          /* said "end": its exit abandons nothing */
  char label[CKPT_JOB_LABEL_MAX];
  struct job_proc *next;
} job_proc_t;

struct ckpt_jobs {
  ckpt_fs_t *fs;
  pthread_mutex_t lock; /* protects procs (a leaf lock) */
  job_proc_t *procs;
  int wake[2];          /* the watcher's: a new process to watch, or stop */
  bool stop;            /* lock */
  pthread_t thread;
};

pid_t ckpt__tgid_of(pid_t tid) {
  char path[64], line[128];
  snprintf(path, sizeof(path), "/proc/%d/status", (int)tid);
  FILE *f = fopen(path, "re");
  if (!f)
    return -1;
  long tgid = -1;
  while (fgets(line, sizeof(line), f))
    if (sscanf(line, "Tgid: %ld", &tgid) == 1)
      break;
  fclose(f);
  return (pid_t)tgid;
}

static job_proc_t *find(ckpt_jobs_t *j, pid_t tgid) {
  for (job_proc_t *p = j->procs; p; p = p->next)
    if (p->tgid == tgid)
      return p;
  return NULL;
}

static void wake(ckpt_jobs_t *j) {
  char c = 1;
  ssize_t n = write(j->wake[1], &c, 1);
  (void)n; /* a full pipe wakes it already */
}

int ckpt__job_declare(ckpt_fs_t *fs, pid_t tid, const char *value,
                      size_t size) {
  ckpt_jobs_t *j = fs->jobs;
  if (!j)
    return -ENOTSUP;
  while (size && (value[size - 1] == '\n' || value[size - 1] == '\0'))
    size--;
  if (size >= CKPT_JOB_LABEL_MAX)
    return -ERANGE;
  for (size_t i = 0; i < size; i++)
    if ((unsigned char)value[i] < 0x20 || value[i] == 0x7f)
      return -EINVAL; /* it goes into the log as it is */
  bool end = size == 3 && memcmp(value, "end", 3) == 0;
  pid_t tgid = ckpt__tgid_of(tid);
  if (tgid <= 0)
    return -ESRCH;
  pthread_mutex_lock(&j->lock);
  job_proc_t *p = find(j, tgid);
  int rc = 0;
  if (p) {
    p->ended = end;
    if (!end) {
      memcpy(p->label, value, size);
      p->label[size] = '\0';
    }
  } else if (!end) {
    int pidfd = (int)syscall(SYS_pidfd_open, tgid, 0);
    if (pidfd < 0)
      rc = -errno;
    else if (!(p = calloc(1, sizeof(*p)))) {
      close(pidfd);
      rc = -ENOMEM;
    } else {
      p->tgid = tgid;
      p->pidfd = pidfd;
      memcpy(p->label, value, size);
      p->label[size] = '\0';
      p->next = j->procs;
      j->procs = p;
      wake(j);
    }
  }
  pthread_mutex_unlock(&j->lock);
  if (rc == 0 && !end && p)
    ckpt__log("job: process %d%s%s declared itself a job of this mount: "
              "its unfinished saves are abandoned if it exits without "
              "\"end\"", (int)tgid, size ? ": " : "", size ? p->label : "");
  else if (rc)
    ckpt__log("job: process %d: cannot watch it (%s): its saves will not be "
              "abandoned when it exits", (int)tgid, strerror(-rc));
  return rc;
}

pid_t ckpt__job_of(ckpt_fs_t *fs, pid_t tid) {
  ckpt_jobs_t *j = fs->jobs;
  if (!j)
    return 0;
  pthread_mutex_lock(&j->lock);
  bool any = j->procs != NULL;
  pthread_mutex_unlock(&j->lock);
  if (!any) /* no job declared: no /proc read on a mkdir */
    return 0;
  pid_t tgid = ckpt__tgid_of(tid);
  pthread_mutex_lock(&j->lock);
  job_proc_t *p = tgid > 0 ? find(j, tgid) : NULL;
  pid_t out = p && !p->ended ? tgid : 0;
  pthread_mutex_unlock(&j->lock);
  return out;
}

bool ckpt__job_label(ckpt_fs_t *fs, pid_t tgid, char *buf, size_t size) {
  ckpt_jobs_t *j = fs->jobs;
  if (!j || tgid <= 0)
    return false;
  pthread_mutex_lock(&j->lock);
  job_proc_t *p = find(j, tgid);
  if (p)
    snprintf(buf, size, "%s", p->label);
  pthread_mutex_unlock(&j->lock);
  return p != NULL;
}

/* The watcher: a process of the list exits -> its saves, unless it said
 * "end". */
static void *watch(void *arg) {
  ckpt_jobs_t *j = arg;
  pthread_setname_np(pthread_self(), "ckptfs-jobs");
  for (;;) {
    pthread_mutex_lock(&j->lock);
    if (j->stop) {
      pthread_mutex_unlock(&j->lock);
      return NULL;
    }
    size_t n = 1;
    for (job_proc_t *p = j->procs; p; p = p->next)
      n++;
    struct pollfd *fds = calloc(n, sizeof(*fds));
    pid_t *tgids = calloc(n, sizeof(*tgids));
    size_t k = 1;
    if (fds && tgids) {
      fds[0] = (struct pollfd){.fd = j->wake[0], .events = POLLIN};
      for (job_proc_t *p = j->procs; p; p = p->next, k++) {
        fds[k] = (struct pollfd){.fd = p->pidfd, .events = POLLIN};
        tgids[k] = p->tgid;
      }
    }
    pthread_mutex_unlock(&j->lock);
    if (!fds || !tgids) {
      free(fds);
      free(tgids);
      sleep(1);
      continue;
    }
    int r = poll(fds, k, -1);
    if (r > 0 && (fds[0].revents & POLLIN)) {
      char buf[64];
      ssize_t got = read(j->wake[0], buf, sizeof(buf));
      (void)got;
    }
    for (size_t i = 1; r > 0 && i < k; i++) {
      if (!fds[i].revents)
        continue;
      /* exited: off the list; its saves, unless it ended cleanly */
      pthread_mutex_lock(&j->lock);
      job_proc_t **pp = &j->procs, *p;
      while ((p = *pp) && p->tgid != tgids[i])
        pp = &p->next;
      if (p)
        *pp = p->next;
      pthread_mutex_unlock(&j->lock);
      if (!p)
        continue;
      if (!p->ended)
        ckpt__jobs_gone(j->fs, p->tgid, p->label);
      close(p->pidfd);
      free(p);
    }
    free(fds);
    free(tgids);
  }
}

int ckpt__jobs_start(ckpt_fs_t *fs) {
  ckpt_jobs_t *j = calloc(1, sizeof(*j));
  if (!j)
    return -ENOMEM;
  j->fs = fs;
  pthread_mutex_init(&j->lock, NULL);
  if (pipe2(j->wake, O_CLOEXEC | O_NONBLOCK)) {
    int e = errno;
    pthread_mutex_destroy(&j->lock);
    free(j);
    return -e;
  }
  int rc = pthread_create(&j->thread, NULL, watch, j);
  if (rc) {
    close(j->wake[0]);
    close(j->wake[1]);
    pthread_mutex_destroy(&j->lock);
    free(j);
    return -rc;
  }
  fs->jobs = j;
  return 0;
}

void ckpt__jobs_stop(ckpt_fs_t *fs) {
  ckpt_jobs_t *j = fs->jobs;
  if (!j)
    return;
  pthread_mutex_lock(&j->lock);
  j->stop = true;
  pthread_mutex_unlock(&j->lock);
  wake(j);
  pthread_join(j->thread, NULL);
  fs->jobs = NULL;
  while (j->procs) {
    job_proc_t *p = j->procs;
    j->procs = p->next;
    close(p->pidfd);
    free(p);
  }
  close(j->wake[0]);
  close(j->wake[1]);
  pthread_mutex_destroy(&j->lock);
  free(j);
}
