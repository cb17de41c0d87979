"""Where envs run: a local pool, the env-step server, its protocol and remote client, and the backend a config opens."""
