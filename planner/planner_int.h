/*
 * planner_int.h - internals shared by the units of the planner module.
 *
 * This file is private to planner/. Nothing outside planner/ includes it.
 */
#ifndef CKPT_PLANNER_INT_H
#define CKPT_PLANNER_INT_H

#include "ckpt_planner.h"

/* Strip surrounding blanks (space, tab) and one trailing newline from the
 * value [*s, *s + *len) in place (used by the dtype and dims parsers). */
void ckpt__trim_value(const char **s, size_t *len);

/* Release what a write item owns (not the item itself). */
void ckpt__write_item_free(ckpt_write_item_t *it);

/* Add a copy of the item described by the arguments to lp, not pinned
 * (pin_file CKPT_NO_PIN); dims (3*ndim values) is copied. The common path
 * of the ckpt_local_plan_add_* functions and of the local plan decoder. */
int ckpt__local_plan_push(ckpt_local_plan_t *lp, const char *path,
                          size_t path_len, ckpt_item_kind_t kind,
                          ckpt_dtype_t dtype, int ndim, const int64_t *dims,
                          uint64_t length, uint64_t checksum,
                          uint32_t local_id);

#endif /* CKPT_PLANNER_INT_H */
