// play_episode URL ENV_ID SEED ACTION...: open a session, play the actions until the episode ends, close it.
// Prints the observation, then "reward=R terminated=T truncated=T" and the observation after each action.
#include <areal_agents/env_client.hpp>

#include <iostream>
#include <string>

int main(int argc, char** argv) {
  if (argc < 5) {
    std::cerr << "usage: play_episode URL ENV_ID SEED ACTION...\n";
    return 2;
  }
  try {
    areal_agents::EnvClient envs(argv[1]);
    auto session = envs.create(argv[2], nlohmann::json::object(), std::stoull(argv[3]));
    std::cout << "observation: " << session.observation << "\n";
    bool over = false;
    for (int i = 4; i < argc && !over; ++i) {
      auto result = envs.step(session.session_id, argv[i]);
      if (result.error) {
        std::cerr << "play_episode: the env failed: " << result.error->type << ": " << result.error->message << "\n";
        return 1;
      }
      std::cout << "action: " << argv[i] << "\nreward=" << result.reward << " terminated=" << std::boolalpha
                << result.terminated << " truncated=" << result.truncated << "\nobservation: " << result.observation
                << "\n";
      over = result.terminated || result.truncated;
    }
    envs.close(session.session_id);
    return 0;
  } catch (const std::exception& e) {  // ProtocolError names the error type, e.g. "unknown_env (HTTP 404): ..."
    std::cerr << "play_episode: " << e.what() << "\n";
    return 1;
  }
}
