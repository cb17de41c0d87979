import arealagents.Env;
import arealagents.EnvClient;
import arealagents.EnvServer;
import arealagents.Json;
import arealagents.ServerOptions;
import java.io.IOException;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;

/**
 * Test helper: EnvServer.stop() with one idle session and one in the middle of a slow step; prints, as a JSON list,
 * what happened in order, so the Python test can check that stop closes the idle env at once and the busy one only
 * when its step returns.
 */
public final class StopClosesEnvs {
    private static final ConcurrentLinkedQueue<String> EVENTS = new ConcurrentLinkedQueue<>();
    private static final CountDownLatch STEPPING = new CountDownLatch(1);
    private static final CountDownLatch BUSY_CLOSED = new CountDownLatch(1);

    /** An env named by kwargs.name whose step takes 1.5 s, interrupted or not, and whose close is recorded. */
    private record Recorder(String name) implements Env {
        @Override
        public Reset reset(Long seed, Map<String, Object> options) {
            return new Reset(name, Map.of());
        }

        @Override
        public Step step(String action) {
            EVENTS.add("step started");
            STEPPING.countDown();
            sleepThroughInterrupts(1500);
            EVENTS.add("step ended");
            return new Step(action, 0, false, false, Map.of());
        }

        @Override
        public void close() {
            EVENTS.add("closed " + name);
            if (name.equals("busy")) BUSY_CLOSED.countDown();
        }
    }

    public static void main(String[] args) throws IOException, InterruptedException {
        EnvServer server = new EnvServer(ServerOptions.parse(new String[] {"--port", "0"}));
        server.addEnv("test/Recorder-v0", "records steps and close",
                kwargs -> new Recorder((String) kwargs.get("name")));
        server.start();
        EnvClient client = new EnvClient(server.url());
        client.create("test/Recorder-v0", Map.of("name", "idle"), null, null);
        String busy = client.create("test/Recorder-v0", Map.of("name", "busy"), null, null).sessionId();
        Thread step = new Thread(() -> {
            try {
                client.step(busy, "slow");
            } catch (IOException serverStopped) {
                // expected: the server stops while this step runs
            }
        });
        step.setDaemon(true);
        step.start();
        if (!STEPPING.await(10, TimeUnit.SECONDS)) throw new IllegalStateException("the step never started");
        server.stop();
        EVENTS.add("stop returned");
        if (!BUSY_CLOSED.await(10, TimeUnit.SECONDS)) EVENTS.add("busy env not closed 10 s after its step");
        System.out.println(Json.write(List.copyOf(EVENTS)));
    }

    private static void sleepThroughInterrupts(long ms) {
        long deadline = System.nanoTime() + ms * 1_000_000;
        boolean interrupted = false;
        for (long left = ms; left > 0; left = (deadline - System.nanoTime()) / 1_000_000) {
            try {
                Thread.sleep(left);
            } catch (InterruptedException e) {
                interrupted = true;
            }
        }
        if (interrupted) Thread.currentThread().interrupt();
    }
}
