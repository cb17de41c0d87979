package arealagents;

import java.util.Map;

/** Makes a fresh {@link Env} for each session from the create request's kwargs (a JSON object, maybe empty). */
@FunctionalInterface
public interface EnvFactory {
    /** Throw {@link IllegalArgumentException} naming the key when {@code kwargs} do not fit the env. */
    Env make(Map<String, Object> kwargs);
}
