import arealagents.Env;
import arealagents.EnvServer;
import java.io.IOException;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.Random;
import java.util.regex.Pattern;

/** java/GridPuzzle-v0: move the agent A to the goal G on a small grid within max_turns moves. */
public final class GridPuzzle implements Env {
    private static final List<String> MOVES = List.of("up", "down", "left", "right");
    private static final Pattern MOVE = Pattern.compile("up|down|left|right", Pattern.CASE_INSENSITIVE);
    private static final int[][] DELTAS = {{-1, 0}, {1, 0}, {0, -1}, {0, 1}};
    private final int size;
    private final int maxTurns;
    private int row, col, goalRow, goalCol, turn;

    GridPuzzle(Map<String, Object> kwargs) {
        kwargs.keySet().stream().filter(k -> !k.equals("size") && !k.equals("max_turns")).findFirst().ifPresent(k -> {
            throw new IllegalArgumentException("kwargs." + k + ": unknown; GridPuzzle takes size and max_turns");
        });
        size = intKwarg(kwargs, "size", 3, 2, 9);
        maxTurns = intKwarg(kwargs, "max_turns", 6, 1, 64);
    }

    private static int intKwarg(Map<String, Object> kwargs, String key, int fallback, int min, int max) {
        Object value = kwargs.getOrDefault(key, (long) fallback);
        if (value instanceof Long n && n >= min && n <= max) return n.intValue();
        throw new IllegalArgumentException("kwargs." + key + ": expected an integer in [" + min + ", " + max + "]");
    }

    @Override
    public Reset reset(Long seed, Map<String, Object> options) {
        Random rng = seed == null ? new Random() : new Random(seed);
        row = rng.nextInt(size);
        col = rng.nextInt(size);
        do {
            goalRow = rng.nextInt(size);
            goalCol = rng.nextInt(size);
        } while (goalRow == row && goalCol == col);
        turn = 0;
        return new Reset(render(""), Map.of("turn", 0));
    }

    @Override
    public Step step(String action) {
        turn++;
        var named = MOVE.matcher(action); // the first move named counts, in any case
        int move = named.find() ? MOVES.indexOf(named.group().toLowerCase(Locale.ROOT)) : -1;
        String note = "";
        if (move < 0) {
            note = "Unknown move.\n";
        } else if (!inside(row + DELTAS[move][0]) || !inside(col + DELTAS[move][1])) {
            note = "You bumped into a wall.\n";
        } else {
            row += DELTAS[move][0];
            col += DELTAS[move][1];
        }
        boolean won = row == goalRow && col == goalCol;
        String observation = won ? "You reached the goal." : render(note);
        return new Step(observation, won ? 1.0 : 0.0, won, !won && turn >= maxTurns, Map.of("turn", turn));
    }

    private boolean inside(int i) {
        return i >= 0 && i < size;
    }

    private String render(String note) {
        StringBuilder grid = new StringBuilder(note);
        for (int r = 0; r < size; r++) {
            for (int c = 0; c < size; c++) {
                grid.append(r == row && c == col ? 'A' : r == goalRow && c == goalCol ? 'G' : '.');
            }
            grid.append('\n');
        }
        return grid.append("Move: up, down, left or right.").toString();
    }

    public static void main(String[] args) throws IOException {
        EnvServer server = EnvServer.fromArgs(args); // a bad flag: its message, exit status 2
        server.addEnv("java/GridPuzzle-v0", "move A to G on a grid (kwargs: size, max_turns)", GridPuzzle::new);
        server.start();
    }
}
