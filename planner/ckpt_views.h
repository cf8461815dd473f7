/*
 * ckpt_views.h - file formats other tools read, computed from a checkpoint's
 * tensor list: safetensors (Hugging Face) and NumPy .npy headers.
 *
 * Pure computation like the rest of planner/ (no I/O): the caller gets the
 * header bytes and, for every tensor, where its row-major bytes go in the
 * file; it then serves or copies the tensor bytes itself. Included from
 * ckpt_planner.h.
 */
#ifndef CKPT_VIEWS_H
#define CKPT_VIEWS_H

#include "ckpt_planner.h"

/* ------------------------------------------------------------------------
 * safetensors (https://github.com/huggingface/safetensors, format section):
 *
 *   OFFSET  SIZE  DESCRIPTION
 *   0       8     N, little-endian u64: bytes of the JSON header
 *   8       N     UTF-8 JSON object, padded with spaces (0x20) so that
 *                 8 + N is a multiple of 8:
 *                 {"__metadata__":{"format":"pt"},
 *                  NAME:{"dtype":"F32","shape":[2,3],"data_offsets":[B,E]},
 *                  ...}
 *   8+N     ...   the tensors' bytes, row-major, little-endian; B and E are
 *                 relative to 8+N; the tensors are contiguous (no holes)
 *                 and the last one ends the file.
 *
 * What ckpt_st_plan produces:
 *  - The JSON is compact (no spaces), "__metadata__" first, with
 *    {"format":"pt"} (what transformers' from_pretrained checks) and, when
 *    tensors were left out, "ckptfs.left_out": a string holding a JSON
 *    array of their names (bytes that are not UTF-8 shown as U+FFFD).
 *  - Left out (place[i].shard == CKPT_ST_LEFT_OUT): tensors safetensors
 *    cannot hold: complex128 (no safetensors dtype), names that are not
 *    valid UTF-8 (safetensors names are strings), the name "__metadata__".
 *  - Sharding, as Hugging Face's save_pretrained: the kept tensors, in the
 *    caller's order, fill shard after shard; a tensor that would take a
 *    non-empty shard's data bytes beyond shard_bytes starts the next one
 *    (so a tensor larger than shard_bytes gets a shard of its own).
 *    shard_bytes 0: one file. Headers do not count towards shard_bytes.
 *  - Inside a file, tensors are ordered by item size, largest first, then
 *    in the caller's order (as safetensors' own writer does): with an
 *    8-aligned data start, every tensor is then aligned to its item size.
 *  - Names: one file is "model.safetensors"; shards are
 *    "model-00001-of-00003.safetensors" (ckpt_st_shard_name), listed in
 *    "model.safetensors.index.json" (ckpt_st_index_json).
 *  - dtypes: bool BOOL, uint8 U8, int8 I8, int16 I16, int32 I32, int64
 *    I64, float16 F16, bfloat16 BF16, float32 F32, float64 F64, complex64
 *    C64 (a recent addition: older readers refuse the file),
 *    float8_e4m3fn F8_E4M3, float8_e5m2 F8_E5M2.
 * ---------------------------------------------------------------------- */

/* safetensors refuses headers larger than this (tensor.rs MAX_HEADER_SIZE);
 * ckpt_st_plan does not, a caller may. */
#define CKPT_ST_MAX_HEADER UINT64_C(100000000)
/* place[i].shard of a tensor left out. */
#define CKPT_ST_LEFT_OUT UINT32_MAX

/* One tensor of the input (borrowed: nothing is copied). */
typedef struct {
  const char *name;     /* FQN, NUL-terminated, any bytes */
  ckpt_dtype_t dtype;
  int ndim;             /* 0..CKPT_MAX_NDIM */
  const int64_t *shape; /* ndim dimensions, each >= 0 (NULL if ndim 0) */
} ckpt_st_tensor_t;

typedef struct {
  uint32_t shard;  /* the file holding it, or CKPT_ST_LEFT_OUT */
  uint64_t offset; /* where its bytes start in that file (header included) */
  uint64_t length; /* its bytes: numel x itemsize */
} ckpt_st_place_t;

typedef struct {
  uint8_t *header;      /* owned: the file's first header_len bytes (the
                           8-byte length, the JSON and its padding) */
  uint64_t header_len;  /* 8 + N, a multiple of 8 */
  uint64_t data_len;    /* bytes of its tensors */
  uint64_t file_size;   /* header_len + data_len */
  size_t first;         /* its tensors: order[first .. first+count) in */
  size_t count;         /*   file order (increasing offsets) */
} ckpt_st_shard_t;

typedef struct {
  uint32_t n_shards;        /* >= 1 (an empty checkpoint is one file) */
  ckpt_st_shard_t *shards;  /* owned */
  size_t n_tensors;         /* of the input */
  ckpt_st_place_t *place;   /* owned, n_tensors, by input index */
  size_t *order;            /* owned: input indices of the kept tensors,
                               shard by shard, in file order */
  size_t n_kept;            /* entries of order */
  size_t n_left_out;
  uint64_t total_size;      /* data bytes of every shard ("total_size") */
} ckpt_st_plan_t;

/* The safetensors dtype name ("F32"), or NULL when it has none. */
const char *ckpt_st_dtype_name(ckpt_dtype_t dt);

/* Compute the layout of t[0..n) (see above). Returns 0, -EINVAL for an
 * invalid dtype, ndim or dimension, -EOVERFLOW when a size passes 2^64,
 * -ENOMEM. On failure *out is left empty (safe to free). */
int ckpt_st_plan(const ckpt_st_tensor_t *t, size_t n, uint64_t shard_bytes,
                 ckpt_st_plan_t *out);
void ckpt_st_plan_free(ckpt_st_plan_t *p);

/* File name of shard k: "model.safetensors" when there is one, else
 * "model-%05u-of-%05u.safetensors" (k + 1). snprintf semantics. */
int ckpt_st_shard_name(const ckpt_st_plan_t *p, uint32_t k, char *buf,
                       size_t cap);

/* Append the text of model.safetensors.index.json, as save_pretrained
 * writes it (json.dumps(index, indent=2, sort_keys=True) + "\n", but names
 * in UTF-8 rather than \u escapes): {"metadata": {"total_size": N},
 * "weight_map": {NAME: FILE, ...}} for the kept tensors, by name. t and n
 * are those given to ckpt_st_plan. 0 or -ENOMEM. */
int ckpt_st_index_json(const ckpt_st_plan_t *p, const ckpt_st_tensor_t *t,
                       size_t n, ckpt_buf_t *out);

/* The first position j in order[shard.first .. shard.first+count) whose
 * tensor ends after file offset off (shard.first + count if none): where a
 * read at off starts. O(log count). */
size_t ckpt_st_find(const ckpt_st_plan_t *p, uint32_t k, uint64_t off);

/* ------------------------------------------------------------------------
 * NumPy .npy (numpy/lib/format.py, format versions 1.0 and 2.0):
 *
 *   OFFSET  SIZE  DESCRIPTION
 *   0       6     "\x93NUMPY"
 *   6       2     version: 1, 0 (or 2, 0 when the header needs it)
 *   8       2|4   HEADER_LEN, little-endian u16 (1.0) or u32 (2.0)
 *   10|12   ...   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
 *                 then spaces and '\n': the data starts at a multiple of 64
 *   ...           the array's bytes, C order
 *
 * The header is byte for byte what np.save of numpy 1.24 writes (it keeps
 * spare spaces after the dict so that the shape can grow in place).
 * dtypes numpy lacks are given as raw bits of the same size: bfloat16 as
 * '<u2', float8_* as '|u1' (view them with ml_dtypes or torch).
 * ---------------------------------------------------------------------- */

/* numpy's type string of dt ("<f4"), raw for bfloat16 and float8; NULL for
 * an invalid dtype. */
const char *ckpt_npy_descr(ckpt_dtype_t dt);
/* Append the .npy header of a C-order array to out: 0, -EINVAL (dtype,
 * ndim or a negative dimension), -ENOMEM. */
int ckpt_npy_header(ckpt_dtype_t dt, int ndim, const int64_t *shape,
                    ckpt_buf_t *out);

#endif /* CKPT_VIEWS_H */
