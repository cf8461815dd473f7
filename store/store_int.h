/*
 * store_int.h - private to store/.
 */
#ifndef CKPT_STORE_INT_H
#define CKPT_STORE_INT_H

#include "store.h"

/* A new checkpoint id of cache c (fdcache.c). */
uint64_t ckpt__fdcache_new_id(ckpt_fdcache_t *c);
/* Close every unused descriptor of checkpoint id. */
void ckpt__fdcache_forget(ckpt_fdcache_t *c, uint64_t id);

/* For tests: ckpt_open_beneath walks (as without openat2) when on. */
void ckpt__open_beneath_force_walk(bool on);

#endif /* CKPT_STORE_INT_H */
