/*
 * fuzz.h - the entry point every fuzz target implements (libFuzzer's), so
 * that the targets build with libFuzzer or with the standalone driver.
 */
#ifndef CKPT_FUZZ_H
#define CKPT_FUZZ_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif /* CKPT_FUZZ_H */
