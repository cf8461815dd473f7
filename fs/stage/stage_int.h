/*
 * stage_int.h - private to its directory: what its files share.
 */
#ifndef CKPT_STAGE_INT_H
#define CKPT_STAGE_INT_H

#include "stage.h"

void ckpt__stg_pt_fd_give(ckpt_staging_t *b);
int ckpt__stg_pt_refresh(ckpt_sfile_t *sf);
int ckpt__stg_pt_rw(ckpt_sfile_t *sf);

#endif /* CKPT_STAGE_INT_H */
