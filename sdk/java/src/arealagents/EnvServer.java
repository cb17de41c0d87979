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
import java.util.UUID;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.Future;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ThreadFactory;
import java.util.concurrent.ThreadPoolExecutor;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * The env-step protocol v1 server (docs/env-protocol.md) for envs written in Java, on the JDK's HttpServer.
 *
 * <pre>
 *   EnvServer server = EnvServer.fromArgs(args);          // --port 8765 --max-sessions 4096 ...
 *   server.addEnv("java/GridPuzzle-v0", "a grid walk", GridPuzzle::new);
 *   server.start();                                       // serving envs on http://127.0.0.1:8765
 * </pre>
 *
 * <p>Each session is one {@link Env}; requests run on a pool of {@code --threads} threads, sessions independently.
 * A request holds its thread from its first byte, so the JDK's server closes a connection whose request has not
 * arrived within {@code --read-timeout} seconds (its {@code sun.net.httpserver.maxReqTime}). Not provided (the
 * Python server has them): step timeouts, process isolation, /metrics.
 */
public final class EnvServer {
    public static final String PROTOCOL = "v1";
    private static final Pattern SESSION_PATH = Pattern.compile("/v1/sessions/([^/]+)(/step)?");
    private static final String MAX_REQ_TIME = "sun.net.httpserver.maxReqTime";
    // The JDK reads its server settings once per JVM, when its first server starts: that start's read timeout.
    private static Integer jvmReadTimeoutS;

    private record Registered(String description, EnvFactory factory) {}

    private static final class Session {
        final Env env;
        final AtomicBoolean busy = new AtomicBoolean();
        final AtomicBoolean closed = new AtomicBoolean();
        volatile boolean done;
        volatile boolean removed;
        volatile long lastUsedNanos = System.nanoTime();

        Session(Env env) {
            this.env = env;
        }
    }

    private final ServerOptions opts;
    private volatile Map<String, Registered> envs = Map.of();
    private final Map<String, Session> sessions = new ConcurrentHashMap<>();
    private final AtomicInteger slots = new AtomicInteger(); // sessions open or being opened
    private HttpServer http;
    private ExecutorService handlers;
    private ExecutorService batchSteps;
    private ScheduledExecutorService reaper;

    public EnvServer(ServerOptions opts) {
        this.opts = opts;
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

    /** Serves envs made by {@code factory} under {@code id} (listed by GET /v1/envs with {@code description}). */
    public synchronized EnvServer addEnv(String id, String description, EnvFactory factory) {
        if (id == null || id.isEmpty()) throw new IllegalArgumentException("env id: expected a non-empty string");
        if (factory == null) throw new IllegalArgumentException("factory of " + id + ": expected a factory, got null");
        if (envs.containsKey(id)) throw new IllegalArgumentException("env id " + id + " is already served");
        Map<String, Registered> next = new LinkedHashMap<>(envs);
        next.put(id, new Registered(description == null ? "" : description, factory));
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
        reaper.scheduleWithFixedDelay(this::expireIdle, periodMs, periodMs, TimeUnit.MILLISECONDS);
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
        for (Session session : sessions.values()) {
            session.removed = true; // a step still running closes its env when it returns
            closeEnv(session);
        }
        sessions.clear();
        slots.set(0);
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
            case "/v1/step": allow(method, "POST"); return stepBatch(readBody(ex));
            default: break;
        }
        Matcher m = SESSION_PATH.matcher(path);
        if (!m.matches()) {
            throw new Refusal(404, "not_found", "no route " + path + "; the routes are GET /health, GET /v1/envs, "
                    + "POST /v1/sessions, POST /v1/sessions/{id}/step, DELETE /v1/sessions/{id}, POST /v1/step");
        }
        if (m.group(2) != null) {
            allow(method, "POST");
            return stepOne(m.group(1), readBody(ex));
        }
        allow(method, "DELETE");
        return close(m.group(1));
    }

    private static void allow(String method, String allowed) {
        if (!method.equals(allowed)) {
            throw new Refusal(405, "method_not_allowed", method + " is not allowed here; use " + allowed);
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
        return object("status", "ok", "protocol", PROTOCOL, "sessions_open", sessions.size(), "limits", limits);
    }

    private Map<String, Object> listEnvs() {
        List<Object> list = new ArrayList<>();
        envs.forEach((id, env) -> list.add(object("id", id, "description", env.description())));
        return object("envs", list);
    }

    private Map<String, Object> create(Map<String, Object> body) {
        RequestBody.onlyKeys(body, "body", "env_id", "kwargs", "seed", "options");
        String envId = RequestBody.requiredString(body, "env_id", "body");
        Map<String, Object> kwargs = RequestBody.optionalObject(body, "kwargs");
        Long seed = RequestBody.seed(body);
        Map<String, Object> options = RequestBody.optionalObject(body, "options");
        Registered env = envs.get(envId);
        if (env == null) {
            throw new Refusal(404, "unknown_env", "no env '" + envId + "' on this server; it serves "
                    + String.join(", ", envs.keySet()));
        }
        reserveSlot();
        boolean opened = false;
        try {
            Session session = new Session(env.factory().make(kwargs));
            Env.Reset reset;
            try {
                reset = reset(session.env, envId, seed, options);
            } catch (Throwable t) {
                closeEnv(session);
                throw t;
            }
            String sid = UUID.randomUUID().toString().replace("-", "");
            sessions.put(sid, session);
            opened = true;
            return object("session_id", sid, "observation", reset.observation(), "info", reset.info());
        } catch (IllegalArgumentException e) {
            throw Refusal.badRequest("cannot make " + envId + ": " + e.getMessage()
                    + "; check the kwargs, seed and options");
        } catch (Throwable t) {
            throw new Refusal(500, "env_error", "cannot make " + envId + ": " + describe(t));
        } finally {
            if (!opened) slots.decrementAndGet();
        }
    }

    /** Takes a session slot atomically (open + opening sessions never pass max_sessions), or refuses with 429. */
    private void reserveSlot() {
        int taken = slots.getAndUpdate(n -> n < opts.maxSessions ? n + 1 : n);
        if (taken >= opts.maxSessions) {
            throw new Refusal(429, "too_many_sessions", taken + " sessions are open or opening, the cap is "
                    + opts.maxSessions + "; close finished sessions or start the server with a larger --max-sessions");
        }
    }

    private static Env.Reset reset(Env env, String envId, Long seed, Map<String, Object> options) {
        Env.Reset reset = env.reset(seed, options);
        if (reset == null || reset.observation() == null) {
            throw new IllegalStateException(envId + ".reset returned no observation");
        }
        return new Env.Reset(reset.observation(), snapshot(reset.info(), "reset's info"));
    }

    private Map<String, Object> stepOne(String sid, Map<String, Object> body) {
        RequestBody.onlyKeys(body, "body", "action");
        return step(sid, RequestBody.requiredString(body, "action", "body"));
    }

    private Map<String, Object> step(String sid, String action) {
        Session session = sessions.get(sid);
        if (session == null) throw unknownSession(sid);
        int chars = action.codePointCount(0, action.length());
        if (chars > opts.maxActionChars) {
            throw new Refusal(400, "action_too_long", "action is " + chars + " characters; the limit is "
                    + opts.maxActionChars + " (--max-action-chars)");
        }
        if (session.done) {
            throw new Refusal(409, "episode_over", "the episode of session " + sid
                    + " has ended; close it or create a new one");
        }
        if (!session.busy.compareAndSet(false, true)) {
            if (sessions.get(sid) != session) throw unknownSession(sid); // expired while we looked
            throw new Refusal(409, "session_busy", "session " + sid + " is already running a step");
        }
        try {
            if (sessions.get(sid) != session) throw unknownSession(sid);
            return runStep(sid, session, action);
        } finally {
            session.busy.set(false);
            if (session.removed) closeEnv(session); // closed while this step ran: its env ends now
        }
    }

    /** One env step; an env that throws (or returns something unusable) ends its own session with an error. */
    private Map<String, Object> runStep(String sid, Session session, String action) {
        Env.Step r;
        Map<String, Object> info;
        try {
            r = session.env.step(action);
            if (r == null || r.observation() == null) throw new IllegalStateException("step returned no observation");
            if (!Double.isFinite(r.reward())) throw new IllegalStateException("step returned reward " + r.reward());
            info = snapshot(r.info(), "step's info");
        } catch (Throwable t) {
            if (sessions.remove(sid, session)) release(session);
            return failedStep(sid, "env_error", "step failed: " + describe(t) + "; the session is closed");
        }
        session.lastUsedNanos = System.nanoTime();
        if (r.terminated() || r.truncated()) session.done = true;
        Map<String, Object> result = object("session_id", sid, "observation", r.observation(), "reward", r.reward());
        result.putAll(object("terminated", r.terminated(), "truncated", r.truncated(), "info", info, "error", null));
        return result;
    }

    private Map<String, Object> stepBatch(Map<String, Object> body) {
        List<Future<Map<String, Object>>> running = new ArrayList<>();
        for (RequestBody.BatchItem item : RequestBody.batchItems(body)) {
            running.add(batchSteps.submit(() -> stepOrRefusal(item.sessionId(), item.action())));
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

    private Map<String, Object> close(String sid) {
        Session session = sessions.remove(sid);
        if (session == null) throw unknownSession(sid);
        release(session);
        return object("session_id", sid, "closed", true);
    }

    /** Frees a removed session's place; its env is closed now, or by the step still running on it. */
    private void release(Session session) {
        slots.decrementAndGet();
        session.removed = true;
        closeEnv(session);
    }

    /** Env.close, once, and only when no step is running (a busy session is closed by its step's end). */
    private static void closeEnv(Session session) {
        if (!session.busy.compareAndSet(false, true)) return;
        if (session.closed.compareAndSet(false, true)) {
            try {
                session.env.close();
            } catch (Throwable t) {
                System.err.println("env close failed: " + describe(t));
            }
        }
    }

    /** Closes sessions with no step for idle_timeout_s; a session in the middle of a step is left alone. */
    private void expireIdle() {
        long cutoff = System.nanoTime() - (long) (opts.idleTimeoutS * 1e9);
        for (Map.Entry<String, Session> e : sessions.entrySet()) {
            Session s = e.getValue();
            if (s.lastUsedNanos - cutoff < 0 && s.busy.compareAndSet(false, true)) {
                try {
                    if (sessions.remove(e.getKey(), s)) release(s);
                } finally {
                    s.busy.set(false);
                }
                if (s.removed) closeEnv(s);
            }
        }
    }

    // -- helpers ----------------------------------------------------------------------------------

    private static Refusal unknownSession(String sid) {
        return new Refusal(404, "unknown_session", "no open session '" + sid + "' (closed, expired, failed or "
                + "never created); create one with POST /v1/sessions");
    }

    /** A JSON copy of an env's info map (null: empty), so the reply never depends on what the env does next. */
    @SuppressWarnings("unchecked")
    private static Map<String, Object> snapshot(Map<String, Object> info, String what) {
        if (info == null) return new LinkedHashMap<>();
        try {
            return (Map<String, Object>) Json.parse(Json.write(info));
        } catch (IllegalArgumentException e) {
            throw new IllegalStateException(what + " is not JSON: " + e.getMessage());
        }
    }

    private static Map<String, Object> failedStep(String sid, String type, String message) {
        Map<String, Object> result = object("session_id", sid, "observation", "", "reward", 0.0, "terminated", true);
        result.putAll(object("truncated", false, "info", Map.of(), "error", errorRecord(type, message)));
        return result;
    }

    private static Map<String, Object> errorBody(String type, String message) {
        return object("error", errorRecord(type, message));
    }

    private static Map<String, Object> errorRecord(String type, String message) {
        return object("type", type, "message", message);
    }

    private static String describe(Throwable t) {
        return t.getClass().getSimpleName() + (t.getMessage() == null ? "" : ": " + t.getMessage());
    }

    /** An ordered map from alternating keys and values. */
    private static Map<String, Object> object(Object... keysAndValues) {
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
