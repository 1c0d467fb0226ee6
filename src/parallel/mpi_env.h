// MpiEnv: this process's MPI world (ranks are processes launched by mpirun, SYSTEM.md S10).
//
// Initialised once (MPI_THREAD_SERIALIZED: the engine thread issues a step's collectives,
// the main thread the start-up and the shutdown, never at the same time). At start the ranks
// exchange host names and process ids; a watchdog thread then checks, every 100 ms, that the
// ranks on its own host are alive (kill(pid, 0)). A dead peer or fail() marks the world failed with a message naming the rank: every wait in a collective
// (wait()) returns that error instead of hanging, the rank-0 engine fails its requests, and the
// process ends through MPI_Abort, which makes mpirun stop every other rank. mpirun itself
// also kills the job when a rank exits abnormally (OpenMPI's default), which covers ranks on
// other hosts: rank 0 then sees SIGTERM.
//
// Waits poll MPI_Test, yielding the core after a short spin (ranks may share cores: mpirun
// --oversubscribe on a 2-core CI machine). ML4_DIST_TIMEOUT_S (seconds, default 0: none) bounds
// a single wait on rank 0 and inside steps.
#pragma once

#include <mpi.h>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/status.h"

namespace ml4 {

class MpiEnv {
 public:
  // True when this process was started by an MPI launcher (OpenMPI's or a PMI environment).
  static bool launched_by_mpi();
  // The launcher's world size from the environment (1 when not launched by MPI).
  static int launched_world_size();
  // One node, no launcher: replaces this process by `mpirun -np world` running the same
  // command line (--oversubscribe; --allow-run-as-root as root), so `ml4 serve -tp 2` starts
  // its ranks itself through the same MPI path. Returns only on failure.
  static Status relaunch_under_mpirun(int world);
  // Initialises MPI the first time (later calls return the same world). Sets ML4_THREADS, when
  // unset, to this host's cores divided by the ranks on it, so ranks do not oversubscribe.
  static Result<MpiEnv*> init();
  // The world, or null before init().
  static MpiEnv* get();

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm world() const { return world_; }
  const std::string& host_of(int rank) const { return hosts_[rank]; }
  int pid_of(int rank) const { return pids_[rank]; }

  // MPI_Comm_split of the world: the ranks passing the same color form one communicator,
  // ordered by key. Collective over the world.
  Result<MPI_Comm> split(int color, int key);

  // Marks the world failed (first reason wins) and returns that error from every later wait.
  void fail(const std::string& reason);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  Status failure() const;
  // Waits for a request; fails on a failed world or after ML4_DIST_TIMEOUT_S when `bounded`.
  Status wait(MPI_Request* req, const char* what, bool bounded = true);

  // Workers: SIGTERM / SIGINT (which mpirun forwards to every rank) are noted and logged; the
  // worker serves on until rank 0, which drains first, stops the group.
  void install_worker_signal_handlers();
  // Ends the process's MPI: MPI_Finalize after a clean run, MPI_Abort after a failure (so
  // mpirun stops the other ranks). Also run at exit.
  void finish();

 private:
  MpiEnv() = default;
  void watchdog();

  int rank_ = 0, size_ = 1;
  MPI_Comm world_ = MPI_COMM_NULL;
  std::vector<std::string> hosts_;
  std::vector<int> pids_;
  double timeout_s_ = 0.0;
  std::atomic<bool> failed_{false};
  mutable std::mutex mu_;
  std::string reason_;
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
  bool finished_ = false;
};

}  // namespace ml4
