// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::heartbeat(): a worker's sign of progress for
/// the hang detection of accel's launchers (LaunchOptions::monitor_interval,
/// `accel launch --monitor_interval`). The launcher gives each worker a file
/// (ACCEL_HEARTBEAT_FILE); a heartbeat advances its modification time. A
/// file, not a pipe: it survives exec, and a worker in any language (a shell
/// script: `touch "$ACCEL_HEARTBEAT_FILE"`) can beat.
#ifndef ACCEL_RUNTIME_HEARTBEAT_HPP
#define ACCEL_RUNTIME_HEARTBEAT_HPP

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>

namespace accel::runtime {

/// Tells the launcher that this process makes progress. accel calls it for
/// every batch a prepared data loader yields and every collective that
/// completes; call it yourself in long stretches without either (a long
/// evaluation written by hand). Cheap: at most one file-time update per
/// 100 ms; does nothing when no launcher watches (ACCEL_HEARTBEAT_FILE unset).
inline void heartbeat() noexcept {
  // Lock-free: a child forked while another thread was here must not inherit a held lock.
  static std::atomic<pid_t> owner{-1};  // the process the file was opened for
  static std::atomic<int> fd{-1};
  static std::atomic<std::int64_t> last_ms{0};
  const pid_t me = ::getpid();
  pid_t seen = owner.load();
  if (seen != me) {
    if (!owner.compare_exchange_strong(seen, me)) return;  // another thread opens it
    const int inherited = fd.exchange(-1);
    if (inherited >= 0) ::close(inherited);  // a forked child's copy of its parent's file
    const char* path = std::getenv("ACCEL_HEARTBEAT_FILE");
    if (path != nullptr && *path != '\0') fd.store(::open(path, O_WRONLY | O_CLOEXEC));
    last_ms.store(0);
  }
  const int f = fd.load();
  if (f < 0) return;
  const std::int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::steady_clock::now().time_since_epoch())
                               .count();
  std::int64_t prev = last_ms.load();
  if (now - prev < 100 || !last_ms.compare_exchange_strong(prev, now)) return;
  ::futimens(f, nullptr);  // modification time := now
}

}  // namespace accel::runtime

#endif  // ACCEL_RUNTIME_HEARTBEAT_HPP
