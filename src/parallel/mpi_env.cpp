#include "parallel/mpi_env.h"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include "core/log.h"

namespace ml4 {
namespace {

MpiEnv* g_env = nullptr;
volatile std::sig_atomic_t g_worker_signal = 0;

extern "C" void on_worker_signal(int sig) { g_worker_signal = sig; }

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// A process that is gone or a zombie (exited, not yet reaped by its launcher daemon).
bool process_dead(int pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return false;
  const size_t close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z';
}

void finish_at_exit() {
  if (g_env != nullptr) g_env->finish();
}

}  // namespace

bool MpiEnv::launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr ||
         std::getenv("PMIX_RANK") != nullptr;
}

int MpiEnv::launched_world_size() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"})
    if (const char* e = std::getenv(v)) return std::max(1, std::atoi(e));
  return 1;
}

Status MpiEnv::relaunch_under_mpirun(int world) {
  if (std::getenv("ML4_MPI_RELAUNCHED") != nullptr)
    return internal_error("started by mpirun but no MPI environment is visible (OMPI_COMM_WORLD_SIZE unset)");
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> args;
  for (std::string a; std::getline(f, a, '\0');) args.push_back(a);
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0 || args.empty()) return io_error("cannot read this process's command line to relaunch it under mpirun");
  exe[n] = '\0';
  std::vector<std::string> cmd = {"mpirun", "-np", std::to_string(world), "--oversubscribe"};
  if (getuid() == 0) cmd.push_back("--allow-run-as-root");
  cmd.push_back(exe);
  cmd.insert(cmd.end(), args.begin() + 1, args.end());
  std::vector<char*> argv;
  for (auto& a : cmd) argv.push_back(a.data());
  argv.push_back(nullptr);
  setenv("ML4_MPI_RELAUNCHED", "1", 1);
  ML4_LOG_INFO("starting {} ranks: mpirun -np {} ...", world, world);
  execvp("mpirun", argv.data());
  return io_error("cannot run mpirun ({}): install openmpi-bin, or start the ranks with mpirun -np {} yourself",
                  std::strerror(errno), world);
}

MpiEnv* MpiEnv::get() { return g_env; }

Result<MpiEnv*> MpiEnv::init() {
  if (g_env != nullptr) return g_env;
  // ML4_THREADS before anything starts the CPU thread pool: the host's cores shared by its ranks.
  if (std::getenv("ML4_THREADS") == nullptr) {
    int local = 1;
    if (const char* e = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) local = std::max(1, std::atoi(e));
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    setenv("ML4_THREADS", std::to_string(std::max(1, cores / local)).c_str(), 0);
  }
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
      return internal_error("MPI_Init_thread failed");
    if (provided < MPI_THREAD_SERIALIZED)
      return internal_error("the MPI library gives thread level {}, ml4 needs MPI_THREAD_SERIALIZED", provided);
  }
  auto* env = new MpiEnv();
  MPI_Comm_dup(MPI_COMM_WORLD, &env->world_);
  // Errors come back as codes (and become Status), never abort inside MPI.
  MPI_Comm_set_errhandler(env->world_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(env->world_, &env->rank_);
  MPI_Comm_size(env->world_, &env->size_);
  if (const char* e = std::getenv("ML4_DIST_TIMEOUT_S")) env->timeout_s_ = std::atof(e);
  // Host names and pids of every rank (the watchdog checks the ranks of its own host).
  struct Ident {
    char host[64];
    int pid;
  } me{}, *all = nullptr;
  gethostname(me.host, sizeof(me.host) - 1);
  me.pid = static_cast<int>(getpid());
  std::vector<Ident> idents(env->size_);
  all = idents.data();
  if (MPI_Allgather(&me, sizeof(Ident), MPI_BYTE, all, sizeof(Ident), MPI_BYTE, env->world_) != MPI_SUCCESS)
    return internal_error("MPI_Allgather of the rank identities failed");
  for (const auto& id : idents) {
    env->hosts_.emplace_back(id.host);
    env->pids_.push_back(id.pid);
  }
  g_env = env;
  std::atexit(finish_at_exit);
  env->watchdog_ = std::thread([env] { env->watchdog(); });
  return env;
}

Result<MPI_Comm> MpiEnv::split(int color, int key) {
  MPI_Comm c = MPI_COMM_NULL;
  if (MPI_Comm_split(world_, color, key, &c) != MPI_SUCCESS) return internal_error("MPI_Comm_split failed");
  MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
  return c;
}

void MpiEnv::fail(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failed_.load()) return;
    reason_ = reason;
    failed_.store(true, std::memory_order_release);
  }
  ML4_LOG_ERROR("rank {}: parallel group stopped: {}", rank_, reason);
}

Status MpiEnv::failure() const {
  std::lock_guard<std::mutex> lk(mu_);
  return Status(StatusCode::kInternal, "parallel group stopped: " + reason_);
}

Status MpiEnv::wait(MPI_Request* req, const char* what, bool bounded) {
  const double start = now_s();
  for (int spins = 0;; ++spins) {
    int done = 0;
    if (MPI_Test(req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
      fail(std::string(what) + ": MPI reported an error (a rank probably exited)");
      return failure();
    }
    if (done) return ok_status();
    if (failed()) {
      // The last message may have arrived before its sender died (rank 0's stop).
      if (MPI_Test(req, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) return ok_status();
      return failure().with_context(what);
    }
    if (spins < 256) continue;
    const double waited = now_s() - start;
    if (bounded && timeout_s_ > 0.0 && waited > timeout_s_) {
      fail(fmt::format("{}: no answer from the group within ML4_DIST_TIMEOUT_S = {} s", what, timeout_s_));
      return failure();
    }
    if (waited < 0.002) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(waited < 0.1 ? 20 : 200));
    }
  }
}

void MpiEnv::install_worker_signal_handlers() {
  std::signal(SIGTERM, on_worker_signal);
  std::signal(SIGINT, on_worker_signal);
}

void MpiEnv::watchdog() {
  bool signal_logged = false;
  while (!stop_.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (failed()) continue;
    if (const int sig = g_worker_signal; sig != 0 && !signal_logged) {
      // mpirun forwards a user's SIGTERM / SIGINT to every rank: rank 0 drains and then stops
      // the group; a worker keeps serving until then (rank 0's death is caught below).
      ML4_LOG_INFO("rank {}: signal {}; serving until rank 0 stops the group", rank_, sig);
      signal_logged = true;
    }
    for (int r = 0; r < size_; ++r) {
      if (r == rank_ || hosts_[r] != hosts_[rank_] || !process_dead(pids_[r])) continue;
      fail(fmt::format("rank {} (pid {} on {}) exited", r, pids_[r], hosts_[r]));
      // Rank 0 serves: a signal to itself starts the server's shutdown; a command without a
      // handler ends here, and mpirun stops the rest.
      if (rank_ == 0) ::kill(getpid(), SIGTERM);
      break;
    }
  }
}

void MpiEnv::finish() {
  if (finished_) return;
  finished_ = true;
  stop_.store(true);
  if (watchdog_.joinable()) watchdog_.join();
  if (failed()) {
    ML4_LOG_ERROR("rank {}: {}; aborting the MPI job", rank_, failure().message());
    MPI_Abort(MPI_COMM_WORLD, 1);
    return;
  }
  int fin = 0;
  MPI_Finalized(&fin);
  if (!fin) MPI_Finalize();
}

}  // namespace ml4
