import arealagents.Json;
import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;

/** Test helper: each stdin line parsed and written back by {@link Json}, or {@code error: MESSAGE}. */
public final class JsonEcho {
    public static void main(String[] args) throws IOException {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        StringBuilder out = new StringBuilder();
        for (String line; (line = in.readLine()) != null; ) {
            try {
                out.append(Json.write(Json.parse(line)));
            } catch (Json.ParseException e) {
                out.append("error: ").append(e.getMessage());
            }
            out.append('\n');
        }
        System.out.write(out.toString().getBytes(StandardCharsets.UTF_8));
        System.out.flush();
    }
}
