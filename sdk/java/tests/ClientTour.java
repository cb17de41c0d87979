import arealagents.EnvClient;
import arealagents.Json;
import arealagents.ProtocolException;
import java.io.IOException;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * Test helper: every EnvClient call against ProbeEnvs' test/Echo-v0 at URL, the outcomes printed as one JSON object
 * (a refusal as {@code [status, type]}) for the Python test to check.
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
