package arealagents;

import java.io.IOException;
import java.io.InterruptedIOException;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.Map;

/** JSON requests over HTTP/1.1 for the SDK's clients; a 4xx/5xx reply becomes a {@link ProtocolException}. */
final class HttpJson {
    // HTTP/1.1 only: the JDK's default h2c upgrade attempt makes uvicorn drop the request body.
    private final HttpClient http;
    private final String base;
    private final Duration timeout;

    HttpJson(String baseUrl, Duration timeout) {
        this.base = baseUrl.replaceAll("/+$", "");
        this.timeout = timeout;
        this.http = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).connectTimeout(timeout).build();
    }

    String base() {
        return base;
    }

    /** The parsed JSON reply of {@code method path} with {@code body} (null: no body). */
    Object send(String method, String path, Object body) throws IOException {
        HttpRequest.BodyPublisher publisher = body == null
                ? HttpRequest.BodyPublishers.noBody()
                : HttpRequest.BodyPublishers.ofString(Json.write(body), StandardCharsets.UTF_8);
        HttpRequest request = HttpRequest.newBuilder(URI.create(base + path))
                .timeout(timeout)
                .header("Content-Type", "application/json")
                .method(method, publisher)
                .build();
        HttpResponse<String> reply;
        try {
            reply = http.send(request, HttpResponse.BodyHandlers.ofString(StandardCharsets.UTF_8));
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new InterruptedIOException("interrupted during " + method + " " + base + path);
        }
        if (reply.statusCode() >= 400) throw refusal(reply.statusCode(), reply.body());
        try {
            return Json.parse(reply.body());
        } catch (Json.ParseException e) {
            throw new IOException(method + " " + base + path + " replied with malformed JSON: " + e.getMessage());
        }
    }

    /** {@code {"error": {"type", "message"}}} when the reply has that shape, else the status and the raw body. */
    private static ProtocolException refusal(int status, String body) {
        try {
            if (Json.parse(body) instanceof Map<?, ?> reply && reply.get("error") instanceof Map<?, ?> error) {
                Object type = error.get("type"), message = error.get("message");
                return new ProtocolException(status, type == null ? "http_" + status : String.valueOf(type),
                        message == null ? body : String.valueOf(message));
            }
        } catch (Json.ParseException notJson) {
            // reported with the raw body below
        }
        return new ProtocolException(status, "http_" + status, body);
    }
}
