package arealagents;

import com.sun.net.httpserver.HttpExchange;
import com.sun.net.httpserver.HttpServer;
import java.io.IOException;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.Callable;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ThreadFactory;
import java.util.concurrent.ThreadPoolExecutor;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * The env-step protocol server (docs/env-protocol.md: v1, and v2 beside it) for envs written in Java, on the JDK's
 * HttpServer.
 *
 * <pre>
 *   EnvServer server = EnvServer.fromArgs(args);          // --port 8765 --max-sessions 4096 ...
 *   server.addEnv("java/GridPuzzle-v0", "a grid walk", GridPuzzle::new);
 *   server.addMultiAgentEnv("java/Relay-v0", "a relay sum", Relay::new);
 *   server.start();                                       // serving envs on http://127.0.0.1:8765
 * </pre>
 *
 * <p>A single-agent {@link Env} is served over v1 and over v2 (as the agent {@code "agent"}); a
 * {@link MultiAgentEnv} over v2 only ({@link ProtocolV2}). Each session is one env; requests run on a pool of {@code --threads} threads, sessions independently.
 * A request holds its thread from its first byte, so the JDK's server closes a connection whose request has not
 * arrived within {@code --read-timeout} seconds (its {@code sun.net.httpserver.maxReqTime}). Not provided (the
 * Python server has them): step timeouts, process isolation, /metrics.
 */
public final class EnvServer {
    public static final String PROTOCOL = "v2";
    public static final List<String> PROTOCOLS = List.of("v1", "v2");
    private static final Pattern SESSION_PATH = Pattern.compile("/(v1|v2)/sessions/([^/]+)(/step)?");
    private static final String MAX_REQ_TIME = "sun.net.httpserver.maxReqTime";
    // The JDK reads its server settings once per JVM, when its first server starts: that start's read timeout.
    private static Integer jvmReadTimeoutS;

    private record Registered(String description, ProtocolV2.Served served) {}

    private final ServerOptions opts;
    private volatile Map<String, Registered> envs = Map.of();
    private final SessionTable sessions;
    private final ProtocolV2 v2;
    private HttpServer http;
    private ExecutorService handlers;
    private ExecutorService batchSteps;
    private ScheduledExecutorService reaper;

    public EnvServer(ServerOptions opts) {
        this.opts = opts;
        this.sessions = new SessionTable(opts);
        this.v2 = new ProtocolV2(opts, sessions);
    }

    /** A server configured from command-line flags; a bad flag prints its message and exits with status 2. */
    public static EnvServer fromArgs(String[] args) {
        try {
            return new EnvServer(ServerOptions.parse(args));
        } catch (IllegalArgumentException e) {
            System.err.println("error: " + e.getMessage());
            System.exit(2);
            throw e; // not reached
        }
    }

    /** Serves single-agent envs made by {@code factory} under {@code id} (listed by GET /v1/envs with
     * {@code description}), over v1 and v2. */
    public EnvServer addEnv(String id, String description, EnvFactory factory) {
        if (factory == null) throw new IllegalArgumentException("factory of " + id + ": expected a factory, got null");
        return register(id, description, new ProtocolV2.Served(false, kw -> new SingleAgent(factory.make(kw))));
    }

    /** Serves multi-agent envs made by {@code factory} under {@code id}, over v2 (POST /v2/sessions). */
    public EnvServer addMultiAgentEnv(String id, String description, MultiAgentEnvFactory factory) {
        if (factory == null) throw new IllegalArgumentException("factory of " + id + ": expected a factory, got null");
        return register(id, description, new ProtocolV2.Served(true, factory::make));
    }

    private synchronized EnvServer register(String id, String description, ProtocolV2.Served served) {
        if (id == null || id.isEmpty()) throw new IllegalArgumentException("env id: expected a non-empty string");
        if (envs.containsKey(id)) throw new IllegalArgumentException("env id " + id + " is already served");
        Map<String, Registered> next = new LinkedHashMap<>(envs);
        next.put(id, new Registered(description == null ? "" : description, served));
        envs = Collections.unmodifiableMap(next);
        return this;
    }

    /** Binds (port 0: a free port), starts serving and prints {@code serving envs on http://HOST:PORT}. */
    public synchronized void start() throws IOException {
        if (http != null) throw new IllegalStateException("the server is already started");
        configureJdkServer(opts.readTimeoutS);
        http = HttpServer.create(new InetSocketAddress(opts.host, opts.port), 1024);
        ThreadPoolExecutor requests = new ThreadPoolExecutor(opts.threads, opts.threads, 60, TimeUnit.SECONDS,
                new LinkedBlockingQueue<>(), daemonThreads("env-http"));
        requests.allowCoreThreadTimeOut(true); // idle threads end; a burst of requests starts them again
        handlers = requests;
        int cores = Runtime.getRuntime().availableProcessors();
        int batchThreads = Math.min(opts.threads, Math.max(4, 2 * cores)); // batch items are CPU work
        batchSteps = Executors.newFixedThreadPool(batchThreads, daemonThreads("env-batch"));
        reaper = Executors.newSingleThreadScheduledExecutor(daemonThreads("env-idle"));
        long periodMs = (long) Math.max(50, Math.min(opts.idleTimeoutS * 1000 / 4, 5000));
        reaper.scheduleWithFixedDelay(sessions::expireIdle, periodMs, periodMs, TimeUnit.MILLISECONDS);
        http.createContext("/", this::handle);
        http.setExecutor(handlers);
        http.start();
        System.out.println("serving envs on " + url());
        System.out.flush();
    }

    /** The JDK server's settings, which it reads once per JVM when its first server starts: replies go out at once
     * (not after the client's delayed ACK), and a request not read within {@code readTimeoutS} has its connection
     * closed. A second server in the same JVM must ask for the same read timeout. */
    private static synchronized void configureJdkServer(int readTimeoutS) {
        if (jvmReadTimeoutS != null && jvmReadTimeoutS != readTimeoutS) {
            throw new IllegalStateException("--read-timeout " + readTimeoutS + ": this JVM's HTTP servers already read "
                    + "requests under " + jvmReadTimeoutS + " s (the JDK takes one setting for all of them)");
        }
        jvmReadTimeoutS = readTimeoutS;
        System.setProperty("sun.net.httpserver.nodelay", "true");
        System.setProperty(MAX_REQ_TIME, Integer.toString(readTimeoutS));
    }

    /** Stops serving at once and closes every session's env (a busy one's when its running step returns). */
    public synchronized void stop() {
        if (http == null) return;
        http.stop(0);
        handlers.shutdownNow();
        batchSteps.shutdownNow();
        reaper.shutdownNow();
        sessions.closeAll();
        http = null;
    }

    /** The port the server listens on (the chosen one when started with port 0). */
    public int port() {
        return http.getAddress().getPort();
    }

    public String url() {
        String host = opts.host.contains(":") ? "[" + opts.host + "]" : opts.host;
        return "http://" + host + ":" + port();
    }

    // -- HTTP -------------------------------------------------------------------------------------

    private void handle(HttpExchange ex) {
        int status = 200;
        Object reply;
        try {
            reply = route(ex);
        } catch (Refusal r) {
            status = r.status;
            reply = errorBody(r.type, r.getMessage());
        } catch (Throwable t) {
            status = 500;
            reply = errorBody("internal_error", "the server failed on this request: " + describe(t));
        }
        try (OutputStream out = ex.getResponseBody()) {
            byte[] bytes = Json.write(reply).getBytes(StandardCharsets.UTF_8);
            ex.getResponseHeaders().set("Content-Type", "application/json");
            ex.sendResponseHeaders(status, bytes.length);
            out.write(bytes);
        } catch (IOException clientWentAway) {
            // nobody to answer
        } finally {
            ex.close();
        }
    }

    private Object route(HttpExchange ex) throws IOException {
        String method = ex.getRequestMethod(), path = ex.getRequestURI().getPath();
        switch (path) {
            case "/health": allow(method, "GET"); return health();
            case "/v1/envs": allow(method, "GET"); return listEnvs();
            case "/v1/sessions": allow(method, "POST"); return create(readBody(ex));
            case "/v1/step": allow(method, "POST"); return stepBatch(readBody(ex), false);
            case "/v2/sessions":
                allow(method, "POST", "DELETE");
                if (method.equals("DELETE")) return v2.closeOwned(ex.getRequestURI().getRawQuery());
                return v2.create(readBody(ex), this::served);
            case "/v2/step": allow(method, "POST"); return stepBatch(readBody(ex), true);
            default: break;
        }
        Matcher m = SESSION_PATH.matcher(path);
        if (!m.matches()) {
            throw new Refusal(404, "not_found", "no route " + path + "; the routes are GET /health, GET /v1/envs, "
                    + "POST /v1/sessions, POST /v1/sessions/{id}/step, DELETE /v1/sessions/{id}, POST /v1/step, "
                    + "POST /v2/sessions, DELETE /v2/sessions?owner=, POST /v2/sessions/{id}/step, "
                    + "DELETE /v2/sessions/{id}, POST /v2/step");
        }
        String sid = m.group(2);
        if (m.group(3) != null) {
            allow(method, "POST");
            return m.group(1).equals("v1") ? stepOne(sid, readBody(ex)) : v2.stepOne(sid, readBody(ex));
        }
        allow(method, "DELETE");
        sessions.close(sid); // either protocol's path closes any session
        return object("session_id", sid, "closed", true);
    }

    private static void allow(String method, String... allowed) {
        if (!List.of(allowed).contains(method)) {
            throw new Refusal(405, "method_not_allowed", method + " is not allowed here; use "
                    + String.join(" or ", allowed));
        }
    }

    private Map<String, Object> readBody(HttpExchange ex) throws IOException {
        return RequestBody.read(ex, opts.maxBodyBytes);
    }

    // -- routes -----------------------------------------------------------------------------------

    private Map<String, Object> health() {
        Map<String, Object> limits = new LinkedHashMap<>();
        limits.put("max_sessions", opts.maxSessions);
        limits.put("max_body_bytes", opts.maxBodyBytes);
        limits.put("max_action_chars", opts.maxActionChars);
        limits.put("idle_timeout_s", opts.idleTimeoutS);
        return object("status", "ok", "protocol", PROTOCOL, "protocols", PROTOCOLS, "sessions_open", sessions.size(),
                "limits", limits);
    }

    private Map<String, Object> listEnvs() {
        List<Object> list = new ArrayList<>();
        envs.forEach((id, env) -> list.add(object("id", id, "description", env.description())));
        return object("envs", list);
    }

    /** An env id this server serves, or 404 {@code unknown_env}. */
    private ProtocolV2.Served served(String envId) {
        Registered env = envs.get(envId);
        if (env == null) {
            throw new Refusal(404, "unknown_env", "no env '" + envId + "' on this server; it serves "
                    + String.join(", ", envs.keySet()));
        }
        return env.served();
    }

    /** POST /v1/sessions: a single-agent env's session (a multi-agent env id is a 400 pointing at v2). */
    private Map<String, Object> create(Map<String, Object> body) {
        RequestBody.Create c = RequestBody.Create.of(body);
        ProtocolV2.Served env = served(c.envId());
        if (env.multiAgent()) {
            throw Refusal.badRequest(c.envId() + " is a multi-agent env" + sessions.agentsOf(env.make(), c.kwargs())
                    + ": create it with POST /v2/sessions");
        }
        SessionTable.Opened s = sessions.open(c.envId(), env.make(), c.kwargs(), c.seed(), c.options(), c.owner());
        String agent = SingleAgent.AGENT;
        return object("session_id", s.sessionId(), "observation", s.observations().get(agent), "info",
                s.infos().get(agent));
    }

    private Map<String, Object> stepOne(String sid, Map<String, Object> body) {
        RequestBody.onlyKeys(body, "body", "action");
        return step(sid, RequestBody.requiredString(body, "action", "body"));
    }

    /** A v1 step: its session must hold a single-agent env. */
    private Map<String, Object> step(String sid, String action) {
        return sessions.step(sid, s -> checkAction(sid, s, action), s -> runStep(sid, s, action));
    }

    private void checkAction(String sid, SessionTable.Session session, String action) {
        int chars = action.codePointCount(0, action.length());
        if (chars > opts.maxActionChars) {
            throw new Refusal(400, "action_too_long", "action is " + chars + " characters; the limit is "
                    + opts.maxActionChars + " (--max-action-chars)");
        }
        if (session.single == null) {
            throw Refusal.badRequest("session " + sid + " is a multi-agent env (agents " + session.agents
                    + "): step it with POST /v2/sessions/" + sid + "/step");
        }
    }

    /** One env step; an env that throws (or returns something unusable) ends its own session with an error. */
    private Map<String, Object> runStep(String sid, SessionTable.Session session, String action) {
        Env.Step r;
        Map<String, Object> info;
        try {
            r = session.single.stepOne(action);
            info = EnvReplies.snapshot(r.info(), "step's info");
        } catch (Throwable t) {
            sessions.fail(sid, session);
            return failedStep(sid, "env_error", "step failed: " + describe(t) + "; the session is closed");
        }
        if (r.terminated() || r.truncated()) session.done = true;
        Map<String, Object> result = object("session_id", sid, "observation", r.observation(), "reward", r.reward());
        result.putAll(object("terminated", r.terminated(), "truncated", r.truncated(), "info", info, "error", null));
        return result;
    }

    /** POST /v1/step or POST /v2/step: the items run side by side, each refusal in its own result. */
    private Map<String, Object> stepBatch(Map<String, Object> body, boolean multiAgent) {
        List<Future<Map<String, Object>>> running = new ArrayList<>();
        for (RequestBody.BatchItem item : RequestBody.batchItems(body, multiAgent)) {
            Callable<Map<String, Object>> one = multiAgent
                    ? () -> v2.stepOrRefusal(item.sessionId(), item.actions())
                    : () -> stepOrRefusal(item.sessionId(), item.action());
            running.add(batchSteps.submit(one));
        }
        List<Object> results = new ArrayList<>();
        for (Future<Map<String, Object>> f : running) results.add(await(f));
        return object("results", results);
    }

    private Map<String, Object> stepOrRefusal(String sid, String action) {
        try {
            return step(sid, action);
        } catch (Refusal r) {
            return failedStep(sid, r.type, r.getMessage());
        }
    }

    private static Map<String, Object> await(Future<Map<String, Object>> f) {
        try {
            return f.get();
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new IllegalStateException("interrupted while stepping a batch", e);
        } catch (ExecutionException e) {
            throw new IllegalStateException("a batch item failed", e.getCause());
        }
    }

    // -- helpers ----------------------------------------------------------------------------------

    private static Map<String, Object> failedStep(String sid, String type, String message) {
        Map<String, Object> result = object("session_id", sid, "observation", "", "reward", 0.0, "terminated", true);
        result.putAll(object("truncated", false, "info", Map.of(), "error", errorRecord(type, message)));
        return result;
    }

    private static Map<String, Object> errorBody(String type, String message) {
        return object("error", errorRecord(type, message));
    }

    static Map<String, Object> errorRecord(String type, String message) {
        return object("type", type, "message", message);
    }

    static String describe(Throwable t) {
        return t.getClass().getSimpleName() + (t.getMessage() == null ? "" : ": " + t.getMessage());
    }

    /** An ordered map from alternating keys and values. */
    static Map<String, Object> object(Object... keysAndValues) {
        Map<String, Object> map = new LinkedHashMap<>();
        for (int i = 0; i < keysAndValues.length; i += 2) map.put((String) keysAndValues[i], keysAndValues[i + 1]);
        return map;
    }

    private static ThreadFactory daemonThreads(String name) {
        AtomicInteger n = new AtomicInteger();
        return r -> {
            Thread t = new Thread(r, name + "-" + n.incrementAndGet());
            t.setDaemon(true);
            return t;
        };
    }
}
