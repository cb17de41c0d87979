// areal_agents/json_routes.hpp: JSON routes over a DeadlineServer, what EnvServer answers through (JsonRoutes).
// A handler returns its reply's JSON or throws HttpError; bodies are read under --max-body-bytes (chunked ones
// too), and every refusal, the server's own included (408, 413, 431, unknown paths), has the protocol's error
// shape (docs/env-protocol.md "Errors").
#pragma once

#include <areal_agents/deadline_server.hpp>
#include <areal_agents/server_options.hpp>
#include <areal_agents/server_replies.hpp>
#include <httplib.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <ctime>
#include <exception>
#include <functional>
#include <string>
#include <utility>

namespace areal_agents {

namespace detail {

class JsonRoutes {
 public:
  using Handler = std::function<json(const httplib::Request&, const std::string& body)>;

  explicit JsonRoutes(ServerOptions options)
      : options_(std::move(options)),
        http_(std::chrono::seconds(options_.read_timeout_s), kMaxHeaderBytes,
              [this](const httplib::Request& req, httplib::Response& res) { refuse(req, res); }) {
    http_.new_task_queue = [threads = options_.threads] { return new httplib::ThreadPool(threads); };
    http_.set_payload_max_length(options_.max_body_bytes);
    http_.set_keep_alive_max_count(100000);
    http_.set_keep_alive_timeout(kKeepAliveTimeoutS);  // an idle connection gives its thread back after this
    http_.set_tcp_nodelay(true);  // a reply's header and body writes must not wait for the client's delayed ACK
  }
  JsonRoutes(const JsonRoutes&) = delete;
  JsonRoutes& operator=(const JsonRoutes&) = delete;

  // Routes match in the order they are added; `pattern` is a regex over the path (groups in req.matches).
  void get(const std::string& pattern, Handler handler) { http_.Get(pattern, plain(std::move(handler))); }
  void post(const std::string& pattern, Handler handler) { http_.Post(pattern, with_body(std::move(handler))); }
  void del(const std::string& pattern, Handler handler) { http_.Delete(pattern, with_body(std::move(handler))); }

  // Every other path (add it last): read (at most max_body_bytes of) the body, then 404 not_found.
  void not_found_elsewhere() {
    auto not_found = with_body([](const httplib::Request& req, const std::string&) -> json {
      throw HttpError(404, "not_found", "no route " + req.method + " " + req.path + "; see docs/env-protocol.md");
    });
    http_.Post(".*", not_found).Put(".*", not_found).Patch(".*", not_found).Delete(".*", not_found);
    http_.Get(".*", plain([](const httplib::Request& req, const std::string&) -> json {
      throw HttpError(404, "not_found", "no route GET " + req.path + "; see docs/env-protocol.md");
    }));
  }

  DeadlineServer& http() { return http_; }

 private:
  // A refusal the server makes itself (what cpp-httplib refuses, or a request cut off), in the protocol's shape.
  void refuse(const httplib::Request& req, httplib::Response& res) const {
    std::string message = "HTTP " + std::to_string(res.status) + " for " +
                          (req.method.empty() ? "a malformed request" : req.method + " " + req.path);
    if (res.status == 408) message = late_message();
    if (res.status == 431) message = "request line and headers over " + std::to_string(kMaxHeaderBytes) + " bytes";
    if (res.status == 413) message = too_large_message();
    if (res.status == 414) message = "request URI too long";
    reply(res, res.status, error_body(error_type_for(res.status), message));
  }

  std::string late_message() const {
    return "request not received in time: its headers and body must arrive within " +
           std::to_string(options_.read_timeout_s) + " s of its first byte (--read-timeout)";
  }

  std::string too_large_message() const {
    return "request body over " + std::to_string(options_.max_body_bytes) + " bytes (--max-body-bytes)";
  }

  // A handler for requests without a body; HttpError becomes the error reply.
  static httplib::Server::Handler plain(Handler handler) {
    return [handler = std::move(handler)](const httplib::Request& req, httplib::Response& res) {
      respond(res, [&] { return handler(req, std::string()); });
    };
  }

  // A handler that reads the body itself, so chunked bodies are bounded too (cpp-httplib 0.11 bounds only
  // a declared Content-Length), then answers as `plain` does.
  httplib::Server::HandlerWithContentReader with_body(Handler handler) {
    return [this, handler = std::move(handler)](const httplib::Request& req, httplib::Response& res,
                                                const httplib::ContentReader& reader) {
      std::string body;
      std::size_t received = 0;
      bool read = reader([&](const char* data, std::size_t length) {
        received += length;
        if (received <= options_.max_body_bytes) body.append(data, length);
        // Past the limit the rest is read and dropped (up to kBodyDrainBytes more), so that the reply is the
        // connection's last word on this request: cpp-httplib would read what is left as the next request.
        return received <= options_.max_body_bytes + kBodyDrainBytes;
      });
      if (received > options_.max_body_bytes || res.status == 413) {
        if (!read) res.set_header("Connection", "close");  // not drained: the connection is spent
        return reply(res, 413, error_body("payload_too_large", too_large_message()));
      }
      if (!read && DeadlineServer::cut() == Cut::deadline) {  // the connection ends after this reply
        res.set_header("Connection", "close");
        return reply(res, 408, error_body("request_timeout", late_message()));
      }
      if (!read) return reply(res, 400, error_body("bad_request", "body: could not be read"));
      respond(res, [&] { return handler(req, body); });
    };
  }

  template <typename Produce>
  static void respond(httplib::Response& res, Produce produce) {
    try {
      reply(res, 200, produce());
    } catch (const HttpError& e) {
      reply(res, e.status, error_body(e.type, e.what()));
    } catch (const std::exception& e) {
      reply(res, 500, error_body("internal_error", e.what()));
    } catch (...) {
      reply(res, 500, error_body("internal_error", "the request threw a non-standard exception"));
    }
  }

  static constexpr std::time_t kKeepAliveTimeoutS = 5;
  static constexpr std::size_t kMaxHeaderBytes = 64 * 1024;  // a request line and its headers, together
  static constexpr std::size_t kBodyDrainBytes = 64 * 1024 * 1024;  // read past the body limit, then give up

  ServerOptions options_;
  DeadlineServer http_;
};

}  // namespace detail

}  // namespace areal_agents
