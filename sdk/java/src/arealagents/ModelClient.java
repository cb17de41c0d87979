package arealagents;

import java.io.IOException;
import java.time.Duration;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * A client of a policy served by {@code areal-agents serve-model} (or SGLang): the native {@code POST /generate} and
 * OpenAI's {@code POST /v1/chat/completions}.
 *
 * <pre>
 *   ModelClient model = new ModelClient("http://127.0.0.1:30000");
 *   ModelClient.Generation g = model.generate("12+30=", ModelClient.Sampling.greedy(8));
 *   ModelClient.ChatReply c = model.chat(List.of(Map.of("role", "user", "content", "hi")), 16, 0.0);
 * </pre>
 */
public final class ModelClient {
    /** Sampling parameters of /generate; {@code extra} adds any other SGLang sampling parameter (e.g. top_k). */
    public record Sampling(int maxNewTokens, double temperature, double topP, Map<String, Object> extra) {
        public static Sampling greedy(int maxNewTokens) {
            return new Sampling(maxNewTokens, 0.0, 1.0, Map.of());
        }

        Map<String, Object> toJson() {
            Map<String, Object> json = new LinkedHashMap<>(extra == null ? Map.of() : extra);
            json.put("max_new_tokens", maxNewTokens);
            json.put("temperature", temperature);
            json.put("top_p", topP);
            return json;
        }
    }

    /** A /generate reply: the text, its token ids with their logprobs, why it stopped (stop, length, abort) and
     * the weight version that produced it. */
    public record Generation(String text, int[] outputIds, double[] logprobs, String finishReason,
                             String weightVersion) {}

    /** A chat completion's first choice. */
    public record ChatReply(String content, String finishReason) {}

    private final HttpJson http;
    private volatile String model;

    /** {@code model} for the chat route is asked of {@code GET /v1/models} on first use. */
    public ModelClient(String baseUrl) {
        this(baseUrl, null, Duration.ofSeconds(300));
    }

    public ModelClient(String baseUrl, String model, Duration timeout) {
        this.http = new HttpJson(baseUrl, timeout);
        this.model = model;
    }

    public Generation generate(int[] inputIds, Sampling sampling) throws IOException {
        return generate("input_ids", inputIds, sampling);
    }

    public Generation generate(String text, Sampling sampling) throws IOException {
        return generate("text", text, sampling);
    }

    private Generation generate(String promptKey, Object prompt, Sampling sampling) throws IOException {
        Map<String, Object> body = new LinkedHashMap<>();
        body.put(promptKey, prompt);
        body.put("sampling_params", sampling.toJson());
        body.put("return_logprob", true);
        Map<String, Object> reply = EnvClient.object(http.send("POST", "/generate", body));
        Map<String, Object> meta = EnvClient.object(reply.get("meta_info"));
        List<?> ids = (List<?>) reply.get("output_ids");
        List<?> logprobs = (List<?>) meta.get("output_token_logprobs");
        int[] outputIds = new int[ids.size()];
        double[] outputLogprobs = new double[logprobs.size()];
        for (int i = 0; i < outputIds.length; i++) outputIds[i] = ((Number) ids.get(i)).intValue();
        for (int i = 0; i < outputLogprobs.length; i++) {
            outputLogprobs[i] = ((Number) ((List<?>) logprobs.get(i)).get(0)).doubleValue();
        }
        String finish = String.valueOf(EnvClient.object(meta.get("finish_reason")).get("type"));
        Object version = meta.get("weight_version");
        return new Generation(EnvClient.string(reply, "text"), outputIds, outputLogprobs, finish,
                version == null ? null : String.valueOf(version));
    }

    /** The first choice of an OpenAI chat completion of {@code messages} ({@code role}/{@code content} maps). */
    public ChatReply chat(List<Map<String, Object>> messages, int maxTokens, double temperature) throws IOException {
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("model", model());
        body.put("messages", messages);
        body.put("max_tokens", maxTokens);
        body.put("temperature", temperature);
        Map<String, Object> reply = EnvClient.object(http.send("POST", "/v1/chat/completions", body));
        Map<String, Object> choice = EnvClient.object(((List<?>) reply.get("choices")).get(0));
        Object content = EnvClient.object(choice.get("message")).get("content");
        String finish = String.valueOf(choice.get("finish_reason"));
        return new ChatReply(content == null ? "" : String.valueOf(content), finish);
    }

    /** The model id the chat route is asked for: the constructor's, else the first of {@code GET /v1/models}. */
    public String model() throws IOException {
        if (model == null) {
            List<?> data = (List<?>) EnvClient.object(http.send("GET", "/v1/models", null)).get("data");
            if (data == null || data.isEmpty()) throw new IOException(http.base() + "/v1/models lists no model");
            model = EnvClient.string(EnvClient.object(data.get(0)), "id");
        }
        return model;
    }
}
