/*
 * daemon.h - fs/daemon: the process: options, the mount's setup and
 * teardown, the metrics file, main. The top layer.
 */
#ifndef CKPT_FS_DAEMON_H
#define CKPT_FS_DAEMON_H

#include "ops.h"

/* Parse the command line. Our options are removed from args; what stays is
 * for fuse_session_new. Returns 0, or -EINVAL with *err (malloc'd). */
int ckpt__opts_parse(struct fuse_args *args, ckpt_opts_t *o, char **err);
void ckpt__opts_free(ckpt_opts_t *o);
void ckpt__opts_help(void);
/* "64M", "1G", "4096": bytes; -EINVAL when malformed or overflowing. */
int ckpt__parse_size(const char *s, uint64_t *out);

/* Write fs's metrics to base in the directory dir_fd, in the Prometheus
 * text format (a new base.tmp.PID.RANDOM made with O_EXCL | O_NOFOLLOW,
 * renamed over base): 0 or -errno. */
int ckpt__metrics_write(ckpt_fs_t *fs, int dir_fd, const char *base);
/* The daemon's periodic thread, every CKPT_METRICS_PERIOD seconds: writes
 * the metrics to path (when not NULL: -o metrics) and closes the cached
 * descriptors of data files removed since (ckpt_fdcache_sweep); stop
 * writes the metrics one last time and joins. */
#define CKPT_METRICS_PERIOD 2.0
typedef struct ckpt_metrics_writer ckpt_metrics_writer_t;
int ckpt__metrics_start(ckpt_fs_t *fs, const char *path,
                        ckpt_metrics_writer_t **out);
void ckpt__metrics_stop(ckpt_metrics_writer_t *w);

/* Create the root; fs->opts and backing_fd must be set. */
int ckpt__fs_init(ckpt_fs_t *fs);
void ckpt__fs_destroy(ckpt_fs_t *fs);

#endif /* CKPT_FS_DAEMON_H */
