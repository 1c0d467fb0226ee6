// Communicator: the collectives a parallel forward needs, over one group of ranks
// (SYSTEM.md S10), backend-neutral.
//
// Two implementations: MpiCommunicator (mpi_communicator.h) for CPU ranks, whose buffers are
// host memory, and NcclCommunicator (cuda/nccl_communicator.h) for CUDA ranks, whose buffers
// are device memory and whose operations are issued on the backend's stream (the stream the
// model program's ops run on, so a collective is ordered after the op that made its input,
// as vLLM's and TensorRT-LLM's NCCL calls are). The model program (runtime/model_forward.h)
// calls these once for every backend; it passes the backend's own buffers.
//
// Group ranks are 0..size()-1 (RankLayout gives their world ranks). Every member must issue
// the same operations in the same order with matching sizes (MPI's and NCCL's rule). Sizes
// are in elements for reductions (f32 sums) and in bytes for data movement. Buffers of
// different ranks are laid out by group rank: all_gather's recv is [size][bytes].
//
// Host metadata (the per-peer counts of an all-to-all-v, which both sides must know before
// the data moves) goes through exchange_counts(), which is host memory for every
// implementation (the NCCL communicator sends it over the MPI communicator it was
// bootstrapped from).
//
// A failure (a peer that died, a timeout, an abort) makes every later call fail with the
// same message: a group that lost a member is never used again (parallel/mpi_env.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace ml4 {

// What a communicator did, for the benchmark's communication cost per step.
struct CommStats {
  int64_t calls = 0;
  int64_t bytes = 0;      // payload bytes this rank sent (all-reduce: its buffer once)
  double seconds = 0.0;   // wall time inside the calls (NCCL: issue time only)
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend_name() const = 0;  // "mpi", "nccl"

  // buf[n] = sum over ranks of buf[n], in place; every rank ends with the same bytes.
  virtual Status all_reduce_sum(float* buf, int64_t n) = 0;
  // recv[size][bytes] = every rank's send[bytes]; send may be recv + rank() * bytes (in place).
  virtual Status all_gather(const void* send, void* recv, int64_t bytes) = 0;
  // recv[n] = sum over ranks of send[rank()][n] (send [size][n]).
  virtual Status reduce_scatter_sum(const float* send, float* recv, int64_t n) = 0;
  // recv[p][bytes] = rank p's send[rank()][bytes] (send, recv [size][bytes]).
  virtual Status all_to_all(const void* send, void* recv, int64_t bytes) = 0;
  // Variable sizes: send holds send_bytes[p] bytes for each peer p, packed in peer order; recv
  // gets recv_bytes[p] from each, packed likewise (the counts come from exchange_counts).
  virtual Status all_to_all_v(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                              const std::vector<int64_t>& recv_bytes) = 0;
  virtual Status broadcast(void* buf, int64_t bytes, int root) = 0;
  virtual Status send(const void* buf, int64_t bytes, int peer) = 0;
  virtual Status recv(void* buf, int64_t bytes, int peer) = 0;
  // Host memory, every implementation: recv[p] = peer p's send[rank()] (size() values each).
  virtual Status exchange_counts(const std::vector<int64_t>& send, std::vector<int64_t>* recv) = 0;
  // Waits for the issued work to finish (NCCL: the stream); MPI calls complete on return.
  virtual Status synchronize() { return ok_status(); }

  const CommStats& stats() const { return stats_; }
  void reset_stats() { stats_ = {}; }

 protected:
  CommStats stats_;
};

// The groups one rank's forward uses (null: that kind of parallelism is off, size 1).
struct ParallelComms {
  Communicator* tp = nullptr;
  Communicator* ep = nullptr;
  Communicator* dcp = nullptr;  // decode context parallelism: the KV cache sharded by token
  Communicator* pcp = nullptr;  // prefill context parallelism: a step's tokens split over ranks
};

}  // namespace ml4
