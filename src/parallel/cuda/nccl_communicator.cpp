#include "parallel/cuda/nccl_communicator.h"

#include <nccl.h>

#include <chrono>

#include "parallel/mpi_env.h"

namespace ml4 {
namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

Status nccl_status(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return ok_status();
  return internal_error("{}: NCCL error {} ({})", what, static_cast<int>(r), ncclGetErrorString(r));
}

#define ML4_NCCL(call, what) ML4_RETURN_IF_ERROR(nccl_status((call), (what)))

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size, Communicator* bootstrap, cudaStream_t stream)
      : comm_(comm), rank_(rank), size_(size), bootstrap_(bootstrap), stream_(stream) {}
  ~NcclCommunicator() override {
    // A group that lost a member is aborted rather than destroyed (destroy would wait on it).
    if (MpiEnv* env = MpiEnv::get(); env != nullptr && env->failed()) {
      ncclCommAbort(comm_);
    } else {
      ncclCommDestroy(comm_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend_name() const override { return "nccl"; }

  Status all_reduce_sum(float* buf, int64_t n) override {
    ML4_RETURN_IF_ERROR(check());
    const double t0 = now_s();
    ML4_NCCL(ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, comm_, stream_), "all_reduce");
    return count(t0, n * 4);
  }
  Status all_gather(const void* send, void* recv, int64_t bytes) override {
    ML4_RETURN_IF_ERROR(check());
    const double t0 = now_s();
    ML4_NCCL(ncclAllGather(send, recv, bytes, ncclChar, comm_, stream_), "all_gather");
    return count(t0, bytes);
  }
  Status reduce_scatter_sum(const float* send, float* recv, int64_t n) override {
    ML4_RETURN_IF_ERROR(check());
    const double t0 = now_s();
    ML4_NCCL(ncclReduceScatter(send, recv, n, ncclFloat, ncclSum, comm_, stream_), "reduce_scatter");
    return count(t0, n * 4 * size_);
  }
  Status all_to_all(const void* send, void* recv, int64_t bytes) override {
    std::vector<int64_t> b(size_, bytes);
    return all_to_all_v(send, b, recv, b);
  }
  Status all_to_all_v(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                      const std::vector<int64_t>& recv_bytes) override {
    ML4_RETURN_IF_ERROR(check());
    if (static_cast<int>(send_bytes.size()) != size_ || static_cast<int>(recv_bytes.size()) != size_)
      return internal_error("all_to_all_v: {} / {} counts for a group of {}", send_bytes.size(), recv_bytes.size(), size_);
    const double t0 = now_s();
    const auto* s = static_cast<const char*>(send);
    auto* r = static_cast<char*>(recv);
    int64_t so = 0, ro = 0;
    ML4_NCCL(ncclGroupStart(), "all_to_all_v");
    for (int p = 0; p < size_; ++p) {
      if (send_bytes[p] > 0) ML4_NCCL(ncclSend(s + so, send_bytes[p], ncclChar, p, comm_, stream_), "all_to_all_v send");
      if (recv_bytes[p] > 0) ML4_NCCL(ncclRecv(r + ro, recv_bytes[p], ncclChar, p, comm_, stream_), "all_to_all_v recv");
      so += send_bytes[p];
      ro += recv_bytes[p];
    }
    ML4_NCCL(ncclGroupEnd(), "all_to_all_v");
    return count(t0, so);
  }
  Status broadcast(void* buf, int64_t bytes, int root) override {
    ML4_RETURN_IF_ERROR(check());
    const double t0 = now_s();
    ML4_NCCL(ncclBroadcast(buf, buf, bytes, ncclChar, root, comm_, stream_), "broadcast");
    return count(t0, rank_ == root ? bytes : 0);
  }
  Status send(const void* buf, int64_t bytes, int peer) override {
    ML4_RETURN_IF_ERROR(check());
    const double t0 = now_s();
    ML4_NCCL(ncclSend(buf, bytes, ncclChar, peer, comm_, stream_), "send");
    return count(t0, bytes);
  }
  Status recv(void* buf, int64_t bytes, int peer) override {
    ML4_RETURN_IF_ERROR(check());
    const double t0 = now_s();
    ML4_NCCL(ncclRecv(buf, bytes, ncclChar, peer, comm_, stream_), "recv");
    return count(t0, 0);
  }
  Status exchange_counts(const std::vector<int64_t>& send, std::vector<int64_t>* recv) override {
    if (bootstrap_ != nullptr) return bootstrap_->exchange_counts(send, recv);
    if (send.size() != 1) return internal_error("exchange_counts: {} counts for a group of 1", send.size());
    *recv = send;
    return ok_status();
  }
  Status synchronize() override {
    if (cudaStreamSynchronize(stream_) != cudaSuccess) return internal_error("NCCL stream: {}", cudaGetErrorString(cudaGetLastError()));
    ncclResult_t async = ncclSuccess;
    ML4_NCCL(ncclCommGetAsyncError(comm_, &async), "async error query");
    return nccl_status(async, "NCCL");
  }

 private:
  Status check() const {
    if (MpiEnv* env = MpiEnv::get(); env != nullptr && env->failed()) return env->failure();
    return ok_status();
  }
  Status count(double t0, int64_t bytes) {
    stats_.calls += 1;
    stats_.bytes += bytes;
    stats_.seconds += now_s() - t0;
    return ok_status();
  }

  ncclComm_t comm_;
  int rank_, size_;
  Communicator* bootstrap_;
  cudaStream_t stream_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> make_nccl_communicator(Communicator* bootstrap, cudaStream_t stream) {
  const int size = bootstrap != nullptr ? bootstrap->size() : 1;
  const int rank = bootstrap != nullptr ? bootstrap->rank() : 0;
  ncclUniqueId id;
  if (rank == 0) ML4_NCCL(ncclGetUniqueId(&id), "ncclGetUniqueId");
  if (bootstrap != nullptr && size > 1) ML4_RETURN_IF_ERROR(bootstrap->broadcast(&id, sizeof(id), 0));
  ncclComm_t comm = nullptr;
  ML4_NCCL(ncclCommInitRank(&comm, size, id, rank), "ncclCommInitRank");
  return std::unique_ptr<Communicator>(new NcclCommunicator(comm, rank, size, size > 1 ? bootstrap : nullptr, stream));
}

}  // namespace ml4
