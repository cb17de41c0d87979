// areal_agents/env.hpp: the two kinds of env an EnvServer serves, what you implement.
//
//   Env            one agent: reset -> observation; step(action) -> observation, reward, terminated, truncated
//                  (Gymnasium's API; protocol v1, and v2 as the one agent "agent")
//   MultiAgentEnv  several agents: reset -> an observation per agent; acting() says who acts next;
//                  step({agent: action}) -> per-agent dicts (PettingZoo's parallel API plus a turn order;
//                  protocol v2 only)
//
// The server makes one env per session from the factory you register, calls it from one thread at a time, and
// destroys it when its session ends (closed, failed, expired, server stopped), never during a step. Throw
// std::invalid_argument from the factory or reset for a request's bad kwargs/seed/options (a 400); any other
// exception is the env's failure (a 500 at creation, an env_error step result mid-episode).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace areal_agents {

using json = nlohmann::json;

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

// One agent, one episode at a time.
class Env {
 public:
  virtual ~Env() = default;
  // Same seed (and kwargs, options) -> same episode. `options` is an object ({} when the request has none).
  virtual Reset reset(std::optional<std::uint64_t> seed, const json& options) = 0;
  virtual Step step(const std::string& action) = 0;
};

using EnvFactory = std::function<std::unique_ptr<Env>(const json& kwargs)>;

// Per agent id: what each agent sees first.
struct MultiReset {
  std::map<std::string, std::string> observations;  // at least every agent of acting()
  std::map<std::string, json> infos;                // objects; an agent left out has {}
};

// The outcome of one step of the acting agents. An agent left out of rewards, terminations, truncations or
// infos has 0.0, false, false, {} there.
struct MultiStep {
  std::map<std::string, std::string> observations;  // every agent that gets a new observation
  std::map<std::string, double> rewards;
  std::map<std::string, bool> terminations;
  std::map<std::string, bool> truncations;
  std::map<std::string, json> infos;
};

// Several agents, one episode at a time. acting() names who acts next: every live agent at once (a parallel
// game) or one at a time (a turn-based one); empty once the episode is over. An agent that terminates or
// truncates in a step must not act again.
class MultiAgentEnv {
 public:
  virtual ~MultiAgentEnv() = default;
  // Every agent id of its episodes, in a fixed order (PettingZoo's possible_agents), fixed once constructed.
  virtual std::vector<std::string> agents() const = 0;
  // Same seed (and kwargs, options) -> same episode. `options` is an object ({} when the request has none).
  virtual MultiReset reset(std::optional<std::uint64_t> seed, const json& options) = 0;
  // Who acts next, in order; never empty right after reset, empty when the episode is over.
  virtual std::vector<std::string> acting() const = 0;
  // `actions` holds an action for each agent acting() named, and no other.
  virtual MultiStep step(const std::map<std::string, std::string>& actions) = 0;
};

using MultiAgentEnvFactory = std::function<std::unique_ptr<MultiAgentEnv>(const json& kwargs)>;

}  // namespace areal_agents
