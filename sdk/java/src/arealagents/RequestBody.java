package arealagents;

import com.sun.net.httpserver.HttpExchange;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.regex.Pattern;

/**
 * The strict request bodies of protocols v1 and v2: a bounded read of the JSON object, and the checks of its keys and types,
 * each refusing with a 400 that names the field ({@code body.<field>: ...}).
 */
final class RequestBody {
    /** One item of a POST /v1/step batch ({@code action}) or a POST /v2/step batch ({@code actions}). */
    record BatchItem(String sessionId, String action, Map<String, String> actions) {}

    private static final Pattern OWNER = Pattern.compile("[A-Za-z0-9_.:-]{1,128}");

    private RequestBody() {}

    /** The request's JSON object, read with a bounded reader whether it came with a Content-Length or chunked. */
    static Map<String, Object> read(HttpExchange ex, int maxBodyBytes) throws IOException {
        String declared = ex.getRequestHeaders().getFirst("Content-Length");
        if (declared != null && declared.matches("\\d{1,18}") && Long.parseLong(declared) > maxBodyBytes) {
            throw tooLarge(maxBodyBytes);
        }
        byte[] body = ex.getRequestBody().readNBytes(maxBodyBytes + 1);
        if (body.length > maxBodyBytes) throw tooLarge(maxBodyBytes);
        String text;
        try {
            text = StandardCharsets.UTF_8.newDecoder().decode(ByteBuffer.wrap(body)).toString();
        } catch (CharacterCodingException e) {
            throw Refusal.badRequest("body: not valid UTF-8");
        }
        Object parsed;
        try {
            parsed = Json.parse(text);
        } catch (Json.ParseException e) {
            throw Refusal.badRequest("body: malformed JSON: " + e.getMessage());
        }
        if (!(parsed instanceof Map)) throw Refusal.badRequest("body: expected a JSON object");
        @SuppressWarnings("unchecked")
        Map<String, Object> object = (Map<String, Object>) parsed;
        return object;
    }

    private static Refusal tooLarge(int maxBodyBytes) {
        return new Refusal(413, "payload_too_large", "request body over " + maxBodyBytes + " bytes (--max-body-bytes)");
    }

    /** Refuses a key of {@code body} (named {@code where}) that is not one of {@code allowed}. */
    static void onlyKeys(Map<String, Object> body, String where, String... allowed) {
        List<String> keys = List.of(allowed);
        for (String key : body.keySet()) {
            if (!keys.contains(key)) {
                throw Refusal.badRequest(where + "." + key + ": unknown key; allowed: " + String.join(", ", keys));
            }
        }
    }

    /** A create-session body (v1's and v2's are the same), its keys checked. */
    record Create(String envId, Map<String, Object> kwargs, Long seed, Map<String, Object> options, String owner) {
        static Create of(Map<String, Object> body) {
            onlyKeys(body, "body", "env_id", "kwargs", "seed", "options", "owner");
            return new Create(requiredString(body, "env_id", "body"), optionalObject(body, "kwargs"),
                    RequestBody.seed(body),
                    optionalObject(body, "options"), RequestBody.owner(body.get("owner"), "body.owner"));
        }
    }

    static String requiredString(Map<String, Object> body, String key, String where) {
        if (!body.containsKey(key)) throw Refusal.badRequest(where + "." + key + ": required");
        if (!(body.get(key) instanceof String s)) throw Refusal.badRequest(where + "." + key + ": expected a string");
        return s;
    }

    /** kwargs/options: a JSON object, or absent (an empty map); options may also be null. */
    @SuppressWarnings("unchecked")
    static Map<String, Object> optionalObject(Map<String, Object> body, String key) {
        Object value = body.get(key);
        if (value == null && (!body.containsKey(key) || key.equals("options"))) return new LinkedHashMap<>();
        if (!(value instanceof Map)) throw Refusal.badRequest("body." + key + ": expected an object");
        return (Map<String, Object>) value;
    }

    /** The seed: an integer >= 0, or null when absent or null (the env picks one). */
    static Long seed(Map<String, Object> body) {
        Object value = body.get("seed");
        if (value == null) return null;
        if (!(value instanceof Long seed)) throw Refusal.badRequest("body.seed: expected an integer >= 0 or null");
        if (seed < 0) throw Refusal.badRequest("body.seed: expected an integer >= 0, got " + seed);
        return seed;
    }

    /** The optional owner tag ({@code where} names it): 1 to 128 characters of A-Z a-z 0-9 _ . : -, or null. */
    static String owner(Object value, String where) {
        if (value == null) return null;
        if (!(value instanceof String owner) || !OWNER.matcher(owner).matches()) {
            throw Refusal.badRequest(where + ": expected 1 to 128 characters of A-Z a-z 0-9 _ . : - (the run's name)");
        }
        return owner;
    }

    /** A v2 step's {@code actions}: an object of strings keyed by agent id (its keys checked against the session's
     * acting agents later, where the session is known). */
    static Map<String, String> actions(Map<String, Object> body, String where) {
        if (!body.containsKey("actions")) throw Refusal.badRequest(where + ".actions: required");
        if (!(body.get("actions") instanceof Map<?, ?> raw)) {
            throw Refusal.badRequest(where + ".actions: expected an object of actions keyed by agent id");
        }
        Map<String, String> actions = new LinkedHashMap<>();
        for (Map.Entry<?, ?> e : raw.entrySet()) {
            if (!(e.getValue() instanceof String action)) {
                throw Refusal.badRequest(where + ".actions." + e.getKey() + ": expected a string");
            }
            actions.put((String) e.getKey(), action);
        }
        return actions;
    }

    /** The items of {@code {"steps": [...]}}, in order; a session named twice refuses the whole batch. Each item has
     * {@code action} (v1) or, when {@code multiAgent}, {@code actions} (v2). */
    static List<BatchItem> batchItems(Map<String, Object> body, boolean multiAgent) {
        onlyKeys(body, "body", "steps");
        if (!body.containsKey("steps")) throw Refusal.badRequest("body.steps: required");
        if (!(body.get("steps") instanceof List<?> items)) throw Refusal.badRequest("body.steps: expected a list");
        List<BatchItem> steps = new ArrayList<>();
        HashSet<String> seen = new HashSet<>();
        for (int i = 0; i < items.size(); i++) {
            String where = "body.steps[" + i + "]";
            if (!(items.get(i) instanceof Map<?, ?> raw)) throw Refusal.badRequest(where + ": expected an object");
            @SuppressWarnings("unchecked")
            Map<String, Object> item = (Map<String, Object>) raw;
            onlyKeys(item, where, "session_id", multiAgent ? "actions" : "action");
            String sid = requiredString(item, "session_id", where);
            if (!seen.add(sid)) {
                throw Refusal.badRequest(where + ".session_id: session " + sid + " appears twice; a batch steps "
                        + "each session at most once");
            }
            steps.add(multiAgent ? new BatchItem(sid, null, actions(item, where))
                    : new BatchItem(sid, requiredString(item, "action", where), null));
        }
        return steps;
    }
}
