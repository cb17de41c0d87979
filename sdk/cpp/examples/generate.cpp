// generate URL "prompt text" | generate URL --ids 1,2,3 | generate URL --chat "message"   [--max-new-tokens N]
// Greedy generation from a serve-model (or SGLang) server; prints what came back, one field a line.
#include <areal_agents/model_client.hpp>

#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::vector<std::int64_t> parse_ids(const std::string& text) {
  std::vector<std::int64_t> ids;
  std::stringstream items(text);
  for (std::string item; std::getline(items, item, ',');) {
    std::size_t used = 0;
    ids.push_back(std::stoll(item, &used));
    if (used != item.size()) throw std::invalid_argument("--ids: '" + item + "' is not an integer");
  }
  return ids;
}

template <typename T>
std::string joined(const std::vector<T>& values) {
  std::ostringstream out;
  for (std::size_t i = 0; i < values.size(); ++i) out << (i ? "," : "") << values[i];
  return out.str();
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  int max_new_tokens = 16;
  if (args.size() == 4 && args[2] == "--max-new-tokens") {
    max_new_tokens = std::stoi(args[3]);
    args.resize(2);
  }
  bool flagged = args.size() == 3 && (args[1] == "--ids" || args[1] == "--chat");
  if (!(args.size() == 2 && args[1].rfind("--", 0) != 0) && !flagged) {
    std::cerr << "usage: generate URL \"prompt text\" | generate URL --ids 1,2,3 | generate URL --chat \"message\""
                 " [--max-new-tokens N]\n";
    return 2;
  }
  try {
    areal_agents::ModelClient policy(args[0]);
    if (flagged && args[1] == "--chat") {
      auto reply = policy.chat({{"user", args[2]}}, max_new_tokens, /*temperature=*/0.0);
      std::cout << "content: " << reply.content << "\nfinish_reason: " << reply.finish_reason << "\n";
      return 0;
    }
    areal_agents::SamplingParams greedy;
    greedy.max_new_tokens = max_new_tokens;
    greedy.temperature = 0.0;
    auto out = flagged ? policy.generate(parse_ids(args[2]), greedy) : policy.generate(args[1], greedy);
    std::cout << "text: " << out.text << "\noutput_ids: " << joined(out.output_ids)
              << "\nlogprobs: " << joined(out.logprobs) << "\nfinish_reason: " << out.finish_reason
              << "\nweight_version: " << out.weight_version << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "generate: " << e.what() << "\n";
    return 1;
  }
}
