// areal_agents/server_replies.hpp: what env_server.hpp replies with and checks requests by: the protocol's
// error records (HttpError), strict JSON body checks that name the field, and failed step results.
#pragma once

#include <httplib.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <random>
#include <stdexcept>
#include <string>
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

inline json parse_body(const std::string& body) {
  try {
    return json::parse(body);
  } catch (const json::parse_error& e) {
    throw bad_request(std::string("body: malformed JSON (") + e.what() + ")");
  }
}

inline json failed_step(const std::string& session_id, const std::string& type, const std::string& message) {
  return {{"session_id", session_id}, {"observation", ""}, {"reward", 0.0}, {"terminated", true},
          {"truncated", false},       {"info", json::object()},  {"error", {{"type", type}, {"message", message}}}};
}

inline std::string new_session_id() {
  static thread_local std::mt19937_64 rng{std::random_device{}() ^ (std::uint64_t{std::random_device{}()} << 32)};
  static const char* digits = "0123456789abcdef";
  std::string id;
  for (int half = 0; half < 2; ++half) {
    std::uint64_t bits = rng();
    for (int i = 0; i < 16; ++i, bits >>= 4) id += digits[bits & 0xF];
  }
  return id;
}

inline const char* error_type_for(int status) {
  switch (status) {
    case 404: return "not_found";
    case 405: return "method_not_allowed";
    case 413: return "payload_too_large";
    case 414: return "uri_too_long";
    default: return status < 500 ? "bad_request" : "internal_error";
  }
}

}  // namespace detail

}  // namespace areal_agents
