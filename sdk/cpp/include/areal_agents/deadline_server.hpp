// areal_agents/deadline_server.hpp: a cpp-httplib server whose requests must arrive in time and in bounds
// (DeadlineServer). cpp-httplib 0.11 times out each read on its own, so a client sending a byte a second holds
// its connection's thread for ever; here a request's headers and body are read under one deadline counted from
// its first byte (as Go's ReadTimeout, nginx's client_header_timeout), and its request line and headers under a
// size cap. A request past either is answered 408 or 431 (see DeadlineServer::cut) and its connection closed.
#pragma once

#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

namespace areal_agents {

// Why the request being read on this thread was cut off.
enum class Cut { none, deadline, header_size };

namespace detail {

using Clock = std::chrono::steady_clock;

// A connection's socket as a cpp-httplib Stream that lives as long as the connection (so bytes read ahead,
// a pipelined request's, are kept): buffered reads that wait no later than the request's deadline, the bytes
// before the body counted against the header cap, and writes that wait at most `write_timeout` each.
class DeadlineStream final : public httplib::Stream {
 public:
  DeadlineStream(socket_t sock, const std::atomic<socket_t>& listening, std::chrono::milliseconds write_timeout)
      : sock_(sock), listening_(listening), write_timeout_(write_timeout) {}

  // Waits up to `idle` for the next request's first byte; false when none came or the server is stopping.
  bool wait_for_request(std::chrono::milliseconds idle) {
    return buffered() > 0 || wait(POLLIN, Clock::now() + idle);
  }

  // The next request: read by `deadline`, at most `header_cap` bytes before its body.
  void start_request(Clock::time_point deadline, std::size_t header_cap) {
    deadline_ = deadline;
    header_bytes_left_ = header_cap;
    in_headers_ = true;
    cut_ = Cut::none;
    wrote_ = false;
  }

  void headers_done() { in_headers_ = false; }
  Cut cut() const { return cut_; }
  bool wrote() const { return wrote_; }

  bool is_readable() const override { return buffered() > 0 || wait(POLLIN, deadline_); }
  bool is_writable() const override { return wait(POLLOUT, Clock::now() + write_timeout_, false); }

  ssize_t read(char* ptr, std::size_t size) override {
    if (buffered() == 0) {
      if (!wait(POLLIN, deadline_)) {
        if (Clock::now() >= deadline_) cut_ = Cut::deadline;
        return -1;
      }
      ssize_t n = recv_some(buffer_.data(), buffer_.size());
      if (n <= 0) return n;
      begin_ = 0;
      end_ = static_cast<std::size_t>(n);
    }
    std::size_t n = std::min(size, buffered());
    if (in_headers_) {
      if (n > header_bytes_left_) {
        cut_ = Cut::header_size;
        return -1;
      }
      header_bytes_left_ -= n;
    }
    std::memcpy(ptr, buffer_.data() + begin_, n);
    begin_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, std::size_t size) override {
    if (!is_writable()) return -1;
    ssize_t n;
    do {
      n = ::send(sock_, ptr, size, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n > 0) wrote_ = true;
    return n;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { address(true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address(false, ip, port); }
  socket_t socket() const override { return sock_; }

 private:
  std::size_t buffered() const { return end_ - begin_; }

  // poll() for `events` until `until`, in slices so that a stopping server is noticed (unless `stop_ends_it` is
  // false: a reply being written still goes out); false on timeout or stop.
  bool wait(short events, Clock::time_point until, bool stop_ends_it = true) const {
    using std::chrono::milliseconds;
    while (!stop_ends_it || listening_ != INVALID_SOCKET) {
      auto left = std::chrono::ceil<milliseconds>(until - Clock::now()).count();
      if (left <= 0) return false;
      pollfd fd{sock_, events, 0};
      int ready = ::poll(&fd, 1, static_cast<int>(std::min<long long>(left, kStopCheck.count())));
      if (ready > 0) return true;
      if (ready < 0 && errno != EINTR) return false;
    }
    return false;
  }

  ssize_t recv_some(char* into, std::size_t size) {
    ssize_t n;
    do {
      n = ::recv(sock_, into, size, 0);
    } while (n < 0 && errno == EINTR);
    return n;
  }

  void address(bool remote, std::string& ip, int& port) const {
    sockaddr_storage addr{};
    socklen_t length = sizeof(addr);
    auto* raw = reinterpret_cast<sockaddr*>(&addr);
    if ((remote ? ::getpeername(sock_, raw, &length) : ::getsockname(sock_, raw, &length)) != 0) return;
    std::array<char, NI_MAXHOST> host{};
    std::array<char, NI_MAXSERV> service{};
    if (::getnameinfo(raw, length, host.data(), host.size(), service.data(), service.size(),
                      NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
      ip = host.data();
      port = std::atoi(service.data());
    }
  }

  static constexpr std::chrono::milliseconds kStopCheck{100};

  socket_t sock_;
  const std::atomic<socket_t>& listening_;  // INVALID_SOCKET once the server stops
  std::chrono::milliseconds write_timeout_;
  std::array<char, 4096> buffer_{};
  std::size_t begin_ = 0, end_ = 0;
  Clock::time_point deadline_ = Clock::now();
  std::size_t header_bytes_left_ = 0;
  bool in_headers_ = false;
  Cut cut_ = Cut::none;  // why a read gave up, if it did
  bool wrote_ = false;
};

// The stream of the connection this thread serves (handlers run on their connection's thread).
inline thread_local DeadlineStream* current_stream = nullptr;

}  // namespace detail

// A cpp-httplib Server (routes, handlers and options as usual) that reads each request under a deadline and
// its request line and headers under a size cap. Every refusal the server makes itself (a request cut off, or
// one cpp-httplib refuses: a malformed request line, a Content-Length over the payload limit) goes through
// `refuse`, with its status set, so all of them have the owner's error shape.
class DeadlineServer : public httplib::Server {
 public:
  DeadlineServer(std::chrono::milliseconds read_deadline, std::size_t header_cap, Handler refuse)
      : read_deadline_(read_deadline), header_cap_(header_cap), refuse_(std::move(refuse)) {
    // The headers are done when routing starts (before any body is read).
    set_pre_routing_handler([](const httplib::Request&, httplib::Response&) {
      if (detail::current_stream) detail::current_stream->headers_done();
      return HandlerResponse::Unhandled;
    });
    // cpp-httplib's own refusals arrive with an empty body (a handler's have one): a request cut off in its
    // headers arrives here as a 400, and is told why.
    set_error_handler(HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return HandlerResponse::Unhandled;
      if (cut() != Cut::none) {
        res.status = cut_status();
        res.set_header("Connection", "close");  // it will be
      }
      refuse_(req, res);
      return HandlerResponse::Handled;
    }));
  }

  // Why the request being read on the calling (handler) thread was cut off: Cut::none if it was not.
  static Cut cut() { return detail::current_stream ? detail::current_stream->cut() : Cut::none; }

  // The status of a request cut off: 408 past the deadline, 431 over the header cap.
  static int cut_status() { return cut() == Cut::deadline ? 408 : 431; }

 private:
  // cpp-httplib's keep-alive loop, with one stream per connection and a deadline per request. A request cut off
  // before cpp-httplib could answer it (in its request line) is answered here; either way the connection ends.
  bool process_and_close_socket(socket_t sock) override {
    using std::chrono::milliseconds;
    auto write_timeout = std::chrono::duration_cast<milliseconds>(std::chrono::seconds(write_timeout_sec_) +
                                                                  std::chrono::microseconds(write_timeout_usec_));
    auto keep_alive = std::chrono::duration_cast<milliseconds>(std::chrono::seconds(keep_alive_timeout_sec_));
    detail::DeadlineStream stream(sock, svr_sock_, write_timeout);
    detail::current_stream = &stream;
    bool ok = false;
    for (std::size_t left = keep_alive_max_count_; left > 0 && stream.wait_for_request(keep_alive); --left) {
      stream.start_request(detail::Clock::now() + read_deadline_, header_cap_);
      bool closed = false;
      ok = process_request(stream, left == 1, closed, nullptr);
      if (stream.cut() != Cut::none) {
        if (!stream.wrote()) answer_cut(stream);
        ok = false;
      }
      if (!ok || closed) break;
    }
    detail::current_stream = nullptr;
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return ok;
  }

  // The reply to a request cut off in its request line (cpp-httplib gives up on those without one).
  void answer_cut(detail::DeadlineStream& stream) {
    httplib::Request req;
    httplib::Response res;
    res.status = cut_status();
    refuse_(req, res);
    std::string reply = "HTTP/1.1 " + std::to_string(res.status) +
                        (res.status == 408 ? " Request Timeout" : " Request Header Fields Too Large") +
                        "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(res.body.size()) +
                        "\r\nConnection: close\r\n\r\n" + res.body;
    for (std::size_t sent = 0; sent < reply.size();) {
      ssize_t n = stream.write(reply.data() + sent, reply.size() - sent);
      if (n <= 0) return;
      sent += static_cast<std::size_t>(n);
    }
  }

  std::chrono::milliseconds read_deadline_;
  std::size_t header_cap_;
  Handler refuse_;
};

}  // namespace areal_agents
