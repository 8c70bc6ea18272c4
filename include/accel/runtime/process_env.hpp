// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::ProcessEnv: who am I among the processes.
#ifndef ACCEL_RUNTIME_PROCESS_ENV_HPP
#define ACCEL_RUNTIME_PROCESS_ENV_HPP

#include <cctype>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include <accel/errors.hpp>

namespace accel::runtime {

/// Rank and world of this process, read from the environment.
struct ProcessEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "none";  ///< which convention supplied the values

  bool distributed() const { return world_size > 1; }

  /// Discovery order (API.md section 5): torchrun (RANK/WORLD_SIZE/LOCAL_RANK),
  /// OpenMPI (OMPI_COMM_WORLD_*), PMI (PMI_RANK/PMI_SIZE), Slurm
  /// (SLURM_PROCID/SLURM_NTASKS); none of them: a single process.
  static ProcessEnv discover();
};

namespace detail {

inline std::optional<std::string> getenv_str(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

inline std::optional<int> getenv_int(const char* name) {
  auto s = getenv_str(name);
  if (!s) return std::nullopt;
  try {
    std::size_t used = 0;
    int v = std::stoi(*s, &used);
    if (used != s->size()) throw std::invalid_argument(*s);
    return v;
  } catch (const std::exception&) {
    throw Error(std::string("accel: environment variable ") + name + "='" + *s +
                "' is not an integer. Unset it or give it a whole number.");
  }
}

/// A yes/no variable, spelled as Accelerate's parse_flag_from_env accepts
/// (1/y/yes/t/true/on, 0/n/no/f/false/off, any case); unset or empty is no,
/// anything else is an error rather than a silent no.
inline bool getenv_flag(const char* name) {
  auto v = getenv_str(name);
  if (!v) return false;
  std::string s = *v;
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* yes : {"1", "y", "yes", "t", "true", "on"})
    if (s == yes) return true;
  for (const char* no : {"0", "n", "no", "f", "false", "off"})
    if (s == no) return false;
  throw Error(std::string("accel: environment variable ") + name + "='" + v->substr(0, 100) +
              "' is neither yes nor no. Set it to 1/yes/true/on or 0/no/false/off, or unset it.");
}

}  // namespace detail

inline ProcessEnv ProcessEnv::discover() {
  using detail::getenv_int;
  using detail::getenv_str;
  ProcessEnv env;
  auto take = [&](const char* rank, const char* size, const char* local_rank,
                  const char* local_size, const char* source) {
    auto r = getenv_int(rank);
    auto s = getenv_int(size);
    // torchrun's pair set by half is a broken launch, not one process (other
    // launchers' variables are left to their launchers).
    if (std::string_view(source) == "torchrun" && r.has_value() != s.has_value())
      throw Error(accel::detail::concat(
          "accel: ", r ? rank : size, "=", r ? *r : *s, " is set but ", r ? size : rank,
          " is not. Set both (accel launch and torchrun do), or neither to run one process."));
    if (!r || !s) return false;
    env.rank = *r;
    env.world_size = *s;
    env.local_rank = local_rank ? getenv_int(local_rank).value_or(env.rank) : env.rank;
    env.local_world_size =
        local_size ? getenv_int(local_size).value_or(env.world_size) : env.world_size;
    env.source = source;
    return true;
  };
  take("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun") ||
      take("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
           "OMPI_COMM_WORLD_LOCAL_SIZE", "openmpi") ||
      take("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "pmi") ||
      take("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "slurm");
  if (auto a = getenv_str("MASTER_ADDR")) env.master_addr = *a;
  if (auto p = getenv_int("MASTER_PORT")) env.master_port = *p;
  if (env.world_size < 1)
    throw Error("accel: world size " + std::to_string(env.world_size) + " (from " + env.source +
                " variables) is not a number of processes. Check the launcher's RANK/WORLD_SIZE "
                "settings.");
  if (env.rank < 0 || env.rank >= env.world_size)
    throw Error("accel: rank " + std::to_string(env.rank) + " is outside world size " +
                std::to_string(env.world_size) + " (from " + env.source +
                " variables). Check the launcher's RANK/WORLD_SIZE settings.");
  if (env.local_world_size < 1) env.local_world_size = 1;
  return env;
}

}  // namespace accel::runtime

#endif  // ACCEL_RUNTIME_PROCESS_ENV_HPP
