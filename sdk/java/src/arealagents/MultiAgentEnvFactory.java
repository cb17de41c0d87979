package arealagents;

import java.util.Map;

/** Makes a fresh {@link MultiAgentEnv} for each session from the create request's kwargs (a JSON object). */
@FunctionalInterface
public interface MultiAgentEnvFactory {
    /** Throw {@link IllegalArgumentException} naming the key when {@code kwargs} do not fit the env. */
    MultiAgentEnv make(Map<String, Object> kwargs);
}
