/*
 * plan_bench.c - time of the coordinator's global plan for many chunks.
 *
 *   build/bin/plan_bench [CHUNKS] [RANKS]
 *
 * Builds RANKS local plans holding CHUNKS chunks in all (1000-row tensors
 * sharded by rows across ranks, plus 1% replicated chunks), then times
 * encoding/decoding the local plans (what crosses the wire) and
 * ckpt_plan_global (dedup, validation, file assignment, metadata). Prints
 * seconds and chunks per second; a benchmark, not a test.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ckpt_planner.h"

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  long chunks = argc > 1 ? atol(argv[1]) : 1000000;
  int ranks = argc > 2 ? atoi(argv[2]) : 4;
  const int64_t rows = 1000, cols = 16; /* each tensor: 1000 row shards */
  long tensors = chunks / rows;
  if (tensors < 1 || ranks < 1) {
    fprintf(stderr, "usage: plan_bench [CHUNKS>=1000] [RANKS>=1]\n");
    return 2;
  }
  ckpt_local_plan_t *lp = calloc((size_t)ranks, sizeof(*lp));
  for (int r = 0; r < ranks; r++)
    ckpt_local_plan_init(&lp[r], r);
  char path[64];
  uint32_t id = 0;
  for (long t = 0; t < tensors; t++) {
    snprintf(path, sizeof(path), "model/layer%ld/weight", t);
    int64_t shape[2] = {rows, cols}, sizes[2] = {1, cols};
    bool replicated = t % 100 == 99; /* 1%: whole tensor on every rank */
    for (int64_t row = 0; row < rows; row++) {
      int64_t offs[2] = {row, 0};
      if (replicated) {
        for (int r = 0; r < ranks; r++)
          ckpt_local_plan_add_tensor(&lp[r], path, CKPT_DTYPE_FLOAT32, 2,
                                     shape, offs, sizes, cols * 4,
                                     (uint64_t)row, id++);
      } else {
        int r = (int)(row * ranks / rows);
        ckpt_local_plan_add_tensor(&lp[r], path, CKPT_DTYPE_FLOAT32, 2, shape,
                                   offs, sizes, cols * 4, (uint64_t)row,
                                   id++);
      }
    }
  }
  long total = 0;
  for (int r = 0; r < ranks; r++)
    total += lp[r].n_items;

  double t0 = now();
  ckpt_buf_t *msgs = calloc((size_t)ranks, sizeof(*msgs));
  ckpt_local_plan_t *decoded = calloc((size_t)ranks, sizeof(*decoded));
  size_t bytes = 0;
  for (int r = 0; r < ranks; r++) {
    ckpt_msg_encode_local_plan(&lp[r], &msgs[r]);
    bytes += msgs[r].len;
  }
  double t1 = now();
  for (int r = 0; r < ranks; r++)
    if (ckpt_msg_decode_local_plan(msgs[r].data, msgs[r].len, &decoded[r])) {
      fprintf(stderr, "decode failed\n");
      return 1;
    }
  double t2 = now();
  ckpt_plan_opts_t opts = {.io_threads = 4,
                           .replica_check = CKPT_REPLICA_ERROR};
  ckpt_global_plan_t gp;
  if (ckpt_plan_global(decoded, ranks, &opts, &gp) || gp.errors) {
    fprintf(stderr, "global plan failed: %s\n", gp.errors ? gp.errors : "");
    return 1;
  }
  double t3 = now();
  printf("chunks %ld over %d ranks (%ld tensors, %u kept after dedup)\n",
         total, ranks, tensors, gp.meta.n_chunks);
  printf("encode local plans   %8.3f s  (%.1f MB on the wire)\n", t1 - t0,
         (double)bytes / 1e6);
  printf("decode local plans   %8.3f s\n", t2 - t1);
  printf("global plan          %8.3f s  (%.2f M chunks/s)\n", t3 - t2,
         (double)total / (t3 - t2) / 1e6);
  ckpt_global_plan_free(&gp);
  for (int r = 0; r < ranks; r++) {
    ckpt_local_plan_free(&lp[r]);
    ckpt_local_plan_free(&decoded[r]);
    ckpt_buf_free(&msgs[r]);
  }
  free(lp);
  free(decoded);
  free(msgs);
  return 0;
}
