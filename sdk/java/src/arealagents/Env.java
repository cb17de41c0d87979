package arealagents;

import java.util.Map;

/**
 * One episode's environment, the Java side of a gymnasium env with text observations and actions.
 *
 * <p>The server calls {@link #reset} once when a session is created and {@link #step} once per action; it never calls
 * one instance from two threads at once. Throw {@link IllegalArgumentException} from the factory or reset for bad
 * kwargs/seed/options (the client gets a 400); any other exception ends the session as an {@code env_error}.
 */
public interface Env {
    /** The first observation of an episode; {@code seed} is null when the client asked for none, {@code options}
     * is never null (empty when none were sent). */
    Reset reset(Long seed, Map<String, Object> options);

    /** The result of acting with {@code action} (the model's text). */
    Step step(String action);

    /** Releases what the episode holds (files, connections, a simulator instance) once its session is closed,
     * expired or failed, or the server stops; never while a step runs. Nothing by default. */
    default void close() {}

    /** What {@link #reset} returns: the first observation and a JSON-serializable info map. */
    record Reset(String observation, Map<String, Object> info) {}

    /** What {@link #step} returns, as gymnasium's step tuple. */
    record Step(String observation, double reward, boolean terminated, boolean truncated, Map<String, Object> info) {}
}
