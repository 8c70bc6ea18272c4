// SPDX-License-Identifier: Apache-2.0
/// @file Defines `accel env`: what to paste into a bug report (versions,
/// backends compiled in, cores, the config in effect).
#ifndef ACCEL_TOOLS_CLI_ENV_COMMAND_HPP
#define ACCEL_TOOLS_CLI_ENV_COMMAND_HPP

#include <sys/utsname.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>

#include <torch/version.h>

#include <accel/config.hpp>
#include <accel/launch/config_file.hpp>
#include <accel/launch/detail/posix.hpp>
#include <accel/version.hpp>

#if ACCEL_WITH_MPI
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // only the C API is used; the C++ bindings warn
#endif
#include <mpi.h>
#endif
#if ACCEL_WITH_CUDA
#include <cuda_runtime_api.h>
#include <torch/cuda.h>
#endif
#if ACCEL_WITH_NCCL
#include <nccl.h>
#endif

namespace accel::cli {

inline std::string mpi_library_version() {
#if ACCEL_WITH_MPI
  char buf[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(buf, &len);  // allowed before MPI_Init
  std::string s(buf, static_cast<std::size_t>(len));
  if (auto nl = s.find('\n'); nl != std::string::npos) s.resize(nl);
  while (!s.empty() && (s.back() == ',' || s.back() == ' ' || s.back() == '\0')) s.pop_back();
  return s;
#else
  return "not compiled in";
#endif
}

/// `accel env [--config_file F]`.
inline int run_env(const std::optional<std::string>& config_file, std::ostream& out) {
  out << "- accel version: " << version_string << "\n";
  out << "- LibTorch version: " << TORCH_VERSION << "\n";
#if ACCEL_WITH_CUDA
  out << "- CUDA runtime: " << CUDART_VERSION / 1000 << "." << (CUDART_VERSION % 1000) / 10
      << " (" << torch::cuda::device_count() << " device(s) visible)\n";
#else
  out << "- CUDA: not compiled in\n";
#endif
#if ACCEL_WITH_NCCL
  out << "- NCCL: " << NCCL_MAJOR << "." << NCCL_MINOR << "." << NCCL_PATCH << "\n";
#else
  out << "- NCCL: not compiled in\n";
#endif
  out << "- MPI: " << mpi_library_version() << "\n";
  out << "- Backends compiled in: SingleDevice, Gloo" << (ACCEL_WITH_MPI ? ", Mpi" : "")
      << (ACCEL_WITH_NCCL ? ", Nccl" : "") << "\n";
  utsname u{};
  if (::uname(&u) == 0)
    out << "- Platform: " << u.sysname << " " << u.release << " " << u.machine << "\n";
#if defined(__clang__)
  out << "- Compiler: clang " << __clang_major__ << "." << __clang_minor__ << "\n";
#elif defined(__GNUC__)
  out << "- Compiler: GCC " << __GNUC__ << "." << __GNUC_MINOR__ << "\n";
#endif
  out << "- CPU cores available: " << detail::launch::available_cores() << "\n";
  const std::filesystem::path path =
      config_file ? std::filesystem::path(*config_file)
                  : config_file_in_effect().value_or(default_config_path());
  if (std::filesystem::exists(path)) {
    try {
      (void)read_config_file(path, nullptr);  // only a readable file is shown
      out << "- Config file: " << path.string() << "\n";
      std::ifstream in(path);
      std::string line;
      while (std::getline(in, line)) out << "    " << line << "\n";
    } catch (const ConfigError& e) {
      out << "- Config file: " << path.string() << " (unreadable: `accel launch` would stop: "
          << e.what() << ")\n";
    }
  } else {
    out << "- Config file: " << path.string() << " (not found: `accel launch` uses defaults)\n";
  }
  return 0;
}

}  // namespace accel::cli

#endif  // ACCEL_TOOLS_CLI_ENV_COMMAND_HPP
