package arealagents;

/** Server options; {@link #parse} reads them from command-line flags. */
public final class ServerOptions {
    public String host = "127.0.0.1";
    public int port = 8765;
    /** Request threads: a request holds one while it is read and run, so they must outnumber slow clients. */
    public int threads = 256;
    public int maxSessions = 4096;
    public int maxBodyBytes = 8 * 1024 * 1024;
    public int maxActionChars = 65536;
    public double idleTimeoutS = 600;
    /** A request's headers and body must arrive within this many seconds of its first byte (whole seconds: the
     * JDK's server counts them so); a slower one has its connection closed. */
    public int readTimeoutS = 10;

    /** Options from {@code --host --port --threads --max-sessions --max-body-bytes --max-action-chars
     * --idle-timeout --read-timeout} (each {@code --flag value} or {@code --flag=value}); a bad flag or value is an
     * IllegalArgumentException naming the flag. */
    public static ServerOptions parse(String[] args) {
        ServerOptions o = new ServerOptions();
        for (int i = 0; i < args.length; i++) {
            String flag = args[i], value;
            int eq = flag.indexOf('=');
            if (flag.startsWith("--") && eq > 0) {
                value = flag.substring(eq + 1);
                flag = flag.substring(0, eq);
            } else if (i + 1 < args.length) {
                value = args[++i];
            } else {
                throw new IllegalArgumentException(flag + ": missing value");
            }
            o.set(flag, value);
        }
        return o;
    }

    private void set(String flag, String value) {
        switch (flag) {
            case "--host" -> host = value;
            case "--port" -> port = intIn(flag, value, 0, 65535);
            case "--threads" -> threads = intIn(flag, value, 1, 4096);
            case "--max-sessions" -> maxSessions = intIn(flag, value, 1, Integer.MAX_VALUE);
            case "--max-body-bytes" -> maxBodyBytes = intIn(flag, value, 1, Integer.MAX_VALUE - 8);
            case "--max-action-chars" -> maxActionChars = intIn(flag, value, 1, Integer.MAX_VALUE);
            case "--idle-timeout" -> idleTimeoutS = positiveSeconds(flag, value);
            case "--read-timeout" -> readTimeoutS = intIn(flag, value, 1, 3600);
            default -> throw new IllegalArgumentException(
                    "unknown flag " + flag + "; the flags are --host --port --threads --max-sessions "
                            + "--max-body-bytes --max-action-chars --idle-timeout --read-timeout");
        }
    }

    private static int intIn(String flag, String value, int min, int max) {
        try {
            int n = Integer.parseInt(value);
            if (n >= min && n <= max) return n;
        } catch (NumberFormatException ignored) {
            // reported below with the range
        }
        throw new IllegalArgumentException(flag + ": expected an integer in [" + min + ", " + max + "], got '"
                + value + "'");
    }

    private static double positiveSeconds(String flag, String value) {
        try {
            double s = Double.parseDouble(value);
            if (s > 0 && Double.isFinite(s)) return s;
        } catch (NumberFormatException ignored) {
            // reported below
        }
        throw new IllegalArgumentException(flag + ": expected a number of seconds > 0, got '" + value + "'");
    }
}
