/*
 * store_int.h - private to store/.
 */
#ifndef CKPT_STORE_INT_H
#define CKPT_STORE_INT_H

#include <setjmp.h>

#include "store.h"

/* A new checkpoint id of cache c (fdcache.c). */
uint64_t ckpt__fdcache_new_id(ckpt_fdcache_t *c);
/* Close every unused descriptor of checkpoint id. */
void ckpt__fdcache_forget(ckpt_fdcache_t *c, uint64_t id);

/* Data file K of rank R of s, opened again by its name: when the name now
 * holds another file (replaced by rename), *ref moves to it (the old
 * descriptor stays open for the refs that hold it, then is closed; new
 * lookups get the new one). 1 when moved, 0 when it is the same file,
 * -errno when it cannot be opened (*ref unchanged). */
int ckpt__fdcache_reopen(const ckpt_stored_t *s, int32_t rank, uint32_t k,
                         ckpt_fdref_t *ref);
/* A data file just opened by the cache (fd): the reader compares it with
 * the file its chunks were checked on (reader.c). */
void ckpt__stored_seen(const ckpt_stored_t *s, int32_t rank, uint32_t k,
                       int fd);

/* The save ID as the identity checks compare it (identity.c): itself, or
 * one longer than ckptfs's 32 hex digits by its XXH3-64. */
void ckpt__save_key(const char *save_id, char out[CKPT_SAVE_ID_LEN + 1]);
/* How many times ckpt_store_save_id read a .metadata (not remembered). */
unsigned long ckpt__save_id_reads(void);

/* Set s's identity to version v, under the lock the identity checks take
 * (identity.c); ckpt_stored_rebind also lets go of its idle descriptors. */
void ckpt__stored_set_identity(ckpt_stored_t *s, const ckpt_version_t *v);

/* Hashing from a mapping (bus_guard.c): is the SIGBUS handler that
 * ckpt_store_hash_mapped_init installed still SIGBUS's? Between arm and
 * disarm, a fault (SIGBUS raised by the kernel) of this thread in
 * [lo, lo+len) siglongjmps to *jb (sigsetjmp'd with its signal mask
 * saved); any other SIGBUS goes on to the handler that was there before,
 * or the default action. */
bool ckpt__bus_guard_ready(void);
void ckpt__bus_guard_arm(sigjmp_buf *jb, const void *lo, size_t len);
void ckpt__bus_guard_disarm(void);
/* For tests: hash through preads only, never a mapping, when set; a hook
 * called with each window's file offset once it is mapped, before it is
 * hashed (to change the file there); bytes hashed from mappings. */
extern _Atomic bool ckpt__hash_reads_only;
extern void (*ckpt__hash_mapped_hook)(int fd, uint64_t pos);
extern _Atomic uint64_t ckpt__hash_mapped_bytes;

/* For tests: ckpt_open_beneath walks (as without openat2) when on. */
void ckpt__open_beneath_force_walk(bool on);

#endif /* CKPT_STORE_INT_H */
