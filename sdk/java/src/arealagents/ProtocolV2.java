package arealagents;

import java.net.URLDecoder;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.function.Function;

/**
 * The /v2 routes of {@link EnvServer}: sessions of several agents (docs/env-protocol.md, protocol v2). Every env is
 * served here, a single-agent one as the one agent {@code "agent"}; a step takes one action per acting agent and
 * answers per-agent results and who acts next. A refusal changes nothing (the session steps on as before).
 */
final class ProtocolV2 {
    /** An env id the server serves: how to make one, and whether it has several agents. */
    record Served(boolean multiAgent, Function<Map<String, Object>, MultiAgentEnv> make) {}

    private final ServerOptions opts;
    private final SessionTable table;

    ProtocolV2(ServerOptions opts, SessionTable table) {
        this.opts = opts;
        this.table = table;
    }

    /** POST /v2/sessions. */
    Map<String, Object> create(Map<String, Object> body, Function<String, Served> lookup) {
        RequestBody.Create c = RequestBody.Create.of(body);
        Served env = lookup.apply(c.envId());
        SessionTable.Opened s = table.open(c.envId(), env.make(), c.kwargs(), c.seed(), c.options(), c.owner());
        return EnvServer.object("session_id", s.sessionId(), "multi_agent", env.multiAgent(), "agents",
                s.session().agents, "acting", s.session().acting, "observations", s.observations(), "infos",
                s.infos());
    }

    /** POST /v2/sessions/{id}/step. */
    Map<String, Object> stepOne(String sid, Map<String, Object> body) {
        RequestBody.onlyKeys(body, "body", "actions");
        return step(sid, RequestBody.actions(body, "body"));
    }

    /** One item of POST /v2/step: its result, or its refusal as a result with {@code error} set. */
    Map<String, Object> stepOrRefusal(String sid, Map<String, String> actions) {
        try {
            return step(sid, actions);
        } catch (Refusal r) {
            return failed(sid, r.type, r.getMessage());
        }
    }

    private Map<String, Object> step(String sid, Map<String, String> actions) {
        return table.step(sid, s -> checkLengths(actions), s -> run(sid, s, actions));
    }

    private void checkLengths(Map<String, String> actions) {
        actions.forEach((agent, action) -> {
            int chars = action.codePointCount(0, action.length());
            if (chars > opts.maxActionChars) {
                throw new Refusal(400, "action_too_long", "the action of " + agent + " is " + chars
                        + " characters; the limit is " + opts.maxActionChars + " (--max-action-chars)");
            }
        });
    }

    /** The step of a held session: the actions' keys must be the acting agents; an env that fails ends it. */
    private Map<String, Object> run(String sid, SessionTable.Session s, Map<String, String> actions) {
        List<String> missing = new ArrayList<>(s.acting), unexpected = new ArrayList<>(actions.keySet());
        missing.removeAll(actions.keySet());
        unexpected.removeAll(s.acting);
        if (!missing.isEmpty() || !unexpected.isEmpty()) {
            throw Refusal.badRequest("body.actions: expected one action for each acting agent " + s.acting
                    + "; missing " + missing + ", unexpected " + unexpected);
        }
        Map<String, Object> result;
        List<String> acting;
        try {
            MultiAgentEnv.Step r = s.env.step(actions);
            if (r == null) throw new IllegalStateException("step returned null");
            acting = EnvReplies.acting(s.env, s.agents);
            result = EnvServer.object("session_id", sid,
                    "observations", EnvReplies.observations(r.observations(), s.agents, acting, "step"),
                    "rewards", EnvReplies.rewards(r.rewards(), s.agents, actions.keySet()),
                    "terminations", EnvReplies.flags(r.terminations(), s.agents, actions.keySet(), "termination"),
                    "truncations", EnvReplies.flags(r.truncations(), s.agents, actions.keySet(), "truncation"));
            result.put("infos", EnvReplies.infos(r.infos(), s.agents, actions.keySet(), "step"));
        } catch (Throwable t) {
            table.fail(sid, s);
            return failed(sid, "env_error", "step failed: " + EnvServer.describe(t) + "; the session is closed");
        }
        s.acting = acting;
        if (acting.isEmpty()) s.done = true;
        result.put("acting", acting);
        result.put("error", null);
        return result;
    }

    /** DELETE /v2/sessions?owner=NAME: closes every open session that NAME created. */
    Map<String, Object> closeOwned(String rawQuery) {
        String owner = null;
        for (String pair : rawQuery == null ? new String[0] : rawQuery.split("&")) {
            int eq = pair.indexOf('=');
            String key = eq < 0 ? pair : pair.substring(0, eq);
            if (!key.equals("owner")) {
                throw Refusal.badRequest("query." + key + ": unknown parameter; DELETE /v2/sessions takes owner");
            }
            if (owner != null) throw Refusal.badRequest("query.owner: given twice");
            owner = decode(eq < 0 ? "" : pair.substring(eq + 1));
        }
        if (owner == null) {
            throw Refusal.badRequest("query.owner: required (DELETE /v2/sessions?owner=NAME closes NAME's sessions; "
                    + "DELETE /v2/sessions/{id} closes one)");
        }
        owner = RequestBody.owner(owner, "query.owner");
        return EnvServer.object("owner", owner, "closed", table.closeOwned(owner));
    }

    private static String decode(String value) {
        try {
            return URLDecoder.decode(value, StandardCharsets.UTF_8);
        } catch (IllegalArgumentException e) {
            throw Refusal.badRequest("query.owner: bad percent-encoding");
        }
    }

    /** A MultiStepResult for a step that did not happen normally (the session is gone, or it was refused). */
    static Map<String, Object> failed(String sid, String type, String message) {
        Map<String, Object> result = EnvServer.object("session_id", sid, "observations", Map.of(), "rewards",
                Map.of(), "terminations", Map.of(), "truncations", Map.of(), "infos", Map.of());
        result.putAll(EnvServer.object("acting", List.of(), "error", EnvServer.errorRecord(type, message)));
        return result;
    }
}
