// areal_agents/server_options.hpp: an env server's options (ServerOptions) and their command-line flags
// (parse_server_options, parse_server_options_or_exit), shared by every env binary built on env_server.hpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace areal_agents {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8765;  // 0: any free port (printed once listening)
  // Request threads. cpp-httplib gives each open connection a thread of its own (an idle keep-alive one lets it
  // go after 5 s, a slow request after read_timeout_s), so this must cover the clients' connections:
  // RemoteEnvPool keeps up to 64 per process.
  int threads = 256;
  std::size_t max_sessions = 4096;
  std::size_t max_body_bytes = 8 * 1024 * 1024;
  std::size_t max_action_chars = 65536;  // Unicode code points
  double idle_timeout_s = 600.0;  // sessions without a step for this long are closed
  // A request's headers and body must arrive within this many seconds of its first byte (a 408 otherwise):
  // a deadline, which a client sending a byte a second cannot put off as it would a timeout per read.
  int read_timeout_s = 10;
};

inline const char* server_options_usage() {
  return "options:\n"
         "  --host HOST               address to listen on (default 127.0.0.1)\n"
         "  --port N                  port, 0 = any free port (default 8765)\n"
         "  --threads N               request threads, one per open connection; an idle keep-alive\n"
         "                            connection frees its thread after 5 s (default 256)\n"
         "  --max-sessions N          open sessions at most (default 4096)\n"
         "  --max-body-bytes N        request body size limit (default 8388608)\n"
         "  --max-action-chars N      action length limit in characters (default 65536)\n"
         "  --idle-timeout SECONDS    close sessions without a step for this long (default 600)\n"
         "  --read-timeout SECONDS    a request's headers and body must arrive within this many whole\n"
         "                            seconds of its first byte, else 408 (default 10)\n";
}

namespace detail {

inline unsigned long long parse_count(const std::string& flag, const std::string& text, unsigned long long min,
                                      unsigned long long max) {
  std::size_t used = 0;
  unsigned long long value = 0;
  try {
    if (!text.empty() && text[0] != '-') value = std::stoull(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || value < min || value > max) {
    throw std::invalid_argument(flag + ": expected an integer from " + std::to_string(min) + " to " +
                                std::to_string(max) + ", got '" + text + "'");
  }
  return value;
}

inline double parse_seconds(const std::string& flag, const std::string& text) {
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || !std::isfinite(value) || value <= 0) {
    throw std::invalid_argument(flag + ": expected a number of seconds > 0, got '" + text + "'");
  }
  return value;
}

}  // namespace detail

// Server options from --host --port --threads --max-sessions --max-body-bytes --max-action-chars
// --idle-timeout --read-timeout (as "--flag value" or "--flag=value"); std::invalid_argument names the flag at fault.
inline ServerOptions parse_server_options(int argc, const char* const* argv) {
  ServerOptions options;
  constexpr auto kMaxSize = static_cast<unsigned long long>(SIZE_MAX);
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i], value;
    if (auto eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag.resize(eq);
    } else if (flag.rfind("--", 0) != 0) {
      throw std::invalid_argument("unexpected argument '" + flag + "' (flags start with --)");
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      throw std::invalid_argument(flag + ": missing value");
    }
    if (flag == "--host") {
      if (value.empty()) throw std::invalid_argument("--host: expected an address, got ''");
      options.host = value;
    } else if (flag == "--port") {
      options.port = static_cast<int>(detail::parse_count(flag, value, 0, 65535));
    } else if (flag == "--threads") {
      options.threads = static_cast<int>(detail::parse_count(flag, value, 1, 4096));
    } else if (flag == "--max-sessions") {
      options.max_sessions = detail::parse_count(flag, value, 1, kMaxSize);
    } else if (flag == "--max-body-bytes") {
      options.max_body_bytes = detail::parse_count(flag, value, 1, kMaxSize);
    } else if (flag == "--max-action-chars") {
      options.max_action_chars = detail::parse_count(flag, value, 1, kMaxSize);
    } else if (flag == "--idle-timeout") {
      options.idle_timeout_s = detail::parse_seconds(flag, value);
    } else if (flag == "--read-timeout") {
      options.read_timeout_s = static_cast<int>(detail::parse_count(flag, value, 1, 3600));
    } else {
      throw std::invalid_argument("unknown flag " + flag);
    }
  }
  return options;
}

// parse_server_options for main(): --help prints the usage and exits 0; a bad flag prints
// "PROGRAM: error: ..." and the usage to stderr and exits 2.
inline ServerOptions parse_server_options_or_exit(int argc, char** argv) {
  std::string program = argc > 0 ? argv[0] : "env-server";
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      std::cout << "usage: " << program << " [options]\n" << server_options_usage();
      std::exit(0);
    }
  }
  try {
    return parse_server_options(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::cerr << program << ": error: " << e.what() << "\n" << server_options_usage();
    std::exit(2);
  }
}

}  // namespace areal_agents
