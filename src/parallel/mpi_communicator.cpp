#include "parallel/mpi_communicator.h"

#include <chrono>
#include <climits>

namespace ml4 {
namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// MPI counts are int: larger messages are refused with a message rather than truncated.
Status check_count(int64_t n, const char* what) {
  if (n < 0 || n > INT_MAX) return invalid_argument("{}: {} elements exceed one MPI message (at most {})", what, n, INT_MAX);
  return ok_status();
}

}  // namespace

MpiCommunicator::MpiCommunicator(MpiEnv* env, MPI_Comm comm) : env_(env), comm_(comm) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

MpiCommunicator::~MpiCommunicator() {
  // After a failure the group is never used again; freeing a communicator with a dead member
  // could block, so it is left to the process's end.
  if (comm_ != MPI_COMM_NULL && comm_ != MPI_COMM_WORLD && comm_ != MPI_COMM_SELF && !env_->failed())
    MPI_Comm_free(&comm_);
}

Status MpiCommunicator::finish(int rc, MPI_Request* req, const char* what, double t0, int64_t bytes, bool bounded) {
  if (rc != MPI_SUCCESS) {
    env_->fail(std::string(what) + ": MPI call failed");
    return env_->failure();
  }
  ML4_RETURN_IF_ERROR(env_->wait(req, what, bounded));
  stats_.calls += 1;
  stats_.bytes += bytes;
  stats_.seconds += now_s() - t0;
  return ok_status();
}

Status MpiCommunicator::all_reduce_sum(float* buf, int64_t n) {
  if (env_->failed()) return env_->failure();
  if (size_ == 1 || n == 0) return ok_status();
  ML4_RETURN_IF_ERROR(check_count(n, "all_reduce"));
  const double t0 = now_s();
  MPI_Request req;
  const int rc = MPI_Iallreduce(MPI_IN_PLACE, buf, static_cast<int>(n), MPI_FLOAT, MPI_SUM, comm_, &req);
  return finish(rc, &req, "all_reduce", t0, n * 4);
}

Status MpiCommunicator::all_gather(const void* send, void* recv, int64_t bytes) {
  if (env_->failed()) return env_->failure();
  ML4_RETURN_IF_ERROR(check_count(bytes, "all_gather"));
  const double t0 = now_s();
  const bool in_place = send == static_cast<const char*>(recv) + rank_ * bytes;
  MPI_Request req;
  const int rc = MPI_Iallgather(in_place ? MPI_IN_PLACE : send, static_cast<int>(bytes), MPI_BYTE, recv,
                                static_cast<int>(bytes), MPI_BYTE, comm_, &req);
  return finish(rc, &req, "all_gather", t0, bytes);
}

Status MpiCommunicator::reduce_scatter_sum(const float* send, float* recv, int64_t n) {
  if (env_->failed()) return env_->failure();
  ML4_RETURN_IF_ERROR(check_count(n, "reduce_scatter"));
  const double t0 = now_s();
  MPI_Request req;
  const int rc = MPI_Ireduce_scatter_block(send, recv, static_cast<int>(n), MPI_FLOAT, MPI_SUM, comm_, &req);
  return finish(rc, &req, "reduce_scatter", t0, n * 4 * size_);
}

Status MpiCommunicator::all_to_all(const void* send, void* recv, int64_t bytes) {
  if (env_->failed()) return env_->failure();
  ML4_RETURN_IF_ERROR(check_count(bytes, "all_to_all"));
  const double t0 = now_s();
  MPI_Request req;
  const int rc = MPI_Ialltoall(send, static_cast<int>(bytes), MPI_BYTE, recv, static_cast<int>(bytes), MPI_BYTE,
                               comm_, &req);
  return finish(rc, &req, "all_to_all", t0, bytes * size_);
}

Status MpiCommunicator::all_to_all_v(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                                     const std::vector<int64_t>& recv_bytes) {
  if (env_->failed()) return env_->failure();
  if (static_cast<int>(send_bytes.size()) != size_ || static_cast<int>(recv_bytes.size()) != size_)
    return internal_error("all_to_all_v: {} / {} counts for a group of {}", send_bytes.size(), recv_bytes.size(), size_);
  std::vector<int> sc(size_), sd(size_), rcnt(size_), rd(size_);
  int64_t so = 0, ro = 0;
  for (int p = 0; p < size_; ++p) {
    ML4_RETURN_IF_ERROR(check_count(so + send_bytes[p], "all_to_all_v"));
    ML4_RETURN_IF_ERROR(check_count(ro + recv_bytes[p], "all_to_all_v"));
    sc[p] = static_cast<int>(send_bytes[p]);
    sd[p] = static_cast<int>(so);
    rcnt[p] = static_cast<int>(recv_bytes[p]);
    rd[p] = static_cast<int>(ro);
    so += send_bytes[p];
    ro += recv_bytes[p];
  }
  const double t0 = now_s();
  MPI_Request req;
  const int rc = MPI_Ialltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rcnt.data(), rd.data(), MPI_BYTE, comm_, &req);
  return finish(rc, &req, "all_to_all_v", t0, so);
}

Status MpiCommunicator::broadcast(void* buf, int64_t bytes, int root) {
  if (env_->failed()) return env_->failure();
  ML4_RETURN_IF_ERROR(check_count(bytes, "broadcast"));
  const double t0 = now_s();
  MPI_Request req;
  const int rc = MPI_Ibcast(buf, static_cast<int>(bytes), MPI_BYTE, root, comm_, &req);
  return finish(rc, &req, "broadcast", t0, rank_ == root ? bytes : 0);
}

Status MpiCommunicator::broadcast_unbounded(void* buf, int64_t bytes, int root) {
  if (env_->failed()) return env_->failure();
  ML4_RETURN_IF_ERROR(check_count(bytes, "broadcast"));
  const double t0 = now_s();
  MPI_Request req;
  const int rc = MPI_Ibcast(buf, static_cast<int>(bytes), MPI_BYTE, root, comm_, &req);
  return finish(rc, &req, "waiting for the next step", t0, rank_ == root ? bytes : 0, /*bounded=*/false);
}

Status MpiCommunicator::send(const void* buf, int64_t bytes, int peer) {
  if (env_->failed()) return env_->failure();
  ML4_RETURN_IF_ERROR(check_count(bytes, "send"));
  const double t0 = now_s();
  MPI_Request req;
  const int rc = MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, peer, 0, comm_, &req);
  return finish(rc, &req, "send", t0, bytes);
}

Status MpiCommunicator::recv(void* buf, int64_t bytes, int peer) {
  if (env_->failed()) return env_->failure();
  ML4_RETURN_IF_ERROR(check_count(bytes, "recv"));
  const double t0 = now_s();
  MPI_Request req;
  const int rc = MPI_Irecv(buf, static_cast<int>(bytes), MPI_BYTE, peer, 0, comm_, &req);
  return finish(rc, &req, "recv", t0, 0);
}

Status MpiCommunicator::exchange_counts(const std::vector<int64_t>& send, std::vector<int64_t>* recv) {
  if (static_cast<int>(send.size()) != size_)
    return internal_error("exchange_counts: {} counts for a group of {}", send.size(), size_);
  recv->assign(size_, 0);
  if (size_ == 1) {
    (*recv)[0] = send[0];
    return ok_status();
  }
  return all_to_all(send.data(), recv->data(), sizeof(int64_t));
}

}  // namespace ml4
