"""A tiny RL config for the trainer tests: 1-digit arithmetic, 2 steps of 4 groups of 4."""


def write_rl_config(tmp_path, tiny_dir):
    rl = tmp_path / "rl.yaml"
    rl.write_text(
        f"run_dir: {tmp_path / 'rl'}\nsteps: 2\nmodel: {{path: {tiny_dir}}}\n"
        "rollout: {batch_size: 4, group_size: 4, max_new_tokens: 4}\n"
        "ppo: {filter_zero_variance_groups: false}\n"
        "env: {id: areal_agents/Arithmetic-v0, kwargs: {digits: 1, max_turns: 2}}\n"
        "eval: {num_problems: 8, env_kwargs: {split: test}}\n"
    )
    return rl
