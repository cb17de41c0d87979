package arealagents;

import java.util.List;
import java.util.Map;
import java.util.UUID;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.function.Consumer;
import java.util.function.Function;

/**
 * The open sessions of an {@link EnvServer}, whichever protocol opened them: each is one {@link MultiAgentEnv} (a
 * single-agent env wrapped as {@link SingleAgent}), stepped by one request at a time, closed once (by its client,
 * by owner, when its env fails, when idle, or when the server stops), and never closed during a step.
 */
final class SessionTable {
    static final class Session {
        final MultiAgentEnv env;
        final SingleAgent single; // the env as v1 steps it; null for a multi-agent env
        final String owner; // null when the client named none
        List<String> agents = List.of();
        volatile List<String> acting = List.of();
        final AtomicBoolean busy = new AtomicBoolean();
        final AtomicBoolean closed = new AtomicBoolean();
        volatile boolean done;
        volatile boolean removed;
        volatile long lastUsedNanos = System.nanoTime();

        Session(MultiAgentEnv env, String owner) {
            this.env = env;
            this.single = env instanceof SingleAgent s ? s : null;
            this.owner = owner;
        }
    }

    /** A session just opened, with what its reset returned (checked). */
    record Opened(String sessionId, Session session, Map<String, Object> observations, Map<String, Object> infos) {}

    private final ServerOptions opts;
    private final Map<String, Session> sessions = new ConcurrentHashMap<>();
    private final AtomicInteger slots = new AtomicInteger(); // sessions open or being opened

    SessionTable(ServerOptions opts) {
        this.opts = opts;
    }

    int size() {
        return sessions.size();
    }

    /**
     * Makes and resets an env of {@code envId} in a new session. An IllegalArgumentException of the env is a 400
     * {@code bad_request}, anything else a 500 {@code env_error}; past the session cap, a 429.
     */
    Opened open(String envId, Function<Map<String, Object>, MultiAgentEnv> factory, Map<String, Object> kwargs,
                Long seed, Map<String, Object> options, String owner) {
        reserveSlot();
        boolean opened = false;
        try {
            MultiAgentEnv env = factory.apply(kwargs);
            if (env == null) throw new IllegalStateException("the env factory returned null");
            Session session = new Session(env, owner);
            Map<String, Object> observations, infos;
            try {
                session.agents = EnvReplies.agents(env);
                MultiAgentEnv.Reset reset = env.reset(seed, options);
                if (reset == null) throw new IllegalStateException("reset returned null");
                session.acting = EnvReplies.acting(env, session.agents);
                if (session.acting.isEmpty()) throw new IllegalStateException("acting() is empty after reset");
                observations = EnvReplies.observations(reset.observations(), session.agents, session.acting, "reset");
                infos = EnvReplies.infos(reset.infos(), session.agents, observations.keySet(), "reset");
            } catch (Throwable t) {
                closeEnv(session);
                throw t;
            }
            String sid = UUID.randomUUID().toString().replace("-", "");
            sessions.put(sid, session);
            opened = true;
            return new Opened(sid, session, observations, infos);
        } catch (IllegalArgumentException e) {
            throw Refusal.badRequest("cannot make " + envId + ": " + e.getMessage()
                    + "; check the kwargs, seed and options");
        } catch (Throwable t) {
            throw new Refusal(500, "env_error", "cannot make " + envId + ": " + EnvServer.describe(t));
        } finally {
            if (!opened) slots.decrementAndGet();
        }
    }

    /** " (agents [...])" of an env made with {@code kwargs} and closed at once, in a session slot (so refused
     * creations cost no more than sessions); nothing when it cannot be made or no slot is free. */
    String agentsOf(Function<Map<String, Object>, MultiAgentEnv> factory, Map<String, Object> kwargs) {
        try {
            reserveSlot();
        } catch (Refusal full) {
            return "";
        }
        try {
            MultiAgentEnv env = factory.apply(kwargs);
            try {
                return " (agents " + EnvReplies.agents(env) + ")";
            } finally {
                env.close();
            }
        } catch (Throwable t) {
            return "";
        } finally {
            slots.decrementAndGet();
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

    /**
     * Runs {@code step} on session {@code sid} while it holds the session, after the protocol's checks in its order:
     * unknown (404), {@code check} (the actions' lengths: 400), ended (409 episode_over), busy (409 session_busy).
     */
    <T> T step(String sid, Consumer<Session> check, Function<Session, T> step) {
        Session session = sessions.get(sid);
        if (session == null) throw unknownSession(sid);
        check.accept(session);
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
            T result = step.apply(session);
            session.lastUsedNanos = System.nanoTime();
            return result;
        } finally {
            session.busy.set(false);
            if (session.removed) closeEnv(session); // closed while this step ran: its env ends now
        }
    }

    /** Ends a session whose env failed in a step (called while the step holds it). */
    void fail(String sid, Session session) {
        if (sessions.remove(sid, session)) release(session);
    }

    void close(String sid) {
        Session session = sessions.remove(sid);
        if (session == null) throw unknownSession(sid);
        release(session);
    }

    /** Closes every open session created with {@code owner}; how many. */
    int closeOwned(String owner) {
        int closed = 0;
        for (Map.Entry<String, Session> e : sessions.entrySet()) {
            if (owner.equals(e.getValue().owner) && sessions.remove(e.getKey(), e.getValue())) {
                release(e.getValue());
                closed++;
            }
        }
        return closed;
    }

    /** Closes sessions with no step for idle_timeout_s; a session in the middle of a step is left alone. */
    void expireIdle() {
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

    /** The server stops: every env is closed (a busy one's when its running step returns). */
    void closeAll() {
        for (Session session : sessions.values()) {
            session.removed = true; // a step still running closes its env when it returns
            closeEnv(session);
        }
        sessions.clear();
        slots.set(0);
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
                System.err.println("env close failed: " + EnvServer.describe(t));
            }
        }
    }

    static Refusal unknownSession(String sid) {
        return new Refusal(404, "unknown_session", "no open session '" + sid + "' (closed, expired, failed or "
                + "never created); create one with POST /v1/sessions or POST /v2/sessions");
    }
}
