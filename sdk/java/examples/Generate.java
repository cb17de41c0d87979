import arealagents.Json;
import arealagents.ModelClient;
import arealagents.ProtocolException;
import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.List;
import java.util.Map;

/**
 * Asks a policy served by {@code areal-agents serve-model} for a completion, greedy by default.
 *
 * <pre>
 *   java -cp build Generate URL "12+30="              # POST /generate with text
 *   java -cp build Generate URL --ids 1,2,3           # POST /generate with token ids
 *   java -cp build Generate URL --chat "hello"        # POST /v1/chat/completions
 *   options (first): --max-new-tokens N (16)  --temperature T (0)
 * </pre>
 */
public final class Generate {
    /** UTF-8 whatever the locale, so observations and replies print intact. */
    private static final PrintStream OUT =
            new PrintStream(new FileOutputStream(FileDescriptor.out), true, StandardCharsets.UTF_8);

    public static void main(String[] argv) throws IOException {
        List<String> args = Arrays.asList(argv);
        int maxNewTokens = 16;
        double temperature = 0.0;
        while (args.size() > 2 && (args.get(0).equals("--max-new-tokens") || args.get(0).equals("--temperature"))) {
            if (args.get(0).equals("--max-new-tokens")) maxNewTokens = Integer.parseInt(args.get(1));
            else temperature = Double.parseDouble(args.get(1));
            args = args.subList(2, args.size());
        }
        if (args.size() < 2 || args.size() > 3) {
            System.err.println("usage: Generate [--max-new-tokens N] [--temperature T] URL (PROMPT | --ids 1,2,3 | "
                    + "--chat MESSAGE)");
            System.exit(2);
        }
        ModelClient model = new ModelClient(args.get(0));
        try {
            if (args.size() == 3 && args.get(1).equals("--chat")) {
                chat(model, args.get(2), maxNewTokens, temperature);
            } else if (args.size() == 3 && args.get(1).equals("--ids")) {
                int[] ids = Arrays.stream(args.get(2).split(",")).mapToInt(s -> Integer.parseInt(s.trim())).toArray();
                print(model.generate(ids, new ModelClient.Sampling(maxNewTokens, temperature, 1.0, Map.of())));
            } else {
                print(model.generate(args.get(1), new ModelClient.Sampling(maxNewTokens, temperature, 1.0, Map.of())));
            }
        } catch (ProtocolException e) {
            System.err.println("error: " + e.getMessage().replace('\n', ' '));
            System.exit(1);
        }
    }

    private static void print(ModelClient.Generation g) {
        OUT.println("text " + Json.write(g.text()));
        OUT.println("output_ids " + Json.write(g.outputIds()));
        OUT.println("logprobs " + Json.write(g.logprobs()));
        OUT.println("finish_reason " + g.finishReason());
        OUT.println("weight_version " + g.weightVersion());
    }

    private static void chat(ModelClient model, String message, int maxTokens, double temperature) throws IOException {
        ModelClient.ChatReply reply = model.chat(List.of(Map.of("role", "user", "content", message)), maxTokens,
                temperature);
        OUT.println("content " + Json.write(reply.content()));
        OUT.println("finish_reason " + reply.finishReason());
    }
}
