"""The vLLM side: `VLLMEngine` (the client of a vLLM server's token and RL routes) and how to start one."""
