"""Agent sessions: recorded ones read from JSONL, synthetic ones whose context grows by a tool result
every turn, and how much of each turn's prompt a prefix cache served against what a perfect one
could have.

An agent resends its whole conversation every turn: turn k's prompt is the session's messages so far
(every earlier turn's messages, each followed by the answer the server gave) and turn k's own. A
perfect prefix cache serves all of turn k-1's prompt and answer again; the server serves what its
cache still holds, in whole blocks (vLLM: 16 tokens on GPU, 128 on CPU), never a prompt's last token.
The shuffled control (--shuffle-history) sends the same turns with each turn's own messages first and
its history after them, shuffled: no prompt starts as its session's earlier ones did, so a perfect
cache serves nothing (a chat template that renders a system message only in first place, as Qwen's
does, leaves a moved one out).

Sessions JSONL, one turn per line; a session's turns in file order (sessions may interleave):
  {"session": "a", "messages": [{"role": "user", "content": "Fix the failing test"}], "output_tokens": 120}
  {"session": "a", "gap_s": 2.5, "messages": [{"role": "tool", "tokens": 1800}], "output_tokens": 60}
  session        the session's id: a string or a whole number
  messages       what the turn adds to the conversation, a non-empty list of {"role": "system", "user"
                 or "tool", with "content" (its text) or "tokens" (its length: bench writes that many
                 words of one token each)}
  output_tokens  the answer's length in tokens (forced with ignore_eos); default --output-tokens
  gap_s          seconds between the previous turn's answer and this turn (the agent's or the tool's
                 time), divided by --speed; default 0; a first turn's is not waited
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

from rooflib.core import fileio
from rooflib.core.errors import UsageError
from rooflib.core.stats import summarize
from rooflib.load.request_outcome import Outcome
from rooflib.load.workloads import MAX_FILE_BYTES, Distribution, PromptMaker

ROLES = ("system", "user", "tool")


@dataclass(frozen=True)
class Message:
    """A message a turn adds: its text, or its length (the text is written before the run)."""
    role: str
    content: str | None = None
    tokens: int | None = None

    def as_chat(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content or ""}


@dataclass(frozen=True)
class Turn:
    messages: tuple[Message, ...]
    output_tokens: int
    gap_s: float = 0.0


@dataclass(frozen=True)
class Session:
    name: str
    turns: tuple[Turn, ...]



def context_tokens(turns: Sequence[Turn]) -> int | None:
    """A session's context at its last answer, when every message has a length (else None): the
    messages' tokens and the answers', without what the chat template adds."""
    sizes = [m.tokens for t in turns for m in t.messages]
    return None if None in sizes else sum(sizes) + sum(t.output_tokens for t in turns)


def _whole(value: Any, where: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{where}: {name} must be a whole number >= 1, got {value!r}")
    return value


def _message(value: Any, where: str) -> Message:
    if not isinstance(value, dict) or value.get("role") not in ROLES:
        raise UsageError(f"{where}: messages[].role must be one of {', '.join(ROLES)}, got "
                         f"{value.get('role') if isinstance(value, dict) else value!r}")
    content, tokens = value.get("content"), value.get("tokens")
    if (content is None) == (tokens is None):
        raise UsageError(f"{where}: a message needs \"content\" (text) or \"tokens\" (a length), one of them")
    if content is not None and (not isinstance(content, str) or not content):
        raise UsageError(f"{where}: messages[].content must be non-empty text")
    return Message(value["role"], content, None if tokens is None else _whole(tokens, where, "messages[].tokens"))


def _turn(row: dict[str, Any], where: str, output_default: int) -> Turn:
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: messages must be a non-empty list of {{\"role\": ..., \"content\" or \"tokens\"}}")
    gap = row.get("gap_s", 0)
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 <= gap < 86400:
        raise UsageError(f"{where}: gap_s must be seconds, 0 <= gap_s < 86400, got {gap!r}")
    out = row.get("output_tokens")
    return Turn(tuple(_message(m, where) for m in messages),
                output_default if out is None else _whole(out, where, "output_tokens"), float(gap))


def read_sessions(path: str, output_default: int) -> list[Session]:
    """The sessions of a JSONL file, in the order they first appear; a bad line is a UsageError
    naming the file, the line and the field."""
    turns: dict[str, list[Turn]] = {}
    for number, row in fileio.read_json_lines(path, "sessions file", MAX_FILE_BYTES):
        where = f"{path}:{number}"
        name = row.get("session")
        if isinstance(name, bool) or not isinstance(name, (str, int)) or name == "":
            raise UsageError(f"{where}: session must be the session's id (a string or a whole number), got {name!r}")
        turns.setdefault(str(name), []).append(_turn(row, where, output_default))
    if not turns:
        raise UsageError(f"sessions file {path} is empty")
    return [Session(name, tuple(steps)) for name, steps in turns.items()]


def synthetic(count: int, turns: int, first_tokens: int, tool: Distribution, output: Distribution,
              gap_s: float, seed: int) -> list[Session]:
    """`count` sessions of `turns` turns: a user message of `first_tokens`, then each turn a tool
    result drawn from `tool`; answers drawn from `output`, `gap_s` before every later turn. The
    same seed, the same sessions."""
    rng = random.Random(seed)
    sessions = []
    for k in range(count):
        steps = [Turn((Message("user", tokens=first_tokens),), output.sample(rng))]
        steps += [Turn((Message("tool", tokens=tool.sample(rng)),), output.sample(rng), gap_s)
                  for _ in range(turns - 1)]
        sessions.append(Session(f"synthetic-{k}", tuple(steps)))
    return sessions


def written(sessions: Sequence[Session], count: int, maker: PromptMaker) -> list[list[Turn]]:
    """The turns of `count` sessions to send (the file's, round it), every message with its text: a
    length becomes that many words, unique to the message, and a session's first message starts
    with the run's head, so that no other session or run shares its prefix."""
    out, salt = [], 0
    for index in range(count):
        steps = []
        for k, turn in enumerate(sessions[index % len(sessions)].turns):
            messages = []
            for m in turn.messages:
                text = m.content
                if text is None:
                    text = maker.message(m.tokens, salt)
                    salt += 1
                messages.append(Message(m.role, f"{maker.head} {text}" if k == 0 and not messages else text, m.tokens))
            steps.append(Turn(tuple(messages), turn.output_tokens, turn.gap_s))
        out.append(steps)
    return out


def arranged(history: list[dict[str, str]], added: list[dict[str, str]], shuffle_seed: int | None,
             key: str) -> list[dict[str, str]]:
    """The messages a turn sends: the history, then the turn's own; for the shuffled control
    (`shuffle_seed` set) the turn's own first, then the history in an order drawn from the seed
    and `key` (the session and turn), so that no prompt starts as its session's earlier ones did."""
    if shuffle_seed is None:
        return [*history, *added]
    rest = list(history)
    random.Random(f"{shuffle_seed}/{key}").shuffle(rest)
    return [*added, *rest]


def perfect_tokens(before: list[dict[str, str]] | None, before_tokens: int | None, messages: list[dict[str, str]],
                   prompt_tokens: int | None) -> int | None:
    """What a perfect prefix cache serves of a turn: the tokens it shares with its session's
    previous turn, whose messages and answer were `before` and their tokens `before_tokens`
    (its prompt's and its answer's). All of them when the turn starts with `before` (at most its
    own prompt), 0 when its first message differs (a first turn has no previous one), None when
    only some of the messages match (their tokens are not known here) or a count is missing."""
    if before is None:
        return 0
    if messages[:len(before)] == before:
        if before_tokens is None:
            return None
        return before_tokens if prompt_tokens is None else min(before_tokens, prompt_tokens)
    return 0 if messages[0] != before[0] else None


def reuse(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Prefix reuse by turn index (turn 1 first) and over the run, of the completed requests:
    the prompt tokens, what a perfect cache would serve (perfect_tokens) and what the server said
    it served (usage cached_tokens; None when no answer carried it), as shares of the prompt
    tokens, and the TTFT of each turn (a later turn's is what an agent's user waits)."""
    done = [o for o in outcomes if o.ok]
    turns = sorted({o.turn for o in done})
    return {"by_turn": [_reuse_row([o for o in done if o.turn == t], t + 1) for t in turns],
            "total": _reuse_row(done, None),
            "sessions": len({o.index for o in done})}


def _share(part: int | None, whole: int | None) -> float | None:
    return None if part is None or not whole else part / whole


def _reuse_row(group: Sequence[Outcome], turn: int | None) -> dict[str, Any]:
    prompt = sum(o.prompt_tokens for o in group if o.prompt_tokens is not None) if group else None
    known = [o.perfect_tokens for o in group if o.perfect_tokens is not None]
    perfect = sum(known) if known else None
    reported = [o.cached_tokens for o in group if o.cached_tokens is not None]
    cached = sum(reported) if reported else None
    ttft = summarize(o.ttft_ms for o in group)
    return {"turn": turn, "requests": len(group), "prompt_tokens": prompt, "perfect_tokens": perfect,
            "perfect_unknown": len(group) - len(known), "cached_tokens": cached,
            "perfect_share": _share(perfect, prompt), "cached_share": _share(cached, prompt),
            "cached_of_perfect": _share(cached, perfect), "ttft_ms": {"p50": ttft["p50"], "p95": ttft["p95"]}}
