/* Unit tests of nodes.c: the inode and name tables of a mount; and of
 * ckpt__op_may_write_node (fs/ops/common.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "daemon.h"
#include "ops_int.h"

enum { N = 3000 }; /* more nodes than the first 1024 buckets: the tables grow */

/* Every inode chain ends within limit links (a node inserted twice makes
 * its chain a cycle, and a lookup there never returns). */
static void assert_chains_end(const ckpt_fs_t *fs, size_t limit) {
  for (size_t b = 0; b < fs->hash_size; b++) {
    size_t steps = 0;
    for (const ckpt_node_t *n = fs->ino_hash[b]; n; n = n->hnext_ino)
      assert_true(++steps <= limit);
  }
}

static void renamed_nodes_keep_their_inodes(void **state) {
  (void)state;
  ckpt_fs_t fs;
  memset(&fs, 0, sizeof(fs));
  fs.backing_fd = -1;
  assert_int_equal(ckpt__fs_init(&fs), 0);
  pthread_mutex_lock(&fs.lock); /* the tree's calls assert it (Debug) */
  ckpt_ckpt_t *ck = ckpt__ckpt_new(&fs, "c");
  assert_non_null(ck);
  ckpt_node_t *sub = ckpt__node_new(&fs, ck->dir, "sub", CKPT_NODE_SDIR,
                                    S_IFDIR | 0755, ck);
  assert_non_null(sub);
  static ckpt_node_t *nodes[N];
  static uint64_t inos[N];
  char name[32];
  for (int i = 0; i < N; i++) {
    snprintf(name, sizeof(name), "f%d", i);
    nodes[i] = ckpt__node_new(&fs, ck->dir, name, CKPT_NODE_SDIR,
                              S_IFDIR | 0755, ck);
    assert_non_null(nodes[i]);
    inos[i] = nodes[i]->ino;
  }
  /* rename each: in its directory, or into another one */
  for (int i = 0; i < N; i++) {
    snprintf(name, sizeof(name), "g%d", i);
    ckpt__node_move(&fs, nodes[i], i % 2 ? sub : ck->dir, name);
  }
  assert_chains_end(&fs, fs.nnodes);
  for (int i = 0; i < N; i++) {
    assert_ptr_equal(ckpt__node_by_ino(&fs, inos[i]), nodes[i]);
    snprintf(name, sizeof(name), "g%d", i);
    assert_ptr_equal(ckpt__node_child(&fs, i % 2 ? sub : ck->dir, name),
                     nodes[i]);
    snprintf(name, sizeof(name), "f%d", i);
    assert_null(ckpt__node_child(&fs, ck->dir, name));
  }
  /* growing the tables again keeps every node once */
  for (int i = 0; i < N; i++) {
    snprintf(name, sizeof(name), "h%d", i);
    assert_non_null(ckpt__node_new(&fs, sub, name, CKPT_NODE_SDIR,
                                   S_IFDIR | 0755, ck));
  }
  assert_chains_end(&fs, fs.nnodes);
  for (int i = 0; i < N; i++)
    assert_ptr_equal(ckpt__node_by_ino(&fs, inos[i]), nodes[i]);
  /* detached nodes leave both tables */
  ckpt__node_detach(&fs, sub);
  for (int i = 0; i < N; i++)
    assert_true((ckpt__node_by_ino(&fs, inos[i]) == NULL) == (i % 2 == 1));
  assert_chains_end(&fs, fs.nnodes);
  pthread_mutex_unlock(&fs.lock);
  ckpt__fs_destroy(&fs);
}

/* The check of the requests that change many entries at once
 * (user.ckpt.metas, user.ckpt.mkdirs): the kernel checks only the
 * directory they are set on, so each entry's mode bits are checked here,
 * by the caller's class. */
static void may_write_node_by_mode_bits(void **state) {
  (void)state;
  static const struct fuse_ctx root = {.uid = 0, .gid = 0},
                        owner = {.uid = 1000, .gid = 5},
                        group = {.uid = 1001, .gid = 100},
                        other = {.uid = 1002, .gid = 7};
  static const struct {
    mode_t mode;
    const struct fuse_ctx *who;
    bool may;
  } cases[] = {
      {S_IFREG | 0444, &root, true},   {S_IFREG | 0444, &owner, false},
      {S_IFREG | 0644, &owner, true},  {S_IFREG | 0644, &group, false},
      {S_IFREG | 0644, &other, false},
      /* the class's own bit, not the others' */
      {S_IFREG | 0464, &owner, false}, {S_IFREG | 0464, &group, true},
      {S_IFREG | 0602, &other, true},  {S_IFREG | 0602, &group, false},
      /* a directory: write and search */
      {S_IFDIR | 0755, &owner, true},  {S_IFDIR | 0755, &group, false},
      {S_IFDIR | 0675, &owner, false}, {S_IFDIR | 0675, &group, true},
      {S_IFDIR | 0303, &owner, true},  {S_IFDIR | 0303, &other, true},
      {S_IFDIR | 0303, &group, false},
  };
  ckpt_node_t n;
  memset(&n, 0, sizeof(n));
  n.uid = 1000;
  n.gid = 100;
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    n.mode = cases[i].mode;
    if (ckpt__op_may_write_node(cases[i].who, &n) != cases[i].may)
      fail_msg("case %zu: mode %o, uid %u", i, (unsigned)n.mode,
               (unsigned)cases[i].who->uid);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(renamed_nodes_keep_their_inodes),
      cmocka_unit_test(may_write_node_by_mode_bits),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
