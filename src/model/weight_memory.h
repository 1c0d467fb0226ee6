// Where the linear weights live on the host: views into the checkpoint's file mapping, or one
// anonymous region advised for transparent huge pages (`--no-mmap`, llama.cpp's flag).
//
// CPU decode streams every active weight once per token, so its rate is the machine's read
// bandwidth. A file mapping is backed by the page cache in 4 KiB pages; an anonymous region with
// MADV_HUGEPAGE gets 2 MiB pages where the kernel allows (`transparent_hugepage` set to madvise
// or always): fewer TLB misses and longer runs for the hardware prefetchers. Measured on the
// dev machine (docs/BENCHMARKS.md, 2026-12-05 fourth session): a 2-thread read of 1 GiB at
// 35.6-36.6 GB/s from huge pages against 32.2-34.5 from the mapped file, and m4-2b bf16 decode
// 24-32 -> 30-42 tok/s in interleaved runs. The cost is memory: the linears are read once into
// the process (the checkpoint's page-cache pages stay reclaimable, and the mapping's resident
// pages are dropped after the copy), so `auto` copies only when the files fit in half of
// MemAvailable; and only from 256 MiB up: a smaller model streams from the caches whatever its
// pages, while fresh huge pages cost their faults (in the dev VM 0.5-1.5 s per GB, with
// compaction stalls; the MPI tests, which load small models hundreds of times over four
// oversubscribed ranks, ran 2x longer with every load copied). Embedding tables stay mapped (a
// token reads one row).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/status.h"
#include "model/checkpoint.h"
#include "model/model_weights.h"

namespace ml4 {

enum class WeightMemory {
  kAuto,    // kCopy when copy_pays_off(checkpoint), else kMapped
  kMapped,  // views into the file mapping (`--mmap`)
  kCopy,    // the linears copied into anonymous huge-page memory (`--no-mmap`)
};

// Every LinearWeight of the model, the drafter's included.
void for_each_linear(ModelWeights& w, const std::function<void(LinearWeight&)>& fn);
void for_each_linear(const ModelWeights& w, const std::function<void(const LinearWeight&)>& fn);

struct WeightCopyReport {
  uint64_t bytes = 0;       // bytes copied (distinct tensors: a tied head is the embedding's bytes once)
  int tensors = 0;          // distinct tensors copied
  bool huge_pages = false;  // MADV_HUGEPAGE accepted for the region
  double seconds = 0;
};

// Copies every linear's weight and scale bytes into one anonymous region, each tensor 64-byte
// aligned, made read-only after the copy, and points the LinearWeights at it. Tensors that
// share bytes (a tied output head and its embedding rows) share the copy. kResourceExhausted
// when the region cannot be mapped; the weights are then unchanged.
Result<WeightCopyReport> copy_linears_to_memory(ModelWeights& w);

// The policy for `kAuto`: the checkpoint's files together take at least kCopyMinBytes and at most
// half of MemAvailable (/proc/meminfo; false where it cannot be read).
constexpr uint64_t kCopyMinBytes = uint64_t{256} << 20;
bool copy_pays_off(const Checkpoint& ck);

}  // namespace ml4
