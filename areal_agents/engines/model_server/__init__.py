"""`areal-agents serve-model`: `HFEngine` behind SGLang's native HTTP API, a CPU drop-in for sglang.launch_server.

    areal-agents serve-model --model-path runs/tiny --port 30000      # like python -m sglang.launch_server

Endpoints (SGLang 0.5.x shapes, see docs/serve-model.md): /generate, /pause_generation,
/continue_generation, /abort_request, /update_weights_from_disk, /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group (over gloo), /load_lora_adapter and
/unload_lora_adapter (LoRA adapters beside the model; /generate's ``lora_path`` names one),
/update_weight_version, /get_model_info (and /model_info), /get_weight_version (and /weight_version), /health,
/health_generate, /flush_cache, /get_server_info; and OpenAI's /v1/chat/completions, /v1/completions and
/v1/models as vLLM and SGLang serve them: messages and tools through the tokenizer's chat template
(``chat_template_kwargs`` per request), ``reasoning_content`` and ``tool_calls`` in replies from the template's
parsers (``--tool-parser`` / ``--reasoning-parser`` override them), logprobs, n and stop strings.

A request the model cannot take (a token id outside the vocabulary, a prompt past its context) is a 400
naming the field, and ``max_new_tokens`` is capped at the context left; an error inside one request fails
that request (500) and the others go on. If the engine's decode loop itself fails, /health and
/health_generate answer 503 (the launcher restarts the server). SIGTERM stops the server within
`EXIT_DEADLINE_S` seconds, whatever its decode thread is doing.

Clients are not trusted (docs/serve-model.md, "Security and limits"): ``--admin-key`` guards the control routes,
bodies, samples per request and adapters are capped, and a client that disconnects has its requests aborted.

Modules: ``server`` (the config and the app's state: engine, tokenizer, weight version names),
``guard`` (admin key, body caps, JSON checks, abort on disconnect), ``adapters`` (an adapter's checks before
loading), ``broadcast`` (the broadcast weight update's receiving side),
``routes`` (the FastAPI app, route group by route group), ``openai_routes`` (the /v1 routes),
``openai_shapes`` (the OpenAI message and reply shapes, shared with the capture proxy),
``process`` (load the model and run uvicorn).
"""

from areal_agents.engines.model_server.process import EXIT_DEADLINE_S, SHUTDOWN_GRACE_S, serve_model
from areal_agents.engines.model_server.routes import CLOSE_TIMEOUT_S, build_app
from areal_agents.engines.model_server.server import ModelServer, ModelServerConfig

__all__ = [
    "CLOSE_TIMEOUT_S",
    "EXIT_DEADLINE_S",
    "SHUTDOWN_GRACE_S",
    "ModelServer",
    "ModelServerConfig",
    "build_app",
    "serve_model",
]
