package arealagents;

import java.util.List;
import java.util.Map;

/**
 * One episode of an env with several agents, the Java side of PettingZoo's API with text observations and actions,
 * served over protocol v2 ({@code POST /v2/sessions}, docs/env-protocol.md).
 *
 * <p>The server calls {@link #agents} and {@link #reset} when a session is created, then {@link #acting} after the
 * reset and after each {@link #step}: the agents it names act in the next step, together ({@code step} gets exactly
 * their actions). A turn-based env names one agent; an env whose agents act at once names them all; an empty list
 * ends the episode. The server never calls one instance from two threads at once. Throw
 * {@link IllegalArgumentException} from the factory or reset for bad kwargs/seed/options (the client gets a 400);
 * any other exception ends the session as an {@code env_error}.
 */
public interface MultiAgentEnv {
    /** Every agent id of an episode, in a fixed order (PettingZoo's {@code possible_agents}); known once made. */
    List<String> agents();

    /** The first observations, one per agent that gets one (at least every agent of {@link #acting}); {@code seed}
     * is null when the client asked for none, {@code options} is never null. */
    Reset reset(Long seed, Map<String, Object> options);

    /** Who acts in the next step, in order (a subset of {@link #agents}); empty once the episode is over. */
    List<String> acting();

    /** The result of the acting agents' actions, keyed by agent id. */
    Step step(Map<String, String> actions);

    /** Releases what the episode holds once its session ends; never while a step runs. Nothing by default. */
    default void close() {}

    /** What {@link #reset} returns: observations and JSON-serializable infos by agent id. */
    record Reset(Map<String, String> observations, Map<String, Map<String, Object>> infos) {}

    /**
     * What {@link #step} returns, by agent id. {@code observations}: every agent that gets a new one (say the next
     * speaker, who sees what was said). The other maps need at least the agents that acted: a missing one is 0.0,
     * false, false and an empty info.
     */
    record Step(Map<String, String> observations, Map<String, Double> rewards, Map<String, Boolean> terminations,
                Map<String, Boolean> truncations, Map<String, Map<String, Object>> infos) {}
}
