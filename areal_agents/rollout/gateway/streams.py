"""``stream: true`` on the gateway's three APIs: the whole reply, once generated, sent as the API's server-sent
events (a client that streams reads the same text, tool calls and usage; the capture is the same). Token-by-token
deltas would change nothing that is trained, and every streaming client accepts a reply in one delta.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any


def _sse(data: dict[str, Any], event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n"


def chat_events(reply: dict[str, Any], include_usage: bool = False) -> Iterator[str]:
    """``chat.completion.chunk`` frames: each choice's message as one delta, then its finish reason; the usage
    chunk when the request's ``stream_options.include_usage`` asks for it; ``[DONE]``."""
    head = {k: reply[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    for choice in reply["choices"]:
        message = choice["message"]
        delta = {"role": "assistant", "content": message.get("content")}
        if message.get("reasoning_content"):
            delta["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [call | {"index": k} for k, call in enumerate(message["tool_calls"])]
        first = {"index": choice["index"], "delta": delta, "logprobs": choice.get("logprobs"), "finish_reason": None}
        yield _sse(head | {"choices": [first]})
        last = {"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}
        yield _sse(head | {"choices": [last]})
    if include_usage:
        yield _sse(head | {"choices": [], "usage": reply["usage"]})
    yield "data: [DONE]\n\n"


def message_events(message: dict[str, Any]) -> Iterator[str]:
    """Anthropic's event sequence: message_start, each content block's start, one delta and stop, then
    message_delta (stop reason, output tokens) and message_stop."""
    start = message | {"content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = message["usage"] | {"output_tokens": 0}
    yield _sse({"type": "message_start", "message": start}, "message_start")
    for index, block in enumerate(message["content"]):
        empty, delta = _block_delta(block)
        yield _sse({"type": "content_block_start", "index": index, "content_block": empty}, "content_block_start")
        yield _sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
        if block["type"] == "thinking":
            signature = {"type": "signature_delta", "signature": block.get("signature", "")}
            yield _sse({"type": "content_block_delta", "index": index, "delta": signature}, "content_block_delta")
        yield _sse({"type": "content_block_stop", "index": index}, "content_block_stop")
    stop = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    usage = {"output_tokens": message["usage"]["output_tokens"]}
    yield _sse({"type": "message_delta", "delta": stop, "usage": usage}, "message_delta")
    yield _sse({"type": "message_stop"}, "message_stop")


def _block_delta(block: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A content block as it starts (empty) and its one delta."""
    if block["type"] == "text":
        return {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    if block["type"] == "thinking":
        delta = {"type": "thinking_delta", "thinking": block["thinking"]}
        return {"type": "thinking", "thinking": "", "signature": ""}, delta
    empty = {k: block[k] for k in ("type", "id", "name")} | {"input": {}}
    return empty, {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}


def response_events(response: dict[str, Any]) -> Iterator[str]:
    """The Responses API's events: created, each output item added, its text or arguments as one delta and done,
    the item done, then completed (or incomplete) with the whole response."""
    seq = itertools.count()
    pending = response | {"status": "in_progress", "output": [], "usage": None, "incomplete_details": None}

    def event(kind: str, **fields: Any) -> str:
        return _sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    for index, item in enumerate(response["output"]):
        yield event("response.output_item.added", output_index=index, item=_item_start(item))
        yield from _item_events(item, index, event)
        yield event("response.output_item.done", output_index=index, item=item)
    done = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield event(done, response=response)


def _item_start(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "message":
        return item | {"content": [], "status": "in_progress"}
    if item["type"] == "function_call":
        return item | {"arguments": "", "status": "in_progress"}
    return item | {"summary": []}


def _item_events(item: dict[str, Any], index: int, event: Any) -> Iterator[str]:
    at = {"item_id": item["id"], "output_index": index}
    if item["type"] == "function_call":
        yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
        yield event("response.function_call_arguments.done", **at, arguments=item["arguments"])
        return
    parts = item["content"] if item["type"] == "message" else item["summary"]
    for k, part in enumerate(parts):
        if item["type"] == "message":
            empty = part | {"text": ""}
            yield event("response.content_part.added", **at, content_index=k, part=empty)
            yield event("response.output_text.delta", **at, content_index=k, delta=part["text"], logprobs=[])
            yield event("response.output_text.done", **at, content_index=k, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **at, content_index=k, part=part)
        else:
            yield event("response.reasoning_summary_part.added", **at, summary_index=k, part=part | {"text": ""})
            yield event("response.reasoning_summary_text.delta", **at, summary_index=k, delta=part["text"])
            yield event("response.reasoning_summary_text.done", **at, summary_index=k, text=part["text"])
            yield event("response.reasoning_summary_part.done", **at, summary_index=k, part=part)
