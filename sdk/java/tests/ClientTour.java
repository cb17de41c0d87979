import arealagents.EnvClient;
import arealagents.Json;
import arealagents.ProtocolException;
import java.io.IOException;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * Test helper: every EnvClient call against ProbeEnvs' test/Echo-v0 and test/EchoPair-v0 at URL, the outcomes
 * printed as one JSON object (a refusal as {@code [status, type]}) for the Python test to check.
 */
public final class ClientTour {
    public static void main(String[] args) throws IOException {
        EnvClient envs = new EnvClient(args[0]);
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("envs", envs.listEnvs());
        out.put("limits", envs.health().get("limits"));
        EnvClient.Created a = envs.create("test/Echo-v0", Map.of("k", 1L), 5L, Map.of("o", "p"));
        EnvClient.Created b = envs.create("test/Echo-v0", null, null, null);
        out.put("created", List.of(a.observation(), a.info(), b.observation()));
        List<EnvClient.StepResult> batch = envs.stepBatch(List.of(
                new EnvClient.BatchStep(a.sessionId(), "x"), new EnvClient.BatchStep(b.sessionId(), "end")));
        out.put("batch", batch.stream().map(r -> List.of(r.observation(), r.reward(), r.done())).toList());
        EnvClient.StepResult over = envs.stepBatch(List.of(new EnvClient.BatchStep(b.sessionId(), "y"))).get(0);
        out.put("over", List.of(over.terminated(), over.error()));
        out.put("step_over", refusal(() -> envs.step(b.sessionId(), "y")));
        envs.close(a.sessionId());
        envs.close(b.sessionId());
        out.put("closed_twice", refusal(() -> envs.close(a.sessionId())));
        out.put("unknown_env", refusal(() -> envs.create("nope", null, null, null)));
        EnvClient.AgentsCreated pair = envs.createAgents("test/EchoPair-v0", null, 4L, null, "tour");
        out.put("agents_created", List.of(pair.multiAgent(), pair.agents(), pair.acting(), pair.observations()));
        EnvClient.AgentsStep said = envs.stepAgents(pair.sessionId(), Map.of("a", "hi", "b", "yo!"));
        out.put("agents_step", List.of(said.observations(), said.rewards(), said.acting()));
        EnvClient.AgentsStep end = envs.stepAgents(pair.sessionId(), Map.of("a", "end", "b", "x"));
        out.put("agents_end", List.of(end.acting(), end.terminations(), end.error() == null));
        out.put("agents_over", refusal(() -> envs.stepAgents(pair.sessionId(), Map.of("a", "x", "b", "x"))));
        EnvClient.AgentsCreated echo = envs.createAgents("test/Echo-v0", null, null, null, "tour");
        out.put("single", List.of(echo.multiAgent(), echo.agents(), echo.observations()));
        out.put("closed_owned", envs.closeOwned("tour"));
        out.put("protocols", envs.health().get("protocols"));
        System.out.println(Json.write(out));
    }

    private interface Call {
        void run() throws IOException;
    }

    private static Object refusal(Call call) throws IOException {
        try {
            call.run();
            return null;
        } catch (ProtocolException e) {
            return List.of(e.status, e.type);
        }
    }
}
