import arealagents.Env;
import arealagents.EnvServer;
import java.io.IOException;
import java.util.Map;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * Test helper: serves {@code test/Echo-v0}, whose observation is the action, to probe what the conformance suite
 * cannot: unicode through the server, env failures, a busy session and idle expiry; and {@link ProbePair}'s
 * {@code test/EchoPair-v0}, two agents at once.
 *
 * <p>Reset options {@code {"fail": "argument"}} throw IllegalArgumentException, {@code {"fail": "state"}}
 * IllegalStateException; the action {@code raise} throws in step, {@code sleep MS} sleeps (its info holds when it
 * started and ended, in System.nanoTime), {@code end} terminates, {@code closed?} answers how many envs were closed.
 */
public final class ProbeEnvs implements Env {
    private static final AtomicInteger CLOSED = new AtomicInteger();
    private final Map<String, Object> kwargs;
    private volatile boolean stepping;

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
        if (action.equals("closed?")) return new Step(String.valueOf(CLOSED.get()), 0, false, false, Map.of());
        if (action.startsWith("sleep ")) {
            long started = System.nanoTime();
            stepping = true;
            sleep(Long.parseLong(action.substring(6)));
            stepping = false;
            return new Step(action, 0.5, false, false, Map.of("started_ns", started, "ended_ns", System.nanoTime()));
        }
        return new Step(action, 0.5, action.equals("end"), false, Map.of("action", action));
    }

    @Override
    public void close() {
        if (stepping) throw new IllegalStateException("closed during a step");
        CLOSED.incrementAndGet();
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
        server.addMultiAgentEnv("test/EchoPair-v0", "two agents echo each other", ProbePair::new);
        server.start();
    }
}
