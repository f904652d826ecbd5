"""The skills keep what the seed skill taught, in English and in Russian: every seed section has its
counterpart in both skills, in the same place, with the guidance the seed gave; and the licence the
skills declare is the project's."""
from __future__ import annotations

import json
import re

import pytest

from markdown_doc import REPO, SKILLS, Doc

ENGLISH, RUSSIAN = SKILLS / "roofline-perf" / "SKILL.md", SKILLS / "roofline-perf-ru" / "SKILL.md"

# (what the seed taught, the English section, the Russian one, phrases the section must hold as
# (English, Russian) pairs; a phrase that is the same in both languages is written once).
SEED_SECTIONS = [
    ("targets", "Metrics and targets", "Метрики и цели",
     [("p95", "p95"), ("never on the mean", "никогда по среднему"), ("Default targets", "Цели по умолчанию"),
      ("under 2 s on a long prompt", "меньше 2 с на длинном промпте"), ("under 50 ms", "меньше 50 мс"),
      ("20-40 tokens/s per user", "20-40 токенов в секунду на пользователя"),
      ("confirm them with the user", "согласуй эти цели с пользователем")]),
    ("one-minute diagnosis", "One-minute diagnosis", "Диагностика за минуту",
     [("`doctor`",), ("`diagnosis`", "`diagnosis`"), ("not by TPOT", "а не по TPOT"),
      ("Behind a balancer", "За балансировщиком")]),
    ("memory", "Memory", "Память",
     [("`kv_cache_tokens`", "`kv_cache_tokens`"), ("marginal fit", "впритык")]),
    ("batching and cache", "Batching and cache", "Батчинг и кеш",
     [("batch continuously", "батчат непрерывно (continuous batching)"),
      ("route by session", "маршрутизируй по сессии"), ("knee", "колено")]),
    ("quantization", "Quantization", "Квантование",
     [("FP8 first in production", "в продакшене сначала FP8"),
      ("only when nothing else fits", "только если больше ничего не влезает"),
      ("does not ship", "в продакшен не идёт"), ("NVFP4",), ("GPTQ on Volta", "GPTQ — Volta"),
      ("user's own agent task set", "собственный набор агентских задач пользователя")]),
    ("speculative decoding", "Speculative decoding", "Спекулятивное декодирование",
     [("as batch grows", "с ростом батча"), ("temperature", "температуры"), ("Enable it last", "Включай его последним"),
      ("real concurrency", "реальной конкурентности"), ("EAGLE-3",), ("n-gram", "n-граммам"),
      ("takes memory from the KV cache", "отнимают память у KV-кеша")]),
    ("bench", "Bench", "Бенчмарк",
     [("`-- --endpoint chat`",), ("live production server", "продакшен-сервер"),
      ("the verdict is mixed", "вердикт смешан"), ("only recommend", "только рекомендовать"),
      ("unknown", "неизвестную")]),
    ("sources", "Sources", "Источники",
     [("https://docs.vllm.ai",), ("https://docs.sglang.io",), ("https://roadmap.sh/inference-engineering",),
      ("https://web.stanford.edu/~jurafsky/slp3/",), ("perplexity", "перплексия"),
      ("https://huggingface.co/docs/transformers/cache_explanation",),
      ("https://huggingface.co/docs/transformers/generation_strategies",), ("vllm/config/cache.py",)]),
]

# What the skill adds on top of the seed: the three questions it must lead to a decision.
DECISIONS = [
    ("Why is my server slow?", "Почему тормозит сервер?", [("`doctor`",), ("`Also:`",), ("unknown", "неизвестно"),
                                                            ("exactly as printed", "ровно как напечатано")]),
    ("Will model X fit on GPU Y, and for how many users?", "Влезет ли модель X на GPU Y и на сколько пользователей?",
     [("concurrent requests at a stated length", "одновременные запросы заданной длины"),
      ("marginal", "на грани"), ("`GPU_UTIL=0.9`",)]),
    ("FP8 or AWQ?", "FP8 или AWQ?",
     [("FP8 first in production", "в продакшене сначала FP8"), ("`QUANT=awq`",),
      ("own tool-call cases", "собственных сценариях вызовов инструментов")]),
]


def sections(path, level: int) -> list[tuple[str, str]]:
    """(heading, text up to the next heading of this level or above) for each heading of `level`."""
    body = Doc.read(path).body
    marks = list(re.finditer(rf"^(#{{1,{level}}}) (.+)$", body, re.M))
    found = []
    for i, mark in enumerate(marks):
        if len(mark.group(1)) == level:
            end = marks[i + 1].start() if i + 1 < len(marks) else len(body)
            found.append((mark.group(2).strip(), body[mark.end():end]))
    return found


def flat(text: str) -> str:
    """Line breaks and indents as single spaces: a phrase may wrap anywhere."""
    return " ".join(text.split())


def assert_counterparts(english_heading, russian_heading, phrases, level):
    english, russian = sections(ENGLISH, level), sections(RUSSIAN, level)
    english_titles, russian_titles = [h for h, _ in english], [h for h, _ in russian]
    assert english_heading in english_titles, f"English skill lost the section {english_heading!r}"
    assert russian_heading in russian_titles, f"Russian skill lost the section {russian_heading!r}"
    position = english_titles.index(english_heading)
    assert russian_titles.index(russian_heading) == position, f"{russian_heading!r} is not where {english_heading!r} is"
    english_text, russian_text = flat(english[position][1]), flat(russian[position][1])
    for pair in phrases:
        in_english, in_russian = pair if len(pair) == 2 else (pair[0], pair[0])
        assert in_english in english_text, f"{english_heading}: the English text lost {in_english!r}"
        assert in_russian in russian_text, f"{russian_heading}: the Russian text lost {in_russian!r}"


@pytest.mark.parametrize("taught, english_heading, russian_heading, phrases", SEED_SECTIONS,
                         ids=[s[0] for s in SEED_SECTIONS])
def test_every_seed_section_has_its_counterpart_in_both_skills(taught, english_heading, russian_heading, phrases):
    assert_counterparts(english_heading, russian_heading, phrases, level=2)


@pytest.mark.parametrize("english_heading, russian_heading, phrases", DECISIONS, ids=[d[0] for d in DECISIONS])
def test_each_question_has_a_decision_procedure_in_both_skills(english_heading, russian_heading, phrases):
    assert_counterparts(english_heading, russian_heading, phrases, level=3)


def test_the_russian_skill_explains_the_english_output():
    """The tools print English: the Russian skill says so and glosses each line that carries a verdict."""
    russian = dict(sections(RUSSIAN, 2))["Как читать вывод"]
    english = dict(sections(ENGLISH, 2))["Reading the output"]
    assert "по-английски" in russian
    for line in ("`FITS`", "`DOES NOT FIT`", "`Diagnosis: no bottleneck found in these figures.`", "`Knee: C = ...`",
                 "`INVALID`", "`NO SLO`", "`cheapest change that fits`"):
        assert line in english and line in russian, line


def test_the_seed_terms_are_kept_in_russian():
    """The seed writes квантование and кеш; a native reader stumbles on the calques listed here."""
    texts = [p.read_text(encoding="utf-8") for p in (SKILLS / "roofline-perf-ru").rglob("*.md")]
    for calque in ("квантизац", "кэш", "точка перегиба", "точку перегиба", "в упоре", "Спроси работающий",
                   "быстрее чего", "против SLO", "идущих запросов", "параллельност"):
        assert not any(calque.lower() in text.lower() for text in texts), calque


def test_the_skills_declare_the_project_licence():
    # pyproject.toml is read by pattern: tomllib needs Python 3.11 and the project supports 3.10.
    project = re.search(r'^license = "([^"]+)"$', (REPO / "pyproject.toml").read_text(encoding="utf-8"), re.M)[1]
    plugin = json.loads((REPO / ".claude-plugin" / "plugin.json").read_text(encoding="utf-8"))["license"]
    skills = {Doc.read(path).frontmatter["license"] for path in (ENGLISH, RUSSIAN)}
    assert skills == {project} == {plugin} == {"MIT"}
    licence = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert licence.startswith("MIT License") and "Roofline contributors" in licence
