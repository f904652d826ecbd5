"""The APIs bench loads: their paths and request bodies, and whether they stream generated text.

Generating APIs stream tokens (TTFT, TPOT, ITL); pooling APIs (embeddings, score) answer once, so a
request's figure is its latency, from sending to the answer's last byte. The formats, as vLLM 0.32.0
serves them (github.com/vllm-project/vllm, tag v0.32.0):
  completions, chat  OpenAI streams: `data:` chunks, usage in every chunk with
                     stream_options.continuous_usage_stats, then `data: [DONE]`
  responses          OpenAI Responses API, POST /v1/responses
                     (vllm/entrypoints/openai/responses/api_router.py, streaming_events.py, serving.py):
                     `event: response.output_text.delta` (text in "delta"; reasoning in
                     response.reasoning_text.delta), ends with `response.completed`, whose
                     response.usage has input_tokens, output_tokens and input_tokens_details.cached_tokens;
                     no usage before it. `ignore_eos` is a vLLM extension of its request.
  messages           Anthropic Messages API, POST /v1/messages (vllm/entrypoints/anthropic/serving.py):
                     `message_start` (message.usage), `content_block_delta` (delta.type text_delta,
                     thinking_delta or input_json_delta), `message_delta` (delta.stop_reason, usage with
                     output_tokens), `message_stop`; usage.input_tokens excludes cache_read_input_tokens
                     and cache_creation_input_tokens. Its request has no ignore_eos: outputs may stop early.
  embeddings         POST /v1/embeddings, {"input": text}: data[].embedding, usage.prompt_tokens
                     (vllm/entrypoints/pooling/embed/protocol.py)
  score              POST /score, {"text_1": query, "text_2": [documents]}: data[].score, one per pair,
                     usage.prompt_tokens (vllm/entrypoints/pooling/scoring/api_router.py, protocol.py);
                     vLLM also serves it at /v1/score, logging a warning per request
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Api:
    name: str
    path: str
    generates: bool      # streams generated tokens (TTFT, TPOT); else one answer per request (its latency)
    chat_template: bool  # the server puts the prompt in the chat template (its length counts it)
    end_event: str       # what ends a complete stream


APIS = {api.name: api for api in (
    Api("completions", "/v1/completions", True, False, "[DONE]"),
    Api("chat", "/v1/chat/completions", True, True, "[DONE]"),
    Api("responses", "/v1/responses", True, True, "response.completed"),
    Api("messages", "/v1/messages", True, True, "message_stop"),
    Api("embeddings", "/v1/embeddings", False, False, ""),
    Api("score", "/score", False, False, ""),
)}


STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


def body(api: str, model: str, prompt: str | None, messages: list[dict[str, str]] | None, output_tokens: int,
         documents: Sequence[str] = ()) -> dict[str, Any]:
    """One request's body: greedy, of an exact length where the API allows it (ignore_eos), streamed
    with usage; a pooling request carries the text (and, for score, the documents it is paired with)."""
    text = prompt if prompt is not None else "\n\n".join(m["content"] for m in messages or [])
    chat = messages if messages is not None else [{"role": "user", "content": text}]
    if api == "embeddings":
        return {"model": model, "input": text, "encoding_format": "float"}
    if api == "score":
        return {"model": model, "text_1": text, "text_2": list(documents)}
    if api in ("responses", "messages"):
        chat = [as_user_if_tool(m) for m in chat]
    if api == "responses":
        return {"model": model, "input": chat if messages is not None else text, "max_output_tokens": output_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "store": False}
    if api == "messages":  # the system prompt is a field of its own; the turns are user and assistant
        system = "\n\n".join(m["content"] for m in chat if m["role"] == "system")
        turns = [m for m in chat if m["role"] != "system"]
        return {"model": model, "max_tokens": output_tokens, "temperature": 0, "stream": True, "messages": turns,
                **({"system": system} if system else {})}
    generation = {"model": model, "max_tokens": output_tokens, "temperature": 0, "ignore_eos": True,
                  "stream": True, "stream_options": STREAM_OPTIONS}
    return {**generation, "messages": chat} if api == "chat" else {**generation, "prompt": text}


def as_user_if_tool(message: dict[str, str]) -> dict[str, str]:
    """A session's tool result as these APIs take plain text: a user message. Their own tool-result
    items (Messages: a tool_result block; Responses: function_call_output) answer a tool call the
    model made, which bench's forced-length answers never contain."""
    return {**message, "role": "user"} if message["role"] == "tool" else message
