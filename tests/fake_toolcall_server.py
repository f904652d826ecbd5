"""A fake vLLM chat server whose "model" calls tools correctly, plain and streamed.

It answers /v1/models and /v1/chat/completions in vLLM's shapes (OpenAI Chat Completions as vLLM implements them: tool call
ids `chatcmpl-tool-<hex>`, `arguments` a JSON string, streamed deltas one per chunk keyed by
`index`, name first then argument fragments, one finish_reason, a usage chunk, `[DONE]`).
Its answers are written here by hand from the prompts, not read from the smoke test's case file,
so a wrong expectation in the case file makes the "correct server passes" test fail.

`faults` breaks it the way real deployments break, for the tests of each check:
  no_tool_parser    400 with vLLM's message, as a server without --enable-auto-tool-choice
  leak_markup       auto calls come back as `<tool_call>{...}</tool_call>` text in content
  string_integer    duration_minutes sent as "45" (a string) instead of 45
  stream_diverges   the streamed arguments differ from the plain ones
  over_trigger      the joke prompt gets a web_search call
"""
from __future__ import annotations

import json
import uuid
from contextlib import contextmanager
from typing import Any, Iterator

from fake_http import serving

MODEL = "fake-toolcaller"
NO_PARSER_MESSAGE = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def _weather(city: str, state: str, unit: str = "fahrenheit") -> tuple[str, dict]:
    return "get_current_weather", {"city": city, "state": state, "unit": unit}


def decide(body: dict[str, Any], faults: set[str]) -> tuple[str, list[tuple[str, dict]]]:
    """What the correct model says: (content, [(tool name, arguments)])."""
    last = body["messages"][-1]
    choice = body.get("tool_choice", "auto")
    prompt = last.get("content") or ""
    if last["role"] == "tool":
        return "It is 98 degrees Fahrenheit in Dallas right now, partly cloudy.", []
    if choice == "none":
        return "I cannot look that up without a tool, but Dallas in summer is usually hot.", []
    if isinstance(choice, dict):
        if choice["function"]["name"] == "get_current_weather" and "Seattle" in prompt:
            return "", [_weather("Seattle", "WA")]
    if "Dallas" in prompt and "Orlando" in prompt:
        return "", [_weather("Dallas", "TX"), _weather("Orlando", "FL")]
    if "Dallas" in prompt:
        return "", [_weather("Dallas", "TX")]
    if "Search the web" in prompt:
        return "", [("web_search", {"search_term": "vLLM 0.11 release notes"})]
    if "joke" in prompt:
        if "over_trigger" in faults:
            return "", [("web_search", {"search_term": "a joke"})]
        return "Why did the GPU cross the road? To get to the other batch.", []
    if "Schedule" in prompt:
        minutes: Any = "45" if "string_integer" in faults else 45
        return "", [("create_event", {
            "title": 'Q3 "budget" review — ünïcödé', "start": "2025-03-14T15:00", "duration_minutes": minutes,
            "attendees": ["alice@example.com", "bob@example.com"], "priority": "high", "all_day": False,
            "location": {"name": "HQ", "lat": 37.77, "lon": -122.42}})]
    if "time is it on the server" in prompt:
        return "", [("get_server_time", {})]
    if "afternoon in Paris" in prompt:
        return "", [("get_current_weather", {"city": "Paris", "unit": "celsius"})]
    return "I do not know.", []


def finish_reason(body: dict[str, Any], calls: list) -> str:
    # vLLM PR #25054: named tool choice ends with "stop", auto/required calls with "tool_calls".
    if not calls or isinstance(body.get("tool_choice"), dict):
        return "stop"
    return "tool_calls"


def plain(body, content, calls, faults) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls and "leak_markup" in faults and body.get("tool_choice") == "auto":
        message["content"] = "".join(f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>"
                                     for n, a in calls)
        calls = []
    message["tool_calls"] = [{"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
                             for name, args in calls]
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(body, calls)}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70}}


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-stream", "object": "chat.completion.chunk", "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def streamed(body, content, calls, faults) -> list[dict[str, Any]]:
    chunks = [chunk({"role": "assistant", "content": ""})]
    for word in content.split(" ") if content else []:
        chunks.append(chunk({"content": word + " "}))
    for index, (name, args) in enumerate(calls):
        if "stream_diverges" in faults and "city" in args:
            args = {**args, "city": args["city"] + "ville"}
        chunks.append(chunk({"tool_calls": [{"index": index, "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
                                             "type": "function", "function": {"name": name}}]}))
        text = json.dumps(args, ensure_ascii=False)
        for start in range(0, len(text), 7):  # argument fragments cut anywhere, as parsers emit them
            chunks.append(chunk({"tool_calls": [{"index": index, "function": {"arguments": text[start:start + 7]}}]}))
    chunks.append(chunk({}, finish_reason(body, calls)))
    chunks.append({"id": "chatcmpl-stream", "object": "chat.completion.chunk", "model": MODEL, "choices": [],
                   "usage": {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70}})
    return chunks


def handler(faults: set[str]):
    def handle(method: str, path: str, body: Any) -> tuple[int, Any]:
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 4096}]}
        if path != "/v1/chat/completions":
            return 404, {"detail": "Not Found"}
        if "no_tool_parser" in faults and body.get("tools") and body.get("tool_choice") == "auto":
            return 400, {"error": {"message": NO_PARSER_MESSAGE, "type": "BadRequestError", "param": None, "code": 400}}
        content, calls = decide(body, faults)
        return 200, streamed(body, content, calls, faults) if body.get("stream") else plain(body, content, calls, faults)
    return handle


@contextmanager
def fake_toolcall_server(*faults: str) -> Iterator[str]:
    with serving(handler(set(faults))) as url:
        yield url
