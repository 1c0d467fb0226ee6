// MpiCommunicator: the Communicator of CPU ranks, over an MPI communicator (host memory).
//
// Every operation is MPI's nonblocking collective (MPI_Iallreduce, MPI_Iallgather, ...)
// finished by MpiEnv::wait, so a dead peer or an abort returns an error instead of hanging.
// All-reduce is MPI_Iallreduce with MPI_SUM on f32: OpenMPI's algorithms for a commutative
// op (recursive doubling, ring) leave the same bytes on every rank, which the forward relies
// on (every TP rank routes its tokens to the same experts); tests/parallel checks it.
#pragma once

#include <mpi.h>

#include "parallel/communicator.h"
#include "parallel/mpi_env.h"

namespace ml4 {

class MpiCommunicator : public Communicator {
 public:
  // Takes ownership of comm (freed on destruction unless it is MPI_COMM_WORLD / SELF).
  MpiCommunicator(MpiEnv* env, MPI_Comm comm);
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend_name() const override { return "mpi"; }
  MPI_Comm comm() const { return comm_; }

  Status all_reduce_sum(float* buf, int64_t n) override;
  Status all_gather(const void* send, void* recv, int64_t bytes) override;
  Status reduce_scatter_sum(const float* send, float* recv, int64_t n) override;
  Status all_to_all(const void* send, void* recv, int64_t bytes) override;
  Status all_to_all_v(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                      const std::vector<int64_t>& recv_bytes) override;
  Status broadcast(void* buf, int64_t bytes, int root) override;
  Status send(const void* buf, int64_t bytes, int peer) override;
  Status recv(void* buf, int64_t bytes, int peer) override;
  Status exchange_counts(const std::vector<int64_t>& send, std::vector<int64_t>* recv) override;
  // Rank 0's wait for a worker's next message is unbounded only on workers (the next step
  // may be hours away); `bounded` false for that wait.
  Status broadcast_unbounded(void* buf, int64_t bytes, int root);

 private:
  Status finish(int rc, MPI_Request* req, const char* what, double t0, int64_t bytes, bool bounded = true);

  MpiEnv* env_;
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
};

}  // namespace ml4
