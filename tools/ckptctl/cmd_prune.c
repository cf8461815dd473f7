/*
 * cmd_prune.c - `ckptctl prune --keep-last N ... BACKING_DIR`: remove the
 * committed checkpoints a retention policy does not keep (the policy of
 * -o keep=, catalog.c), each durably as `rm -r` through a mount does;
 * unfinished and damaged ones are left alone. And `ckptctl protect` /
 * `unprotect NAME`, the marker that policy honours.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "catalog.h"
#include "ckptctl.h"
#include "json.h"

/* The passes of the report, each a list: what became of a checkpoint. */
enum { P_REMOVED, P_KEPT, P_SKIPPED, P_FAILED, P_PASSES };

/* Checkpoint e, which pass lists (result: what removing it returned), as
 * a JSON object or a line. */
static void prune_entry(json_t *j, const args_t *a, const ckpt_cat_entry_t *e,
                        int pass, int result, unsigned kept_by) {
  char t[64], by[96];
  ckpt__catalog_why_text(kept_by, by, sizeof(by));
  bool committed = e->state == CKPT_CAT_COMMITTED;
  const char *why = NULL;
  if (pass == P_SKIPPED)
    why = e->state == CKPT_CAT_DAMAGED
              ? "damaged .metadata (check it with ckptfs-fsck)"
          : e->held ? "unfinished save, a writer holds it"
                    : "unfinished save (the next mount removes it)";
  else if (pass == P_FAILED)
    why = result == -EBUSY ? "busy: a save holds it; try again"
                           : strerror(-result);
  if (a->json) {
    j_open(j, '{');
    j_key(j, "name"), j_str(j, e->name);
    j_key(j, "created_at");
    committed ? j_str(j, iso_time(e->meta.created_at, t, sizeof(t)))
              : j_null(j);
    if (committed) {
      j_key(j, "step");
      e->step >= 0 ? j_i64(j, e->step) : j_null(j);
    }
    if (pass == P_KEPT)
      j_key(j, "kept_by"), j_str(j, by);
    if (why)
      j_key(j, pass == P_FAILED ? "error" : "reason"), j_str(j, why);
    j_close(j, '}');
    return;
  }
  static const char *const verbs[P_PASSES] = {"removed", "kept", "skipped",
                                              "FAILED"};
  char step[48] = "";
  if (committed && e->step >= 0)
    snprintf(step, sizeof(step), "  step %lld", (long long)e->step);
  if (pass == P_KEPT)
    why = by;
  printf("%-12s  %s%s%s%s%s%s\n",
         pass == P_REMOVED && a->dry_run ? "would remove" : verbs[pass],
         e->name, committed ? "  " : "",
         committed ? iso_time(e->meta.created_at, t, sizeof(t)) : "", step,
         why ? ": " : "", why ? why : "");
}

/* Every checkpoint of cat, pass by pass: removed (or would be), kept,
 * skipped, failed. old[i]: beyond the N newest; result[i]: what removing
 * it returned. */
static void prune_report(const args_t *a, const ckpt_catalog_t *cat,
                         const bool *old, const int *result,
                         const unsigned *why) {
  json_t j;
  char policy[160];
  ckpt_keep_policy_format(&a->policy, policy, sizeof(policy));
  if (a->json) {
    j_begin(&j);
    j_open(&j, '{');
    j_key(&j, "backing_dir"), j_str(&j, a->pos[0]);
    j_key(&j, "keep"), a->keep >= 0 ? j_i64(&j, a->keep) : j_null(&j);
    j_key(&j, "policy"), j_str(&j, policy);
    j_key(&j, "dry_run"), j_bool(&j, a->dry_run);
  }
  static const char *const keys[P_PASSES] = {"removed", "kept", "skipped",
                                             "errors"};
  for (int pass = 0; pass < P_PASSES; pass++) {
    if (a->json) {
      j_key(&j, keys[pass]);
      j_open(&j, '[');
    }
    for (size_t i = 0; i < cat->n; i++) {
      const ckpt_cat_entry_t *e = &cat->e[i];
      int which = e->state != CKPT_CAT_COMMITTED ? P_SKIPPED
                  : !old[i]                      ? P_KEPT
                  : result[i]                    ? P_FAILED
                                                 : P_REMOVED;
      if (which == pass)
        prune_entry(&j, a, e, pass, result[i], why[i]);
    }
    if (a->json)
      j_close(&j, ']');
  }
  if (a->json) {
    j_close(&j, '}');
    j_end(&j);
  }
}

int cmd_prune(const args_t *a, int bfd) {
  const char *backing = a->pos[0];
  ckpt_catalog_t cat;
  int rc = ckpt__catalog_scan(bfd, false, &cat);
  if (rc) {
    fail("cannot list %s: %s", backing, strerror(-rc));
    return EXIT_NO;
  }
  bool *old = calloc(cat.n ? cat.n : 1, sizeof(*old));
  int *result = calloc(cat.n ? cat.n : 1, sizeof(*result));
  unsigned *why = calloc(cat.n ? cat.n : 1, sizeof(*why));
  if (!old || !result || !why) {
    fail("out of memory");
    free(old), free(result), free(why);
    ckpt__catalog_free(&cat);
    return EXIT_NO;
  }
  ckpt__catalog_select_prunable(bfd, &cat, &a->policy, NULL, old, why);
  int failed = 0;
  for (size_t i = 0; i < cat.n; i++)
    if (old[i] && !a->dry_run &&
        (result[i] = ckpt__checkpoint_remove(bfd, cat.e[i].name, true)))
      failed++;
  prune_report(a, &cat, old, result, why);
  if (failed)
    fail("%d checkpoints could not be removed (see above)", failed);
  free(old);
  free(result);
  free(why);
  ckpt__catalog_free(&cat);
  return failed ? EXIT_NO : 0;
}

static int set_protect(const args_t *a, int bfd, bool on) {
  const char *name = a->pos[1];
  int rc = ckpt_name_valid(name) ? ckpt__checkpoint_protect(bfd, name, on)
                                 : -EINVAL;
  if (rc) {
    fail("%s %s: %s", on ? "protect" : "unprotect", name,
         rc == -ENOENT   ? "no committed checkpoint of that name"
         : rc == -EINVAL ? "not a checkpoint name"
                         : strerror(-rc));
    return EXIT_NO;
  }
  if (a->json) {
    json_t j;
    j_begin(&j);
    j_open(&j, '{');
    j_key(&j, "name"), j_str(&j, name);
    j_key(&j, "protected"), j_bool(&j, on);
    j_close(&j, '}');
    j_end(&j);
  } else {
    printf("%s: %s\n", name, on ? "protected" : "not protected");
  }
  return 0;
}

int cmd_protect(const args_t *a, int bfd) { return set_protect(a, bfd, true); }

int cmd_unprotect(const args_t *a, int bfd) {
  return set_protect(a, bfd, false);
}
