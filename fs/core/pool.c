/*
 * pool.c - the mount's worker pool: ckpt__pool_run hands out task indices
 * to io_threads workers (the data files of a save are written on it).
 */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>

#include "fs.h"
struct ckpt_pool {
  pthread_mutex_t lock; /* protects everything below */
  pthread_cond_t work;  /* a batch is available, or stopping */
  pthread_cond_t idle;  /* a batch finished */
  pthread_mutex_t run_lock; /* one batch at a time */
  uint32_t nthreads;
  pthread_t *threads;
  int (*fn)(void *arg, uint32_t i);
  void *arg;
  uint32_t next;    /* next task index to hand out */
  uint32_t n;       /* tasks in the batch */
  uint32_t running; /* tasks handed out and not finished */
  int result;       /* first non-zero task result */
  uint64_t batch;   /* batch generation */
  bool stopping;
};

static void *pool_main(void *arg) {
  ckpt_pool_t *p = arg;
  pthread_setname_np(pthread_self(), "ckptfs-io");
  pthread_mutex_lock(&p->lock);
  for (;;) {
    while (!p->stopping && p->next >= p->n)
      pthread_cond_wait(&p->work, &p->lock);
    if (p->stopping)
      break;
    uint32_t i = p->next++;
    p->running++;
    pthread_mutex_unlock(&p->lock);
    int rc = p->fn(p->arg, i);
    pthread_mutex_lock(&p->lock);
    if (rc && !p->result)
      p->result = rc;
    if (--p->running == 0 && p->next >= p->n)
      pthread_cond_broadcast(&p->idle);
  }
  pthread_mutex_unlock(&p->lock);
  return NULL;
}

int ckpt__pool_new(uint32_t nthreads, ckpt_pool_t **out) {
  ckpt_pool_t *p = calloc(1, sizeof(*p));
  if (!p)
    return -ENOMEM;
  p->threads = calloc(nthreads, sizeof(*p->threads));
  if (!p->threads) {
    free(p);
    return -ENOMEM;
  }
  pthread_mutex_init(&p->lock, NULL);
  pthread_mutex_init(&p->run_lock, NULL);
  pthread_cond_init(&p->work, NULL);
  pthread_cond_init(&p->idle, NULL);
  for (uint32_t i = 0; i < nthreads; i++) {
    int rc = pthread_create(&p->threads[i], NULL, pool_main, p);
    if (rc) {
      p->nthreads = i;
      ckpt__pool_free(p);
      return -rc;
    }
  }
  p->nthreads = nthreads;
  *out = p;
  return 0;
}

void ckpt__pool_free(ckpt_pool_t *p) {
  if (!p)
    return;
  pthread_mutex_lock(&p->lock);
  p->stopping = true;
  pthread_cond_broadcast(&p->work);
  pthread_mutex_unlock(&p->lock);
  for (uint32_t i = 0; i < p->nthreads; i++)
    pthread_join(p->threads[i], NULL);
  pthread_mutex_destroy(&p->lock);
  pthread_mutex_destroy(&p->run_lock);
  pthread_cond_destroy(&p->work);
  pthread_cond_destroy(&p->idle);
  free(p->threads);
  free(p);
}

int ckpt__pool_run(ckpt_pool_t *p, uint32_t n,
                   int (*fn)(void *arg, uint32_t i), void *arg) {
  if (n == 0)
    return 0;
  pthread_mutex_lock(&p->run_lock);
  pthread_mutex_lock(&p->lock);
  p->fn = fn;
  p->arg = arg;
  p->next = 0;
  p->n = n;
  p->running = 0;
  p->result = 0;
  pthread_cond_broadcast(&p->work);
  while (p->next < p->n || p->running > 0)
    pthread_cond_wait(&p->idle, &p->lock);
  int rc = p->result;
  p->n = 0;
  p->next = 0;
  pthread_mutex_unlock(&p->lock);
  pthread_mutex_unlock(&p->run_lock);
  return rc;
}
