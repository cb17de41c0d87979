// areal_agents/env_client.hpp: play episodes on an env-step server (protocol v1, docs/env-protocol.md).
//
//   areal_agents::EnvClient envs("http://127.0.0.1:8765");
//   auto session = envs.create("areal_agents/Arithmetic-v0", {{"digits", 2}}, /*seed=*/7);
//   auto result = envs.step(session.session_id, "42");   // result.reward, result.terminated, ...
//   envs.close(session.session_id);
//
// A refused request (4xx/5xx) throws ProtocolError (status, type, message). An env that failed mid-episode is
// not thrown: its StepResult has `error` set and the episode is over.
#pragma once

#include <areal_agents/http_json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace areal_agents {

struct Session {
  std::string session_id;
  std::string observation;
  nlohmann::json info;
};

struct StepError {
  std::string type;  // env_error, timeout, worker_died; in a batch also unknown_session, episode_over, ...
  std::string message;
};

struct StepResult {
  std::string session_id;
  std::string observation;
  double reward = 0.0;
  bool terminated = false;
  bool truncated = false;
  nlohmann::json info;
  std::optional<StepError> error;  // set when the step did not happen normally; the episode is over
};

struct BatchStep {
  std::string session_id;
  std::string action;
};

struct EnvInfo {
  std::string id;
  std::string description;
};

class EnvClient {
 public:
  explicit EnvClient(const std::string& base_url, double timeout_s = 120.0) : http_(base_url, timeout_s) {}

  // A new session's first observation; `seed` makes the episode reproducible.
  Session create(const std::string& env_id, const nlohmann::json& kwargs = nlohmann::json::object(),
                 std::optional<std::uint64_t> seed = std::nullopt,
                 const nlohmann::json& options = nlohmann::json()) {
    nlohmann::json body = {{"env_id", env_id}, {"kwargs", kwargs}};
    if (seed) body["seed"] = *seed;
    if (!options.is_null()) body["options"] = options;
    nlohmann::json reply = http_.post("/v1/sessions", body);
    return {reply.at("session_id").get<std::string>(), reply.at("observation").get<std::string>(),
            reply.at("info")};
  }

  StepResult step(const std::string& session_id, const std::string& action) {
    return step_result(http_.post("/v1/sessions/" + session_id + "/step", {{"action", action}}));
  }

  // One action for each of several distinct sessions, in one request; results in the same order.
  std::vector<StepResult> step_batch(const std::vector<BatchStep>& steps) {
    nlohmann::json items = nlohmann::json::array();
    for (const auto& item : steps) items.push_back({{"session_id", item.session_id}, {"action", item.action}});
    std::vector<StepResult> results;
    for (const auto& result : http_.post("/v1/step", {{"steps", items}}).at("results")) {
      results.push_back(step_result(result));
    }
    return results;
  }

  void close(const std::string& session_id) { http_.del("/v1/sessions/" + session_id); }

  // {"status", "protocol", "sessions_open", "limits": {...}}
  nlohmann::json health() { return http_.get("/health"); }

  std::vector<EnvInfo> list_envs() {
    std::vector<EnvInfo> envs;
    for (const auto& env : http_.get("/v1/envs").at("envs")) {
      envs.push_back({env.at("id").get<std::string>(), env.at("description").get<std::string>()});
    }
    return envs;
  }

 private:
  static StepResult step_result(const nlohmann::json& reply) {
    StepResult result;
    result.session_id = reply.at("session_id").get<std::string>();
    result.observation = reply.at("observation").get<std::string>();
    result.reward = reply.at("reward").get<double>();
    result.terminated = reply.at("terminated").get<bool>();
    result.truncated = reply.at("truncated").get<bool>();
    result.info = reply.at("info");
    if (reply.contains("error") && !reply["error"].is_null()) {
      result.error = StepError{reply["error"].at("type").get<std::string>(),
                               reply["error"].at("message").get<std::string>()};
    }
    return result;
  }

  detail::JsonHttp http_;
};

}  // namespace areal_agents
