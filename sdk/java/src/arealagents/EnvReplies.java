package arealagents;

import java.util.ArrayList;
import java.util.Collection;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * What a {@link MultiAgentEnv} returned, checked and copied into the JSON of a v2 reply: ids among the env's agents,
 * observations where the protocol needs them, finite rewards, JSON infos. A violation is an
 * IllegalStateException naming it (the server answers it as the env's error, never the client's).
 */
final class EnvReplies {
    private EnvReplies() {}

    /** {@code env.agents()}: a non-empty list of distinct non-empty ids. */
    static List<String> agents(MultiAgentEnv env) {
        List<String> agents = env.agents();
        if (agents == null || agents.isEmpty()) throw new IllegalStateException("agents() listed no agent");
        List<String> copy = new ArrayList<>(agents);
        for (String a : copy) {
            if (a == null || a.isEmpty()) throw new IllegalStateException("agents() listed an empty or null id");
        }
        if (new HashSet<>(copy).size() != copy.size()) throw new IllegalStateException("agents() repeats an id");
        return List.copyOf(copy);
    }

    /** {@code env.acting()}: distinct ids among {@code agents} (empty: the episode is over). */
    static List<String> acting(MultiAgentEnv env, List<String> agents) {
        List<String> acting = env.acting();
        if (acting == null) throw new IllegalStateException("acting() returned null; return an empty list at the end");
        List<String> copy = List.copyOf(acting);
        for (String a : copy) known(a, agents, "acting()");
        if (new HashSet<>(copy).size() != copy.size()) throw new IllegalStateException("acting() repeats an id");
        return copy;
    }

    /** Observations by agent: strings, one at least for each of {@code needed}. */
    static Map<String, Object> observations(Map<String, String> observations, List<String> agents,
                                            Collection<String> needed, String what) {
        Map<String, Object> out = new LinkedHashMap<>();
        if (observations != null) {
            observations.forEach((a, o) -> {
                known(a, agents, what + "'s observations");
                if (o == null) throw new IllegalStateException(what + " returned a null observation for " + a);
                out.put(a, o);
            });
        }
        for (String a : needed) {
            if (!out.containsKey(a)) throw new IllegalStateException(what + " returned no observation for " + a);
        }
        return out;
    }

    /** Infos by agent as JSON copies (a null info is empty), with an empty one for each of {@code filled}. */
    static Map<String, Object> infos(Map<String, Map<String, Object>> infos, List<String> agents,
                                     Collection<String> filled, String what) {
        Map<String, Object> out = new LinkedHashMap<>();
        if (infos != null) {
            infos.forEach((a, info) -> {
                known(a, agents, what + "'s infos");
                out.put(a, snapshot(info, what + "'s info of " + a));
            });
        }
        for (String a : filled) out.putIfAbsent(a, new LinkedHashMap<>());
        return out;
    }

    /** Finite rewards by agent, 0.0 for each of {@code filled} the env left out. */
    static Map<String, Object> rewards(Map<String, Double> rewards, List<String> agents, Collection<String> filled) {
        Map<String, Object> out = new LinkedHashMap<>();
        if (rewards != null) {
            rewards.forEach((a, r) -> {
                known(a, agents, "step's rewards");
                if (r == null || !Double.isFinite(r)) throw new IllegalStateException("step returned reward " + r
                        + " for " + a);
                out.put(a, r);
            });
        }
        for (String a : filled) out.putIfAbsent(a, 0.0);
        return out;
    }

    /** Terminations or truncations by agent, false for each of {@code filled} the env left out. */
    static Map<String, Object> flags(Map<String, Boolean> flags, List<String> agents, Collection<String> filled,
                                     String what) {
        Map<String, Object> out = new LinkedHashMap<>();
        if (flags != null) {
            flags.forEach((a, f) -> {
                known(a, agents, "step's " + what);
                if (f == null) throw new IllegalStateException("step returned a null " + what + " flag for " + a);
                out.put(a, f);
            });
        }
        for (String a : filled) out.putIfAbsent(a, false);
        return out;
    }

    /** A JSON copy of an env's info map (null: empty), so the reply never depends on what the env does next. */
    @SuppressWarnings("unchecked")
    static Map<String, Object> snapshot(Map<String, Object> info, String what) {
        if (info == null) return new LinkedHashMap<>();
        try {
            return (Map<String, Object>) Json.parse(Json.write(info));
        } catch (IllegalArgumentException e) {
            throw new IllegalStateException(what + " is not JSON: " + e.getMessage());
        }
    }

    private static void known(String agent, List<String> agents, String where) {
        if (!agents.contains(agent)) {
            throw new IllegalStateException(where + " names " + agent + ", not one of the env's agents " + agents);
        }
    }
}
