/*
 * msg_fuzzer.c - fuzz the decoders of the binary messages between ranks.
 *
 * The input goes to all three decoders. A decoder must reject it cleanly or
 * accept it; what it accepts must encode back to exactly the input (the
 * format has a single encoding of every message), and an accepted local
 * plan (pins and reservations included) must be something the global
 * planner handles, the rank plans of a valid plan decoding again.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_planner.h"
#include "fuzz.h"

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond))                                                               \
      abort();                                                                 \
  } while (0)

/* out must hold exactly data[0..size). */
static void check_same(const ckpt_buf_t *out, const uint8_t *data,
                       size_t size) {
  CHECK(out->len == size && memcmp(out->data, data, size) == 0);
}

static void fuzz_local_plan(const uint8_t *data, size_t size) {
  ckpt_local_plan_t lp;
  ckpt_buf_t out;
  int rc = ckpt_msg_decode_local_plan(data, size, &lp);
  if (rc < 0) {
    CHECK(rc == -EINVAL || rc == -ENOMEM);
    return;
  }
  ckpt_buf_init(&out);
  CHECK(ckpt_msg_encode_local_plan(&lp, &out) == 0);
  check_same(&out, data, size);
  ckpt_buf_free(&out);

  /* A world of rank+1 ranks where the others have nothing. */
  if (lp.rank < 4) {
    ckpt_local_plan_t world[4];
    ckpt_plan_opts_t opts = {.io_threads = 1 + size % 5,
                             .replica_check = CKPT_REPLICA_WARN};
    ckpt_global_plan_t gp;
    for (int32_t r = 0; r < lp.rank; r++)
      ckpt_local_plan_init(&world[r], r);
    world[lp.rank] = lp;
    rc = ckpt_plan_global(world, lp.rank + 1, &opts, &gp);
    CHECK(rc == 0 || rc == -ENOMEM || rc == -EINVAL);
    /* the rank plans of a valid plan are what the rank plan decoder
     * accepts (order, no overlap, inside the files), pins and all */
    for (int32_t r = 0; rc == 0 && gp.errors == NULL && r <= lp.rank; r++) {
      ckpt_rank_plan_t back;
      ckpt_buf_init(&out);
      CHECK(ckpt_msg_encode_rank_plan(&gp.ranks[r], &out) == 0);
      rc = ckpt_msg_decode_rank_plan(out.data, out.len, &back);
      CHECK(rc == 0 || rc == -ENOMEM);
      if (rc == 0)
        ckpt_rank_plan_free(&back);
      rc = 0;
      ckpt_buf_free(&out);
    }
    ckpt_global_plan_free(&gp);
  }
  ckpt_local_plan_free(&lp);
}

static void fuzz_rank_plan(const uint8_t *data, size_t size) {
  ckpt_rank_plan_t rp;
  ckpt_buf_t out;
  int rc = ckpt_msg_decode_rank_plan(data, size, &rp);
  if (rc < 0) {
    CHECK(rc == -EINVAL || rc == -ENOMEM);
    return;
  }
  ckpt_buf_init(&out);
  CHECK(ckpt_msg_encode_rank_plan(&rp, &out) == 0);
  check_same(&out, data, size);
  ckpt_buf_free(&out);
  ckpt_rank_plan_free(&rp);
}

static void fuzz_write_result(const uint8_t *data, size_t size) {
  ckpt_write_result_t wr;
  ckpt_buf_t out;
  int rc = ckpt_msg_decode_write_result(data, size, &wr);
  if (rc < 0) {
    CHECK(rc == -EINVAL || rc == -ENOMEM);
    return;
  }
  ckpt_buf_init(&out);
  CHECK(ckpt_msg_encode_write_result(&wr, &out) == 0);
  check_same(&out, data, size);
  ckpt_buf_free(&out);
  ckpt_write_result_free(&wr);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_local_plan(data, size);
  fuzz_rank_plan(data, size);
  fuzz_write_result(data, size);
  return 0;
}
