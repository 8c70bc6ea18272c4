// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::detail::MpiRuntime: MPI initialised once per
/// process (finalised at exit unless the user initialised it), and the join of
/// processes that mpirun did not start (OpenMPI singletons + ompi-server).
#ifndef ACCEL_RUNTIME_DETAIL_MPI_RUNTIME_HPP
#define ACCEL_RUNTIME_DETAIL_MPI_RUNTIME_HPP

#if ACCEL_WITH_MPI

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <accel/errors.hpp>
#include <accel/runtime/detail/mpi.hpp>
#include <accel/runtime/process_env.hpp>

namespace accel::runtime::detail {

inline std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(len));
}

/// True when an MPI launcher (mpirun/mpiexec, srun with PMI/PMIx) started us.
inline bool started_by_mpi_launcher() {
  return getenv_str("OMPI_COMM_WORLD_SIZE") || getenv_str("PMIX_RANK") || getenv_str("PMI_SIZE") ||
         getenv_str("PMI_RANK");
}

/// Process-wide MPI state: one MPI_Init_thread, one MPI_Finalize at exit.
class MpiRuntime {
 public:
  static MpiRuntime& instance() {
    static MpiRuntime runtime;
    return runtime;
  }

  /// Initialises MPI unless someone (the user, or an earlier call) did.
  void ensure_initialized() {
    std::lock_guard<std::mutex> guard(init_mutex_);
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    ACCEL_CHECK(!finalized, "accel: MPI was already finalised in this process. Create the MPI "
                            "communicator before MPI_Finalize.");
    if (!initialized) {
      int provided = 0;
      int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      ACCEL_CHECK(rc == MPI_SUCCESS, "accel: MPI_Init_thread failed: ", mpi_error_string(rc),
                  ". Check the MPI installation (try `mpirun -np 2 hostname`).");
      owns_mpi_ = true;
    }
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    multiple_ = level >= MPI_THREAD_MULTIPLE;
  }

  /// Locks MPI calls unless MPI is thread-safe (MPI_THREAD_MULTIPLE).
  std::unique_lock<std::mutex> lock() {
    return multiple_ ? std::unique_lock<std::mutex>(call_mutex_, std::defer_lock)
                     : std::unique_lock<std::mutex>(call_mutex_);
  }

  bool thread_multiple() const { return multiple_; }
  bool owns_mpi() const { return owns_mpi_; }

  /// An ompi-server this process started for the singleton join; ended at exit.
  void adopt_server(pid_t pid) { server_pid_ = pid; }

  /// MPI_Finalize (if accel initialised MPI) and stop ompi-server. Runs at
  /// exit; call it yourself only before leaving through _exit.
  void shutdown() {
    std::lock_guard<std::mutex> guard(init_mutex_);
    int initialized = 0, finalized = 1;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (owns_mpi_ && initialized && !finalized) MPI_Finalize();
    if (server_pid_ > 0) {
      ::kill(server_pid_, SIGTERM);
      ::waitpid(server_pid_, nullptr, 0);
      server_pid_ = -1;
    }
  }

  ~MpiRuntime() { shutdown(); }

  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

 private:
  MpiRuntime() = default;
  std::mutex init_mutex_, call_mutex_;
  bool owns_mpi_ = false, multiple_ = false;
  pid_t server_pid_ = -1;
};

inline std::string store_get_string(c10d::Store& store, const std::string& key) {
  auto v = store.get(key);
  return std::string(v.begin(), v.end());
}

inline void store_set_string(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

inline std::string find_program(const std::string& name) {
  auto path = getenv_str("PATH").value_or("/usr/bin:/bin");
  std::size_t start = 0;
  while (start <= path.size()) {
    auto end = path.find(':', start);
    if (end == std::string::npos) end = path.size();
    std::filesystem::path p = std::filesystem::path(path.substr(start, end - start)) / name;
    if (::access(p.c_str(), X_OK) == 0) return p.string();
    start = end + 1;
  }
  return {};
}

/// Rank 0: starts `ompi-server` and returns its URI (read from --report-uri).
inline std::string start_ompi_server(std::chrono::milliseconds timeout) {
  const std::string exe = find_program("ompi-server");
  ACCEL_CHECK(!exe.empty(), "accel: backend::Mpi in processes not started by mpirun needs "
                            "OpenMPI's ompi-server, which is not on PATH (OpenMPI 5 no longer "
                            "ships it). Start the program with `mpirun -np N`, or use "
                            "backend::Gloo with notebook_launcher and `accel launch`.");
  const auto uri_file = std::filesystem::temp_directory_path() /
                        ("accel-ompi-server-" + std::to_string(::getpid()) + ".uri");
  std::filesystem::remove(uri_file);
  pid_t pid = ::fork();
  ACCEL_CHECK(pid >= 0, "accel: cannot fork ompi-server. Start the program with `mpirun -np N`.");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // never outlives rank 0
    ::execl(exe.c_str(), exe.c_str(), "--no-daemonize", "--report-uri", uri_file.c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  MpiRuntime::instance().adopt_server(pid);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string uri;
  while (uri.empty()) {
    std::ifstream in(uri_file);
    if (in) std::getline(in, uri);
    if (!uri.empty()) break;
    int status = 0;
    ACCEL_CHECK(::waitpid(pid, &status, WNOHANG) == 0,
                "accel: ompi-server exited before reporting its address. Start the program with "
                "`mpirun -np N` instead.");
    ACCEL_CHECK(std::chrono::steady_clock::now() < deadline,
                "accel: ompi-server did not report its address in time. Start the program with "
                "`mpirun -np N` instead.");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::filesystem::remove(uri_file);
  return uri;
}

/// Joins `world_size` OpenMPI singletons into one intra-communicator whose
/// ranks equal env.rank: rank 0 opens a port, then rank k connects while
/// ranks 0..k-1 accept, and each step merges (the newcomer last). The port
/// name and ompi-server's URI travel through the c10d store. Must run before
/// MPI_Init: OMPI_MCA_pmix_server_uri is read there.
inline MPI_Comm join_singletons(const ProcessEnv& env, c10d::Store& store,
                                std::chrono::milliseconds timeout) {
  auto& rt = MpiRuntime::instance();
  int initialized = 0;
  MPI_Initialized(&initialized);
  ACCEL_CHECK(!initialized, "accel: MPI is already initialised but this process was not started "
                            "by mpirun, so its ranks cannot be joined. Start the program with "
                            "`mpirun -np N`, or let accel initialise MPI.");
  if (env.rank == 0) {
    std::string uri;
    try {
      uri = start_ompi_server(timeout);
    } catch (...) {
      store_set_string(store, "accel/mpi/uri", "");
      throw;
    }
    store_set_string(store, "accel/mpi/uri", uri);
  }
  std::string uri;
  try {
    uri = store_get_string(store, "accel/mpi/uri");
  } catch (const std::exception& e) {
    // Rank 0 serves the store: when it fails here, its exit cuts the
    // connection, and the launcher must report rank 0's error, not this one.
    const std::string what = e.what();
    throw Error(accel::detail::concat("accel: backend::Mpi: rank ", env.rank, " lost the rendezvous "
                                      "store on rank 0 while joining (", what.substr(0, what.find('\n')),
                                      "). ", accel::detail::kPeerVanished, " or failed: look at rank 0's error."));
  }
  ACCEL_CHECK(!uri.empty(), "accel: rank 0 could not start ompi-server for backend::Mpi ",
              accel::detail::kFailedElsewhere, ". Start the program with `mpirun -np N`.");
  ::setenv("OMPI_MCA_pmix_server_uri", uri.c_str(), 1);
  rt.ensure_initialized();

  char port[MPI_MAX_PORT_NAME] = {0};
  if (env.rank == 0) {
    MPI_Open_port(MPI_INFO_NULL, port);
    store_set_string(store, "accel/mpi/port", port);
  }
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_SELF, &comm);
  for (int k = 1; k < env.world_size; ++k) {
    if (env.rank > k) continue;  // not started yet: joins at step env.rank
    MPI_Comm inter = MPI_COMM_NULL, merged = MPI_COMM_NULL;
    int rc;
    if (env.rank < k) {
      if (env.rank == 0) store_set_string(store, "accel/mpi/accepting/" + std::to_string(k), "1");
      rc = MPI_Comm_accept(port, MPI_INFO_NULL, 0, comm, &inter);
    } else {
      store.wait({"accel/mpi/accepting/" + std::to_string(k)}, timeout);
      const std::string name = store_get_string(store, "accel/mpi/port");
      rc = MPI_Comm_connect(name.c_str(), MPI_INFO_NULL, 0, MPI_COMM_SELF, &inter);
    }
    ACCEL_CHECK(rc == MPI_SUCCESS, "accel: rank ", env.rank, " could not join MPI rank ", k, ": ",
                mpi_error_string(rc), ". Start the program with `mpirun -np N`.");
    MPI_Intercomm_merge(inter, env.rank == k ? 1 : 0, &merged);
    MPI_Comm_free(&inter);
    MPI_Comm_free(&comm);
    comm = merged;
  }
  if (env.rank == 0) MPI_Close_port(port);
  int r = -1, n = 0;
  MPI_Comm_rank(comm, &r);
  MPI_Comm_size(comm, &n);
  ACCEL_CHECK(r == env.rank && n == env.world_size, "accel: joined MPI ranks disagree with the "
              "environment (rank ", r, " of ", n, " vs ", env.rank, " of ", env.world_size,
              "). Start the program with `mpirun -np N`.");
  return comm;
}

}  // namespace accel::runtime::detail

#endif  // ACCEL_WITH_MPI

#endif  // ACCEL_RUNTIME_DETAIL_MPI_RUNTIME_HPP
