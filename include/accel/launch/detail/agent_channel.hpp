// SPDX-License-Identifier: Apache-2.0
/// @file Defines the connection between the launchers of several machines
/// (launch/detail/node_agent.hpp): one TCP stream carrying messages, each a
/// list of text fields on one line. Free of LibTorch (`accel launch` uses it).
#ifndef ACCEL_LAUNCH_DETAIL_AGENT_CHANNEL_HPP
#define ACCEL_LAUNCH_DETAIL_AGENT_CHANNEL_HPP

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <string_view>
#include <vector>

#include <accel/launch/detail/posix.hpp>

namespace accel::detail::launch {

using AgentMessage = std::vector<std::string>;

/// One line: fields joined by tabs; backslash, tab and newline escaped, so a
/// worker's multi-line error travels as one field.
inline std::string encode_message(const AgentMessage& fields) {
  std::string line;
  for (std::size_t i = 0; i < fields.size(); ++i) {
    if (i > 0) line.push_back('\t');
    for (char c : fields[i]) {
      if (c == '\\') line += "\\\\";
      else if (c == '\t') line += "\\t";
      else if (c == '\n') line += "\\n";
      else line.push_back(c);
    }
  }
  line.push_back('\n');
  return line;
}

inline AgentMessage decode_message(std::string_view line) {
  AgentMessage fields(1);
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (c == '\t') {
      fields.emplace_back();
    } else if (c == '\\' && i + 1 < line.size()) {
      const char e = line[++i];
      fields.back().push_back(e == 't' ? '\t' : e == 'n' ? '\n' : e);
    } else {
      fields.back().push_back(c);
    }
  }
  return fields;
}

/// A non-blocking TCP connection to another launcher. The kernel's keepalive
/// probes notice a machine that vanished without closing it (power loss, a
/// cut cable) within about 15 s; a process that dies closes it at once.
class AgentChannel {
 public:
  AgentChannel() = default;
  explicit AgentChannel(Fd fd) : fd_(std::move(fd)) {
    ::fcntl(fd_.get(), F_SETFL, ::fcntl(fd_.get(), F_GETFL) | O_NONBLOCK);
    int one = 1, idle = 5, interval = 2, count = 5;
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    ::setsockopt(fd_.get(), IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    ::setsockopt(fd_.get(), IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
    ::setsockopt(fd_.get(), IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
    ::setsockopt(fd_.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }

  bool open() const { return fd_.valid(); }
  int fd() const { return fd_.get(); }
  void close() { fd_.reset(); }

  /// Sends one message (waiting up to 5 s for room); false, and closed, if
  /// the peer is gone. Never raises SIGPIPE.
  bool send(const AgentMessage& fields) {
    const std::string line = encode_message(fields);
    std::size_t done = 0;
    while (fd_.valid() && done < line.size()) {
      const ssize_t n = ::send(fd_.get(), line.data() + done, line.size() - done, MSG_NOSIGNAL);
      if (n > 0) {
        done += static_cast<std::size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        ::pollfd p{fd_.get(), POLLOUT, 0};
        if (::poll(&p, 1, 5000) <= 0) close();
      } else {
        close();
      }
    }
    return fd_.valid();
  }

  /// Appends the messages that have arrived to `out`; false once the peer
  /// closed the connection or it failed (the messages before that still count).
  /// A peer that sends more than 1 MiB without a line end is not a launcher.
  bool receive(std::vector<AgentMessage>& out) {
    if (!fd_.valid()) return false;
    const bool alive = read_available(fd_.get(), in_);
    std::size_t start = 0;
    for (std::size_t nl; (nl = in_.find('\n', start)) != std::string::npos; start = nl + 1)
      out.push_back(decode_message(std::string_view(in_).substr(start, nl - start)));
    in_.erase(0, start);
    if (!alive || in_.size() > (1u << 20)) close();
    return fd_.valid();
  }

  /// Waits up to `ms` for something to read (or the peer closing).
  bool wait_readable(int ms) const {
    if (!fd_.valid()) return true;
    ::pollfd p{fd_.get(), POLLIN, 0};
    return ::poll(&p, 1, ms) != 0;
  }

 private:
  Fd fd_;
  std::string in_;
};

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_AGENT_CHANNEL_HPP
