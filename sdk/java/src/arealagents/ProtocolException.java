package arealagents;

/** A refused request: the HTTP status and the {@code {"error": {"type", "message"}}} the server replied with. */
public final class ProtocolException extends RuntimeException {
    public final int status;
    public final String type;

    public ProtocolException(int status, String type, String message) {
        super(status + " " + type + ": " + message);
        this.status = status;
        this.type = type;
    }
}
