// areal_agents/agent_episodes.hpp: how EnvServer serves every env as agents (protocol v2): a single-agent Env as
// the one agent "agent" (SingleAgentEnv), an env's per-agent results checked and written as the protocol's dicts,
// and a step's actions checked against who acts. An env that breaks the MultiAgentEnv contract (an unknown agent
// id, a non-finite reward, an agent acting after it terminated) throws std::runtime_error here: its episode fails
// with env_error, the server lives on.
#pragma once

#include <areal_agents/env.hpp>
#include <areal_agents/server_replies.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace areal_agents {

namespace detail {

// The id of a single-agent env's one agent over v2.
inline const std::string kSingleAgent = "agent";

// A single-agent Env as a MultiAgentEnv of one agent; its own env() serves v1 steps of the same session.
class SingleAgentEnv final : public MultiAgentEnv {
 public:
  explicit SingleAgentEnv(std::unique_ptr<Env> env) : env_(std::move(env)) {}

  Env& env() { return *env_; }

  std::vector<std::string> agents() const override { return {kSingleAgent}; }

  MultiReset reset(std::optional<std::uint64_t> seed, const json& options) override {
    Reset first = env_->reset(seed, options);
    over_ = false;
    return {{{kSingleAgent, first.observation}}, {{kSingleAgent, first.info}}};
  }

  std::vector<std::string> acting() const override {
    return over_ ? std::vector<std::string>{} : std::vector<std::string>{kSingleAgent};
  }

  MultiStep step(const std::map<std::string, std::string>& actions) override {
    Step result = env_->step(actions.at(kSingleAgent));
    over_ = result.terminated || result.truncated;
    return {{{kSingleAgent, result.observation}},
            {{kSingleAgent, result.reward}},
            {{kSingleAgent, result.terminated}},
            {{kSingleAgent, result.truncated}},
            {{kSingleAgent, result.info}}};
  }

 private:
  std::unique_ptr<Env> env_;
  bool over_ = false;
};

// Ids as a message shows them: ['a', 'b'], the first 16 (a client may send thousands).
inline std::string listed(const std::vector<std::string>& ids) {
  constexpr std::size_t kShown = 16;
  std::string out;
  for (std::size_t i = 0; i < std::min(ids.size(), kShown); ++i) {
    out += (i ? ", '" : "'") + ids[i].substr(0, 128) + "'";
  }
  if (ids.size() > kShown) out += ", ... " + std::to_string(ids.size() - kShown) + " more";
  return "[" + out + "]";
}

// An info as the protocol has it: null becomes {}, anything else but an object is the env's error.
inline void check_info(json& info) {
  if (info.is_null()) info = json::object();
  if (!info.is_object()) throw std::runtime_error("info must be a JSON object, got " + info.dump());
}

// The episode's agent ids, checked: at least one, none empty, none twice.
inline std::vector<std::string> checked_agents(const MultiAgentEnv& env) {
  std::vector<std::string> agents = env.agents();
  if (agents.empty()) throw std::runtime_error("agents() is empty");
  std::set<std::string> seen;
  for (const auto& id : agents) {
    if (id.empty() || !seen.insert(id).second) {
      throw std::runtime_error("agents() " + listed(agents) + ": ids must be non-empty and distinct");
    }
  }
  return agents;
}

inline bool known(const std::vector<std::string>& agents, const std::string& id) {
  return std::find(agents.begin(), agents.end(), id) != agents.end();
}

// Who acts next, checked against the episode's agents: known ids, each once.
inline std::vector<std::string> checked_acting(const MultiAgentEnv& env, const std::vector<std::string>& agents) {
  std::vector<std::string> acting = env.acting();
  std::set<std::string> seen;
  for (const auto& id : acting) {
    if (!known(agents, id)) throw std::runtime_error("acting() names '" + id + "', not an agent " + listed(agents));
    if (!seen.insert(id).second) throw std::runtime_error("acting() names '" + id + "' twice");
  }
  return acting;
}

// The actions of a v2 step against who acts: exactly one for each acting agent (a 400 naming the others).
inline void check_actions(const std::map<std::string, std::string>& actions, const std::vector<std::string>& acting) {
  std::vector<std::string> missing, unexpected;
  for (const auto& agent : acting) {
    if (!actions.count(agent)) missing.push_back(agent);
  }
  for (const auto& item : actions) {
    if (!known(acting, item.first)) unexpected.push_back(item.first);
  }
  if (missing.empty() && unexpected.empty()) return;
  throw bad_request("body.actions: expected an action of each acting agent " + listed(acting) +
                    (missing.empty() ? "" : "; missing " + listed(missing)) +
                    (unexpected.empty() ? "" : "; not acting " + listed(unexpected)));
}

template <typename Value>
void check_keys(const std::map<std::string, Value>& dict, const std::string& name,
                const std::vector<std::string>& agents) {
  for (const auto& item : dict) {
    if (!known(agents, item.first)) {
      throw std::runtime_error(name + " has '" + item.first + "', not an agent " + listed(agents));
    }
  }
}

// A reset's observations and infos (an info for every agent that has an observation), checked.
inline json reset_json(MultiReset& first, const std::vector<std::string>& agents,
                       const std::vector<std::string>& acting) {
  if (acting.empty()) throw std::runtime_error("acting() is empty after reset: nobody can act");
  check_keys(first.observations, "observations", agents);
  check_keys(first.infos, "infos", agents);
  for (const auto& id : acting) {
    if (!first.observations.count(id)) throw std::runtime_error("no observation for '" + id + "', who acts first");
  }
  for (const auto& item : first.observations) first.infos.emplace(item.first, json::object());
  for (auto& item : first.infos) check_info(item.second);
  return {{"observations", first.observations}, {"infos", first.infos}};
}

// A step's five dicts, checked, with an entry in rewards, terminations, truncations and infos for each agent that
// acted; `next` is who acts after it.
inline json step_json(MultiStep& result, const std::vector<std::string>& agents,
                      const std::map<std::string, std::string>& actions, const std::vector<std::string>& next) {
  check_keys(result.observations, "observations", agents);
  check_keys(result.rewards, "rewards", agents);
  check_keys(result.terminations, "terminations", agents);
  check_keys(result.truncations, "truncations", agents);
  check_keys(result.infos, "infos", agents);
  for (const auto& item : actions) {
    result.rewards.emplace(item.first, 0.0);
    result.terminations.emplace(item.first, false);
    result.truncations.emplace(item.first, false);
    result.infos.emplace(item.first, json::object());
  }
  for (const auto& item : result.rewards) {
    if (!std::isfinite(item.second)) throw std::runtime_error("reward of '" + item.first + "' is not a finite number");
  }
  for (auto& item : result.infos) check_info(item.second);
  auto set = [](const std::map<std::string, bool>& flags, const std::string& id) {
    auto found = flags.find(id);
    return found != flags.end() && found->second;
  };
  for (const auto& id : next) {
    if (set(result.terminations, id) || set(result.truncations, id)) {
      throw std::runtime_error("'" + id + "' ended in this step, yet acting() names it to act next");
    }
  }
  return {{"observations", result.observations}, {"rewards", result.rewards},
          {"terminations", result.terminations}, {"truncations", result.truncations},
          {"infos", result.infos}};
}

}  // namespace detail

}  // namespace areal_agents
