"""The README and docs/ hold together: the configuration reference is the schema's docstrings as they are now, and
every link to a local file or heading leads somewhere."""

import re
from pathlib import Path

import pytest

from hpctrain.config.describe import REGENERATE, reference_markdown

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code: a link or heading shown as code is not one."""
    text = re.sub(r"(?ms)^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", "", text)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not - and _), spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    code_free = re.sub(r"(?ms)^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", "", page.read_text())
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"(?m)^#{1,6} +(.+?) *#*$", code_free):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_the_config_reference_is_generated_from_the_schema():
    path = ROOT / "docs" / "config-reference.md"
    assert path.read_text() == reference_markdown(), (
        f"docs/config-reference.md differs from the schema's docstrings: regenerate it with `{REGENERATE}` "
        "(from the repository root) and commit it")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_local_link_resolves(page: Path):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"broken links in {page.relative_to(ROOT)}:\n" + "\n".join(broken)


REPO_PATH = re.compile(r"(?<![\w/.])(?:src/hpctrain|tests|benchmarks|tools|configs|docs)/[\w./-]*\w")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_named_in_the_text_exists(page: Path):
    """A file named in prose or code (`tools/gpu_check.py`, src/hpctrain/...) is where the page says: files move,
    and a page that names the old place sends its reader nowhere. Placeholders (configs/NAME.toml) are skipped."""
    named = set(REPO_PATH.findall(page.read_text()))
    missing = sorted(p for p in named if not (ROOT / p).exists()
                     and not any(re.fullmatch(r"[A-Z_]+", Path(part).stem) for part in Path(p).parts))
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"


def test_the_anchors_follow_githubs_rules():
    assert slug("Sharded training: `dist.strategy`") == "sharded-training-diststrategy"
    assert slug("Step modes: `train.step_mode`") == "step-modes-trainstep_mode"
    assert slug("What is guaranteed (and tested with real processes)") == \
        "what-is-guaranteed-and-tested-with-real-processes"
