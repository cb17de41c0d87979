// areal_agents/server_replies.hpp: what env_server.hpp replies with and checks requests by: the protocol's
// error records (HttpError), strict JSON body checks that name the field (the routes' bodies parsed and checked),
// and failed step results.
#pragma once

#include <httplib.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace areal_agents {

using json = nlohmann::json;

namespace detail {

// A refused request: the HTTP status and the protocol's error type.
struct HttpError : std::runtime_error {
  HttpError(int status, std::string type, const std::string& message)
      : std::runtime_error(message), status(status), type(std::move(type)) {}
  int status;
  std::string type;
};

inline HttpError bad_request(const std::string& message) { return HttpError(400, "bad_request", message); }

inline json error_body(const std::string& type, const std::string& message) {
  return {{"error", {{"type", type}, {"message", message}}}};
}

inline void reply(httplib::Response& res, int status, const json& body) {
  res.status = status;
  // Envs may put any bytes in observations and infos; invalid UTF-8 is replaced rather than failing the reply.
  res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

// Code points in a UTF-8 string (the JSON parser has already rejected invalid UTF-8).
inline std::size_t utf8_length(const std::string& text) {
  return static_cast<std::size_t>(
      std::count_if(text.begin(), text.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; }));
}

inline std::string join(const std::vector<std::string>& items, const std::string& separator) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : separator) + item;
  return out;
}

// `value` must be an object with only the `allowed` keys; `where` names it in messages ("body", "body.steps[2]").
inline void check_object(const json& value, const std::string& where, const std::vector<std::string>& allowed) {
  if (!value.is_object()) throw bad_request(where + ": expected a JSON object");
  for (const auto& item : value.items()) {
    if (std::find(allowed.begin(), allowed.end(), item.key()) == allowed.end()) {
      throw bad_request(where + "." + item.key() + ": unknown field (allowed: " + join(allowed, ", ") + ")");
    }
  }
}

inline std::string required_string(const json& object, const std::string& where, const std::string& key) {
  auto found = object.find(key);
  if (found == object.end()) throw bad_request(where + "." + key + ": required");
  if (!found->is_string()) throw bad_request(where + "." + key + ": expected a string");
  return found->get<std::string>();
}

// Arrays and objects nested deeper than this are refused: copying and printing a json value recurse per level,
// so a body of a few hundred KB of brackets would otherwise overflow a request thread's stack.
constexpr int kMaxJsonDepth = 512;

inline json parse_body(const std::string& body) {
  auto bounded = [](int depth, json::parse_event_t event, json&) {
    bool opens = event == json::parse_event_t::object_start || event == json::parse_event_t::array_start;
    if (opens && depth >= kMaxJsonDepth) {
      throw bad_request("body: nested deeper than " + std::to_string(kMaxJsonDepth) +
                        " arrays/objects (the nesting limit)");
    }
    return true;
  };
  try {
    return json::parse(body, bounded);
  } catch (const json::parse_error& e) {
    throw bad_request(std::string("body: malformed JSON (") + e.what() + ")");
  }
}

// -- the request bodies of the protocol's routes --

struct CreateRequest {
  std::string env_id;
  json kwargs = json::object();
  std::optional<std::uint64_t> seed;
  json options = json::object();
  std::string owner;  // the client run that owns the session; empty: none
};

// An owner tag: 1..128 characters of [A-Za-z0-9_.:-]; `where` names it in the message ("body.owner").
inline std::string checked_owner(const std::string& owner, const std::string& where) {
  bool allowed = !owner.empty() && owner.size() <= 128 && std::all_of(owner.begin(), owner.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == ':' || c == '-';
  });
  if (!allowed) throw bad_request(where + ": expected 1 to 128 characters of A-Z a-z 0-9 _ . : -");
  return owner;
}

// The body of POST /v1/sessions and POST /v2/sessions, checked strictly.
inline CreateRequest parse_create(const json& body) {
  check_object(body, "body", {"env_id", "kwargs", "seed", "options", "owner"});
  CreateRequest request;
  request.env_id = required_string(body, "body", "env_id");
  if (body.contains("kwargs")) {
    if (!body["kwargs"].is_object()) throw bad_request("body.kwargs: expected an object");
    request.kwargs = body["kwargs"];
  }
  if (body.contains("seed") && !body["seed"].is_null()) {
    if (!body["seed"].is_number_unsigned()) throw bad_request("body.seed: expected an integer >= 0 or null");
    request.seed = body["seed"].get<std::uint64_t>();
  }
  if (body.contains("options") && !body["options"].is_null()) {
    if (!body["options"].is_object()) throw bad_request("body.options: expected an object or null");
    request.options = body["options"];
  }
  if (body.contains("owner")) request.owner = checked_owner(required_string(body, "body", "owner"), "body.owner");
  return request;
}

// The action of a POST /v1/sessions/{id}/step body.
inline std::string parse_action(const json& body) {
  check_object(body, "body", {"action"});
  return required_string(body, "body", "action");
}

using Actions = std::map<std::string, std::string>;  // agent id -> action

// The `actions` object of `object` (a v2 step body, or a v2 batch item): agent id -> a string each.
inline Actions required_actions(const json& object, const std::string& where) {
  auto found = object.find("actions");
  if (found == object.end()) throw bad_request(where + ".actions: required");
  if (!found->is_object()) throw bad_request(where + ".actions: expected an object of agent id -> action");
  Actions actions;
  for (const auto& item : found->items()) {
    if (!item.value().is_string()) throw bad_request(where + ".actions." + item.key() + ": expected a string");
    actions.emplace(item.key(), item.value().get<std::string>());
  }
  return actions;
}

// The actions of a POST /v2/sessions/{id}/step body.
inline Actions parse_actions(const json& body) {
  check_object(body, "body", {"actions"});
  return required_actions(body, "body");
}

// The (session_id, what `read` reads) pairs of a batch body, each session at most once; `field` is the item's
// other field ("action" in v1, "actions" in v2).
template <typename Read>
auto parse_steps(const json& body, const std::string& field, Read read) {
  check_object(body, "body", {"steps"});
  if (!body.contains("steps")) throw bad_request("body.steps: required");
  const json& steps = body["steps"];
  if (!steps.is_array()) throw bad_request("body.steps: expected a list");
  std::vector<std::pair<std::string, decltype(read(steps, std::string()))>> items;
  std::set<std::string> seen;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    std::string where = "body.steps[" + std::to_string(i) + "]";
    check_object(steps[i], where, {"session_id", field});
    items.emplace_back(required_string(steps[i], where, "session_id"), read(steps[i], where));
    if (!seen.insert(items.back().first).second) {
      throw bad_request(where + ".session_id: session " + items.back().first +
                        " appears twice; each session may appear once per batch");
    }
  }
  return items;
}

// The (session_id, action) pairs of a POST /v1/step body.
inline std::vector<std::pair<std::string, std::string>> parse_batch(const json& body) {
  return parse_steps(body, "action", [](const json& item, const std::string& where) {
    return required_string(item, where, "action");
  });
}

// The (session_id, actions) pairs of a POST /v2/step body.
inline std::vector<std::pair<std::string, Actions>> parse_batch_v2(const json& body) {
  return parse_steps(body, "actions", required_actions);
}

inline json failed_step(const std::string& session_id, const std::string& type, const std::string& message) {
  return {{"session_id", session_id}, {"observation", ""}, {"reward", 0.0}, {"terminated", true},
          {"truncated", false},       {"info", json::object()},  {"error", {{"type", type}, {"message", message}}}};
}

// A v2 step that failed (an env error, or a batch item refused): nobody acts next.
inline json failed_multi_step(const std::string& session_id, const std::string& type, const std::string& message) {
  return {{"session_id", session_id},     {"observations", json::object()}, {"rewards", json::object()},
          {"terminations", json::object()}, {"truncations", json::object()}, {"infos", json::object()},
          {"acting", json::array()},        {"error", {{"type", type}, {"message", message}}}};
}

// 128 bits from std::random_device (the OS's or the CPU's entropy) for each id, not a seeded generator,
// so an id cannot be predicted from the ones before it.
inline std::string new_session_id() {
  static thread_local std::random_device entropy;
  static const char* digits = "0123456789abcdef";
  std::string id;
  for (int word = 0; word < 4; ++word) {
    std::uint32_t bits = entropy();
    for (int i = 0; i < 8; ++i, bits >>= 4) id += digits[bits & 0xF];
  }
  return id;
}

inline const char* error_type_for(int status) {
  switch (status) {
    case 404: return "not_found";
    case 405: return "method_not_allowed";
    case 408: return "request_timeout";
    case 413: return "payload_too_large";
    case 414: return "uri_too_long";
    case 431: return "headers_too_large";
    default: return status < 500 ? "bad_request" : "internal_error";
  }
}

}  // namespace detail

}  // namespace areal_agents
