// areal_agents/http_json.hpp: JSON requests over cpp-httplib for the SDK's clients, and ProtocolError.
#pragma once

#include <httplib.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

namespace areal_agents {

// A request the server refused (4xx/5xx), or that got no usable reply (status 0: "unreachable", "bad_reply").
// `type` is the reply's error type (env server: unknown_env, bad_request, ...; serve-model: its "type" when it
// sends one, else "http_error").
class ProtocolError : public std::runtime_error {
 public:
  ProtocolError(int status, std::string type, std::string message)
      : std::runtime_error(type + " (HTTP " + std::to_string(status) + "): " + message),
        status_(status),
        type_(std::move(type)),
        message_(std::move(message)) {}

  int status() const { return status_; }
  const std::string& type() const { return type_; }
  const std::string& message() const { return message_; }

 private:
  int status_;
  std::string type_;
  std::string message_;
};

namespace detail {

// One server's base URL ("http://host:port", optionally with a path prefix); JSON in, JSON out.
// Not for concurrent use: give each thread its own client.
class JsonHttp {
 public:
  JsonHttp(const std::string& base_url, double timeout_s) : base_url_(trim_slash(base_url)) {
    std::size_t scheme = base_url_.find("://");
    if (scheme == std::string::npos) {
      throw std::invalid_argument("base_url: expected http://HOST:PORT, got '" + base_url + "'");
    }
    std::size_t path = base_url_.find('/', scheme + 3);
    prefix_ = path == std::string::npos ? "" : base_url_.substr(path);
    client_ = std::make_unique<httplib::Client>(base_url_.substr(0, path));
    if (!client_->is_valid()) throw std::invalid_argument("base_url: cannot use '" + base_url + "'");
    auto timeout = std::chrono::duration<double>(timeout_s);
    client_->set_connection_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
    client_->set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
    client_->set_write_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
    client_->set_keep_alive(true);
  }

  nlohmann::json get(const std::string& path) { return checked(path, client_->Get(prefix_ + path)); }

  nlohmann::json post(const std::string& path, const nlohmann::json& body) {
    return checked(path, client_->Post(prefix_ + path, body.dump(), "application/json"));
  }

  nlohmann::json del(const std::string& path) { return checked(path, client_->Delete(prefix_ + path)); }

  const std::string& base_url() const { return base_url_; }

 private:
  static std::string trim_slash(std::string url) {
    while (!url.empty() && url.back() == '/') url.pop_back();
    return url;
  }

  // The reply's JSON, or ProtocolError for no reply, an error status or a body that is not JSON.
  nlohmann::json checked(const std::string& path, const httplib::Result& result) const {
    if (!result) {
      throw ProtocolError(0, "unreachable", base_url_ + path + ": " + httplib::to_string(result.error()));
    }
    nlohmann::json body = nlohmann::json::parse(result->body, nullptr, /*allow_exceptions=*/false);
    if (result->status >= 400) throw error_of(result->status, body, result->body);
    if (body.is_discarded()) {
      throw ProtocolError(result->status, "bad_reply", base_url_ + path + " answered with non-JSON: " +
                                                           result->body.substr(0, 200));
    }
    return body;
  }

  // {"error": {"type", "message"}} (env servers, OpenAI routes) or {"error": {"message"}} (SGLang's).
  static ProtocolError error_of(int status, const nlohmann::json& body, const std::string& text) {
    if (body.is_object() && body.contains("error") && body["error"].is_object()) {
      const auto& error = body["error"];
      std::string type = error.contains("type") && error["type"].is_string() ? error["type"].get<std::string>()
                                                                              : "http_error";
      std::string message = error.contains("message") && error["message"].is_string()
                                ? error["message"].get<std::string>()
                                : error.dump();
      return ProtocolError(status, type, message);
    }
    return ProtocolError(status, "http_error", text.substr(0, 500));
  }

  std::string base_url_;
  std::string prefix_;
  std::unique_ptr<httplib::Client> client_;
};

}  // namespace detail
}  // namespace areal_agents
