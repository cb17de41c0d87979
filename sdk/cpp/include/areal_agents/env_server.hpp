// areal_agents/env_server.hpp: serve C++ environments over the env-step protocol v1 (docs/env-protocol.md).
//
//   class MyEnv : public areal_agents::Env { ... reset(...) / step(...) ... };
//   int main(int argc, char** argv) {
//     areal_agents::EnvServer server(areal_agents::parse_server_options_or_exit(argc, argv));
//     server.add_env("me/MyEnv-v0", "what it is", [](const nlohmann::json& kwargs) {
//       return std::make_unique<MyEnv>(kwargs); });
//     return server.listen() ? 0 : 1;
//   }
//
// Header-only; needs cpp-httplib (linked, pkg-config cpp-httplib) and nlohmann-json. Not implemented:
// step timeouts, process isolation, /metrics (the Python server has them).
#pragma once

#include <areal_agents/deadline_server.hpp>
#include <areal_agents/server_options.hpp>
#include <areal_agents/server_replies.hpp>
#include <httplib.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace areal_agents {

using json = nlohmann::json;

namespace detail {

// Runs `undo` when the scope ends, by return or by exception, unless dismissed: a reservation to give back,
// a busy session to drop, threads to join.
template <typename Undo>
class OnExit {
 public:
  explicit OnExit(Undo undo) : undo_(std::move(undo)) {}
  ~OnExit() {
    if (armed_) undo_();
  }
  OnExit(const OnExit&) = delete;
  OnExit& operator=(const OnExit&) = delete;
  void dismiss() { armed_ = false; }

 private:
  Undo undo_;
  bool armed_ = true;
};

}  // namespace detail

// The first observation of an episode.
struct Reset {
  std::string observation;
  json info = json::object();
};

// The outcome of one action.
struct Step {
  std::string observation;
  double reward = 0.0;
  bool terminated = false;
  bool truncated = false;
  json info = json::object();
};

// One episode at a time; the server makes one Env per session and never calls it from two threads at once.
// It is destroyed when its session ends (closed, failed, expired, server stopped), never during a step.
// Throw std::invalid_argument from the factory or reset for a request's bad kwargs/seed/options (a 400);
// any other exception is the env's failure (a 500 at creation, an env_error step result mid-episode).
class Env {
 public:
  virtual ~Env() = default;
  // Same seed (and kwargs, options) -> same episode. `options` is an object ({} when the request has none).
  virtual Reset reset(std::optional<std::uint64_t> seed, const json& options) = 0;
  virtual Step step(const std::string& action) = 0;
};

using EnvFactory = std::function<std::unique_ptr<Env>(const json& kwargs)>;

// The env-step protocol v1 over HTTP: a session table under one mutex, a thread pool for requests,
// and a background thread that closes idle sessions.
class EnvServer {
 public:
  explicit EnvServer(ServerOptions options = {})
      : options_(std::move(options)),
        http_(std::chrono::seconds(options_.read_timeout_s), kMaxHeaderBytes,
              [this](const httplib::Request& req, httplib::Response& res) { refuse(req, res); }) {
    install_routes();
  }
  ~EnvServer() { stop(); }
  EnvServer(const EnvServer&) = delete;
  EnvServer& operator=(const EnvServer&) = delete;

  // Serve `id` (listed with `description` in GET /v1/envs); `factory` makes one env per session from its kwargs.
  void add_env(const std::string& id, const std::string& description, EnvFactory factory) {
    std::lock_guard<std::mutex> lock(mutex_);
    envs_[id] = Registered{description, std::move(factory)};
  }

  // Blocks until stop(). Prints "serving envs on http://HOST:PORT" (flushed) once connections are accepted;
  // false (with the reason on stderr) when the address cannot be bound.
  bool listen() {
    int port = options_.port;
    bool bound = port == 0 ? (port = http_.bind_to_any_port(options_.host)) > 0
                           : http_.bind_to_port(options_.host, port);
    if (!bound) {
      std::cerr << "env server: cannot listen on " << options_.host << ":" << options_.port
                << " (address in use, or not an address of this machine)" << std::endl;
      return false;
    }
    port_ = port;
    std::cout << "serving envs on http://" << options_.host << ":" << port << std::endl;
    std::thread expiry([this] { expire_idle_sessions(); });
    bool ok = http_.listen_after_bind();
    stop();
    expiry.join();
    return ok;
  }

  // Stops listen() (from any thread); the sessions are dropped with the server.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    stopped_.notify_all();
    http_.stop();
  }

  // The port being listened on (the chosen one when options.port was 0); 0 before listen().
  int port() const { return port_; }

  const ServerOptions& options() const { return options_; }

 private:
  struct Registered {
    std::string description;
    EnvFactory factory;
  };

  struct Session {
    std::unique_ptr<Env> env;
    std::chrono::steady_clock::time_point last_used;
    bool busy = false;  // a step is running (the env is not called concurrently)
    bool done = false;  // terminated or truncated: further steps are refused
  };

  using JsonHandler = std::function<json(const httplib::Request&, const std::string& body)>;

  // -- routes ---------------------------------------------------------------------------------------

  void install_routes() {
    http_.new_task_queue = [threads = options_.threads] { return new httplib::ThreadPool(threads); };
    http_.set_payload_max_length(options_.max_body_bytes);
    http_.set_keep_alive_max_count(100000);
    http_.set_keep_alive_timeout(kKeepAliveTimeoutS);  // an idle connection gives its thread back after this
    http_.set_tcp_nodelay(true);  // a reply's header and body writes must not wait for the client's delayed ACK
    http_.Get("/health", plain([this](const httplib::Request&, const std::string&) { return health(); }));
    http_.Get("/v1/envs", plain([this](const httplib::Request&, const std::string&) { return list_envs(); }));
    http_.Post("/v1/sessions", with_body([this](const httplib::Request&, const std::string& body) {
                 return create(detail::parse_create(detail::parse_body(body)));
               }));
    http_.Post(R"(/v1/sessions/([^/]+)/step)", with_body([this](const httplib::Request& req, const std::string& body) {
                 return step(req.matches[1], detail::parse_action(detail::parse_body(body)));
               }));
    http_.Post("/v1/step", with_body([this](const httplib::Request&, const std::string& body) {
                 return step_batch(detail::parse_body(body));
               }));
    http_.Delete(R"(/v1/sessions/([^/]+))", with_body([this](const httplib::Request& req, const std::string&) {
                   return close(req.matches[1]);
                 }));
    // Any other path: read (at most max_body_bytes of) the body, then 404, all in the protocol's error shape.
    auto not_found = with_body([](const httplib::Request& req, const std::string&) -> json {
      throw detail::HttpError(404, "not_found", "no route " + req.method + " " + req.path + "; see docs/env-protocol.md");
    });
    http_.Post(".*", not_found).Put(".*", not_found).Patch(".*", not_found).Delete(".*", not_found);
    http_.Get(".*", plain([](const httplib::Request& req, const std::string&) -> json {
      throw detail::HttpError(404, "not_found", "no route GET " + req.path + "; see docs/env-protocol.md");
    }));
  }

  // A refusal the server makes itself (what cpp-httplib refuses, or a request cut off), in the protocol's shape.
  void refuse(const httplib::Request& req, httplib::Response& res) const {
    std::string message = "HTTP " + std::to_string(res.status) + " for " +
                          (req.method.empty() ? "a malformed request" : req.method + " " + req.path);
    if (res.status == 408) message = late_message();
    if (res.status == 431) message = "request line and headers over " + std::to_string(kMaxHeaderBytes) + " bytes";
    if (res.status == 413) message = too_large_message();
    if (res.status == 414) message = "request URI too long";
    detail::reply(res, res.status, detail::error_body(detail::error_type_for(res.status), message));
  }

  std::string late_message() const {
    return "request not received in time: its headers and body must arrive within " +
           std::to_string(options_.read_timeout_s) + " s of its first byte (--read-timeout)";
  }

  std::string too_large_message() const {
    return "request body over " + std::to_string(options_.max_body_bytes) + " bytes (--max-body-bytes)";
  }

  // A handler for requests without a body; HttpError becomes the error reply.
  httplib::Server::Handler plain(JsonHandler handler) {
    return [handler = std::move(handler)](const httplib::Request& req, httplib::Response& res) {
      respond(res, [&] { return handler(req, std::string()); });
    };
  }

  // A handler that reads the body itself, so chunked bodies are bounded too (cpp-httplib 0.11 bounds only
  // a declared Content-Length), then answers as `plain` does.
  httplib::Server::HandlerWithContentReader with_body(JsonHandler handler) {
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
        return detail::reply(res, 413, detail::error_body("payload_too_large", too_large_message()));
      }
      if (!read && DeadlineServer::cut() == Cut::deadline) {  // the connection ends after this reply
        res.set_header("Connection", "close");
        return detail::reply(res, 408, detail::error_body("request_timeout", late_message()));
      }
      if (!read) return detail::reply(res, 400, detail::error_body("bad_request", "body: could not be read"));
      respond(res, [&] { return handler(req, body); });
    };
  }

  template <typename Produce>
  static void respond(httplib::Response& res, Produce produce) {
    try {
      detail::reply(res, 200, produce());
    } catch (const detail::HttpError& e) {
      detail::reply(res, e.status, detail::error_body(e.type, e.what()));
    } catch (const std::exception& e) {
      detail::reply(res, 500, detail::error_body("internal_error", e.what()));
    } catch (...) {
      detail::reply(res, 500, detail::error_body("internal_error", "the request threw a non-standard exception"));
    }
  }

  // -- the protocol -----------------------------------------------------------------------------------

  json health() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {{"status", "ok"},
            {"protocol", "v1"},
            {"sessions_open", sessions_.size()},
            {"limits",
             {{"max_sessions", options_.max_sessions},
              {"max_body_bytes", options_.max_body_bytes},
              {"max_action_chars", options_.max_action_chars},
              {"idle_timeout_s", options_.idle_timeout_s}}}};
  }

  json list_envs() {
    std::lock_guard<std::mutex> lock(mutex_);
    json envs = json::array();
    for (const auto& [id, env] : envs_) envs.push_back({{"id", id}, {"description", env.description}});
    return {{"envs", envs}};
  }

  json create(const detail::CreateRequest& request) {
    EnvFactory factory = reserve_session(request.env_id);
    detail::OnExit give_back_place([this] {  // when no session is made, however this returns or throws
      std::lock_guard<std::mutex> lock(mutex_);
      --opening_;
    });
    std::unique_ptr<Env> env;
    Reset first;
    try {
      env = factory(request.kwargs);
      if (!env) throw std::runtime_error("the factory returned no env");
      first = env->reset(request.seed, request.options);
      check_info(first.info);
    } catch (const std::invalid_argument& e) {
      throw detail::bad_request("cannot make " + request.env_id + ": " + e.what() +
                                "; check the kwargs, seed and options");
    } catch (const std::exception& e) {
      throw detail::HttpError(500, "env_error", "cannot make " + request.env_id + ": " + e.what());
    } catch (...) {
      throw detail::HttpError(500, "env_error", "cannot make " + request.env_id + ": " + kNonStandard);
    }
    std::string id = detail::new_session_id();
    auto session = std::make_shared<Session>();
    session->env = std::move(env);
    session->last_used = std::chrono::steady_clock::now();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      sessions_[id] = std::move(session);
      --opening_;  // the place passes to the session under the same lock: it is never counted twice
      give_back_place.dismiss();
    }
    return {{"session_id", id}, {"observation", first.observation}, {"info", first.info}};
  }

  // The factory of `env_id`, with a place under max_sessions taken for the new session (atomically, so the
  // cap holds under concurrent creations); the caller gives it back when the session is made or not.
  EnvFactory reserve_session(const std::string& env_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = envs_.find(env_id);
    if (found == envs_.end()) {
      std::vector<std::string> ids;
      for (const auto& entry : envs_) ids.push_back(entry.first);
      throw detail::HttpError(404, "unknown_env",
                              "unknown env id '" + env_id + "'; this server serves: " + detail::join(ids, ", "));
    }
    std::size_t open = sessions_.size() + opening_;
    if (open >= options_.max_sessions) {
      throw detail::HttpError(429, "too_many_sessions",
                              std::to_string(open) + " sessions are open or opening, the cap is " +
                                  std::to_string(options_.max_sessions) +
                                  "; close finished sessions or start the server with a larger --max-sessions");
    }
    ++opening_;
    return found->second.factory;
  }

  json step(const std::string& id, const std::string& action) {
    std::shared_ptr<Session> session = claim_for_step(id, action);
    // Unless the step ends well, the session is removed, so it is never left busy for good; its env is
    // destroyed after the lock is released (`session` outlives the guard).
    detail::OnExit remove_unless_done([&] { remove_session(id, session); });
    Step result;
    try {
      result = session->env->step(action);
      check_info(result.info);
      if (!std::isfinite(result.reward)) throw std::runtime_error("reward is not a finite number");
    } catch (const std::exception& e) {  // the episode ends with a typed record; nothing else is affected
      return detail::failed_step(id, "env_error", std::string("step failed: ") + e.what());
    } catch (...) {
      return detail::failed_step(id, "env_error", std::string("step failed: ") + kNonStandard);
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      session->busy = false;
      session->done = result.terminated || result.truncated;
      session->last_used = std::chrono::steady_clock::now();
    }
    remove_unless_done.dismiss();
    return {{"session_id", id},
            {"observation", result.observation},
            {"reward", result.reward},
            {"terminated", result.terminated},
            {"truncated", result.truncated},
            {"info", result.info},
            {"error", nullptr}};
  }

  // The session `id`, marked busy, after the protocol's checks in the protocol's order.
  std::shared_ptr<Session> claim_for_step(const std::string& id, const std::string& action) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = sessions_.find(id);
    if (found == sessions_.end()) throw unknown_session(id);
    std::size_t length = detail::utf8_length(action);
    if (length > options_.max_action_chars) {
      throw detail::HttpError(400, "action_too_long",
                              "action is " + std::to_string(length) + " characters; the limit is " +
                                  std::to_string(options_.max_action_chars) + " (--max-action-chars)");
    }
    Session& session = *found->second;
    if (session.done) {
      throw detail::HttpError(409, "episode_over",
                              "the episode of session " + id + " has ended; close it or create a new one");
    }
    if (session.busy) throw detail::HttpError(409, "session_busy", "session " + id + " is already running a step");
    session.busy = true;
    return found->second;
  }

  json step_batch(const json& body) {
    auto items = detail::parse_batch(body);
    std::vector<json> results(items.size());
    std::atomic<std::size_t> next{0};
    auto work = [&] {
      for (std::size_t i; (i = next++) < items.size();) results[i] = step_or_failed(items[i].first, items[i].second);
    };
    // Items run concurrently (sessions are independent), on at most one thread per core.
    std::size_t helpers = std::min<std::size_t>(items.size(), std::max(1u, std::thread::hardware_concurrency())) - 1;
    {
      std::vector<std::thread> threads;
      detail::OnExit join_all([&] {  // also when work() throws: a joinable thread's destructor ends the process
        for (auto& thread : threads) thread.join();
      });
      try {
        while (threads.size() < helpers) threads.emplace_back(work);
      } catch (const std::system_error&) {  // no more threads to be had: the ones running share the work
      }
      if (!items.empty()) work();
    }
    return {{"results", results}};
  }

  // A batch item: its StepResult, or a failed one typed as the single step's refusal would be.
  json step_or_failed(const std::string& id, const std::string& action) {
    try {
      return step(id, action);
    } catch (const detail::HttpError& e) {
      return detail::failed_step(id, e.type, e.what());
    } catch (const std::exception& e) {
      return detail::failed_step(id, "internal_error", e.what());
    } catch (...) {
      return detail::failed_step(id, "internal_error", "the step threw a non-standard exception");
    }
  }

  json close(const std::string& id) {
    std::shared_ptr<Session> closing;  // its env is destroyed outside the lock (or after a running step)
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto found = sessions_.find(id);
      if (found == sessions_.end()) throw unknown_session(id);
      closing = std::move(found->second);
      sessions_.erase(found);
    }
    return {{"session_id", id}, {"closed", true}};
  }

  static detail::HttpError unknown_session(const std::string& id) {
    return detail::HttpError(404, "unknown_session",
                             "no open session '" + id + "' (closed, expired, failed or never created)");
  }

  static void check_info(json& info) {
    if (info.is_null()) info = json::object();
    if (!info.is_object()) throw std::runtime_error("info must be a JSON object, got " + info.dump());
  }

  // Removes `id` if it is still `session` (a DELETE may have closed it, and a new one cannot reuse the id).
  void remove_session(const std::string& id, const std::shared_ptr<Session>& session) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = sessions_.find(id);
    if (found != sessions_.end() && found->second == session) sessions_.erase(found);
  }  // the caller still holds `session`: its env is destroyed after the lock is released

  // Closes sessions without a step for idle_timeout_s, checking a few times per timeout, until stop().
  void expire_idle_sessions() {
    const auto timeout = std::chrono::duration<double>(options_.idle_timeout_s);
    const auto period = std::chrono::duration<double>(std::clamp(options_.idle_timeout_s / 4, 0.05, 5.0));
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopped_.wait_for(lock, period, [this] { return stopping_; })) {
      const auto cutoff = std::chrono::steady_clock::now() - timeout;
      std::vector<std::shared_ptr<Session>> expired;
      for (auto it = sessions_.begin(); it != sessions_.end();) {
        bool idle = !it->second->busy && it->second->last_used < cutoff;
        if (idle) expired.push_back(std::move(it->second));
        it = idle ? sessions_.erase(it) : std::next(it);
      }
      lock.unlock();
      expired.clear();  // the envs' destructors run without blocking requests
      lock.lock();
    }
  }

  static constexpr std::time_t kKeepAliveTimeoutS = 5;
  static constexpr std::size_t kMaxHeaderBytes = 64 * 1024;  // a request line and its headers, together
  static constexpr std::size_t kBodyDrainBytes = 64 * 1024 * 1024;  // read past the body limit, then give up
  static constexpr const char* kNonStandard = "the env threw a non-standard exception (not a std::exception)";

  ServerOptions options_;
  DeadlineServer http_;
  std::atomic<int> port_{0};
  std::mutex mutex_;  // guards everything below, and each Session's busy/done/last_used
  std::condition_variable stopped_;
  bool stopping_ = false;
  std::map<std::string, Registered> envs_;
  std::unordered_map<std::string, std::shared_ptr<Session>> sessions_;
  std::size_t opening_ = 0;  // creations between taking a place and registering their session
};

}  // namespace areal_agents
