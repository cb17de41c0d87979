import arealagents.EnvClient;
import arealagents.Json;
import arealagents.ProtocolException;
import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * Plays one episode of a multi-agent env over protocol v2: at each step every acting agent sends the next ACTION.
 * Prints the created session, then each step's result, as one JSON object a line; stops when nobody acts.
 *
 * <pre>  java -cp build PlayAgents [--kwargs JSON] URL ENV_ID SEED ACTION...</pre>
 *
 * A refused request prints {@code error: STATUS TYPE: MESSAGE} on one line and exits with status 1.
 */
public final class PlayAgents {
    /** UTF-8 whatever the locale, so observations and replies print intact. */
    private static final PrintStream OUT =
            new PrintStream(new FileOutputStream(FileDescriptor.out), true, StandardCharsets.UTF_8);

    public static void main(String[] argv) throws IOException {
        List<String> args = Arrays.asList(argv);
        Object kwargs = Map.of();
        if (args.size() >= 2 && args.get(0).equals("--kwargs")) {
            kwargs = Json.parse(args.get(1));
            args = args.subList(2, args.size());
        }
        if (args.size() < 3 || !(kwargs instanceof Map<?, ?>)) {
            System.err.println("usage: PlayAgents [--kwargs JSON-OBJECT] URL ENV_ID SEED ACTION...");
            System.exit(2);
        }
        try {
            @SuppressWarnings("unchecked")
            Map<String, Object> kw = (Map<String, Object>) kwargs;
            play(new EnvClient(args.get(0)), args.get(1), kw, Long.parseLong(args.get(2)), args.subList(3, args.size()));
        } catch (ProtocolException e) {
            System.err.println("error: " + e.getMessage().replace('\n', ' '));
            System.exit(1);
        }
    }

    private static void play(EnvClient envs, String envId, Map<String, Object> kwargs, long seed, List<String> actions)
            throws IOException {
        String owner = "play-agents-" + ProcessHandle.current().pid();
        EnvClient.AgentsCreated s = envs.createAgents(envId, kwargs, seed, null, owner);
        OUT.println(Json.write(Map.of("agents", s.agents(), "acting", s.acting(), "observations", s.observations())));
        List<String> acting = s.acting();
        try {
            for (String action : actions) {
                if (acting.isEmpty()) return;
                Map<String, String> step = new LinkedHashMap<>();
                for (String agent : acting) step.put(agent, action);
                EnvClient.AgentsStep r = envs.stepAgents(s.sessionId(), step);
                Map<String, Object> line = new LinkedHashMap<>();
                line.put("acting", r.acting());
                line.put("observations", r.observations());
                line.put("rewards", r.rewards());
                line.put("terminations", r.terminations());
                line.put("error", r.error());
                OUT.println(Json.write(line));
                acting = r.acting();
            }
        } finally {
            envs.closeOwned(owner); // whatever is still open of this run (a failed step's session is gone already)
        }
    }
}
