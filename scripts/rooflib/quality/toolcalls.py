"""The tool-call smoke test: its case catalog (scripts/rooflib/catalog/toolcall_cases.yaml, plus a folder of
the user's own), the requests, plain and streamed answers, the checks against each case and the
verdict. smoke_toolcall.py is its command line; accept.py uses it.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from rooflib.core import fileio, http_client, printing
from rooflib.core.errors import ServerError, UsageError

PASS, WARN, FAIL, SKIP, ERROR = "PASS", "WARN", "FAIL", "SKIP", "ERROR"
SEVERITY = {PASS: 0, SKIP: 0, WARN: 1, FAIL: 2, ERROR: 2}


PASS_SHARE = 0.8  # a case passes when at least this share of its repeats pass (one flaky repeat in 5 is tolerated)


# vLLM 0.32.0 vllm/renderers/online_renderer.py: the 400 answers when no tool parser is configured:
#   '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
#   'tool_choice="required" requires --tool-call-parser to be set' (the same for a named tool)
NO_TOOL_PARSER = re.compile(r"requires --enable-auto-tool-choice|requires --tool-call-parser")


CONFIG_HINT = ("restart the server with tool calling: vLLM --enable-auto-tool-choice --tool-call-parser "
               "<parser> (hermes for Qwen2.5/Qwen3, llama3_json for Llama 3.x, mistral, ...), SGLang "
               "--tool-call-parser <parser> (qwen25, llama3, ...); in a Roofline profile set tool_call_parser")


LONG_FILLER = ("This is background material for the conversation. It describes nothing in particular "
               "and asks for nothing; read it and carry on. ")


class ConfigError(UsageError):
    """The server is not set up for tool calling (exit 2)."""


_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
    or (isinstance(v, float) and v.is_integer()),
}


def schema_errors(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """Violations of a JSON Schema, for the keywords tool definitions use.

    type (one or a list), enum, const, properties, required, additionalProperties (bool or
    schema), items, minItems/maxItems, minLength/maxLength, pattern, minimum/maximum and the
    exclusive forms, anyOf/oneOf/allOf. Annotations (description, title, default, format) are
    not checked, as in a validator with format checking off.
    """
    errors: list[str] = []
    types = schema.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        if not any(_TYPES.get(name, lambda v: True)(value) for name in names):
            return [f"{path}: expected {' or '.join(names)}, got {json_type(value)} {short(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {short(value)} is not one of {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: {short(value)} is not {schema['const']!r}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"{path}: missing required {name!r}")
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            if name in properties:
                errors += schema_errors(item, properties[name], f"{path}.{name}")
            elif extra is False:
                errors.append(f"{path}: unexpected property {name!r}")
            elif isinstance(extra, dict):
                errors += schema_errors(item, extra, f"{path}.{name}")
    if isinstance(value, list):
        if "items" in schema and isinstance(schema["items"], dict):
            for index, item in enumerate(value):
                errors += schema_errors(item, schema["items"], f"{path}[{index}]")
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} items")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: shorter than {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']} characters")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {short(value)} does not match {schema['pattern']!r}")
    if _TYPES["number"](value):
        bounds = [("minimum", lambda v, b: v >= b), ("maximum", lambda v, b: v <= b),
                  ("exclusiveMinimum", lambda v, b: v > b), ("exclusiveMaximum", lambda v, b: v < b)]
        for keyword, holds in bounds:
            if keyword in schema and not holds(value, schema[keyword]):
                errors.append(f"{path}: {value} violates {keyword} {schema[keyword]}")
    for sub in schema.get("allOf", []):
        errors += schema_errors(value, sub, path)
    if "anyOf" in schema and all(schema_errors(value, sub, path) for sub in schema["anyOf"]):
        errors.append(f"{path}: matches none of anyOf")
    if "oneOf" in schema and sum(not schema_errors(value, sub, path) for sub in schema["oneOf"]) != 1:
        errors.append(f"{path}: does not match exactly one of oneOf")
    return errors


def json_type(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _TYPES[name](value) and not (name == "integer" and isinstance(value, float)):
            return name
    return type(value).__name__


def short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def standardize(text: str) -> str:
    """BFCL ast_checker standardize_string: case, spaces and ,./-_*^ do not count; ' is "."""
    return re.sub(r"[ ,./\-_*^]", "", text).lower().replace("'", '"')


def value_matches(actual: Any, expected: Any) -> bool:
    if isinstance(expected, str):
        return isinstance(actual, str) and standardize(actual) == standardize(expected)
    if isinstance(expected, bool) or expected is None:
        return actual is expected
    if isinstance(expected, (int, float)):
        return _TYPES["number"](actual) and math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(expected, list):
        return isinstance(actual, list) and len(actual) == len(expected) and \
            all(value_matches(a, e) for a, e in zip(actual, expected))
    if isinstance(expected, dict):
        return isinstance(actual, dict) and actual.keys() == expected.keys() and \
            all(value_matches(actual[k], expected[k]) for k in expected)
    return actual == expected


def args_mismatches(args: dict[str, Any], expected: dict[str, list[Any]]) -> list[str]:
    """Which expected parameters have a value outside their allowed values."""
    problems = []
    if expected == {} and args != {}:
        return [f"expected no arguments, got {short(args)}"]
    for name, allowed in expected.items():
        if name not in args:
            problems.append(f"{name} missing")
        elif not any(value_matches(args[name], option) for option in allowed):
            problems.append(f"{name}={short(args[name])}, expected {short(allowed[0])}")
    return problems


@dataclass
class Check:
    status: str
    reason: str


@dataclass
class Answer:
    """One assistant answer, plain or reassembled from a stream."""
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {id, name, arguments}
    finish_reasons: list[str] = field(default_factory=list)
    stream_problems: list[Check] = field(default_factory=list)


def tool_definition(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": spec["description"],
                                              "parameters": spec["parameters"]}}


def chat_message(message: dict[str, Any]) -> dict[str, Any]:
    """Case messages write assistant tool calls compactly; the API wants them in OpenAI form."""
    if "tool_calls" not in message:
        return dict(message)
    calls = [{"id": call["id"], "type": "function",
              "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
             for call in message["tool_calls"]]
    return {"role": message["role"], "content": message.get("content"), "tool_calls": calls}


def build_request(case: dict[str, Any], tools: dict[str, Any], model: str, max_tokens: int,
                  stream: bool, long_words: int = 0) -> dict[str, Any]:
    messages = [chat_message(m) for m in case["messages"]]
    if case.get("long_context"):
        filler = LONG_FILLER * max(1, long_words // len(LONG_FILLER.split()))
        messages.insert(0, {"role": "system", "content": filler.strip()})
    choice = case["tool_choice"]
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    body: dict[str, Any] = {
        "model": model, "messages": messages, "tools": [tool_definition(n, tools[n]) for n in case["tools"]],
        "tool_choice": choice, "temperature": 0, "seed": 1234, "max_tokens": max_tokens, "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def raise_for_config(status: int, text: str) -> None:
    if status == 400 and NO_TOOL_PARSER.search(text):
        message = text
        try:
            message = fileio.parse_json(text).get("error", {}).get("message", text)
        except (ValueError, AttributeError):
            pass
        raise ConfigError(f"the server does not have tool calling enabled (HTTP 400: {message.strip()}): {CONFIG_HINT}")


def plain_answer(body: dict[str, Any]) -> Answer:
    choice = (body.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    calls = [{"id": call.get("id"), "name": (call.get("function") or {}).get("name"),
              "arguments": (call.get("function") or {}).get("arguments")}
             for call in message.get("tool_calls") or []]
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    finish = [choice["finish_reason"]] if choice.get("finish_reason") else []
    return Answer(content=message.get("content") or "", reasoning=reasoning, tool_calls=calls,
                  finish_reasons=finish)


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield fileio.parse_json(data)


def merge_stream(chunks: Sequence[dict[str, Any]]) -> Answer:
    """Reassemble streamed deltas: tool calls keyed by `index` (None counts as 0, as K2VV does),
    arguments appended, id and name taken on first sight. Does not assume one delta per chunk."""
    answer = Answer()
    calls: dict[int, dict[str, Any]] = {}
    seen_ids: dict[int, int] = {}
    seen_names: dict[int, int] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            answer.content += delta.get("content") or ""
            answer.reasoning += delta.get("reasoning_content") or delta.get("reasoning") or ""
            for tool_delta in delta.get("tool_calls") or []:
                index = tool_delta.get("index") or 0
                call = calls.setdefault(index, {"id": None, "name": None, "arguments": ""})
                if tool_delta.get("id"):
                    seen_ids[index] = seen_ids.get(index, 0) + 1
                    call["id"] = call["id"] or tool_delta["id"]
                function = tool_delta.get("function") or {}
                if function.get("name"):
                    seen_names[index] = seen_names.get(index, 0) + 1
                    call["name"] = call["name"] or function["name"]
                if function.get("arguments") is not None:
                    if not isinstance(function["arguments"], str):
                        answer.stream_problems.append(Check(FAIL, f"call {index}: an arguments fragment is not a string"))
                        continue
                    call["arguments"] += function["arguments"]
            if choice.get("finish_reason"):
                answer.finish_reasons.append(choice["finish_reason"])
    for index in sorted(calls):
        if seen_names.get(index, 0) > 1:
            answer.stream_problems.append(Check(WARN, f"call {index}: the name was streamed {seen_names[index]} times"))
        if seen_ids.get(index, 0) > 1:
            answer.stream_problems.append(Check(WARN, f"call {index}: the id was streamed {seen_ids[index]} times"))
    answer.tool_calls = [calls[i] for i in sorted(calls)]
    return answer


def send(http, body: dict[str, Any]) -> Answer:
    """POST a chat request; a no-tool-parser 400 is a ConfigError, other failures ServerError."""
    try:
        with http_client.answered(f"{http.base_url}/v1/chat/completions", http.timeout.read):
            if not body["stream"]:
                response = http.post("/v1/chat/completions", json=body)
                raise_for_config(response.status_code, response.text)
                if response.status_code != 200:
                    raise ServerError(f"HTTP {response.status_code}: {response.text[:200].strip()}")
                return plain_answer(fileio.parse_json(response.content))
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    text = response.read().decode(errors="replace")
                    raise_for_config(response.status_code, text)
                    raise ServerError(f"HTTP {response.status_code}: {text[:200].strip()}")
                return merge_stream(list(sse_events(response.iter_lines())))
    except ValueError as exc:
        raise ServerError(f"the answer is not valid JSON ({exc})")
    except (AttributeError, TypeError, KeyError) as exc:
        # Valid JSON of another shape (a list, a choices item that is a string, a number where
        # text belongs): the server's fault, reported for this case; the other cases go on.
        raise ServerError(f"the answer is JSON but not a chat completion ({type(exc).__name__}: {exc})")


def parse_arguments(call: dict[str, Any], tools: dict[str, Any]) -> tuple[dict[str, Any] | None, list[Check]]:
    """Arguments as a dict, or None with the failing checks."""
    name, raw = call.get("name"), call.get("arguments")
    parameterless = not tools.get(name, {}).get("parameters", {}).get("properties")
    if raw in ("", None) and parameterless:
        return {}, [Check(WARN, f"{name}: arguments are {raw!r}, not '{{}}' (vllm#28806)")]
    if not isinstance(raw, str):
        return None, [Check(FAIL, f"{name}: arguments is {json_type(raw)}, not a JSON string")]
    try:
        args = fileio.parse_json(raw)
    except ValueError:
        return None, [Check(FAIL, f"{name}: arguments are not valid JSON: {short(raw)}")]
    if not isinstance(args, dict):
        return None, [Check(FAIL, f"{name}: arguments are {json_type(args)}, not an object: {short(raw)}")]
    return args, []


def check_calls(answer: Answer, case: dict[str, Any], tools: dict[str, Any]) -> list[Check]:
    expected = case["expect"]["calls"]
    checks: list[Check] = []
    calls = answer.tool_calls
    if expected == []:
        if calls:
            names = ", ".join(str(c.get("name")) for c in calls)
            return [Check(FAIL, f"expected no tool call, got {len(calls)} ({names})")]
        return checks
    if not calls:
        want = "a tool call" if expected == "any" else f"a call to {expected[0]['name']}"
        return [Check(FAIL, f"expected {want}, got no tool call (content: {short(answer.content) or 'empty'})")]
    parsed = []
    for call in calls:
        if call.get("name") not in case["tools"]:
            checks.append(Check(FAIL, f"called {call.get('name')!r}, which is not among the offered tools"))
            continue
        args, problems = parse_arguments(call, tools)
        checks += problems
        if args is None:
            continue
        errors = schema_errors(args, tools[call["name"]]["parameters"])
        if errors:
            checks.append(Check(FAIL, f"{call['name']}: arguments violate the schema: {'; '.join(errors[:3])}"))
        parsed.append((call["name"], args))
    if expected != "any":
        checks += match_expected_calls(parsed, expected, len(calls))
    ids = [c.get("id") for c in calls]
    if not all(isinstance(i, str) and i for i in ids) or len(set(ids)) != len(ids):
        checks.append(Check(WARN, f"tool call ids are not non-empty and unique: {ids}"))
    return checks


def match_expected_calls(parsed: list[tuple[str, dict]], expected: list[dict], count: int) -> list[Check]:
    """Every expected call matched by a distinct actual call, in any order (BFCL no_order)."""
    if count != len(expected):
        names = ", ".join(name for name, _ in parsed) or "none parsed"
        return [Check(FAIL, f"expected {len(expected)} call(s), got {count} ({names})")]
    remaining = list(parsed)
    checks = []
    for want in expected:
        candidates = [(n, a) for n, a in remaining if n == want["name"]]
        if not candidates:
            got = ", ".join(n for n, _ in remaining) or "nothing usable"
            checks.append(Check(FAIL, f"expected a call to {want['name']}, got {got}"))
            continue
        problems_by_candidate = [(args_mismatches(a, want.get("args", {})) if "args" in want else [], (n, a))
                                 for n, a in candidates]
        problems, chosen = min(problems_by_candidate, key=lambda item: len(item[0]))
        remaining.remove(chosen)
        if problems:
            checks.append(Check(FAIL, f"{want['name']}: wrong values: {'; '.join(problems)}"))
    return checks


def check_content(answer: Answer, case: dict[str, Any], markup: Sequence[str]) -> list[Check]:
    checks = []
    leaked = [m for m in markup if m in answer.content]
    if leaked:
        checks.append(Check(FAIL, f"tool markup {leaked[0]!r} leaked into the content: {short(answer.content)}"))
    in_reasoning = [m for m in markup if m in answer.reasoning]
    if in_reasoning:
        checks.append(Check(WARN, f"tool markup {in_reasoning[0]!r} inside the reasoning text"))
    if case["expect"]["calls"] == []:
        if not answer.content.strip():
            checks.append(Check(FAIL, "expected a text answer, got empty content"))
        for needle in case["expect"].get("content", {}).get("contains", []):
            if needle not in answer.content:
                checks.append(Check(FAIL, f"expected {needle!r} in the answer, got {short(answer.content)}"))
    elif answer.tool_calls and answer.content.strip() and not leaked:
        checks.append(Check(WARN, f"text beside the call: {short(answer.content)}"))
    return checks


def check_finish(answer: Answer, case: dict[str, Any], streamed: bool) -> list[Check]:
    checks = []
    if streamed and len(answer.finish_reasons) != 1:
        checks.append(Check(FAIL, f"finish_reason streamed {len(answer.finish_reasons)} times, expected once"))
    accepted = case["expect"].get("finish_reason")
    got = answer.finish_reasons[-1] if answer.finish_reasons else None
    if accepted and got not in accepted:
        checks.append(Check(WARN, f"finish_reason {got!r}, expected {' or '.join(accepted)}"))
    return checks


def check_stream(streamed: Answer, plain: Answer, tools: dict[str, Any]) -> list[Check]:
    """Streamed deltas merged by index must give the plain answer (temperature 0, same request)."""
    checks = list(streamed.stream_problems)
    for index, call in enumerate(streamed.tool_calls):
        if not call.get("name"):
            checks.append(Check(FAIL, f"call {index} never got a name"))

    def comparable(answer: Answer) -> list[tuple[Any, Any]]:
        result = []
        for call in answer.tool_calls:
            args, _ = parse_arguments(call, tools)
            result.append((call.get("name"), args if args is not None else call.get("arguments")))
        return result

    if comparable(streamed) != comparable(plain):
        checks.append(Check(FAIL, f"merged calls {short(comparable(streamed), 120)} differ from "
                                  f"the plain answer {short(comparable(plain), 120)}"))
    elif not plain.tool_calls and streamed.content.strip() != plain.content.strip():
        checks.append(Check(WARN, "the streamed text differs from the plain text"))
    return checks


def check_answer(answer: Answer, case: dict[str, Any], catalog: dict[str, Any], streamed: bool) -> list[Check]:
    tools = catalog["tools"]
    return (check_calls(answer, case, tools) + check_content(answer, case, catalog["markup"])
            + check_finish(answer, case, streamed))


def worst(statuses: Sequence[str]) -> str:
    return max(statuses, key=lambda s: SEVERITY[s], default=PASS)


def run_repeat(http, case: dict[str, Any], catalog: dict[str, Any], model: str, max_tokens: int,
               long_words: int) -> dict[str, Any]:
    """One repeat of a case: the plain request, and the streamed one when the case streams."""
    record: dict[str, Any] = {"checks": []}
    try:
        plain = send(http, build_request(case, catalog["tools"], model, max_tokens, False, long_words))
    except ServerError as exc:
        return {"status": ERROR, "checks": [{"status": ERROR, "reason": f"plain: {exc}"}]}
    checks = [("plain", c) for c in check_answer(plain, case, catalog, False)]
    record["plain"] = answer_record(plain)
    if case.get("stream"):
        try:
            streamed = send(http, build_request(case, catalog["tools"], model, max_tokens, True, long_words))
        except ServerError as exc:
            checks.append(("stream", Check(ERROR, str(exc))))
        else:
            record["stream"] = answer_record(streamed)
            checks += [("stream", c) for c in check_answer(streamed, case, catalog, True)]
            checks += [("stream", c) for c in check_stream(streamed, plain, catalog["tools"])]
    record["checks"] = [{"status": c.status, "reason": f"{mode}: {c.reason}"} for mode, c in checks]
    record["status"] = worst([c.status for _, c in checks])
    return record


def answer_record(answer: Answer) -> dict[str, Any]:
    return {"content": answer.content, "tool_calls": answer.tool_calls, "finish_reasons": answer.finish_reasons}


def summarize_case(case_id: str, case: dict[str, Any], repeats: list[dict[str, Any]]) -> dict[str, Any]:
    needed = math.ceil(PASS_SHARE * len(repeats))
    passed = sum(1 for r in repeats if SEVERITY[r["status"]] < SEVERITY[FAIL])
    failing = [c for r in repeats for c in r["checks"] if SEVERITY[c["status"]] >= SEVERITY[FAIL]]
    warnings = [c for r in repeats for c in r["checks"] if c["status"] == WARN]
    if passed >= needed:
        status = WARN if warnings else PASS
        reason = warnings[0]["reason"] if warnings else ""
    else:
        status = ERROR if all(r["status"] == ERROR for r in repeats) else FAIL
        distinct = list(dict.fromkeys(c["reason"] for c in failing))
        reason = distinct[0] + (f" (+{len(distinct) - 1} more)" if len(distinct) > 1 else "")
    return {"case": case_id, "description": case["description"], "status": status, "reason": reason,
            "passed": passed, "repeats": len(repeats), "runs": repeats}


USER_CASES_MAX_BYTES = 1 << 20  # one YAML file of the user's cases


CASE_FIELDS = ("description", "tools", "tool_choice", "messages", "expect")


def with_user_cases(catalog: dict[str, Any], folder: str) -> tuple[dict[str, Any], list[str]]:
    """The catalog plus the user's own cases: every *.yaml / *.yml in `folder`, in the format of
    scripts/rooflib/catalog/toolcall_cases.yaml (`cases:`, and `tools:` of their own if they need any).
    Returns the merged catalog and the user's case names."""
    directory = Path(folder).expanduser()
    if not directory.is_dir():
        raise UsageError(f"cases folder {folder!r} is not a directory: point --cases-dir (CASES) at a folder of YAML files")
    files = sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")])
    if not files:
        raise UsageError(f"{directory} holds no *.yaml case files (format: scripts/rooflib/catalog/toolcall_cases.yaml)")
    merged = {**catalog, "tools": dict(catalog["tools"]), "cases": dict(catalog["cases"])}
    names: list[str] = []
    for path in files:
        data = fileio.load_yaml(fileio.read_bounded(path, "cases file", USER_CASES_MAX_BYTES), str(path)) or {}
        if not isinstance(data, dict) or not isinstance(data.get("cases"), dict):
            raise UsageError(f"{path} needs a `cases:` mapping, as in scripts/rooflib/catalog/toolcall_cases.yaml")
        for name, tool in (data.get("tools") or {}).items():
            if name in merged["tools"] and merged["tools"][name] != tool:
                raise UsageError(f"{path}: tool {name!r} differs from the one already defined: rename it")
            merged["tools"][name] = tool
        for name, case in data["cases"].items():
            missing = [f for f in CASE_FIELDS if not isinstance(case, dict) or f not in case]
            if missing:
                raise UsageError(f"{path}: case {name!r} lacks {', '.join(missing)}")
            unknown = [t for t in case["tools"] if t not in merged["tools"]]
            if unknown:
                raise UsageError(f"{path}: case {name!r} offers unknown tool {unknown[0]!r}: define it under tools:")
            if name in merged["cases"]:
                raise UsageError(f"{path}: case {name!r} is already defined: give it another name")
            merged["cases"][name] = case
            names.append(name)
    return merged, names


def select_cases(catalog: dict[str, Any], names: str, long: bool) -> list[str]:
    cases = catalog["cases"]
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in cases]
        if unknown:
            raise UsageError(f"unknown case {unknown[0]!r}: known cases are {', '.join(cases)}")
        return wanted
    return [n for n, c in cases.items() if long or not c.get("optional")]


def call_is_valid(call: dict[str, Any], tools: dict[str, Any]) -> bool:
    """K2VV's "successful" call: a known tool, arguments that parse and validate."""
    if call.get("name") not in tools:
        return False
    args, _ = parse_arguments(call, tools)
    return args is not None and not schema_errors(args, tools[call["name"]]["parameters"])


def trigger_stats(results: list[dict[str, Any]], catalog: dict[str, Any]) -> dict[str, Any]:
    """K2VV-style trigger precision/recall/F1 and schema accuracy over every answer."""
    tp = fp = fn = tn = 0
    with_calls = valid = 0
    for result in results:
        case = catalog["cases"][result["case"]]
        due = case["expect"]["calls"] != []
        for run in result["runs"]:
            for mode in ("plain", "stream"):
                if mode not in run:
                    continue
                called = bool(run[mode]["tool_calls"])
                tp += due and called
                fp += called and not due
                fn += due and not called
                tn += not due and not called
                if called:
                    with_calls += 1
                    valid += all(call_is_valid(c, catalog["tools"]) for c in run[mode]["tool_calls"])
    precision = tp / (tp + fp) if tp + fp else None
    recall = tp / (tp + fn) if tp + fn else None
    f1 = 2 * precision * recall / (precision + recall) if precision and recall else (0.0 if tp + fp + fn else None)
    return {"trigger_precision": precision, "trigger_recall": recall, "trigger_f1": f1,
            "schema_accuracy": valid / with_calls if with_calls else None,
            "answers": tp + fp + fn + tn, "answers_with_calls": with_calls}


def compare_baseline(results: list[dict[str, Any]], baseline: dict[str, Any]) -> dict[str, list[str]]:
    before = {r["case"]: r["status"] for r in baseline.get("cases", [])}
    regressions, limitations = [], []
    for result in results:
        old = before.get(result["case"])
        if old is None or result["status"] in (PASS, WARN, SKIP):
            continue
        (regressions if old in (PASS, WARN) else limitations).append(result["case"])
    return {"regressions": regressions, "model_limitations": limitations}


def load_baseline(path: str) -> dict[str, Any]:
    data = fileio.read_json_file(path, "baseline", f"save it with `smoke_toolcall.py --json > {path}`")
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list):
        raise UsageError(f"baseline {path} has no 'cases' list: save it with `smoke_toolcall.py --json > {path}`")
    return data


def preflight(http, catalog: dict[str, Any], model: str) -> None:
    """One short auto request: a server without tool calling answers 400 before any case runs."""
    case = catalog["cases"]["single_auto"]
    send(http, build_request(case, catalog["tools"], model, 1, False))


def run_smoke(http, model: str, case_ids: list[str], repeat: int, max_tokens: int, no_parallel: bool,
              long_words: int, catalog: dict[str, Any]) -> dict[str, Any]:
    preflight(http, catalog, model)
    results = []
    interrupted = False
    try:
        for case_id in case_ids:
            case = catalog["cases"][case_id]
            if no_parallel and case.get("parallel"):
                results.append({"case": case_id, "description": case["description"], "status": SKIP,
                                "reason": "--no-parallel: the model family does not do parallel calls",
                                "passed": 0, "repeats": 0, "runs": []})
                continue
            printing.progress(f"case {case_id} ({repeat} repeat(s))")
            runs = [run_repeat(http, case, catalog, model, max_tokens, long_words) for _ in range(repeat)]
            results.append(summarize_case(case_id, case, runs))
    except KeyboardInterrupt:
        interrupted = True  # the finished cases are still reported
    return {"model": model, "repeat": repeat, "cases": results, "stats": trigger_stats(results, catalog),
            "interrupted": interrupted}


def verdict(report: dict[str, Any]) -> tuple[str, list[str]]:
    reasons = [f"{r['case']}: {r['reason']}" for r in report["cases"] if r["status"] in (FAIL, ERROR)]
    accuracy = report["stats"]["schema_accuracy"]
    if accuracy is not None and accuracy < 1.0:
        reasons.append(f"schema accuracy {accuracy:.0%} (must be 100%)")
    if report["interrupted"]:
        reasons.append(f"interrupted after {len(report['cases'])} case(s): partial results")
    regressions = report.get("baseline", {}).get("regressions", [])
    if regressions:
        reasons.append("regressions against the baseline: " + ", ".join(regressions))
    if reasons:
        return FAIL, reasons
    return (WARN if any(r["status"] == WARN for r in report["cases"]) else PASS), []
