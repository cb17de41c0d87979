import arealagents.Env;
import arealagents.EnvServer;
import java.io.IOException;
import java.util.Map;

/**
 * Test helper: serves {@code test/Echo-v0}, whose observation is the action, to probe what the conformance suite
 * cannot: unicode through the server, env failures, a busy session and idle expiry.
 *
 * <p>Reset options {@code {"fail": "argument"}} throw IllegalArgumentException, {@code {"fail": "state"}}
 * IllegalStateException; the action {@code raise} throws in step, {@code sleep MS} sleeps, {@code end} terminates.
 */
public final class ProbeEnvs implements Env {
    private final Map<String, Object> kwargs;

    ProbeEnvs(Map<String, Object> kwargs) {
        this.kwargs = kwargs;
    }

    @Override
    public Reset reset(Long seed, Map<String, Object> options) {
        Object fail = options.get("fail");
        if ("argument".equals(fail)) throw new IllegalArgumentException("options.fail: asked to fail");
        if ("state".equals(fail)) throw new IllegalStateException("asked to fail");
        return new Reset("seed " + seed, Map.of("kwargs", kwargs, "options", options));
    }

    @Override
    public Step step(String action) {
        if (action.equals("raise")) throw new UnsupportedOperationException("asked to raise");
        if (action.startsWith("sleep ")) sleep(Long.parseLong(action.substring(6)));
        return new Step(action, 0.5, action.equals("end"), false, Map.of("action", action));
    }

    private static void sleep(long ms) {
        try {
            Thread.sleep(ms);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
    }

    public static void main(String[] args) throws IOException {
        EnvServer server = EnvServer.fromArgs(args);
        server.addEnv("test/Echo-v0", "echoes the action", ProbeEnvs::new);
        server.start();
    }
}
