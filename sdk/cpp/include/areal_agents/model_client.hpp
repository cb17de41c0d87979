// areal_agents/model_client.hpp: call a policy served by `areal-agents serve-model` (or SGLang, vLLM's
// OpenAI routes) from C++: SGLang's native POST /generate and OpenAI's POST /v1/chat/completions.
//
//   areal_agents::ModelClient policy("http://127.0.0.1:30000");
//   auto out = policy.generate("12+7=", {/*max_new_tokens=*/8, /*temperature=*/0.0});
//   // out.text, out.output_ids, out.logprobs, out.finish_reason, out.weight_version
//   auto reply = policy.chat({{"user", "Hello"}}, /*max_tokens=*/32);   // reply.content, reply.finish_reason
//
// A refused request throws ProtocolError (status, type, message).
#pragma once

#include <areal_agents/http_json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace areal_agents {

// SGLang's sampling_params; `extra` adds any other key (e.g. {"ignore_eos": true}).
struct SamplingParams {
  int max_new_tokens = 128;
  double temperature = 1.0;  // 0 = greedy
  double top_p = 1.0;
  int top_k = -1;  // -1 = off
  std::vector<std::int64_t> stop_token_ids;
  nlohmann::json extra = nlohmann::json::object();
};

struct Generation {
  std::string text;
  std::vector<std::int64_t> output_ids;
  std::vector<double> logprobs;  // the behaviour logprob of each output token
  std::string finish_reason;  // stop | length | abort
  std::string weight_version;
  nlohmann::json meta_info;  // everything else: prompt_tokens, completion_tokens, e2e_latency, ...
};

struct ChatMessage {
  std::string role;  // system | user | assistant
  std::string content;
};

struct ChatReply {
  std::string content;  // "" when the reply has none (e.g. only tool calls)
  std::string finish_reason;  // stop | length | tool_calls
  nlohmann::json completion;  // the whole chat.completion reply (usage, ...)
};

class ModelClient {
 public:
  // `model` is sent as the chat request's "model"; empty: the first of GET /v1/models, asked once.
  explicit ModelClient(const std::string& base_url, std::string model = "", double timeout_s = 600.0)
      : http_(base_url, timeout_s), model_(std::move(model)) {}

  Generation generate(const std::vector<std::int64_t>& input_ids, const SamplingParams& sampling = {}) {
    return generation(http_.post("/generate", request({{"input_ids", input_ids}}, sampling)));
  }

  Generation generate(const std::string& text, const SamplingParams& sampling = {}) {
    return generation(http_.post("/generate", request({{"text", text}}, sampling)));
  }

  ChatReply chat(const std::vector<ChatMessage>& messages, int max_tokens = 128, double temperature = 1.0) {
    nlohmann::json body = {{"model", model()}, {"max_tokens", max_tokens}, {"temperature", temperature},
                           {"messages", nlohmann::json::array()}};
    for (const auto& message : messages) body["messages"].push_back({{"role", message.role}, {"content", message.content}});
    nlohmann::json reply = http_.post("/v1/chat/completions", body);
    const nlohmann::json& choice = reply.at("choices").at(0);
    const nlohmann::json& content = choice.at("message").value("content", nlohmann::json());
    return {content.is_string() ? content.get<std::string>() : "", choice.value("finish_reason", ""), reply};
  }

  // The served model's name (GET /v1/models), unless one was given to the constructor.
  const std::string& model() {
    if (model_.empty()) model_ = http_.get("/v1/models").at("data").at(0).at("id").get<std::string>();
    return model_;
  }

 private:
  static nlohmann::json request(nlohmann::json body, const SamplingParams& sampling) {
    nlohmann::json params = {{"max_new_tokens", sampling.max_new_tokens},
                             {"temperature", sampling.temperature},
                             {"top_p", sampling.top_p},
                             {"top_k", sampling.top_k}};
    if (!sampling.stop_token_ids.empty()) params["stop_token_ids"] = sampling.stop_token_ids;
    params.update(sampling.extra);
    body["sampling_params"] = params;
    body["return_logprob"] = true;
    return body;
  }

  static Generation generation(const nlohmann::json& reply) {
    Generation out;
    out.text = reply.at("text").get<std::string>();
    out.output_ids = reply.at("output_ids").get<std::vector<std::int64_t>>();
    out.meta_info = reply.at("meta_info");
    out.finish_reason = out.meta_info.at("finish_reason").at("type").get<std::string>();
    const auto& version = out.meta_info.value("weight_version", nlohmann::json());
    out.weight_version = version.is_string() ? version.get<std::string>() : version.dump();
    for (const auto& entry : out.meta_info.value("output_token_logprobs", nlohmann::json::array())) {
      out.logprobs.push_back(entry.at(0).get<double>());  // [logprob, token_id, text-or-null]
    }
    return out;
  }

  detail::JsonHttp http_;
  std::string model_;
};

}  // namespace areal_agents
