// SPDX-License-Identifier: Apache-2.0
/// @file Defines the file side of save_state/load_state: torch archives and
/// JSON files read with errors that name the file, fsync of written files,
/// the atomic directory commit, the generator states of a process, and the
/// test-only crash hook.
#ifndef ACCEL_CHECKPOINT_DETAIL_STATE_FILES_HPP
#define ACCEL_CHECKPOINT_DETAIL_STATE_FILES_HPP

#include <accel/checkpoint/detail/file_io.hpp>
#include <accel/errors.hpp>
#include <accel/random.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <exception>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>

#include <fcntl.h>
#include <unistd.h>

namespace accel::ckpt::detail {

namespace fs = std::filesystem;

/// Test-only: ACCEL_TEST_SAVE_STATE_CRASH=<point> makes save_state kill its
/// own process with SIGKILL at that point ("writing": after this process's
/// first file; "before_commit": main process, all files in, before the
/// rename; "between_renames": main process, forces the two-rename commit and
/// dies between the renames). Lets tests check that a killed save leaves the
/// previous checkpoint loadable.
inline void crash_point(std::string_view point) {
  const char* want = std::getenv("ACCEL_TEST_SAVE_STATE_CRASH");
  if (want != nullptr && point == want) ::kill(::getpid(), SIGKILL);
}
inline bool crash_requested(std::string_view point) {
  const char* want = std::getenv("ACCEL_TEST_SAVE_STATE_CRASH");
  return want != nullptr && point == want;
}

/// fsync a file or directory (best effort for directories: some file
/// systems refuse it).
inline void fsync_path(const fs::path& p, bool directory) {
  const int fd = ::open(p.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) {
    if (directory) return;
    fail_io("open for flushing", p, errno);
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && !directory) fail_io("flush", p, err);
}

/// Writes an archive atomically through accel's own file, so that a failed
/// write (a full disk) is an error naming the path and errno rather than
/// LibTorch's "unexpected pos" (and its abort: its writer's destructor throws
/// again), and the checksum comes with the write.
inline std::uint64_t save_archive(torch::serialize::OutputArchive& archive, const fs::path& path) {
  AtomicFile file(path);
  std::exception_ptr io_error;
  const auto write = [&](const void* data, std::size_t size) -> std::size_t {
    // After a failed write the rest is dropped but reported as written, so
    // that LibTorch finishes its archive normally; the error is thrown below.
    if (io_error) return size;
    try {
      if (data != nullptr) {
        file.write(data, size);
      } else {  // LibTorch's "skip ahead": a hole, zeros in a new file
        const std::string zeros(size, '\0');
        file.write(zeros.data(), size);
      }
      return size;
    } catch (...) {
      io_error = std::current_exception();
      return size;
    }
  };
  try {
    archive.save_to(write);
  } catch (const c10::Error& e) {
    if (io_error) std::rethrow_exception(io_error);
    throw Error(accel::detail::concat("accel: cannot write '", path.string(), "': ",
                                      e.what_without_backtrace(),
                                      ". Check the path, its permissions and the free disk space."));
  }
  if (io_error) std::rethrow_exception(io_error);
  file.commit();
  return file.checksum();
}

[[noreturn]] inline void fail_missing(const fs::path& path) {
  throw Error("accel: the checkpoint file '" + path.string() +
              "' is missing. Load a directory written completely by save_state().");
}

[[noreturn]] inline void fail_checksum(const fs::path& path, std::uint64_t actual, std::uint64_t expected) {
  throw Error(accel::detail::concat(
      "accel: the checkpoint file '", path.string(),
      "' is corrupt: its bytes changed after save_state() wrote them (XXH64 ", to_hex(actual),
      ", recorded ", to_hex(expected), "). Load another checkpoint, or restore this file from a copy."));
}

/// The file's bytes (a small file), checked against the checksum save_state
/// recorded for it (none: a checkpoint written before accel recorded them).
inline std::string read_checked(const fs::path& path, std::optional<std::uint64_t> expected) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) fail_missing(path);
  std::string bytes = read_whole_file(path);
  if (expected) {
    Xxh64 hash;
    hash.update(bytes);
    if (hash.digest() != *expected) fail_checksum(path, hash.digest(), *expected);
  }
  return bytes;
}

/// A whole archive, checked and parsed; a truncated or corrupt file is an
/// accel::Error. The check reads the file once more (from the page cache)
/// rather than holding a copy of it in memory: optimizer files are large.
inline void load_archive(torch::serialize::InputArchive& archive, const fs::path& path,
                         std::optional<std::uint64_t> expected,
                         c10::optional<torch::Device> device = c10::nullopt) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) fail_missing(path);
  if (expected) {
    const auto actual = file_checksum(path);
    if (actual != *expected) fail_checksum(path, actual, *expected);
  }
  try {
    archive.load_from(path.string(), device);
  } catch (const c10::Error& e) {
    throw Error(accel::detail::concat("accel: the checkpoint file '", path.string(),
                                      "' is truncated or corrupt (", e.what_without_backtrace(),
                                      "). Load another checkpoint, or save this one again."));
  }
}

inline std::uint64_t write_json(const fs::path& path, const nlohmann::json& j) {
  return write_file_atomic(path, j.dump(2) + "\n");
}

inline nlohmann::json read_json(const fs::path& path,
                                std::optional<std::uint64_t> expected = std::nullopt) {
  const std::string text = read_checked(path, expected);
  try {
    auto j = nlohmann::json::parse(text);
    if (!j.is_object()) throw std::runtime_error("not a JSON object");
    return j;
  } catch (const std::exception& e) {
    throw Error(accel::detail::concat("accel: the checkpoint file '", path.string(),
                                      "' is truncated or corrupt (", e.what(),
                                      "). Load another checkpoint, or save this one again."));
  }
}

/// j[key] as T, or an accel::Error naming the file and the key.
template <class T>
T json_field(const nlohmann::json& j, const char* key, const fs::path& source) {
  try {
    return j.at(key).get<T>();
  } catch (const std::exception&) {
    throw Error(accel::detail::concat("accel: the checkpoint file '", source.string(),
                                      "' has no valid '", key,
                                      "' entry. Load a directory written by save_state()."));
  }
}

/// Puts `stage` (complete, flushed) in place of `target`. A reader sees the
/// old or the new checkpoint at every instant: renameat2(RENAME_EXCHANGE)
/// swaps them in one step; where that is unavailable, target moves aside to
/// target.accel-old first (load_state() falls back to it if target is gone).
inline void commit_directory(const fs::path& stage, const fs::path& target) {
  std::error_code ec;
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const fs::path old = target.string() + ".accel-old";
  if (!fs::exists(target, ec)) {
    if (::rename(stage.c_str(), target.c_str()) != 0)
      fail_io("rename the finished checkpoint to", target, errno);
    fsync_path(parent, true);
    fs::remove_all(old, ec);
    return;
  }
#if defined(RENAME_EXCHANGE)
  if (!crash_requested("between_renames") &&
      ::renameat2(AT_FDCWD, stage.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
    fsync_path(parent, true);
    fs::remove_all(stage, ec);  // now the previous checkpoint
    return;
  }
#endif
  fs::remove_all(old, ec);
  if (::rename(target.c_str(), old.c_str()) != 0)
    fail_io("move the previous checkpoint aside from", target, errno);
  fsync_path(parent, true);
  crash_point("between_renames");
  if (::rename(stage.c_str(), target.c_str()) != 0)
    fail_io("rename the finished checkpoint to", target, errno);
  fsync_path(parent, true);
  fs::remove_all(old, ec);
}

/// The directory to read: target, or target.accel-old when a commit was
/// interrupted between its two renames.
inline fs::path readable_checkpoint(const fs::path& target) {
  std::error_code ec;
  if (fs::is_directory(target, ec)) return target;
  const fs::path old = target.string() + ".accel-old";
  if (!fs::exists(target, ec) && fs::is_directory(old, ec)) return old;
  if (fs::exists(target, ec))
    throw Error("accel: the checkpoint path '" + target.string() +
                "' is a file, not a directory. Pass the directory save_state() wrote (the one "
                "holding accel_state.json).");
  throw Error("accel: the checkpoint directory '" + target.string() +
              "' does not exist. Pass a directory written by save_state().");
}

// ---- generator states ----

inline torch::Tensor generator_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
inline void set_generator_state(at::Generator gen, const torch::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

inline int cuda_device_count() {
  return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
}

/// This process's generators: LibTorch's CPU generator, every CUDA device's,
/// and accel::std_generator(). std::rand has no readable state and is not saved.
inline void save_generators(torch::serialize::OutputArchive& out) {
  out.write("cpu", generator_state(at::detail::getDefaultCPUGenerator()));
  const int n = cuda_device_count();
  out.write("cuda_count", torch::tensor(static_cast<int64_t>(n)));
  for (int i = 0; i < n; ++i)
    out.write("cuda_" + std::to_string(i),
              generator_state(at::globalContext().defaultGenerator(
                  c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)))));
  std::ostringstream mt;
  mt << std_generator();
  out.write("std_generator", c10::IValue(mt.str()));
}

/// The generator states read from an archive, checked; apply() sets them.
struct GeneratorStates {
  torch::Tensor cpu;
  std::vector<torch::Tensor> cuda;
  std::mt19937_64 std_gen;

  static GeneratorStates read(torch::serialize::InputArchive& in, const fs::path& source) {
    GeneratorStates s;
    try {
      in.read("cpu", s.cpu);
      torch::Tensor count;
      in.read("cuda_count", count);
      const auto n = count.item<int64_t>();
      for (int64_t i = 0; i < n; ++i) {
        torch::Tensor t;
        in.read("cuda_" + std::to_string(i), t);
        s.cuda.push_back(t);
      }
      c10::IValue mt;
      in.read("std_generator", mt);
      std::istringstream text(mt.toStringRef());
      text >> s.std_gen;
      if (!text) throw std::runtime_error("std_generator state does not parse");
    } catch (const std::exception& e) {
      throw Error(accel::detail::concat("accel: the checkpoint file '", source.string(),
                                        "' is truncated or corrupt (", e.what(),
                                        "). Load another checkpoint, or save this one again."));
    }
    const auto expect = generator_state(at::detail::getDefaultCPUGenerator());
    ACCEL_CHECK(s.cpu.scalar_type() == torch::kByte && s.cpu.numel() == expect.numel(),
                "accel: the CPU generator state in '", source.string(),
                "' has the wrong size. Load a checkpoint saved by this LibTorch.");
    return s;
  }

  void apply() const {
    set_generator_state(at::detail::getDefaultCPUGenerator(), cpu);
    const int n = std::min<int>(cuda_device_count(), static_cast<int>(cuda.size()));
    for (int i = 0; i < n; ++i)
      set_generator_state(at::globalContext().defaultGenerator(
                              c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i))),
                          cuda[static_cast<std::size_t>(i)]);
    std_generator() = std_gen;
  }
};

}  // namespace accel::ckpt::detail

#endif  // ACCEL_CHECKPOINT_DETAIL_STATE_FILES_HPP
