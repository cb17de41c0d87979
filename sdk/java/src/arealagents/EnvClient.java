package arealagents;

import java.io.IOException;
import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * A client of the env-step protocol (any server: Python's serve-env, {@link EnvServer}, the C++ SDK): v1, and v2's
 * sessions of several agents ({@link #createAgents}, {@link #stepAgents}, {@link #closeOwned}).
 *
 * <pre>
 *   EnvClient envs = new EnvClient("http://127.0.0.1:8765");
 *   EnvClient.Created s = envs.create("areal_agents/Arithmetic-v0", Map.of(), 7L, null);
 *   EnvClient.StepResult r = envs.step(s.sessionId(), "42");
 *   EnvClient.AgentsCreated d = envs.createAgents("areal_agents/Debate-v0", Map.of(), 7L, null, "my-run");
 *   EnvClient.AgentsStep next = envs.stepAgents(d.sessionId(), Map.of("debater_0", "42", "debater_1", "41"));
 * </pre>
 *
 * A refused request (4xx/5xx) throws {@link ProtocolException} with the server's status, error type and message.
 */
public final class EnvClient {
    public record Created(String sessionId, String observation, Map<String, Object> info) {}

    /** One step's result; {@code error} is null unless this step failed ({@code type}, {@code message}). */
    public record StepResult(String sessionId, String observation, double reward, boolean terminated,
                             boolean truncated, Map<String, Object> info, Map<String, Object> error) {
        public boolean done() {
            return terminated || truncated;
        }
    }

    /** A v2 session: its agents, who acts first, and the first observations and infos by agent id. */
    public record AgentsCreated(String sessionId, boolean multiAgent, List<String> agents, List<String> acting,
                                Map<String, Object> observations, Map<String, Object> infos) {}

    /** A v2 step's result by agent id; {@code acting} empty: the episode is over; {@code error} as in StepResult. */
    public record AgentsStep(String sessionId, Map<String, Object> observations, Map<String, Object> rewards,
                             Map<String, Object> terminations, Map<String, Object> truncations,
                             Map<String, Object> infos, List<String> acting, Map<String, Object> error) {}

    /** One item of {@link #stepBatch}. */
    public record BatchStep(String sessionId, String action) {}

    private final HttpJson http;

    public EnvClient(String baseUrl) {
        this(baseUrl, Duration.ofSeconds(120));
    }

    public EnvClient(String baseUrl, Duration timeout) {
        this.http = new HttpJson(baseUrl, timeout);
    }

    /** Opens a session (an episode); {@code kwargs}, {@code seed} and {@code options} may be null. */
    public Created create(String envId, Map<String, Object> kwargs, Long seed, Map<String, Object> options)
            throws IOException {
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("env_id", envId);
        body.put("kwargs", kwargs == null ? Map.of() : kwargs);
        body.put("seed", seed);
        body.put("options", options);
        Map<String, Object> reply = object(http.send("POST", "/v1/sessions", body));
        return new Created(string(reply, "session_id"), string(reply, "observation"), object(reply.get("info")));
    }

    public StepResult step(String sessionId, String action) throws IOException {
        return stepResult(http.send("POST", "/v1/sessions/" + sessionId + "/step", Map.of("action", action)));
    }

    /** Steps several sessions in one request; a refused item comes back as a StepResult with its error set. */
    public List<StepResult> stepBatch(List<BatchStep> steps) throws IOException {
        List<Object> items = new ArrayList<>();
        for (BatchStep s : steps) items.add(Map.of("session_id", s.sessionId(), "action", s.action()));
        Object results = object(http.send("POST", "/v1/step", Map.of("steps", items))).get("results");
        List<StepResult> out = new ArrayList<>();
        for (Object r : (List<?>) results) out.add(stepResult(r));
        return out;
    }

    public void close(String sessionId) throws IOException {
        http.send("DELETE", "/v1/sessions/" + sessionId, null);
    }

    /** POST /v2/sessions; {@code kwargs}, {@code seed}, {@code options} and {@code owner} (the run's name, for
     * {@link #closeOwned}) may be null. */
    public AgentsCreated createAgents(String envId, Map<String, Object> kwargs, Long seed, Map<String, Object> options,
                                      String owner) throws IOException {
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("env_id", envId);
        body.put("kwargs", kwargs == null ? Map.of() : kwargs);
        body.put("seed", seed);
        body.put("options", options);
        if (owner != null) body.put("owner", owner);
        Map<String, Object> r = object(http.send("POST", "/v2/sessions", body));
        return new AgentsCreated(string(r, "session_id"), (Boolean) r.get("multi_agent"), strings(r.get("agents")),
                strings(r.get("acting")), object(r.get("observations")), object(r.get("infos")));
    }

    /** POST /v2/sessions/{id}/step with one action for each acting agent. */
    public AgentsStep stepAgents(String sessionId, Map<String, String> actions) throws IOException {
        Map<String, Object> r = object(http.send("POST", "/v2/sessions/" + sessionId + "/step",
                Map.of("actions", actions)));
        Map<String, Object> error = r.get("error") == null ? null : object(r.get("error"));
        return new AgentsStep(string(r, "session_id"), object(r.get("observations")), object(r.get("rewards")),
                object(r.get("terminations")), object(r.get("truncations")), object(r.get("infos")),
                strings(r.get("acting")), error);
    }

    /** DELETE /v2/sessions?owner=: closes every session created with {@code owner}; how many. */
    public long closeOwned(String owner) throws IOException {
        String query = java.net.URLEncoder.encode(owner, java.nio.charset.StandardCharsets.UTF_8);
        return ((Number) object(http.send("DELETE", "/v2/sessions?owner=" + query, null)).get("closed")).longValue();
    }

    /** GET /health: status, protocol (and protocols), sessions_open, limits. */
    public Map<String, Object> health() throws IOException {
        return object(http.send("GET", "/health", null));
    }

    /** The served envs, id to description, in the server's order. */
    public Map<String, String> listEnvs() throws IOException {
        Map<String, String> envs = new LinkedHashMap<>();
        for (Object e : (List<?>) object(http.send("GET", "/v1/envs", null)).get("envs")) {
            envs.put(string(object(e), "id"), string(object(e), "description"));
        }
        return envs;
    }

    private static StepResult stepResult(Object json) {
        Map<String, Object> r = object(json);
        Map<String, Object> error = r.get("error") == null ? null : object(r.get("error"));
        return new StepResult(string(r, "session_id"), string(r, "observation"), ((Number) r.get("reward"))
                .doubleValue(), (Boolean) r.get("terminated"), (Boolean) r.get("truncated"), object(r.get("info")),
                error);
    }

    @SuppressWarnings("unchecked")
    static Map<String, Object> object(Object json) {
        if (!(json instanceof Map)) throw new IllegalStateException("expected a JSON object in the reply, got " + json);
        return (Map<String, Object>) json;
    }

    private static List<String> strings(Object json) {
        if (!(json instanceof List<?> list)) throw new IllegalStateException("expected a JSON list in the reply");
        return list.stream().map(String.class::cast).toList();
    }

    static String string(Map<String, Object> json, String key) {
        if (!(json.get(key) instanceof String s)) throw new IllegalStateException("reply." + key + ": not a string");
        return s;
    }
}
