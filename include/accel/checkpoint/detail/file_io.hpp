// SPDX-License-Identifier: Apache-2.0
/// @file Defines the POSIX file helpers of checkpointing: atomic writes
/// (temporary file in the same directory, fsync, rename) that checksum what
/// they write, positioned reads, and whole-file reads.
#ifndef ACCEL_CHECKPOINT_DETAIL_FILE_IO_HPP
#define ACCEL_CHECKPOINT_DETAIL_FILE_IO_HPP

#include <accel/checkpoint/detail/xxhash64.hpp>
#include <accel/errors.hpp>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace accel::ckpt::detail {

[[noreturn]] inline void fail_io(std::string_view what, const std::filesystem::path& path,
                                 int error) {
  throw Error(accel::detail::concat("accel: cannot ", what, " '", path.string(),
                                    "': ", std::strerror(error),
                                    ". Check the path, its permissions and the free disk space."));
}

/// A file written under a temporary name and renamed over `target` on
/// commit(), so readers see the old file or the complete new one, never a
/// partial write. Destroyed uncommitted, it removes the temporary file.
/// checksum() is the XXH64 of the bytes given to write(), in order.
class AtomicFile {
 public:
  explicit AtomicFile(std::filesystem::path target) : target_(std::move(target)) {
    const std::filesystem::path dir = target_.has_parent_path() ? target_.parent_path() : ".";
    // Appended piecewise: GCC 12 at -O3 warns falsely on "." + std::string&&.
    std::string name(1, '.');
    name += target_.filename().string();
    name += ".tmp.XXXXXX";
    std::string tmpl = (dir / name).string();
    fd_ = ::mkstemp(tmpl.data());
    if (fd_ < 0) fail_io("create a temporary file for", target_, errno);
    temp_ = tmpl;
    (void)::fchmod(fd_, 0644);  // mkstemp creates 0600; checkpoints are meant to be shared
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
  }

  void write(const void* data, std::size_t size) {
    hash_.update(data, size);
    const auto* p = static_cast<const char*>(data);
    while (size > 0) {
      const ::ssize_t n = ::write(fd_, p, size);
      if (n < 0) {
        if (errno == EINTR) continue;
        fail_io("write", temp_, errno);
      }
      p += n;
      size -= static_cast<std::size_t>(n);
    }
  }

  /// Overwrites bytes already written (a header field known only at the end);
  /// checksum() does not see them.
  void write_at(std::uint64_t offset, const void* data, std::size_t size) {
    const auto* p = static_cast<const char*>(data);
    while (size > 0) {
      const ::ssize_t n = ::pwrite(fd_, p, size, static_cast<::off_t>(offset));
      if (n < 0) {
        if (errno == EINTR) continue;
        fail_io("write", temp_, errno);
      }
      p += n;
      size -= static_cast<std::size_t>(n);
      offset += static_cast<std::uint64_t>(n);
    }
  }

  std::uint64_t checksum() const { return hash_.digest(); }
  const std::filesystem::path& temp_path() const { return temp_; }

  /// fsync, rename over the target, then fsync the directory so the rename
  /// itself survives a crash.
  void commit() {
    if (::fsync(fd_) != 0) fail_io("flush", temp_, errno);
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail_io("close", temp_, errno);
    if (::rename(temp_.c_str(), target_.c_str()) != 0) fail_io("rename a temporary file to", target_, errno);
    committed_ = true;
    const std::filesystem::path dir = target_.has_parent_path() ? target_.parent_path() : ".";
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);  // best effort: some file systems refuse fsync on directories
      ::close(dfd);
    }
  }

 private:
  std::filesystem::path target_;
  std::filesystem::path temp_;
  int fd_ = -1;
  bool committed_ = false;
  Xxh64 hash_;
};

/// Writes `text` to `path` atomically; returns its checksum.
inline std::uint64_t write_file_atomic(const std::filesystem::path& path, std::string_view text) {
  AtomicFile file(path);
  file.write(text.data(), text.size());
  file.commit();
  return file.checksum();
}

/// The XXH64 of a whole file, read in 4 MiB pieces (no copy of it in memory).
inline std::uint64_t file_checksum(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_io("open", path, errno);
  std::string buffer(std::size_t{4} << 20, '\0');
  Xxh64 hash;
  while (true) {
    const ::ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      fail_io("read", path, err);
    }
    if (n == 0) break;
    hash.update(buffer.data(), static_cast<std::size_t>(n));
  }
  ::close(fd);
  return hash.digest();
}

/// The whole file (one read, for small files that are checked and parsed).
inline std::string read_whole_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_io("open", path, errno);
  struct ::stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail_io("read", path, err);
  }
  std::string bytes;
  bytes.resize(static_cast<std::size_t>(st.st_size));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ::ssize_t n = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      fail_io("read", path, err);
    }
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return bytes;
}

/// A read-only file descriptor with positioned, complete reads.
class ReadFile {
 public:
  explicit ReadFile(const std::filesystem::path& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) fail_io("open", path, errno);
  }
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;
  ~ReadFile() { ::close(fd_); }

  /// Reads exactly size bytes at offset; a short file is an error (it may have
  /// been truncated since its header was validated).
  void read_at(std::uint64_t offset, void* out, std::size_t size) const {
    auto* p = static_cast<char*>(out);
    while (size > 0) {
      const ::ssize_t n = ::pread(fd_, p, size, static_cast<::off_t>(offset));
      if (n < 0) {
        if (errno == EINTR) continue;
        fail_io("read", path_, errno);
      }
      if (n == 0)
        throw Error("accel: invalid safetensors file '" + path_.string() +
                    "': the file ended before its data buffer did. The file is truncated: "
                    "write it again.");
      p += n;
      size -= static_cast<std::size_t>(n);
      offset += static_cast<std::uint64_t>(n);
    }
  }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

}  // namespace accel::ckpt::detail

#endif  // ACCEL_CHECKPOINT_DETAIL_FILE_IO_HPP
