"""The docs match the code: docs/config.md lists every serve config key with the code's default;
every relative link in README.md, docs/ and benchmarks/README.md resolves (file and anchor); every
file of the README's module map exists, and every function its request walk names is defined there.

Reference: `raysched.config.ServeConfig()` (the defaults) and the files on disk. Negative controls:
a config block with one default changed and one key left out, a page with a dead link and a dead
anchor, and a walk row naming a function that does not exist, must each be reported.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from raysched.config import ServeConfig, load_serve_config

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
INTERNAL = {"pool.explicit"}  # filled by the loader, not a user key
COMMENTED = {"pool.memory_bytes"}  # an alternative to the counts: shown commented out
OPTIONAL_SECTIONS = ("roles", "autoscale")  # absent by default: shown as null / commented keys


def config_block(text: str) -> dict[str, Any]:
    """The first ```yaml block of a page, parsed."""
    match = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert match, "no ```yaml block"
    return yaml.safe_load(match.group(1))


def _key_paths(mapping: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for name, value in mapping.items():
        out.add(prefix + name)
        if isinstance(value, dict):
            out |= _key_paths(value, f"{prefix}{name}.")
    return out


def _field_paths(obj: Any, prefix: str = "") -> set[str]:
    out = set()
    for f in dataclasses.fields(obj):
        out.add(prefix + f.name)
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out |= _field_paths(value, f"{prefix}{f.name}.")
    return out


def _differences(doc: Any, code: Any, path: str = "") -> list[str]:
    if dataclasses.is_dataclass(code):
        return [d for f in dataclasses.fields(code)
                for d in _differences(getattr(doc, f.name), getattr(code, f.name), f"{path}.{f.name}")]
    return [] if doc == code else [f"{path[1:]}: docs {doc!r}, code {code!r}"]


def config_doc_problems(block: dict[str, Any]) -> list[str]:
    """Keys the code has and the block lacks (or the reverse), and defaults that differ."""
    code = ServeConfig()
    shown = _key_paths(block)
    problems = [f"missing from docs: {k}" for k in sorted(_field_paths(code) - shown - INTERNAL - COMMENTED)]
    problems += [f"not in the code: {k}" for k in sorted(shown - _field_paths(code))]
    given = {k: v for k, v in block.items() if k not in OPTIONAL_SECTIONS}
    return problems + _differences(load_serve_config(given), code)


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = page.read_text()
    return set(re.findall(r'<a id="([^"]+)"', text)) | {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def dead_links(page: Path) -> list[str]:
    """Relative links of `page` (outside code blocks) whose file or anchor does not exist."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    dead = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            dead.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            dead.append(target)
    return dead


def test_config_doc_lists_every_key_with_the_codes_default():
    assert config_doc_problems(config_block((REPO / "docs" / "config.md").read_text())) == []


def test_config_doc_check_catches_a_wrong_default_and_a_missing_key():
    """Negative control: the same block with pool.kv_tokens changed and scheduler.preemption
    removed is reported on both counts."""
    block = config_block((REPO / "docs" / "config.md").read_text())
    block["pool"]["kv_tokens"] += 1
    del block["scheduler"]["preemption"]
    problems = config_doc_problems(block)
    assert "missing from docs: scheduler.preemption" in problems
    assert any(p.startswith("pool.kv_tokens: docs 513") for p in problems), problems


def test_every_relative_link_resolves():
    dead = {page.relative_to(REPO).as_posix(): dead_links(page) for page in PAGES}
    assert {page: links for page, links in dead.items() if links} == {}


def test_link_check_catches_a_dead_file_and_a_dead_anchor(tmp_path):
    """Negative control: a page linking a missing file and a missing heading is reported."""
    (tmp_path / "other.md").write_text("# Present heading\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#present-heading) [gone](missing.md) [bad](other.md#absent)\n"
                    "```\n[in code](ignored.md)\n```\n")
    assert dead_links(page) == ["missing.md", "other.md#absent"]


def _section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def module_map_missing(readme: str) -> list[str]:
    """Paths in the first column of the module map that are not in the repository (a path under
    `scheduler/` is `raysched/scheduler/...`)."""
    missing = []
    for row in _section(readme, "Module map").splitlines()[3:]:
        for path in re.findall(r"`([\w/.-]+(?:\.py|\.c|/))`", row.split(" | ")[0]):
            full = f"raysched/{path}" if path.startswith("scheduler/") else path
            if not (REPO / full).exists():
                missing.append(path)
    return missing


def walk_missing(readme: str) -> list[str]:
    """`file:Name` entries of the request walk's "where" column (later names in a group of
    commas share its file) that no `def` / `class` in that file defines."""
    missing = []
    for row in _section(readme, "One request's life").splitlines():
        if not row.startswith("| ") or row.startswith("| #"):
            continue
        for group in row.rstrip(" |").split(" | ")[-1].split(";"):
            path = None
            for item in (x.strip().strip("`") for x in group.split(",")):
                path, name = item.split(":", 1) if ":" in item else (path, item)
                if path is None or name.endswith(".py"):
                    continue
                source = (REPO / path).read_text() if (REPO / path).is_file() else ""
                if not re.search(rf"^\s*(?:async )?(?:def|class) {re.escape(name.split('.')[-1])}\b", source, re.M):
                    missing.append(f"{path}:{name}")
    return missing


def test_the_module_map_and_the_request_walk_name_what_exists():
    readme = (REPO / "README.md").read_text()
    assert module_map_missing(readme) == []
    assert walk_missing(readme) == []


def test_walk_check_catches_a_function_that_is_gone():
    """Negative control: one walk row renamed to a function no file defines, and one module-map
    path that does not exist, are reported."""
    readme = (REPO / "README.md").read_text()
    broken = readme.replace("`raysched/scheduler/planner.py:plan_step`", "`raysched/scheduler/planner.py:plan_stepx`")
    broken = broken.replace("| `raysched/sampling.py` |", "| `raysched/sampling_gone.py` |")
    assert walk_missing(broken) == ["raysched/scheduler/planner.py:plan_stepx"]
    assert module_map_missing(broken) == ["raysched/sampling_gone.py"]
