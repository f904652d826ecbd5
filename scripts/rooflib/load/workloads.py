"""What bench.py sends: synthetic length distributions, prompt datasets, ShareGPT conversations
and timed traces, read into one `Workload` whose requests are made one at a time, when sent.

Formats (one JSON object per line unless said otherwise; a bad line is reported as file:line):
  prompts JSONL    {"prompt": "..."} or {"messages": [{"role": ..., "content": ...}, ...]},
                   optional "output_tokens"
  ShareGPT         {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}, ...]}
                   per line, or a JSON array of such objects (the ShareGPT release format);
                   every human turn is one request whose history is the recorded conversation
  trace JSONL      Mooncake: {"timestamp": ms, "input_length": n, "output_length": m,
                   "hash_ids": [...]} (github.com/kvcache-ai/Mooncake, FAST25-release/traces);
                   BurstGPT column names are read too: "Timestamp" (s), "Request tokens",
                   "Response tokens" (github.com/HPMLL/BurstGPT)
  distributions    fixed:N (or N), uniform:LO,HI, normal:MEAN,SD, lognormal:P50,P95
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from rooflib.core import fileio
from rooflib.core.errors import UsageError

MAX_FILE_BYTES = 2 * 1024 ** 3
MOONCAKE_BLOCK_TOKENS = 512  # a Mooncake hash id stands for a block of 512 tokens (its README)
Z95 = 1.6448536269514722     # standard normal quantile at 0.95
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "bard": "assistant", "bing": "assistant", "assistant": "assistant", "system": "system"}


# ---------------------------------------------------------------------------------------------
# Length distributions

@dataclass(frozen=True)
class Distribution:
    """A token-length distribution; `sample` draws a whole number >= 1."""
    kind: str
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:  # lognormal with median a and 95th percentile b
            sigma = math.log(self.b / self.a) / Z95
            value = rng.lognormvariate(math.log(self.a), sigma)
        return max(1, round(value))

    def describe(self) -> str:
        return {"fixed": f"{self.a:g}", "uniform": f"uniform {self.a:g}..{self.b:g}",
                "normal": f"normal mean {self.a:g} sd {self.b:g}",
                "lognormal": f"lognormal p50 {self.a:g} p95 {self.b:g}"}[self.kind]

    @property
    def upper(self) -> int:
        """A length no sample is likely to exceed (for the max_model_len check)."""
        if self.kind in ("fixed", "uniform"):
            return int(self.b or self.a)
        if self.kind == "normal":
            return round(self.a + 4 * self.b)
        return round(math.exp(math.log(self.a) + 4 * math.log(self.b / self.a) / Z95))


def parse_distribution(text: str, what: str) -> Distribution:
    """'512', 'fixed:512', 'uniform:128,1024', 'normal:512,64', 'lognormal:400,2000'."""
    kind, _, rest = str(text).strip().partition(":")
    if not rest:
        kind, rest = "fixed", kind
    example = f"{what} takes fixed:N, uniform:LO,HI, normal:MEAN,SD or lognormal:P50,P95, got {text!r}"
    try:
        numbers = [float(x) for x in rest.replace("-", ",").split(",") if x.strip()]
    except ValueError:
        raise UsageError(example)
    wanted = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2}.get(kind)
    if wanted is None or len(numbers) != wanted or not all(math.isfinite(x) for x in numbers):
        raise UsageError(example)
    a, b = numbers[0], numbers[1] if wanted == 2 else 0.0
    if a < 1 or (kind == "uniform" and b < a) or (kind == "normal" and b < 0) or \
            (kind == "lognormal" and b <= a):
        raise UsageError(f"{what} {text!r}: lengths are at least 1"
                         + {"uniform": ", HI >= LO", "normal": ", SD >= 0", "lognormal": ", P95 > P50"}.get(kind, ""))
    return Distribution(kind, a, b)


# ---------------------------------------------------------------------------------------------
# Files

def _lines(path: str, what: str) -> list[tuple[int, Any]]:
    """(line number, parsed JSON object) of a JSONL file; blank lines skipped."""
    rows = fileio.read_json_lines(path, what, MAX_FILE_BYTES)
    if not rows:
        raise UsageError(f"{what} {path} is empty")
    return rows


def _whole(value: Any, where: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 or value != int(value):
        raise UsageError(f"{where}: {name} must be a whole number >= 1, got {value!r}")
    return int(value)


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        raise UsageError(f"{where}: messages must be a non-empty list of {{\"role\": ..., \"content\": ...}}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


@dataclass
class Entry:
    """One request of a dataset: a prompt or chat messages, and its output length if known."""
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    output_tokens: int | None = None
    prompt_tokens: int | None = None  # the length it was built to (bench's own prompts)


def read_prompts(path: str) -> list[Entry]:
    entries = []
    for number, row in _lines(path, "prompts file"):
        where = f"{path}:{number}"
        out = None if row.get("output_tokens") is None else _whole(row["output_tokens"], where, "output_tokens")
        if isinstance(row.get("prompt"), str) and row["prompt"]:
            entries.append(Entry(prompt=row["prompt"], output_tokens=out))
        elif "messages" in row:
            entries.append(Entry(messages=_messages(row["messages"], where), output_tokens=out))
        else:
            raise UsageError(f"{where}: needs \"prompt\" (text) or \"messages\" (OpenAI chat messages)")
    return entries


def _opens_an_array(file: Path) -> bool:
    """Whether a file's first byte opens a JSON array (the ShareGPT release format), read without
    reading the whole file."""
    if not file.is_file():
        return False
    with open(file, "rb") as handle:
        return handle.read(1) == b"["


def read_sharegpt(path: str, count_tokens: Callable[[str], int]) -> list[Entry]:
    """Every human turn of every conversation, with the recorded history before it; its output
    length is the recorded answer's (by `count_tokens`), None when no answer follows."""
    if _opens_an_array(Path(path)):
        try:
            data = fileio.parse_json(fileio.read_bounded(path, "ShareGPT file", MAX_FILE_BYTES))
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}:{exc.lineno}: not JSON ({exc.msg})")
        except ValueError as exc:  # nested too deeply: no line to name
            raise UsageError(f"{path}: not JSON ({exc})")
        rows = [(f"{path}: conversation #{k + 1}", row) for k, row in enumerate(data)]
    else:
        rows = [(f"{path}:{number}", row) for number, row in _lines(path, "ShareGPT file")]
    entries = []
    for where, row in rows:
        turns = row.get("conversations") if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns:
            raise UsageError(f"{where}: needs \"conversations\": [{{\"from\": \"human\", \"value\": ...}}, ...]")
        history: list[dict[str, str]] = []
        for k, turn in enumerate(turns):
            role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
            if role is None or not isinstance(turn.get("value"), str):
                raise UsageError(f"{where}: turn {k + 1} needs \"from\" (human, gpt or system) and \"value\" (text)")
            if role == "user":
                answer = turns[k + 1] if k + 1 < len(turns) else None
                answered = isinstance(answer, dict) and SHAREGPT_ROLES.get(str(answer.get("from", "")).lower()) == "assistant"
                out = max(1, count_tokens(answer["value"])) if answered and isinstance(answer.get("value"), str) else None
                entries.append(Entry(messages=[*history, {"role": "user", "content": turn["value"]}], output_tokens=out))
            history.append({"role": role, "content": turn["value"]})
    if not entries:
        raise UsageError(f"{path}: no human turn in any conversation")
    return entries


@dataclass
class TraceRow:
    at_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: list[int] = field(default_factory=list)


def read_trace(path: str) -> list[TraceRow]:
    """Trace rows sorted by time (Mooncake ms timestamps, or BurstGPT seconds)."""
    rows = []
    for number, row in _lines(path, "trace file"):
        where = f"{path}:{number}"
        if "timestamp" in row:
            at = row["timestamp"]
            scale, names = 1e-3, ("input_length", "output_length")
        elif "Timestamp" in row:
            at = row["Timestamp"]
            scale, names = 1.0, ("Request tokens", "Response tokens")
        else:
            raise UsageError(f"{where}: needs \"timestamp\" (ms) with \"input_length\", \"output_length\" "
                             "(Mooncake) or BurstGPT's \"Timestamp\", \"Request tokens\", \"Response tokens\"")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at) or at < 0:
            raise UsageError(f"{where}: the timestamp must be a number >= 0, got {at!r}")
        hash_ids = row.get("hash_ids") or []
        if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
            raise UsageError(f"{where}: hash_ids must be a list of whole numbers")
        rows.append(TraceRow(at * scale, _whole(row.get(names[0]), where, names[0]),
                             _whole(row.get(names[1]), where, names[1]), hash_ids))
    rows.sort(key=lambda r: r.at_s)
    return rows


# ---------------------------------------------------------------------------------------------
# Prompt text of an exact token length, made in O(length) with no tokenizer call

@dataclass
class PromptMaker:
    """Texts of plain words that are one token each after a space (found by asking the
    tokenizer once per word), so a text of k words after `head` is `overhead + k` tokens.
    The head (a per-run nonce) keeps the first word's tokenization out of the count, and makes
    every run's prompts new to the prefix cache; a unique salt after it makes every prompt new.
    bench.py checks a sample with the tokenizer before the run."""
    words: list[str]
    head: str
    overhead: int  # tokens of the head plus what the template or special tokens add
    seed: int = 0
    _filler: str = ""
    _ends: list[int] = field(default_factory=list)  # _filler[:_ends[k]] is its first k words
    _blocks: dict[int, str] = field(default_factory=dict)

    def fits(self, tokens: int, salt: int) -> int:
        """The length a text for `tokens` gets: never shorter than the head and the salt."""
        return max(tokens, self.overhead + len(self.salt(salt)))

    def text(self, tokens: int, salt: int) -> str:
        """`fits(tokens, salt)` tokens: the head, a unique salt (`salt` in words), then filler."""
        salt_words = self.salt(salt)
        return self._join([self.head, *salt_words], tokens - self.overhead - len(salt_words))

    def message(self, tokens: int, salt: int) -> str:
        """`tokens` words, one token each after a space (a chat message's text): a unique salt
        (`salt` in words), then filler."""
        salt_words = self.salt(salt)[:tokens]
        return self._join(salt_words, tokens - len(salt_words))

    def salt(self, index: int) -> list[str]:
        out = []
        while True:
            index, digit = divmod(index, len(self.words))
            out.append(self.words[digit])
            if not index:
                return out

    def _join(self, parts: list[str], fill: int) -> str:
        """parts + the first `fill` filler words; the filler is one string cut at a word end,
        so a long prompt costs a copy, not a word-by-word build, inside the run."""
        if fill <= 0:
            return " ".join(parts)
        if fill > len(self._ends):
            rng = random.Random(self.seed)
            extra = " ".join(rng.choice(self.words) for _ in range(max(fill, 2 * len(self._ends), 4096)))
            self._filler = (self._filler + " " + extra) if self._filler else extra
            self._ends, pos = [], 0
            for word in self._filler.split(" "):
                pos += len(word) + (1 if self._ends else 0)
                self._ends.append(pos)
        return " ".join(parts) + " " + self._filler[:self._ends[fill - 1]]

    def block(self, hash_id: int, block_tokens: int) -> str:
        """The words of one trace block: the same hash id, the same words."""
        if hash_id not in self._blocks:
            rng = random.Random(f"{self.head}/{hash_id}")
            self._blocks[hash_id] = " ".join(rng.choice(self.words) for _ in range(block_tokens))
        return self._blocks[hash_id]

    def blocks(self, tokens: int, hash_ids: Sequence[int], block_tokens: int, salt: int) -> str:
        """A trace prompt of `tokens` tokens: one block per hash id (a shared prefix between
        requests with the same ids), cut to the length, or completed with unique words."""
        wanted = tokens - self.overhead
        parts, have = [self.head], 0
        for h in hash_ids:
            if have + block_tokens > wanted:
                words = self.block(h, block_tokens).split(" ")[:wanted - have]
                parts.append(" ".join(words))
                have += len(words)
                break
            parts.append(self.block(h, block_tokens))
            have += block_tokens
        parts = [p for p in parts if p]
        if have < wanted:
            salt_words = self.salt(salt)[:wanted - have]
            return self._join(parts + salt_words, wanted - have - len(salt_words))
        return " ".join(parts)


@dataclass
class Spec:
    """One request: its text (or messages), the output tokens asked for, and the prompt
    length it was built to (None for a dataset's own text)."""
    prompt: str | None
    messages: list[dict[str, str]] | None
    output_tokens: int
    prompt_tokens: int | None


@dataclass
class Workload:
    """The requests of a run, made on demand from their index (the same index, the same request,
    in any worker process). `offsets_s` are a trace's intended send times."""
    kind: str  # synthetic | prompts | sharegpt | trace
    count: int
    output_default: int
    seed: int = 0
    maker: PromptMaker | None = None
    input_dist: Distribution | None = None
    output_dist: Distribution | None = None
    entries: list[Entry] | None = None
    trace: list[TraceRow] | None = None
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    shared_prefix: str = ""  # synthetic: the same first words in every prompt
    shared_tokens: int = 0

    def lengths(self, index: int) -> tuple[int | None, int]:
        """(prompt tokens, output tokens) of request `index` as spec builds it, without its text
        (cheap for every request of a large run); prompt tokens None: a dataset's own text, which
        only the server counts."""
        if self.kind == "trace":
            row = self.trace[index]
            return max(row.input_tokens, self.maker.overhead), row.output_tokens
        if self.kind == "synthetic":
            rng = random.Random(self.seed * 1_000_003 + index)
            tokens = self.input_dist.sample(rng)
            out = self.output_dist.sample(rng)
            if not self.shared_tokens:
                return self.maker.fits(tokens, index), out
            if tokens <= self.shared_tokens:
                return self.shared_tokens, out
            own = self.maker.fits(tokens - self.shared_tokens + self.maker.overhead, index)
            return self.shared_tokens + own - self.maker.overhead, out
        entry = self.entries[index % len(self.entries)]
        return entry.prompt_tokens, entry.output_tokens or self.output_default

    def spec(self, index: int) -> Spec:
        tokens, out = self.lengths(index)
        if self.kind == "trace":
            return Spec(self.maker.blocks(tokens, self.trace[index].hash_ids, self.block_tokens, index), None,
                        out, tokens)
        if self.kind == "synthetic":
            if not self.shared_tokens:
                return Spec(self.maker.text(tokens, index), None, out, tokens)
            if tokens == self.shared_tokens:  # drawn no longer than the shared words
                return Spec(self.shared_prefix, None, out, tokens)
            # The shared words, then this request's salt and filler (the head only once).
            rest = self.maker.text(tokens - self.shared_tokens + self.maker.overhead, index)
            return Spec(self.shared_prefix + rest[len(self.maker.head):], None, out, tokens)
        entry = self.entries[index % len(self.entries)]
        return Spec(entry.prompt, entry.messages, out, tokens)

    def document(self, index: int, k: int, documents: int) -> str:
        """Score: the k-th of the `documents` texts paired with request `index`'s: a text made as the
        requests' are, past them (a synthetic prompt of the same length; a dataset's entries,
        round the file)."""
        spec = self.spec(self.count + index * documents + k)
        return spec.prompt if spec.prompt is not None else "\n\n".join(m["content"] for m in spec.messages)

    def offsets_s(self, speed: float) -> list[float] | None:
        if self.trace is None:
            return None
        start = self.trace[0].at_s
        return [(row.at_s - start) / speed for row in self.trace[:self.count]]
