/*
 * cmd_ls.c - `ckptctl ls BACKING_DIR`: every checkpoint directory of a
 * backing directory, committed, unfinished or damaged (catalog.c), as a
 * table or one JSON document.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "catalog.h"
#include "ckptctl.h"
#include "json.h"

static const char *state_name(ckpt_cat_state_t s) {
  return s == CKPT_CAT_COMMITTED    ? "committed"
         : s == CKPT_CAT_UNFINISHED ? "unfinished"
                                    : "damaged";
}

/* One checkpoint as a JSON object: what .metadata says is null unless it
 * is committed. */
static void ls_entry_json(json_t *j, const ckpt_cat_entry_t *e) {
  const ckpt_metadata_t *m = &e->meta;
  bool ok = e->state == CKPT_CAT_COMMITTED;
  char t[64];
  j_open(j, '{');
  j_key(j, "name"), j_str(j, e->name);
  j_key(j, "state"), j_str(j, state_name(e->state));
  j_key(j, "created_at");
  ok ? j_str(j, iso_time(m->created_at, t, sizeof(t))) : j_null(j);
  j_key(j, "created_at_unix");
  ok ? j_i64(j, m->created_at) : j_null(j);
  j_key(j, "save_id"), j_str(j, ok ? m->save_id : NULL);
  j_key(j, "world_size");
  ok ? j_i64(j, m->world_size) : j_null(j);
  j_key(j, "tensors");
  ok ? j_u64(j, m->n_tensors) : j_null(j);
  j_key(j, "chunks");
  ok ? j_u64(j, m->n_chunks) : j_null(j);
  j_key(j, "blobs");
  ok ? j_u64(j, m->n_blobs) : j_null(j);
  j_key(j, "bytes");
  ok ? j_u64(j, stored_bytes(m)) : j_null(j);
  j_key(j, "disk_bytes"), j_u64(j, e->disk_bytes);
  j_key(j, "held"), j_bool(j, e->held);
  j_key(j, "error"), j_str(j, e->error);
  j_close(j, '}');
}

static void ls_json(const char *backing, const ckpt_catalog_t *cat) {
  json_t j;
  j_begin(&j);
  j_open(&j, '{');
  j_key(&j, "backing_dir");
  j_str(&j, backing);
  j_key(&j, "checkpoints");
  j_open(&j, '[');
  for (size_t i = 0; i < cat->n; i++)
    ls_entry_json(&j, &cat->e[i]);
  j_close(&j, ']');
  j_close(&j, '}');
  j_end(&j);
}

static void ls_text(const char *backing, const ckpt_catalog_t *cat) {
  char t[64], b[32];
  if (cat->n == 0) {
    printf("%s: no checkpoints\n", backing);
    return;
  }
  int w = 4;
  for (size_t i = 0; i < cat->n; i++)
    if ((int)strlen(cat->e[i].name) > w)
      w = (int)strlen(cat->e[i].name);
  printf("%-*s  %-10s  %-20s  %5s  %7s  %6s  %10s\n", w, "NAME", "STATE",
         "CREATED", "WORLD", "TENSORS", "BLOBS", "BYTES");
  for (size_t i = 0; i < cat->n; i++) {
    const ckpt_cat_entry_t *e = &cat->e[i];
    const ckpt_metadata_t *m = &e->meta;
    if (e->state == CKPT_CAT_COMMITTED) {
      printf("%-*s  %-10s  %-20s  %5d  %7u  %6u  %10s\n", w, e->name,
             "committed", iso_time(m->created_at, t, sizeof(t)),
             m->world_size, m->n_tensors, m->n_blobs,
             human_bytes(stored_bytes(m), b, sizeof(b)));
    } else {
      printf("%-*s  %-10s  %-20s  %5s  %7s  %6s  %10s  %s\n", w, e->name,
             state_name(e->state), "-", "-", "-", "-",
             human_bytes(e->disk_bytes, b, sizeof(b)),
             e->state == CKPT_CAT_DAMAGED ? e->error
             : e->held ? "(a save in flight holds it)"
                       : "(interrupted save: the next mount removes it)");
    }
  }
}

int cmd_ls(const args_t *a, int bfd) {
  const char *backing = a->pos[0];
  ckpt_catalog_t cat;
  int rc = ckpt__catalog_scan(bfd, true, &cat);
  if (rc) {
    fail("cannot list %s: %s", backing, strerror(-rc));
    return EXIT_NO;
  }
  if (a->json)
    ls_json(backing, &cat);
  else
    ls_text(backing, &cat);
  ckpt__catalog_free(&cat);
  return 0;
}
