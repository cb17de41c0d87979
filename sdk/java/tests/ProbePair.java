import arealagents.MultiAgentEnv;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * Test helper: {@code test/EchoPair-v0}, two agents a and b acting at once (PettingZoo's parallel API), each seeing
 * the other's action; probes what the Relay example cannot. An action {@code end} ends the episode, {@code raise}
 * throws, {@code stranger} rewards an agent the env does not have, {@code leave} leaves that agent out of the next
 * step (its own result still comes back); the reward of an action is its length.
 */
public final class ProbePair implements MultiAgentEnv {
    private static final List<String> AGENTS = List.of("a", "b");
    private List<String> acting = AGENTS;

    ProbePair(Map<String, Object> kwargs) {
        if (!kwargs.isEmpty()) throw new IllegalArgumentException("kwargs: EchoPair takes none");
    }

    @Override
    public List<String> agents() {
        return AGENTS;
    }

    @Override
    public Reset reset(Long seed, Map<String, Object> options) {
        acting = AGENTS;
        return new Reset(Map.of("a", "seed " + seed, "b", "seed " + seed), Map.of("a", Map.of("role", "user")));
    }

    @Override
    public List<String> acting() {
        return acting;
    }

    @Override
    public Step step(Map<String, String> actions) {
        if (actions.containsValue("raise")) throw new UnsupportedOperationException("asked to raise");
        Map<String, String> observations = new LinkedHashMap<>();
        Map<String, Double> rewards = new LinkedHashMap<>();
        actions.forEach((agent, action) -> {
            rewards.put(agent, (double) action.length());
            observations.put(agent.equals("a") ? "b" : "a", action);
        });
        if (actions.containsValue("stranger")) rewards.put("z", 1.0);
        boolean over = actions.containsValue("end");
        acting = over ? List.of() : AGENTS.stream().filter(a -> !"leave".equals(actions.get(a))).toList();
        if (over) observations.clear();
        observations.keySet().retainAll(acting);
        Map<String, Boolean> done = over ? Map.of("a", true, "b", true) : Map.of();
        return new Step(observations, rewards, done, Map.of(), Map.of());
    }
}
