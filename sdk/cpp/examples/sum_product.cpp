// cpp/SumProduct-v0: a two-agent game played in parallel. Both agents see the same two small numbers; at once,
// the adder answers their sum and the multiplier their product, each rewarded 1 for a right answer; then come
// new numbers, for `rounds` rounds. The server also serves cpp/Sum-v0, the adder alone (a single-agent env).
//   ./sum_product --port 8768   then   areal-agents train CONFIG env.backend=server env.id=cpp/SumProduct-v0
//       env.server_url=http://127.0.0.1:8768 rollout.agent=areal_agents.agents.multi_agent:MultiAgentChatAgent
#include <areal_agents/env_server.hpp>

#include <algorithm>
#include <cctype>
#include <random>

using areal_agents::json;

class SumProduct : public areal_agents::MultiAgentEnv {
 public:
  explicit SumProduct(const json& kwargs)
      : max_operand_(integer(kwargs, "max_operand", 3, 99)), rounds_(integer(kwargs, "rounds", 1, 16)) {
    for (const auto& item : kwargs.items()) {
      if (item.key() != "max_operand" && item.key() != "rounds")
        throw std::invalid_argument("unknown kwarg '" + item.key() + "' (known: max_operand, rounds)");
    }
  }

  std::vector<std::string> agents() const override { return {"adder", "multiplier"}; }

  areal_agents::MultiReset reset(std::optional<std::uint64_t> seed, const json& /*options*/) override {
    rng_.seed(seed ? *seed : std::random_device{}());
    round_ = 0;
    return {new_questions(), {}};
  }

  // Both agents act in every round (in parallel); nobody once the last round is answered.
  std::vector<std::string> acting() const override { return round_ < rounds_ ? agents() : std::vector<std::string>{}; }

  areal_agents::MultiStep step(const std::map<std::string, std::string>& actions) override {
    ++round_;
    areal_agents::MultiStep out;
    for (const auto& [agent, answer] : std::map<std::string, long long>{{"adder", a_ + b_}, {"multiplier", a_ * b_}}) {
      bool right = first_integer(actions.at(agent)) == answer;
      out.rewards[agent] = right ? 1.0 : 0.0;
      out.terminations[agent] = round_ == rounds_;
      out.infos[agent] = {{"round", round_}, {"answer", answer}, {"success", right}};
    }
    if (round_ < rounds_) out.observations = new_questions();
    return out;
  }

 private:
  std::map<std::string, std::string> new_questions() {
    std::uniform_int_distribution<long long> operand(0, max_operand_);
    a_ = operand(rng_);
    b_ = operand(rng_);
    std::string a = std::to_string(a_), b = std::to_string(b_);
    return {{"adder", a + "+" + b + "="}, {"multiplier", a + "*" + b + "="}};
  }

  // The first integer in the text (at most 18 digits); a plain scan, as std::regex recurses per character.
  static std::optional<long long> first_integer(const std::string& text) {
    auto is_digit = [](unsigned char c) { return std::isdigit(c) != 0; };
    auto start = std::find_if(text.begin(), text.end(), is_digit);
    auto end = std::find_if_not(start, text.end(), is_digit);
    if (start == end || end - start > 18) return std::nullopt;
    long long value = std::stoll(std::string(start, end));
    return start != text.begin() && start[-1] == '-' ? -value : value;
  }

  static long long integer(const json& kwargs, const char* key, long long fallback, long long max) {
    if (!kwargs.contains(key)) return fallback;
    if (!kwargs[key].is_number_integer() || kwargs[key] < 1 || kwargs[key] > max)
      throw std::invalid_argument(std::string(key) + ": expected an integer from 1 to " + std::to_string(max));
    return kwargs[key].get<long long>();
  }

  long long max_operand_, rounds_, round_ = 0, a_ = 0, b_ = 0;
  std::mt19937_64 rng_;
};

// cpp/Sum-v0: the adder's game alone, a single-agent env (served over v1, and over v2 as the agent "agent").
class Sum : public areal_agents::Env {
 public:
  explicit Sum(const json& kwargs) : game_(kwargs) {}

  areal_agents::Reset reset(std::optional<std::uint64_t> seed, const json& options) override {
    return {game_.reset(seed, options).observations.at("adder"), json::object()};
  }

  areal_agents::Step step(const std::string& action) override {
    areal_agents::MultiStep out = game_.step({{"adder", action}, {"multiplier", ""}});
    return {out.observations["adder"], out.rewards["adder"], out.terminations["adder"], false, out.infos["adder"]};
  }

 private:
  SumProduct game_;
};

int main(int argc, char** argv) {
  areal_agents::EnvServer server(areal_agents::parse_server_options_or_exit(argc, argv));
  server.add_multi_agent_env("cpp/SumProduct-v0", "an adder and a multiplier answer about the same two numbers",
                             [](const json& kwargs) { return std::make_unique<SumProduct>(kwargs); });
  server.add_env("cpp/Sum-v0", "the adder alone", [](const json& kwargs) { return std::make_unique<Sum>(kwargs); });
  return server.listen() ? 0 : 1;
}
