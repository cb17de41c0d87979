import arealagents.EnvClient;
import arealagents.Json;
import arealagents.ProtocolException;
import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.List;
import java.util.Map;

/**
 * Plays one episode on an env-step server with the given actions, printing each observation (as a JSON string),
 * reward and terminated flag; stops early when the episode ends.
 *
 * <pre>  java -cp build PlayEpisode [--kwargs JSON] URL ENV_ID SEED ACTION...</pre>
 *
 * A refused request prints {@code error: STATUS TYPE: MESSAGE} on one line and exits with status 1.
 */
public final class PlayEpisode {
    /** UTF-8 whatever the locale, so observations and replies print intact. */
    private static final PrintStream OUT =
            new PrintStream(new FileOutputStream(FileDescriptor.out), true, StandardCharsets.UTF_8);

    public static void main(String[] argv) throws IOException {
        List<String> args = Arrays.asList(argv);
        Map<String, Object> kwargs = Map.of();
        if (args.size() >= 2 && args.get(0).equals("--kwargs")) {
            kwargs = asObject(Json.parse(args.get(1)));
            args = args.subList(2, args.size());
        }
        if (args.size() < 3) {
            System.err.println("usage: PlayEpisode [--kwargs JSON] URL ENV_ID SEED ACTION...");
            System.exit(2);
        }
        try {
            long seed = Long.parseLong(args.get(2));
            play(new EnvClient(args.get(0)), args.get(1), kwargs, seed, args.subList(3, args.size()));
        } catch (ProtocolException e) {
            System.err.println("error: " + e.getMessage().replace('\n', ' '));
            System.exit(1);
        }
    }

    private static void play(EnvClient envs, String envId, Map<String, Object> kwargs, long seed, List<String> actions)
            throws IOException {
        EnvClient.Created session = envs.create(envId, kwargs, seed, null);
        OUT.println("observation " + Json.write(session.observation()));
        try {
            for (String action : actions) {
                EnvClient.StepResult r = envs.step(session.sessionId(), action);
                OUT.println("observation " + Json.write(r.observation()) + " reward " + r.reward()
                        + " terminated " + r.terminated() + " truncated " + r.truncated());
                if (r.error() != null) OUT.println("error " + Json.write(r.error()));
                if (r.done() || r.error() != null) return;
            }
        } finally {
            closeQuietly(envs, session.sessionId());
        }
    }

    /** A failed step has already closed its session; anything else is closed here. */
    private static void closeQuietly(EnvClient envs, String sessionId) throws IOException {
        try {
            envs.close(sessionId);
        } catch (ProtocolException alreadyClosed) {
            // unknown_session: the server closed it (the env failed)
        }
    }

    @SuppressWarnings("unchecked")
    private static Map<String, Object> asObject(Object json) {
        if (!(json instanceof Map)) throw new IllegalArgumentException("--kwargs: expected a JSON object");
        return (Map<String, Object>) json;
    }
}
