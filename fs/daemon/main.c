/*
 * main.c - the ckptfs daemon: one rank mount.
 *
 *   ckptfs [-f] [-o OPT[,OPT...]] BACKING_DIR MOUNTPOINT
 *
 * Start-up: options (exit 2 when malformed, nothing mounted) -> the world
 * (dist) -> BACKING_DIR (cleanup of unfinished saves, committed
 * checkpoints loaded) -> mount -> daemonize (world of one, no -f) -> the
 * worker threads -> the multithreaded FUSE loop. On fusermount3 -u the
 * loop ends; queued saves run to their end, then the process exits 0. On
 * SIGTERM, SIGINT or SIGHUP the saves in flight finish first while the
 * mount keeps serving, so that a writer of a sync commit gets its real
 * outcome and can close .commit; then the mount goes and the process
 * exits 0.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <dlfcn.h>
#include <stdatomic.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <inttypes.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "failpoint.h"
#include "daemon.h"

#define EXIT_USAGE 2

/* MOUNTPOINT (or the log file) with every %r replaced by the rank. */
static char *expand_mountpoint(const char *tmpl, int rank) {
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  for (const char *p = tmpl; *p; p++) {
    if (p[0] == '%' && p[1] == 'r') {
      ckpt_buf_printf(&b, "%d", rank);
      p++;
    } else {
      ckpt_buf_append(&b, p, 1);
    }
  }
  return ckpt_buf_steal(&b);
}

/* BACKING_DIR as an absolute path, whether or not it exists yet. */
static char *absolute_backing(const char *dir) {
  char *abs = realpath(dir, NULL);
  if (abs)
    return abs;
  /* not there yet: its parent resolved (as realpath will give it once it
   * is made), then its last component */
  char *copy = strdup(dir);
  if (!copy)
    return NULL;
  size_t n = strlen(copy);
  while (n > 1 && copy[n - 1] == '/')
    copy[--n] = '\0';
  char *slash = strrchr(copy, '/');
  const char *base = slash ? slash + 1 : copy;
  char *parent = slash ? (slash == copy ? strdup("/") : (*slash = '\0', realpath(copy, NULL)))
                       : getcwd(NULL, 0);
  char *out = NULL;
  if (parent)
    out = ckpt__strdup_printf("%s%s%s", parent,
                              parent[strlen(parent) - 1] == '/' ? "" : "/",
                              base);
  else if (dir[0] == '/')
    out = strdup(dir);
  free(parent);
  free(copy);
  return out;
}

/* Open BACKING_DIR, creating it (not its parents: a typo in the path is
 * then an error, not an empty store) when it is missing; *created says
 * so. */
static int open_backing(ckpt_fs_t *fs, bool *created) {
  const char *dir = fs->opts.backing_dir;
  *created = false;
  if (mkdir(dir, 0700) == 0) {
    *created = true;
    ckpt__log("created BACKING_DIR %s (it did not exist)", dir);
  } else if (errno != EEXIST) {
    fprintf(stderr, "ckptfs: cannot create BACKING_DIR %s: %s%s\n", dir,
            strerror(errno),
            errno == ENOENT ? " (its parent directory does not exist)" : "");
    return -1;
  }
  fs->backing_path = realpath(dir, NULL);
  fs->backing_fd = fs->backing_path
                       ? open(fs->backing_path,
                              O_RDONLY | O_DIRECTORY | O_CLOEXEC)
                       : -1;
  if (fs->backing_fd < 0) {
    fprintf(stderr, "ckptfs: cannot open BACKING_DIR %s: %s\n", dir,
            strerror(errno));
    return -1;
  }
  return 0;
}

/* The filesystem of BACKING_DIR (or, not made yet, of its parent). */
static int backing_dev(const char *abs_backing, dev_t *dev) {
  struct stat st;
  if (stat(abs_backing, &st) == 0) {
    *dev = st.st_dev;
    return 0;
  }
  char *parent = strdup(abs_backing);
  char *slash = parent ? strrchr(parent, '/') : NULL;
  if (slash == parent)
    slash[1] = '\0'; /* "/" */
  else if (slash)
    *slash = '\0';
  int rc = slash && stat(parent, &st) == 0 ? 0 : -1;
  free(parent);
  if (rc == 0)
    *dev = st.st_dev;
  return rc;
}

/* The world a mount of a tier belongs to: its BACKING_DIR, world size and
 * the launcher's job (PMIx namespace; "" without one). Every rank of one
 * world on a node says the same; another world (a second job, another
 * BACKING_DIR) does not. */
static char *world_id(const ckpt_fs_t *fs, const char *backing) {
  const char *job = getenv("PMIX_NAMESPACE");
  if (!job)
    job = getenv("OMPI_MCA_ess_base_jobid");
  return ckpt__strdup_printf("backing %s\nworld %d\njob %s\n", backing,
                             fs->world_size, job ? job : "");
}

/* TIER/.world says which world mounts the tier (several ranks of a node
 * do). Written by a rank that holds the tier alone (exclusive flock). */
#define TIER_WORLD ".world"

static int write_world(int tier_fd, const char *id) {
  int fd = openat(tier_fd, TIER_WORLD ".tmp",
                  O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  int rc = fd < 0 ? -errno : 0;
  if (rc == 0 && write(fd, id, strlen(id)) != (ssize_t)strlen(id))
    rc = -EIO;
  if (rc == 0 && fsync(fd))
    rc = -errno;
  if (fd >= 0)
    close(fd);
  if (rc == 0 && renameat(tier_fd, TIER_WORLD ".tmp", tier_fd, TIER_WORLD))
    rc = -errno;
  return rc;
}

static bool same_world(int tier_fd, const char *id) {
  char buf[PATH_MAX + 600];
  int fd = openat(tier_fd, TIER_WORLD, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  ssize_t n = fd < 0 ? -1 : read(fd, buf, sizeof(buf) - 1);
  if (fd >= 0)
    close(fd);
  if (n < 0)
    return false;
  buf[n] = '\0';
  return !strcmp(buf, id);
}

/* One world per tier, held while the mount runs (let go at a crash):
 * another world's flush records are not this one's to resume or drop.
 * A world of one rank holds the tier exclusively (flock), as before; the
 * ranks of a larger world that share a node hold it shared, and the
 * first of them (alone: exclusive for a moment) writes TIER/.world, which
 * the others must match. 0, or a message on stderr and -1. */
static int lock_tier(ckpt_fs_t *fs, const char *dir, const char *backing) {
  if (fs->world_size <= 1) {
    if (flock(fs->tier_fd, LOCK_EX | LOCK_NB) == 0)
      return 0;
    if (errno == EWOULDBLOCK)
      fprintf(stderr, "ckptfs: tier=%s is in use by another mount\n", dir);
    else
      fprintf(stderr, "ckptfs: tier=%s: cannot lock it: %s\n", dir,
              strerror(errno));
    return -1;
  }
  char *id = world_id(fs, backing);
  if (!id)
    return -1;
  int rc = -1, i;
  /* A rank of this world holds it exclusively only while it writes
   * .world: wait for that, up to 10 s. */
  for (i = 0; i < 1000; i++) {
    if (flock(fs->tier_fd, LOCK_EX | LOCK_NB) == 0) {
      int w = write_world(fs->tier_fd, id);
      if (w)
        fprintf(stderr, "ckptfs: tier=%s: writing %s: %s\n", dir,
                TIER_WORLD, strerror(-w));
      /* not atomic: a mount of one rank may take it in between (refused) */
      if (w == 0 && flock(fs->tier_fd, LOCK_SH | LOCK_NB) == 0)
        rc = 0;
      else if (w == 0)
        fprintf(stderr, "ckptfs: tier=%s is in use by another mount\n",
                dir);
      break;
    }
    if (errno != EWOULDBLOCK) {
      fprintf(stderr, "ckptfs: tier=%s: cannot lock it: %s\n", dir,
              strerror(errno));
      break;
    }
    if (flock(fs->tier_fd, LOCK_SH | LOCK_NB) == 0) {
      if (same_world(fs->tier_fd, id)) {
        rc = 0;
        break;
      }
      flock(fs->tier_fd, LOCK_UN);
      fprintf(stderr, "ckptfs: tier=%s is in use by another world (another "
              "job, world size or BACKING_DIR: %s/%s): a tier serves one "
              "world at a time\n", dir, fs->tier_path, TIER_WORLD);
      break;
    }
    usleep(10000);
  }
  if (i == 1000)
    fprintf(stderr, "ckptfs: tier=%s is in use by another mount (of one "
            "rank)\n", dir);
  free(id);
  return rc;
}

/* -o tier=DIR: an existing directory on another filesystem than
 * BACKING_DIR (a tier on the shared store would only copy each checkpoint
 * twice), used by no other world (every rank of a node mounts the same
 * tier) and holding no checkpoint unflushed to another BACKING_DIR.
 * Opened into fs, or a message on stderr and -1 (the mount is refused,
 * exit 2). */
static int open_tier(ckpt_fs_t *fs, const char *abs_backing) {
  const char *dir = fs->opts.tier_dir;
  struct stat st;
  dev_t bdev;
  if (abs_backing && strchr(abs_backing, '\n')) {
    fprintf(stderr, "ckptfs: tier=%s: BACKING_DIR's path has a newline, "
            "which the tier's flush records cannot hold\n", dir);
    return -1;
  }
  if (stat(dir, &st)) {
    fprintf(stderr, "ckptfs: tier=%s: %s (the tier directory must exist)\n",
            dir, strerror(errno));
    return -1;
  }
  if (!S_ISDIR(st.st_mode)) {
    fprintf(stderr, "ckptfs: tier=%s: not a directory\n", dir);
    return -1;
  }
  if (abs_backing && backing_dev(abs_backing, &bdev) == 0 &&
      bdev == st.st_dev) {
    fprintf(stderr, "ckptfs: tier=%s is on the same filesystem as "
            "BACKING_DIR %s: the tier must be node-local storage of its own "
            "(tmpfs, NVMe)\n", dir, abs_backing);
    return -1;
  }
  fs->tier_path = realpath(dir, NULL);
  fs->tier_fd = fs->tier_path ? open(fs->tier_path,
                                     O_RDONLY | O_DIRECTORY | O_CLOEXEC)
                              : -1;
  if (fs->tier_fd < 0) {
    fprintf(stderr, "ckptfs: cannot open tier=%s: %s\n", dir,
            strerror(errno));
    return -1;
  }
  /* Everything in the tier is served and flushed to BACKING_DIR on its
   * own word (checkpoints, flush records): no other user may write it. */
  char *err = NULL;
  if (ckpt_store_check_private(fs->tier_fd, fs->tier_path, true, &err)) {
    fprintf(stderr,
            "ckptfs: tier=%s is not private to the daemon's user (uid %u): "
            "%s. Another user could plant checkpoints or flush records "
            "there, which the mount would serve and publish to BACKING_DIR. "
            "Make the tier the daemon user's alone, e.g. `mount -t tmpfs -o "
            "mode=0700 tmpfs %s`, or `chown %u %s && chmod 0700 %s` and "
            "remove what other users put there\n",
            dir, (unsigned)geteuid(), err ? err : "cannot check it",
            fs->tier_path, (unsigned)geteuid(), fs->tier_path,
            fs->tier_path);
    free(err);
    return -1;
  }
  char *real = abs_backing ? realpath(abs_backing, NULL) : NULL;
  const char *backing = real ? real : abs_backing ? abs_backing : "";
  int rc = lock_tier(fs, dir, backing);
  if (rc == 0 && (rc = ckpt__flush_check(fs, backing, &err)) != 0)
    fprintf(stderr, "ckptfs: %s\n", err);
  free(err);
  free(real);
  return rc ? -1 : 0;
}

/* The tier's records first (they say which unfinished saves to keep),
 * then both roots' cleanup. */
static void cleanup_roots(ckpt_fs_t *fs) {
  if (fs->tier_fd < 0) {
    ckpt_store_cleanup(fs->backing_fd, -1);
    return;
  }
  ckpt__flush_recover(fs);
  int keep = ckpt_open_beneath(fs->tier_fd, CKPT_FLUSH_DIR,
                               O_RDONLY | O_DIRECTORY, 0);
  ckpt_store_cleanup(fs->tier_fd, keep);
  ckpt_store_cleanup(fs->backing_fd, keep);
  if (keep >= 0)
    close(keep);
}

typedef struct {
  char *mountpoint;
  uint64_t readahead;
} readahead_job_t;

/* FUSE mounts start with the kernel's 128 KiB readahead (the INIT reply
 * can only lower it): a sequential load then costs one 128 KiB request per
 * step. Raise it in the mount's bdi once INIT is done, which the stat of
 * the mountpoint waits for (it needs the loop running, so this runs on a
 * thread of its own). Root only; otherwise the kernel's value stays. */
static void *raise_readahead(void *arg) {
  readahead_job_t *job = arg;
  struct stat st;
  if (stat(job->mountpoint, &st) == 0) {
    char path[96];
    snprintf(path, sizeof(path), "/sys/class/bdi/%u:%u/read_ahead_kb",
             major(st.st_dev), minor(st.st_dev));
    FILE *f = fopen(path, "w");
    if (f) {
      fprintf(f, "%" PRIu64 "\n", job->readahead >> 10);
      fclose(f);
    }
  }
  free(job->mountpoint);
  free(job);
  return NULL;
}

static void start_readahead_tuning(const char *mountpoint, uint64_t bytes) {
  readahead_job_t *job = malloc(sizeof(*job));
  pthread_t t;
  if (!job || bytes == 0 || !(job->mountpoint = strdup(mountpoint))) {
    free(job);
    return;
  }
  job->readahead = bytes;
  if (pthread_create(&t, NULL, raise_readahead, job)) {
    free(job->mountpoint);
    free(job);
    return;
  }
  pthread_detach(t);
}

/* ------------------------------------------------------------------------
 * Stopping on a signal. libfuse's handlers end the loop at once: a sync
 * commit's writer then loses its reply or its close(2) (ENOTCONN,
 * ECONNABORTED) although the save goes on. Here the stopper thread takes
 * the signal (sigwait), stops the saves (the queued ones finish, no new
 * one starts) while the loop keeps serving, waits a moment for .commit
 * files to be closed, and only then ends the loop. A signal that comes
 * while the daemon starts waits until it serves (then it stops at once).
 * ---------------------------------------------------------------------- */

#define STOP_CLOSE_GRACE 10.0 /* seconds for writers to close .commit */

/* SIGTERM, SIGINT and SIGHUP are blocked in every thread (from the start
 * of main, so every thread inherits it): no system call of a save is
 * interrupted by one, and the stopper takes them with sigwait. */
static sigset_t stop_set;

static void on_wake_signal(int sig) { (void)sig; } /* interrupts a wait */

typedef struct {
  ckpt_fs_t *fs;
  pthread_t main_thread; /* runs the FUSE loop */
  atomic_bool loop_done; /* the loop has returned */
  pthread_t thread;
  bool running;
} stopper_t;

static void *stopper_main(void *arg) {
  stopper_t *st = arg;
  ckpt_fs_t *fs = st->fs;
  int sig = 0;
  while (sigwait(&stop_set, &sig) != 0)
    ;
  if (atomic_load(&st->loop_done))
    return NULL; /* the loop ended by itself (stopper_join's wake-up) */
  ckpt__log("signal %d: stopping once the saves in flight are done", sig);
  ckpt_dist_stop(fs->dist);
  double end = ckpt__mono_now() + STOP_CLOSE_GRACE;
  for (;;) {
    pthread_mutex_lock(&fs->lock);
    uint32_t open = fs->commit_handles;
    pthread_mutex_unlock(&fs->lock);
    if (open == 0 || ckpt__mono_now() >= end || atomic_load(&st->loop_done))
      break;
    struct timespec ts = {0, 10000000L};
    nanosleep(&ts, NULL);
  }
  fuse_session_exit(fs->se);
  /* The loop's thread waits on a semaphore: interrupt it until it sees
   * the exit (a signal just before its wait would be lost). */
  while (!atomic_load(&st->loop_done)) {
    pthread_kill(st->main_thread, SIGUSR2);
    struct timespec ts = {0, 20000000L};
    nanosleep(&ts, NULL);
  }
  return NULL;
}

/* First thing in main: block the stop signals for every thread to come. */
static void stop_signals_block(void) {
  sigemptyset(&stop_set);
  sigaddset(&stop_set, SIGTERM);
  sigaddset(&stop_set, SIGINT);
  sigaddset(&stop_set, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop_set, NULL);
}

static int stop_signals_set(void) {
  struct sigaction sa = {0};
  sigemptyset(&sa.sa_mask);
  sa.sa_handler = on_wake_signal; /* no SA_RESTART: the wait returns */
  if (sigaction(SIGUSR2, &sa, NULL))
    return -1;
  sa.sa_handler = SIG_IGN;
  /* SIGIO: a lease break (staging.c's read leases, held for an instant)
   * must not end the daemon */
  if (sigaction(SIGIO, &sa, NULL))
    return -1;
  return sigaction(SIGPIPE, &sa, NULL);
}

static int stopper_start(stopper_t *st, ckpt_fs_t *fs) {
  st->fs = fs;
  st->main_thread = pthread_self();
  atomic_store(&st->loop_done, false);
  if (pthread_create(&st->thread, NULL, stopper_main, st))
    return -1;
  st->running = true;
  return 0;
}

/* The loop returned: let the stopper go (it may still be stopping). */
static void stopper_join(stopper_t *st) {
  if (!st->running)
    return;
  atomic_store(&st->loop_done, true);
  pthread_kill(st->thread, SIGHUP); /* ends its sigwait if it is there */
  pthread_join(st->thread, NULL);
  st->running = false;
}

/* -o metrics=FILE for this rank: %r replaced, absolute (the daemon works
 * in / once daemonized), in a directory that exists and can be written
 * (FILE.tmp.PID.RANDOM is made there). NULL with a message on stderr. */
static char *metrics_path(const char *tmpl, int rank) {
  char *expanded = expand_mountpoint(tmpl, rank);
  char *path = expanded ? absolute_backing(expanded) : NULL;
  free(expanded);
  if (!path) {
    fprintf(stderr, "ckptfs: invalid metrics '%s': %s\n", tmpl,
            strerror(errno ? errno : ENOMEM));
    return NULL;
  }
  char *slash = strrchr(path, '/');
  char *dir = slash == path ? strdup("/")
                            : ckpt__strdup_printf("%.*s", (int)(slash - path),
                                                  path);
  struct stat st;
  const char *why = NULL;
  if (!dir)
    why = strerror(ENOMEM);
  else if (stat(dir, &st))
    why = strerror(errno);
  else if (!S_ISDIR(st.st_mode))
    why = "not a directory";
  else if (access(dir, W_OK | X_OK))
    why = strerror(errno);
  if (why) {
    fprintf(stderr, "ckptfs: invalid metrics '%s': its directory %s: %s\n",
            tmpl, dir ? dir : "", why);
    free(path);
    path = NULL;
  }
  free(dir);
  return path;
}

/* MOUNTPOINT must be a directory (FUSE would also mount over a file);
 * say what to do when it is not. */
static int check_mountpoint(const char *mp) {
  struct stat st;
  if (stat(mp, &st) == 0) {
    if (S_ISDIR(st.st_mode))
      return 0;
    fprintf(stderr, "ckptfs: MOUNTPOINT %s is not a directory\n", mp);
  } else if (errno == ENOENT) {
    fprintf(stderr,
            "ckptfs: MOUNTPOINT %s does not exist: create it (mkdir -p %s)\n",
            mp, mp);
  } else if (errno == ENOTCONN) {
    fprintf(stderr,
            "ckptfs: MOUNTPOINT %s is a dead FUSE mount (its daemon died): "
            "unmount it first (fusermount3 -u %s)\n",
            mp, mp);
  } else {
    fprintf(stderr, "ckptfs: MOUNTPOINT %s: %s\n", mp, strerror(errno));
  }
  return -1;
}

/* The mount shows as type fuse.ckptfs with BACKING_DIR as its source
 * (mountinfo, findmnt, df, systemd), like an fstab line names it. Inserted
 * first, so a user's own -o fsname= or subtype= wins. */
static int name_mount(struct fuse_args *args, const char *backing) {
  ckpt_buf_t b;
  ckpt_buf_init(&b);
  ckpt_buf_printf(&b, "-osubtype=ckptfs,fsname=");
  for (const char *p = backing; *p; p++) {
    if (*p == ',' || *p == '\\')
      ckpt_buf_append(&b, "\\", 1); /* fuse_opt's escape */
    ckpt_buf_append(&b, p, 1);
  }
  char *opt = ckpt_buf_steal(&b);
  int rc = opt ? fuse_opt_insert_arg(args, 1, opt) : -1;
  free(opt);
  return rc;
}

/* Open files up to the hard limit: a save holds data files, streams and
 * SQLite's files at once, passthrough a backing file per staged file (half the
 * limit at most), and the usual soft limit of 1024 is soon spent. */
static void raise_fd_limit(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) || rl.rlim_cur == rl.rlim_max)
    return;
  rlim_t was = rl.rlim_cur;
  rl.rlim_cur = rl.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &rl) == 0)
    ckpt__log("raised the limit of open files from %llu to %llu (the hard "
              "limit)", (unsigned long long)was,
              (unsigned long long)rl.rlim_max);
}

/* libfuse ends its worker threads with pthread_cancel, for which glibc
 * loads libgcc_s at the first use: with every descriptor taken by then
 * that fails and aborts the daemon before in-flight saves finish. Loaded
 * now, it is found in memory then. */
static void preload_unwinder(void) {
  if (!dlopen("libgcc_s.so.1", RTLD_NOW | RTLD_NODELETE))
    ckpt__log("cannot load libgcc_s.so.1 (%s): the unmount may fail when "
              "no descriptor is left", dlerror());
}

/* The daemon's state across main's steps. */
typedef struct {
  ckpt_fs_t fs;
  struct fuse_args args;
  char *mountpoint;              /* absolute, %r replaced */
  struct fuse_session *se;
  struct fuse_loop_config *loop;
  stopper_t stopper;
  char *metrics_file;            /* -o metrics, %r replaced, or NULL */
  ckpt_metrics_writer_t *metrics;
  bool mounted;
} daemon_t;

/* The command line: -1 to go on, else the exit status (--help, --version,
 * a bad option). */
static int parse_command_line(daemon_t *d) {
  char *err = NULL;
  if (ckpt__opts_parse(&d->args, &d->fs.opts, &err)) {
    fprintf(stderr, "ckptfs: %s\n", err);
    fprintf(stderr, "Try 'ckptfs --help' for the options.\n");
    free(err);
    return EXIT_USAGE;
  }
  if (!d->fs.opts.show_help && !d->fs.opts.show_version)
    return -1;
  if (d->fs.opts.show_help)
    ckpt__opts_help();
  else
    printf("ckptfs %s (FUSE %s)\n", CKPT_VERSION, fuse_pkgversion());
  return EXIT_SUCCESS;
}

/* -o log=FILE opened: 0, or -1 said on stderr. */
static int open_log(daemon_t *d) {
  ckpt_fs_t *fs = &d->fs;
  char *path = expand_mountpoint(fs->opts.log_file, fs->rank);
  int lrc = path ? ckpt__log_to(path, false, fs->rank) : -ENOMEM;
  if (lrc)
    fprintf(stderr, "ckptfs: cannot open the log %s: %s%s\n",
            path ? path : fs->opts.log_file, strerror(-lrc),
            lrc == -EPERM  ? " (it belongs to another user: never "
                             "written by the daemon)"
            : lrc == -ELOOP ? " (a symbolic link: never followed)"
            : lrc == -EINVAL ? " (not a regular file)"
                             : "");
  free(path);
  return lrc ? -1 : 0;
}

/* The world (MPI), failpoints, the log, the metrics file's and the
 * mountpoint's names: 0, or the exit status. */
static int join_world(daemon_t *d) {
  ckpt_fs_t *fs = &d->fs;
  char *err = NULL;
  if (ckpt_dist_init(&fs->dist, &err)) {
    fprintf(stderr, "ckptfs: %s\n", err);
    free(err);
    return EXIT_FAILURE;
  }
  fs->rank = ckpt_dist_rank(fs->dist);
  fs->world_size = ckpt_dist_size(fs->dist);
  const char *why = NULL;
  if (ckpt_failpoint_setup(fs->rank, &why)) {
    fprintf(stderr, "ckptfs: %s\n", why);
    return EXIT_FAILURE;
  }
  if (fs->opts.log_file && open_log(d))
    return EXIT_FAILURE;
  if (fs->world_size > 1)
    ckpt__log("rank %d of %d, node %d of %d", fs->rank, fs->world_size,
              ckpt_dist_node_of(fs->dist, fs->rank),
              ckpt_dist_nodes(fs->dist));
  if (fs->opts.metrics_file &&
      !(d->metrics_file = metrics_path(fs->opts.metrics_file, fs->rank))) {
    fprintf(stderr, "Try 'ckptfs --help' for the options.\n");
    return EXIT_USAGE;
  }
  raise_fd_limit();
  preload_unwinder();
  d->mountpoint = expand_mountpoint(fs->opts.mountpoint, fs->rank);
  if (d->mountpoint) {
    /* Absolute, like other FUSE filesystems: a daemon works in / and
     * unmounts by this path at exit. */
    char *abs = realpath(d->mountpoint, NULL);
    if (abs) {
      free(d->mountpoint);
      d->mountpoint = abs;
    }
  }
  if (!d->mountpoint || !(fs->mount_path = strdup(d->mountpoint)))
    return EXIT_FAILURE;
  return 0;
}

/* With verify: share the chunks this node's daemons checked (-o
 * verify_shared=DIR; by default /run/ckptfs as root, else
 * $XDG_RUNTIME_DIR/ckptfs). 0, or -1 said on stderr: a DIR given that
 * cannot be (the default only logs why and goes without). */
static int share_verified(ckpt_fs_t *fs) {
  const char *dir = fs->opts.verify_shared;
  if (!fs->opts.verify || (dir && !strcmp(dir, "none")))
    return 0;
  char *own = NULL;
  const char *xdg = getenv("XDG_RUNTIME_DIR");
  if (!dir && geteuid() == 0)
    dir = "/run/ckptfs";
  else if (!dir && xdg && xdg[0] == '/')
    dir = own = ckpt__strdup_printf("%s/ckptfs", xdg);
  char *why = NULL;
  int rc = dir ? ckpt_store_known_share(dir, &why) : 0;
  if (rc && fs->opts.verify_shared)
    fprintf(stderr, "ckptfs: verify_shared=%s: %s\n", dir,
            why ? why : strerror(-rc));
  else if (rc)
    ckpt__log("verified chunks not shared with this node's other mounts "
              "(%s): each chunk is hashed once per mount", why ? why : strerror(-rc));
  free(why);
  free(own);
  return rc && fs->opts.verify_shared ? -1 : 0;
}

/* Everything that can refuse the mount comes before BACKING_DIR is
 * touched, so that a refused mount leaves nothing behind: the tier, the
 * verified chunks' shared directory, the session and its options, the
 * mountpoint. 0, or the exit status. */
static int new_session(daemon_t *d) {
  ckpt_fs_t *fs = &d->fs;
  char max_read[32];
  snprintf(max_read, sizeof(max_read), "-omax_read=%u",
           (unsigned)CKPT_MAX_READ);
  char *abs_backing = absolute_backing(fs->opts.backing_dir);
  if (!fs->opts.tier_dir && fs->opts.flush_rate)
    fprintf(stderr, "ckptfs: flush_rate= without tier=: nothing is flushed, "
            "the option has no effect\n");
  if (fs->opts.tier_dir && open_tier(fs, abs_backing)) {
    free(abs_backing);
    return EXIT_USAGE;
  }
  if (share_verified(fs)) {
    free(abs_backing);
    return EXIT_USAGE;
  }
  int named = abs_backing ? name_mount(&d->args, abs_backing) : -1;
  free(abs_backing);
  if (named || fuse_opt_add_arg(&d->args, max_read))
    return EXIT_FAILURE;
  d->se = fuse_session_new(&d->args, &ckpt__fuse_ops, sizeof(ckpt__fuse_ops),
                           fs);
  if (!d->se) {
    /* libfuse said which option it did not know */
    fprintf(stderr, "Try 'ckptfs --help' for the options.\n");
    return EXIT_USAGE;
  }
  if (check_mountpoint(d->mountpoint)) {
    fprintf(stderr, "ckptfs: cannot mount %s\n", d->mountpoint);
    return EXIT_FAILURE;
  }
  return 0;
}

/* BACKING_DIR opened (created if missing), the tree loaded from it, the
 * signal handlers set, the mount made, the daemon in the background:
 * 0, or -1. */
static int mount_backing(daemon_t *d) {
  ckpt_fs_t *fs = &d->fs;
  bool created = false;
  if (open_backing(fs, &created) ||
      (fs->commit_fd = fs->tier_fd >= 0 ? fs->tier_fd : fs->backing_fd,
       fs->commit_path = fs->tier_path ? fs->tier_path : fs->backing_path,
       ckpt__fs_init(fs))) {
    if (created && fs->backing_path)
      rmdir(fs->backing_path);
    return -1;
  }
  cleanup_roots(fs);
  ckpt__fs_load(fs);
  fs->se = d->se;
  if (stop_signals_set()) {
    fprintf(stderr, "ckptfs: cannot set signal handlers: %s\n",
            strerror(errno));
    return -1;
  }
  if (fuse_session_mount(d->se, d->mountpoint)) {
    fprintf(stderr, "ckptfs: cannot mount %s\n", d->mountpoint);
    if (created)
      rmdir(fs->backing_path); /* only if still empty */
    return -1;
  }
  d->mounted = true;
  if (!fs->opts.foreground && !ckpt_dist_launched(fs->dist)) {
    if (fuse_daemonize(0))
      return -1;
    /* stderr is /dev/null now: without -o log, the log goes to syslog */
    if (!fs->opts.log_file)
      ckpt__log_to(NULL, true, -1);
  }
  return 0;
}

/* Threads only after daemonizing (fork keeps none), then the FUSE loop
 * until unmount or a stop signal: the exit status. */
static int serve(daemon_t *d) {
  ckpt_fs_t *fs = &d->fs;
  if (ckpt__pool_new(fs->opts.io_threads, &fs->pool) ||
      ckpt_dist_start(fs->dist, &ckpt__save_ops, fs, fs->opts.commit_timeout) ||
      stopper_start(&d->stopper, fs) ||
      (fs->opts.passthrough && ckpt__drain_start(fs, &fs->drain)) ||
      (fs->tier_fd >= 0 && ckpt__flush_start(fs, &fs->flush)) ||
      ckpt__metrics_start(fs, d->metrics_file, &d->metrics) ||
      ckpt__jobs_start(fs)) {
    fprintf(stderr, "ckptfs: cannot start threads\n");
    return EXIT_FAILURE;
  }
  d->loop = fuse_loop_cfg_create();
  if (!d->loop)
    return EXIT_FAILURE;
  fuse_loop_cfg_set_max_threads(d->loop, 64);
  fuse_loop_cfg_set_clone_fd(d->loop, 0);
  start_readahead_tuning(d->mountpoint, fs->opts.readahead);
  int rc = fuse_session_loop_mt(d->se, d->loop);
  stopper_join(&d->stopper);
  return rc < 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}

/* Stop in order: no save abandoned, saves finished, the last metrics,
 * the drain and the flush stopped, unmounted, everything freed. */
static void teardown(daemon_t *d) {
  ckpt_fs_t *fs = &d->fs;
  ckpt__jobs_stop(fs); /* no save is abandoned from here on */
  /* Saves queued or running finish first; a sync commit still gets its
   * reply while the mount is there. */
  if (fs->dist)
    ckpt_dist_stop(fs->dist);
  ckpt__metrics_stop(d->metrics); /* the last write: every save counted */
  ckpt__drain_stop(fs->drain); /* before the nodes it holds go */
  ckpt__flush_stop(fs->flush); /* a copy under way resumes at next mount */
  if (d->mounted)
    fuse_session_unmount(d->se);
  stopper_join(&d->stopper);
  if (d->se)
    fuse_session_destroy(d->se);
  if (d->loop)
    fuse_loop_cfg_destroy(d->loop);
  ckpt__pool_free(fs->pool);
  if (fs->root) {
    ckpt__release_handles(fs);
    ckpt__fs_destroy(fs);
  }
  ckpt_dist_destroy(fs->dist);
  if (fs->backing_fd >= 0)
    close(fs->backing_fd);
  free(fs->backing_path);
  if (fs->tier_fd >= 0)
    close(fs->tier_fd);
  free(fs->tier_path);
  free(fs->mount_path);
  free(d->metrics_file);
  free(d->mountpoint);
  fuse_opt_free_args(&d->args);
  ckpt__opts_free(&fs->opts);
}

int main(int argc, char **argv) {
  stop_signals_block();
  static daemon_t d = {.fs = {.backing_fd = -1, .tier_fd = -1,
                              .commit_fd = -1}};
  d.args = (struct fuse_args)FUSE_ARGS_INIT(argc, argv);
  int status = parse_command_line(&d);
  if (status >= 0) {
    fuse_opt_free_args(&d.args);
    ckpt__opts_free(&d.fs.opts);
    return status;
  }
  status = join_world(&d);
  /* After MPI's own handlers (Open MPI's for SIGBUS prints a stack):
   * ours jumps out of a hash's mapping and leaves the rest to them. */
  int hrc = status == 0 ? ckpt_store_hash_mapped_init() : 0;
  if (hrc < 0)
    ckpt__log("hashing staged files through reads (no SIGBUS handler: %s)",
              strerror(-hrc));
  if (status == 0)
    status = new_session(&d);
  if (status == 0)
    status = mount_backing(&d) ? EXIT_FAILURE : serve(&d);
  teardown(&d);
  return status;
}
