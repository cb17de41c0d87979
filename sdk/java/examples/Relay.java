import arealagents.EnvServer;
import arealagents.MultiAgentEnv;
import java.io.IOException;
import java.util.List;
import java.util.Map;
import java.util.Random;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * java/Relay-v0, a turn-based multi-agent env: two runners add a list of numbers in turns. runner_0 adds the first
 * two, then each runner in turn adds the next number to the total; each sees what the other said (the first integer
 * of its answer). A runner's reward for its turn is 1.0 when that integer is the right total, else 0.0.
 */
public final class Relay implements MultiAgentEnv {
    private static final List<String> RUNNERS = List.of("runner_0", "runner_1");
    private static final Pattern INTEGER = Pattern.compile("-?\\d+");
    private final int terms;
    private final int maxNumber;
    private int[] numbers = new int[0];
    private int added; // how many numbers are in the total so far
    private int total;

    Relay(Map<String, Object> kwargs) {
        kwargs.keySet().stream().filter(k -> !k.equals("terms") && !k.equals("max_number")).findFirst().ifPresent(k -> {
            throw new IllegalArgumentException("kwargs." + k + ": unknown; Relay takes terms and max_number");
        });
        terms = intKwarg(kwargs, "terms", 3, 2, 9);
        maxNumber = intKwarg(kwargs, "max_number", 9, 1, 999);
    }

    private static int intKwarg(Map<String, Object> kwargs, String key, int fallback, int min, int max) {
        Object value = kwargs.getOrDefault(key, (long) fallback);
        if (value instanceof Long n && n >= min && n <= max) return n.intValue();
        throw new IllegalArgumentException("kwargs." + key + ": expected an integer in [" + min + ", " + max + "]");
    }

    @Override
    public List<String> agents() {
        return RUNNERS;
    }

    @Override
    public Reset reset(Long seed, Map<String, Object> options) {
        Random rng = seed == null ? new Random() : new Random(seed);
        numbers = rng.ints(terms, 1, maxNumber + 1).toArray();
        added = 2;
        total = numbers[0] + numbers[1];
        String task = "Relay: you and runner_1 add numbers in turns. " + numbers[0] + "+" + numbers[1] + "=";
        return new Reset(Map.of("runner_0", task), Map.of("runner_0", Map.of("turn", 0)));
    }

    /** One runner at a time: runner_0 on the first step, then they alternate; nobody once every number is in. */
    @Override
    public List<String> acting() {
        return added > terms ? List.of() : List.of(RUNNERS.get(added % 2));
    }

    @Override
    public Step step(Map<String, String> actions) {
        String runner = acting().get(0), answer = actions.get(runner); // the server sends exactly acting()'s actions
        Matcher named = INTEGER.matcher(answer);
        String said = named.find() ? named.group() : "no number";
        boolean right = said.equals(Integer.toString(total));
        double reward = right ? 1.0 : 0.0;
        Map<String, Object> info = Map.of("turn", added - 1, "total", total, "right", right);
        if (added == terms) { // that was the last number: the episode ends for both runners
            added++;
            Map<String, Boolean> over = Map.of("runner_0", true, "runner_1", true);
            return new Step(Map.of(), Map.of(runner, reward), over, Map.of(), Map.of(runner, info));
        }
        String next = RUNNERS.get(1 - RUNNERS.indexOf(runner)); // the other runner sees what this one said
        String observation = runner + " said " + said + "; the total is " + total + ". " + total + "+" + numbers[added]
                + "=";
        total += numbers[added++];
        return new Step(Map.of(next, observation), Map.of(runner, reward), Map.of(runner, false), Map.of(),
                Map.of(runner, info));
    }

    public static void main(String[] args) throws IOException {
        EnvServer server = EnvServer.fromArgs(args); // a bad flag: its message, exit status 2
        server.addMultiAgentEnv("java/Relay-v0", "two runners add numbers in turns (kwargs: terms, max_number)",
                Relay::new);
        server.addEnv("java/GridPuzzle-v0", "move A to G on a grid (kwargs: size, max_turns)", GridPuzzle::new);
        server.start();
    }
}
