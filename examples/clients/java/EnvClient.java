// A minimal env-step client in Java (JDK 11+, no dependencies): plays one Arithmetic-v0 episode.
//
//   javac EnvClient.java && java EnvClient http://127.0.0.1:8765 7
//
// It creates a session with a seed, reads the problem ("37+58="), answers it, prints the reward and
// closes the session. See docs/env-protocol.md for the protocol.

import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class EnvClient {
    // HTTP/1.1: the default h2c upgrade attempt makes uvicorn drop the request body.
    private final HttpClient http = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();
    private final String base;

    EnvClient(String base) {
        this.base = base.replaceAll("/+$", "");
    }

    String call(String method, String path, String json) throws Exception {
        HttpRequest.Builder b = HttpRequest.newBuilder(URI.create(base + path)).header("Content-Type", "application/json");
        b = json == null ? b.method(method, HttpRequest.BodyPublishers.noBody())
                         : b.method(method, HttpRequest.BodyPublishers.ofString(json));
        HttpResponse<String> r = http.send(b.build(), HttpResponse.BodyHandlers.ofString());
        if (r.statusCode() >= 400) {
            throw new RuntimeException("HTTP " + r.statusCode() + ": " + r.body());
        }
        return r.body();
    }

    /** The string value of a top-level key, JSON escapes decoded (enough for this protocol's replies). */
    static String stringField(String json, String key) {
        Matcher m = Pattern.compile("\"" + key + "\":\"((?:[^\"\\\\]|\\\\.)*)\"").matcher(json);
        if (!m.find()) throw new IllegalArgumentException("no string field " + key + " in " + json);
        String s = m.group(1);
        StringBuilder out = new StringBuilder();
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            if (c != '\\') { out.append(c); continue; }
            char e = s.charAt(++i);
            switch (e) {
                case 'n': out.append('\n'); break;
                case 't': out.append('\t'); break;
                case 'u': out.append((char) Integer.parseInt(s.substring(i + 1, i + 5), 16)); i += 4; break;
                default: out.append(e);
            }
        }
        return out.toString();
    }

    static String numberField(String json, String key) {
        Matcher m = Pattern.compile("\"" + key + "\":(-?[0-9.eE+-]+|true|false)").matcher(json);
        if (!m.find()) throw new IllegalArgumentException("no field " + key + " in " + json);
        return m.group(1);
    }

    static String quote(String s) {
        return "\"" + s.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n") + "\"";
    }

    static long solve(String problem) {
        Matcher m = Pattern.compile("(-?\\d+)([+*-])(-?\\d+)=").matcher(problem);
        if (!m.find()) throw new IllegalArgumentException("not an arithmetic problem: " + problem);
        long a = Long.parseLong(m.group(1)), b = Long.parseLong(m.group(3));
        switch (m.group(2)) {
            case "+": return a + b;
            case "-": return a - b;
            default: return a * b;
        }
    }

    public static void main(String[] args) throws Exception {
        EnvClient client = new EnvClient(args.length > 0 ? args[0] : "http://127.0.0.1:8765");
        int seed = args.length > 1 ? Integer.parseInt(args[1]) : 0;
        String created = client.call("POST", "/v1/sessions",
            "{\"env_id\":\"areal_agents/Arithmetic-v0\",\"kwargs\":{\"digits\":3},\"seed\":" + seed + "}");
        String sid = stringField(created, "session_id");
        String problem = stringField(created, "observation");
        String answer = Long.toString(solve(problem));
        String result = client.call("POST", "/v1/sessions/" + sid + "/step", "{\"action\":" + quote(answer) + "}");
        System.out.println("problem " + problem + " answer " + answer + " reward " + numberField(result, "reward")
            + " terminated " + numberField(result, "terminated"));
        client.call("DELETE", "/v1/sessions/" + sid, null);
    }
}
