package arealagents;

import java.util.HashMap;
import java.util.List;
import java.util.Map;

/** A single-agent {@link Env} seen as a {@link MultiAgentEnv} whose one agent is {@code "agent"}: how v2 serves it.
 * Its session also steps over v1 ({@link #stepOne}), and either way {@link #acting} knows when the episode ended. */
final class SingleAgent implements MultiAgentEnv {
    static final String AGENT = "agent";
    private static final List<String> AGENTS = List.of(AGENT);
    private final Env env;
    private boolean over;

    SingleAgent(Env env) {
        if (env == null) throw new IllegalStateException("the env factory returned null");
        this.env = env;
    }

    @Override
    public List<String> agents() {
        return AGENTS;
    }

    @Override
    public Reset reset(Long seed, Map<String, Object> options) {
        Env.Reset r = env.reset(seed, options);
        if (r == null || r.observation() == null) throw new IllegalStateException("reset returned no observation");
        over = false;
        return new Reset(Map.of(AGENT, r.observation()), one(r.info()));
    }

    @Override
    public List<String> acting() {
        return over ? List.of() : AGENTS;
    }

    /** One v1 step, checked: an observation and a finite reward. */
    Env.Step stepOne(String action) {
        Env.Step r = env.step(action);
        if (r == null || r.observation() == null) throw new IllegalStateException("step returned no observation");
        if (!Double.isFinite(r.reward())) throw new IllegalStateException("step returned reward " + r.reward());
        over = r.terminated() || r.truncated();
        return r;
    }

    @Override
    public Step step(Map<String, String> actions) {
        Env.Step r = stepOne(actions.get(AGENT));
        return new Step(Map.of(AGENT, r.observation()), Map.of(AGENT, r.reward()), Map.of(AGENT, r.terminated()),
                Map.of(AGENT, r.truncated()), one(r.info()));
    }

    @Override
    public void close() {
        env.close();
    }

    private static Map<String, Map<String, Object>> one(Map<String, Object> info) {
        Map<String, Map<String, Object>> infos = new HashMap<>();
        infos.put(AGENT, info); // may be null: the reply's info is then empty
        return infos;
    }
}
