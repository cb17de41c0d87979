// areal_agents/env_server.hpp: serve C++ environments over the env-step protocol, v1 and v2 (docs/env-protocol.md).
//
//   class MyEnv : public areal_agents::Env { ... reset(...) / step(...) ... };                 // env.hpp
//   int main(int argc, char** argv) {
//     areal_agents::EnvServer server(areal_agents::parse_server_options_or_exit(argc, argv));
//     server.add_env("me/MyEnv-v0", "what it is", [](const nlohmann::json& kwargs) {
//       return std::make_unique<MyEnv>(kwargs); });
//     return server.listen() ? 0 : 1;
//   }
//
// A single-agent Env is served over v1 and over v2 (as the one agent "agent"); a MultiAgentEnv, registered with
// add_multi_agent_env, over v2 only. Header-only; needs cpp-httplib (linked, pkg-config cpp-httplib) and
// nlohmann-json. Not implemented: step timeouts, process isolation, /metrics (the Python server has them).
#pragma once

#include <areal_agents/agent_episodes.hpp>
#include <areal_agents/env.hpp>
#include <areal_agents/json_routes.hpp>
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
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace areal_agents {

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

// The env-step protocol over HTTP: a session table under one mutex, a thread pool for requests,
// and a background thread that closes idle sessions.
class EnvServer {
 public:
  explicit EnvServer(ServerOptions options = {}) : options_(options), routes_(std::move(options)) {
    install_routes();
  }
  ~EnvServer() { stop(); }
  EnvServer(const EnvServer&) = delete;
  EnvServer& operator=(const EnvServer&) = delete;

  // Serve the single-agent env `id` (listed with `description` in GET /v1/envs); `factory` makes one env per
  // session from its kwargs.
  void add_env(const std::string& id, const std::string& description, EnvFactory factory) {
    add(id, description, false, [factory = std::move(factory)](const json& kwargs) -> std::unique_ptr<MultiAgentEnv> {
      std::unique_ptr<Env> env = factory(kwargs);
      return env ? std::make_unique<detail::SingleAgentEnv>(std::move(env)) : nullptr;
    });
  }

  // Serve the multi-agent env `id` (created with POST /v2/sessions; listed in GET /v1/envs).
  void add_multi_agent_env(const std::string& id, const std::string& description, MultiAgentEnvFactory factory) {
    add(id, description, true, std::move(factory));
  }

  // Blocks until stop(). Prints "serving envs on http://HOST:PORT" (flushed) once connections are accepted;
  // false (with the reason on stderr) when the address cannot be bound.
  bool listen() {
    int port = options_.port;
    bool bound = port == 0 ? (port = http().bind_to_any_port(options_.host)) > 0
                           : http().bind_to_port(options_.host, port);
    if (!bound) {
      std::cerr << "env server: cannot listen on " << options_.host << ":" << options_.port
                << " (address in use, or not an address of this machine)" << std::endl;
      return false;
    }
    port_ = port;
    std::cout << "serving envs on http://" << options_.host << ":" << port << std::endl;
    std::thread expiry([this] { expire_idle_sessions(); });
    bool ok = http().listen_after_bind();
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
    http().stop();
  }

  // The port being listened on (the chosen one when options.port was 0); 0 before listen().
  int port() const { return port_; }

  const ServerOptions& options() const { return options_; }

 private:
  struct Registered {
    std::string description;
    bool multi_agent;
    MultiAgentEnvFactory factory;  // a single-agent env's makes it a detail::SingleAgentEnv
  };

  struct Session {
    std::unique_ptr<MultiAgentEnv> env;
    Env* single = nullptr;  // a single-agent session's own env, which v1 steps call; null for a multi-agent env
    std::vector<std::string> agents;
    std::vector<std::string> acting;  // who acts next; empty: the episode is over and further steps are refused
    std::string owner;
    std::chrono::steady_clock::time_point last_used;
    bool busy = false;  // a step is running (the env is not called concurrently)
  };

  void add(const std::string& id, const std::string& description, bool multi_agent, MultiAgentEnvFactory factory) {
    std::lock_guard<std::mutex> lock(mutex_);
    envs_[id] = Registered{description, multi_agent, std::move(factory)};
  }

  DeadlineServer& http() { return routes_.http(); }

  void install_routes() {
    using Request = httplib::Request;
    routes_.get("/health", [this](const Request&, const std::string&) { return health(); });
    routes_.get("/v1/envs", [this](const Request&, const std::string&) { return list_envs(); });
    routes_.post("/v1/sessions", [this](const Request&, const std::string& body) {
      return create(detail::parse_create(detail::parse_body(body)), false);
    });
    routes_.post(R"(/v1/sessions/([^/]+)/step)", [this](const Request& req, const std::string& body) {
      return step(req.matches[1], detail::parse_action(detail::parse_body(body)));
    });
    routes_.post("/v1/step", [this](const Request&, const std::string& body) {
      return batch(detail::parse_batch(detail::parse_body(body)), &EnvServer::step, detail::failed_step);
    });
    auto close_one = [this](const Request& req, const std::string&) { return close(req.matches[1]); };
    routes_.del(R"(/v1/sessions/([^/]+))", close_one);
    routes_.post("/v2/sessions", [this](const Request&, const std::string& body) {
      return create(detail::parse_create(detail::parse_body(body)), true);
    });
    routes_.post(R"(/v2/sessions/([^/]+)/step)", [this](const Request& req, const std::string& body) {
      return step_agents(req.matches[1], detail::parse_actions(detail::parse_body(body)));
    });
    routes_.post("/v2/step", [this](const Request&, const std::string& body) {
      return batch(detail::parse_batch_v2(detail::parse_body(body)), &EnvServer::step_agents,
                   detail::failed_multi_step);
    });
    routes_.del("/v2/sessions", [this](const Request& req, const std::string&) { return close_owned(req); });
    routes_.del(R"(/v2/sessions/([^/]+))", close_one);
    routes_.not_found_elsewhere();
  }

  // -- the protocol -----------------------------------------------------------------------------------

  json health() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {{"status", "ok"},
            {"protocol", "v2"},
            {"protocols", json::array({"v1", "v2"})},
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

  // POST /v1/sessions (`v2` false: single-agent envs only, the v1 reply) and POST /v2/sessions.
  json create(const detail::CreateRequest& request, bool v2) {
    Registered env_type = reserve_session(request.env_id);
    detail::OnExit give_back_place([this] {  // when no session is made, however this returns or throws
      std::lock_guard<std::mutex> lock(mutex_);
      --opening_;
    });
    if (!v2 && env_type.multi_agent) throw multi_agent_over_v1(request, env_type.factory);
    auto session = std::make_shared<Session>();
    json first;
    try {
      session->env = env_type.factory(request.kwargs);
      if (!session->env) throw std::runtime_error("the factory returned no env");
      MultiReset reset = session->env->reset(request.seed, request.options);
      session->agents = detail::checked_agents(*session->env);
      session->acting = detail::checked_acting(*session->env, session->agents);
      first = detail::reset_json(reset, session->agents, session->acting);
    } catch (const std::invalid_argument& e) {
      throw detail::bad_request("cannot make " + request.env_id + ": " + e.what() +
                                "; check the kwargs, seed and options");
    } catch (const std::exception& e) {
      throw detail::HttpError(500, "env_error", "cannot make " + request.env_id + ": " + e.what());
    } catch (...) {
      throw detail::HttpError(500, "env_error", "cannot make " + request.env_id + ": " + kNonStandard);
    }
    if (!env_type.multi_agent) session->single = &static_cast<detail::SingleAgentEnv&>(*session->env).env();
    session->owner = request.owner;
    session->last_used = std::chrono::steady_clock::now();
    std::string id = detail::new_session_id();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      sessions_[id] = session;
      --opening_;  // the place passes to the session under the same lock: it is never counted twice
      give_back_place.dismiss();
    }
    const std::string& agent = detail::kSingleAgent;
    if (!v2) {
      return {{"session_id", id}, {"observation", first["observations"][agent]}, {"info", first["infos"][agent]}};
    }
    return {{"session_id", id},
            {"multi_agent", env_type.multi_agent},
            {"agents", session->agents},
            {"acting", session->acting},
            {"observations", first["observations"]},
            {"infos", first["infos"]}};
  }

  // The 400 of a v1 creation of a multi-agent env, naming its agents when an env can be made from the kwargs.
  static detail::HttpError multi_agent_over_v1(const detail::CreateRequest& request, const MultiAgentEnvFactory& make) {
    std::string agents;
    try {
      if (auto env = make(request.kwargs)) agents = " (agents " + detail::listed(env->agents()) + ")";
    } catch (...) {  // the kwargs are for v2 to judge
    }
    return detail::bad_request("'" + request.env_id + "' is a multi-agent env" + agents +
                               ": create it with POST /v2/sessions");
  }

  // The registration of `env_id`, with a place under max_sessions taken for the new session (atomically, so the
  // cap holds under concurrent creations); the caller gives it back when the session is made or not.
  Registered reserve_session(const std::string& env_id) {
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
    return found->second;
  }

  // POST /v1/sessions/{id}/step: a single-agent session's step.
  json step(const std::string& id, const std::string& action) {
    std::shared_ptr<Session> session = claim(id, {{detail::kSingleAgent, action}}, false);
    // Unless the step ends well, the session is removed, so it is never left busy for good; its env is
    // destroyed after the lock is released (`session` outlives the guard).
    detail::OnExit remove_unless_done([&] { remove_session(id, session); });
    Step result;
    try {
      result = session->single->step(action);
      detail::check_info(result.info);
      if (!std::isfinite(result.reward)) throw std::runtime_error("reward is not a finite number");
    } catch (const std::exception& e) {  // the episode ends with a typed record; nothing else is affected
      return detail::failed_step(id, "env_error", std::string("step failed: ") + e.what());
    } catch (...) {
      return detail::failed_step(id, "env_error", std::string("step failed: ") + kNonStandard);
    }
    bool over = result.terminated || result.truncated;
    release(*session, over ? std::vector<std::string>{} : std::vector<std::string>{detail::kSingleAgent});
    remove_unless_done.dismiss();
    return {{"session_id", id},
            {"observation", result.observation},
            {"reward", result.reward},
            {"terminated", result.terminated},
            {"truncated", result.truncated},
            {"info", result.info},
            {"error", nullptr}};
  }

  // POST /v2/sessions/{id}/step: the acting agents' actions, in one step of any session.
  json step_agents(const std::string& id, const detail::Actions& actions) {
    std::shared_ptr<Session> session = claim(id, actions, true);
    detail::OnExit remove_unless_done([&] { remove_session(id, session); });
    json reply;
    std::vector<std::string> next;
    try {
      MultiStep result = session->env->step(actions);
      next = detail::checked_acting(*session->env, session->agents);
      reply = detail::step_json(result, session->agents, actions, next);
    } catch (const std::exception& e) {
      return detail::failed_multi_step(id, "env_error", std::string("step failed: ") + e.what());
    } catch (...) {
      return detail::failed_multi_step(id, "env_error", std::string("step failed: ") + kNonStandard);
    }
    release(*session, next);
    remove_unless_done.dismiss();
    reply["session_id"] = id;
    reply["acting"] = next;
    reply["error"] = nullptr;
    return reply;
  }

  // The session `id`, marked busy, after the protocol's checks in the protocol's order (nothing changes when one
  // fails): known, v1 steps of single-agent sessions only, the episode not over, the actions of exactly the acting
  // agents (v2), none too long (v1 checks this before the episode), no step running.
  std::shared_ptr<Session> claim(const std::string& id, const detail::Actions& actions, bool v2) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = sessions_.find(id);
    if (found == sessions_.end()) throw unknown_session(id);
    Session& session = *found->second;
    if (!v2 && !session.single) {
      throw detail::bad_request("session " + id + " holds a multi-agent env (agents " + detail::listed(session.agents) +
                                "): step it with POST /v2/sessions/" + id + "/step");
    }
    auto check_lengths = [&] {
      for (const auto& [agent, action] : actions) {
        std::size_t length = detail::utf8_length(action);
        if (length > options_.max_action_chars) {
          throw detail::HttpError(400, "action_too_long",
                                  (v2 ? "the action of agent '" + agent + "'" : std::string("action")) + " is " +
                                      std::to_string(length) + " characters; the limit is " +
                                      std::to_string(options_.max_action_chars) + " (--max-action-chars)");
        }
      }
    };
    if (!v2) check_lengths();  // v1's order: the action's length, then the episode
    if (session.acting.empty()) {
      throw detail::HttpError(409, "episode_over",
                              "the episode of session " + id + " has ended; close it or create a new one");
    }
    if (v2) detail::check_actions(actions, session.acting);
    if (v2) check_lengths();
    if (session.busy) throw detail::HttpError(409, "session_busy", "session " + id + " is already running a step");
    session.busy = true;
    return found->second;
  }

  // A step done well: the session is free again, `next` act next.
  void release(Session& session, std::vector<std::string> next) {
    std::lock_guard<std::mutex> lock(mutex_);
    session.busy = false;
    session.acting = std::move(next);
    session.last_used = std::chrono::steady_clock::now();
  }

  // POST /v1/step and /v2/step: each item stepped by `step_one`, a refused one answered by `failed` (a failed
  // result of the refusal's type), in order.
  template <typename Input, typename StepOne, typename Failed>
  json batch(const std::vector<std::pair<std::string, Input>>& items, StepOne step_one, Failed failed) {
    std::vector<json> results(items.size());
    std::atomic<std::size_t> next{0};
    auto work = [&] {
      for (std::size_t i; (i = next++) < items.size();) {
        const std::string& id = items[i].first;
        try {
          results[i] = (this->*step_one)(id, items[i].second);
        } catch (const detail::HttpError& e) {
          results[i] = failed(id, e.type, e.what());
        } catch (const std::exception& e) {
          results[i] = failed(id, "internal_error", e.what());
        } catch (...) {
          results[i] = failed(id, "internal_error", "the step threw a non-standard exception");
        }
      }
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

  // DELETE /v2/sessions?owner=NAME: every open session created with that owner (a run's, at its end or restart).
  json close_owned(const httplib::Request& req) {
    for (const auto& param : req.params) {
      if (param.first != "owner") {
        throw detail::bad_request("query." + param.first + ": unknown parameter (allowed: owner)");
      }
    }
    if (req.get_param_value_count("owner") != 1) throw detail::bad_request("query.owner: required, once");
    std::string owner = detail::checked_owner(req.get_param_value("owner"), "query.owner");
    std::vector<std::shared_ptr<Session>> closing;  // destroyed outside the lock
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = sessions_.begin(); it != sessions_.end();) {
        bool owned = it->second->owner == owner;
        if (owned) closing.push_back(std::move(it->second));
        it = owned ? sessions_.erase(it) : std::next(it);
      }
    }
    return {{"owner", owner}, {"closed", closing.size()}};
  }

  static detail::HttpError unknown_session(const std::string& id) {
    return detail::HttpError(404, "unknown_session",
                             "no open session '" + id + "' (closed, expired, failed or never created)");
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

  static constexpr const char* kNonStandard = "the env threw a non-standard exception (not a std::exception)";

  ServerOptions options_;
  detail::JsonRoutes routes_;
  std::atomic<int> port_{0};
  std::mutex mutex_;  // guards everything below, and each Session's busy/acting/last_used
  std::condition_variable stopped_;
  bool stopping_ = false;
  std::map<std::string, Registered> envs_;
  std::unordered_map<std::string, std::shared_ptr<Session>> sessions_;
  std::size_t opening_ = 0;  // creations between taking a place and registering their session
};

}  // namespace areal_agents
