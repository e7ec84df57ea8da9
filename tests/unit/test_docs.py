"""The documentation stays true: docs/configuration.md documents exactly the keys `udfs/config/sections.py`
accepts, the README stays a short front door, and no relative link in it or in docs/ is broken."""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Union

import pytest

from udfs.config import JobConfig

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONFIG_DOC = ROOT / "docs" / "configuration.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
BENCH_DOCS = [*sorted((ROOT / "jobs" / "dev" / "bench").glob("*.md")),
              *sorted((ROOT / "jobs" / "dev" / "bench" / "journal").glob("*.md"))]
"""The bench's README and its journal (not the reports in journal/results/, which quote as they were)."""
PERFORMANCE_DOC = ROOT / "docs" / "performance.md"
REFERENCE_MAX_LINES = 250
README_MAX_LINES = 250

# A row of a reference table in docs/configuration.md: the first cell is one key, in backticks.
KEY_ROW = re.compile(r"^\|\s*`([A-Za-z0-9_.]+)`\s*\|")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"`+[^`]*`+")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _nested_dataclasses(tp: Any) -> list[type]:
    """The config sections a field's type holds: through `Annotated` and `Optional`/unions."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return _nested_dataclasses(typing.get_args(tp)[0])
    if origin in (Union, types.UnionType):
        return [dc for arg in typing.get_args(tp) for dc in _nested_dataclasses(arg)]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return [tp]
    return []


def config_keys(section: type = JobConfig, prefix: str = "") -> set[str]:
    """Every dotted YAML key path of a config section; a mapping-typed field is one key."""
    hints = typing.get_type_hints(section, include_extras=True)
    keys: set[str] = set()
    for f in dataclasses.fields(section):
        path = prefix + str(f.metadata.get("key", f.name))
        nested = _nested_dataclasses(hints[f.name])
        if not nested:
            keys.add(path)
        for sub in nested:
            keys |= config_keys(sub, path + ".")
    return keys


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """The numbered lines of a Markdown file outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def documented_keys(path: Path = CONFIG_DOC) -> list[str]:
    return [m.group(1) for _, line in _prose_lines(path) if (m := KEY_ROW.match(line))]


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text (code and link markup rendered away) in lower
    case, punctuation dropped, spaces turned into hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file; a repeated heading gets `-1`, `-2`, … as on GitHub."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    for _, line in _prose_lines(path):
        if m := HEADING.match(line):
            slug = github_slug(m.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def broken_links(path: Path) -> list[str]:
    """Relative links of a Markdown file whose file, or whose `#anchor` in a Markdown file, is missing."""
    problems = []
    for number, line in _prose_lines(path):
        for target in LINK.findall(CODE_SPAN.sub("code", line)):
            if SCHEME.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not linked.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"{where} (no heading #{anchor} in {linked.relative_to(ROOT)})")
    return problems


def test_config_reference_documents_every_key_and_only_those() -> None:
    keys = config_keys()
    documented = documented_keys()
    missing = sorted(keys - set(documented))
    stale = sorted(set(documented) - keys)
    repeated = sorted({key for key in documented if documented.count(key) > 1})
    assert not (missing or stale or repeated), (
        f"docs/configuration.md is out of step with udfs/config/sections.py: "
        f"undocumented keys {missing}; documented keys that do not exist {stale}; keys documented twice {repeated}")


def test_config_keys_walk_into_sections_and_renamed_fields() -> None:
    keys = config_keys()
    assert {"async.capacity", "model.batch.max_size", "model.prices.prompt_per_1k", "kafka.properties",
            "model.response_format", "flink"} <= keys
    assert not {"async_.capacity", "model.batch", "model.prices"} & keys


def test_readme_is_a_short_front_door() -> None:
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move reference material to docs/")
    first_block = text.split("```")[1].splitlines()
    commands = [line.split("#")[0].strip() for line in first_block]
    assert "make demo" in commands and "make test" in commands, "README's first code block must show `make demo` and `make test`"


@pytest.mark.parametrize("path", DOCS + BENCH_DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS + BENCH_DOCS])
def test_relative_links_resolve(path: Path) -> None:
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize(("heading", "slug"), [
    ("Fault tolerance", "fault-tolerance"),
    ("`llmstream status`", "llmstream-status"),
    ("async, retry, rate_limit", "async-retry-rate_limit"),
    ("Architecture: the inference stage", "architecture-the-inference-stage"),
])
def test_github_slug(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_every_dead_letter_reason_in_the_code_is_in_the_record_contract() -> None:
    """A reason code a user may find in a dead letter has a row in docs/record-contract.md."""
    import re

    code = "".join(path.read_text() for path in (ROOT / "udfs").rglob("*.py"))
    reasons = set(re.findall(r'BadInput\(\s*"([a-z_]+)"', code)) | set(re.findall(r'reason = "([a-z_]+)"', code))
    table = (ROOT / "docs" / "record-contract.md").read_text()
    documented = {code for row in table.splitlines() if row.startswith("| `")
                  for code in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    assert reasons and not sorted(reasons - documented), f"undocumented reasons: {sorted(reasons - documented)}"


CODE_PATH = re.compile(r"(?<![\w./-])((?:jobs|udfs|tests|pom-free|flink-conf|grafana)/[\w./-]*\w)(?![\w*-]|/\w)")
"""A path into the project's code as docs and docstrings name it (`udfs/inference/client.py`, `jobs/dev/`)."""


def _named_paths(text: str) -> set[str]:
    return {m.rstrip(".") for m in CODE_PATH.findall(text) if "*" not in m and "<" not in m}


def test_every_code_path_the_docs_and_docstrings_name_exists() -> None:
    """A file moved or renamed leaves no doc or docstring pointing at where it was."""
    sources = [*DOCS, *BENCH_DOCS, *(ROOT / "jobs").rglob("*.py"), *(ROOT / "udfs").rglob("*.py")]
    missing = sorted({f"{src.relative_to(ROOT)}: {path}" for src in sources
                      for path in _named_paths(src.read_text(encoding="utf-8"))
                      if not (ROOT / path).exists() and not path.startswith(("pom-free/cache", "tests/tmp"))})
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_named_paths_are_found() -> None:
    assert _named_paths("see `udfs/inference/client.py`, jobs/dev/ and (tests/unit/test_docs.py), "
                        "not a pattern like jobs/dev/bench/results/d-orjson-*.md.") == {
        "udfs/inference/client.py", "jobs/dev", "tests/unit/test_docs.py"}


def test_broken_links_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The link check itself: a missing file, a missing heading, and what it must leave alone."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# A heading\n\n## `Code` and more, again\n")
    doc = tmp_path / "doc.md"
    doc.write_text("# Doc\n\n[ok](other.md#a-heading) [ok](other.md#code-and-more-again) [ok](#doc)\n"
                   "[gone](missing.md) [no anchor](other.md#nope) [self](#nope) [web](https://example.com/x)\n"
                   "`[in code](missing.md)`\n\n```\n[fenced](missing.md)\n```\n")
    assert broken_links(doc) == [
        "doc.md:4: missing.md (no such file)",
        "doc.md:4: other.md#nope (no heading #nope in other.md)",
        "doc.md:4: #nope (no heading #nope in doc.md)",
    ]


def test_performance_is_a_reference_and_links_its_journal_once() -> None:
    """docs/performance.md holds current figures; the dated runs are in jobs/dev/bench/journal/."""
    text = PERFORMANCE_DOC.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= REFERENCE_MAX_LINES, (
        f"docs/performance.md has {len(text.splitlines())} lines (at most {REFERENCE_MAX_LINES}): "
        "move dated runs to jobs/dev/bench/journal/")
    journal_links = [t for t in LINK.findall(text) if "bench/journal" in t]
    assert journal_links == ["../jobs/dev/bench/journal/README.md"], journal_links
    assert not (ROOT / "jobs" / "dev" / "bench" / "results").exists(), "bench results live in journal/results/"
    assert not (ROOT / "jobs" / "dev" / "bench" / "journal" / "__init__.py").exists()
