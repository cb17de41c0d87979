package arealagents;

/** A request the server refuses: the HTTP status and the protocol's error record ({@code type}, message). */
final class Refusal extends RuntimeException {
    final int status;
    final String type;

    Refusal(int status, String type, String message) {
        super(message, null, false, false);
        this.status = status;
        this.type = type;
    }

    /** A 400 {@code bad_request}; the message names the field as {@code body.<field>}. */
    static Refusal badRequest(String message) {
        return new Refusal(400, "bad_request", message);
    }
}
