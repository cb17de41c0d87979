// cpp/GuessNumber-v0: guess a secret integer; the env answers "Higher." or "Lower.".
//   ./guess_number --port 8766   then   areal-agents train CONFIG env.backend=server
//                                           env.server_url=http://127.0.0.1:8766 env.id=cpp/GuessNumber-v0
#include <areal_agents/env_server.hpp>

#include <algorithm>
#include <cctype>
#include <random>

using areal_agents::json;

class GuessNumber : public areal_agents::Env {
 public:
  explicit GuessNumber(const json& kwargs)
      : low_(integer(kwargs, "low", 1)), high_(integer(kwargs, "high", 10)), max_turns_(integer(kwargs, "max_turns", 4)) {
    for (const auto& item : kwargs.items()) {
      if (item.key() != "low" && item.key() != "high" && item.key() != "max_turns")
        throw std::invalid_argument("unknown kwarg '" + item.key() + "' (known: low, high, max_turns)");
    }
    if (low_ > high_) throw std::invalid_argument("low must be <= high");
    if (max_turns_ < 1) throw std::invalid_argument("max_turns must be >= 1");
  }

  areal_agents::Reset reset(std::optional<std::uint64_t> seed, const json& /*options*/) override {
    std::mt19937_64 rng(seed ? *seed : std::random_device{}());
    secret_ = std::uniform_int_distribution<long long>(low_, high_)(rng);
    turn_ = 0;
    return {"Guess the number between " + std::to_string(low_) + " and " + std::to_string(high_) + ".", {{"turn", 0}}};
  }

  areal_agents::Step step(const std::string& action) override {
    ++turn_;
    std::optional<long long> guess = first_integer(action);
    bool parsed = guess.has_value(), correct = parsed && *guess == secret_;
    bool truncated = !correct && turn_ >= max_turns_;
    std::string observation = !parsed ? "Not a number." : correct ? "Correct!" : *guess < secret_ ? "Higher." : "Lower.";
    json info = {{"turn", turn_}};
    if (correct || truncated) info["secret"] = secret_;
    return {observation, correct ? 1.0 : 0.0, correct, truncated, info};
  }

 private:
  // The first integer in the text (at most 18 digits); a plain scan, as std::regex recurses per character.
  static std::optional<long long> first_integer(const std::string& text) {
    auto is_digit = [](unsigned char c) { return std::isdigit(c) != 0; };
    auto start = std::find_if(text.begin(), text.end(), is_digit);
    auto end = std::find_if_not(start, text.end(), is_digit);
    if (start == end || end - start > 18) return std::nullopt;
    long long value = std::stoll(std::string(start, end));
    return start != text.begin() && start[-1] == '-' ? -value : value;
  }

  static long long integer(const json& kwargs, const char* key, long long fallback) {
    if (!kwargs.contains(key)) return fallback;
    if (!kwargs[key].is_number_integer()) throw std::invalid_argument(std::string(key) + ": expected an integer");
    return kwargs[key].get<long long>();
  }

  long long low_, high_, max_turns_, secret_ = 0, turn_ = 0;
};

int main(int argc, char** argv) {
  areal_agents::EnvServer server(areal_agents::parse_server_options_or_exit(argc, argv));
  server.add_env("cpp/GuessNumber-v0", "guess a secret integer between low and high; the env says higher or lower",
                 [](const json& kwargs) { return std::make_unique<GuessNumber>(kwargs); });
  return server.listen() ? 0 : 1;
}
