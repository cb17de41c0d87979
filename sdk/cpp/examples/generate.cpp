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
    try {
      ids.push_back(std::stoll(item, &used));
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size()) throw std::invalid_argument("--ids: '" + item + "' is not an integer");
  }
  return ids;
}

template <typename T>
std::string joined(const std::vector<T>& values) {
  std::ostringstream out;
  for (std::size_t i = 0; i < values.size(); ++i) out << (i ? "," : "") << values[i];
  return out.str();
}

// The command line: URL, then exactly one of a prompt, --ids or --chat, and optionally --max-new-tokens.
struct Args {
  std::string url, prompt, ids, chat;
  int max_new_tokens = 16;
};

Args parse_args(int argc, char** argv) {
  Args args;
  int inputs = 0;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    bool flag = arg == "--ids" || arg == "--chat" || arg == "--max-new-tokens";
    if (flag && i + 1 == argc) throw std::invalid_argument(arg + ": missing value");
    if (arg == "--ids") args.ids = argv[++i], ++inputs;
    else if (arg == "--chat") args.chat = argv[++i], ++inputs;
    else if (arg == "--max-new-tokens") args.max_new_tokens = std::stoi(argv[++i]);
    else if (arg.rfind("--", 0) == 0) throw std::invalid_argument("unknown flag " + arg);
    else if (args.url.empty()) args.url = arg;
    else args.prompt = arg, ++inputs;
  }
  if (args.url.empty() || inputs != 1) throw std::invalid_argument("give a URL and one of: a prompt, --ids, --chat");
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse_args(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "generate: " << e.what() << "\nusage: generate URL (\"prompt text\" | --ids 1,2,3 | --chat \"message\")"
              << " [--max-new-tokens N]\n";
    return 2;
  }
  try {
    areal_agents::ModelClient policy(args.url);
    if (!args.chat.empty()) {
      auto reply = policy.chat({{"user", args.chat}}, args.max_new_tokens, /*temperature=*/0.0);
      std::cout << "content: " << reply.content << "\nfinish_reason: " << reply.finish_reason << "\n";
      return 0;
    }
    areal_agents::SamplingParams greedy;
    greedy.max_new_tokens = args.max_new_tokens;
    greedy.temperature = 0.0;
    auto out = args.ids.empty() ? policy.generate(args.prompt, greedy) : policy.generate(parse_ids(args.ids), greedy);
    std::cout << "text: " << out.text << "\noutput_ids: " << joined(out.output_ids)
              << "\nlogprobs: " << joined(out.logprobs) << "\nfinish_reason: " << out.finish_reason
              << "\nweight_version: " << out.weight_version << "\n";
    return 0;
  } catch (const std::exception& e) {  // ProtocolError: "TYPE (HTTP STATUS): message"
    std::cerr << "generate: " << e.what() << "\n";
    return 1;
  }
}
