"""The README is a front page that cannot rot: its Python blocks run, it stays short, and
every relative link in it and in docs/ resolves (file, and heading for ``#anchor`` links).

The README's ```python blocks run in order in ONE shared namespace: the second block (the
loop without closures) reuses the first block's data, loss and schedule, as a reader
would. They run on the CPU in a few seconds (a linear model on 64 synthetic examples).
"""
import ast
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
MAX_LINES = 150
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _python_blocks(text):
    return [body for lang, body in FENCE.findall(text) if lang == "python"]


def test_readme_is_a_front_page():
    n = len(_read(README).splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES}): move detail to docs/"


def test_readme_python_blocks_run():
    blocks = _python_blocks(_read(README))
    assert blocks, "README.md has no ```python block"
    loops = [b for b in blocks if "opt.step(" in b]
    assert len(loops) >= 2, "README.md shows a loop with closures and one without"
    for b in loops:
        last = ast.parse(b).body[-1]
        # the loop checks its own result, so a loop that stops working fails here
        assert isinstance(last, ast.Assert), f"a training loop must end with an assert:\n{b}"
        assert "refresh_count" in ast.unparse(last), "the loop must check that it refreshed"
    for b in blocks:
        assert not re.search(r"\b(pk|poco_kernels)\._|\bopt\._", b), \
            f"README code uses a private name:\n{b}"
    namespace = {"__name__": "readme"}
    for i, b in enumerate(blocks):
        exec(compile(b, f"README.md python block {i + 1}", "exec"), namespace)


# --------------------------------------------------------------------------- links
def _markdown_files():
    files = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    files += [os.path.join(ROOT, "benchmarks", "README.md"), os.path.join(ROOT, "csrc", "README.md")]
    return [f for f in files if os.path.exists(f)]


def _strip_code(text):
    """Text outside fenced blocks and inline code spans (a ``#`` in a bash block is no
    heading, a ``[x](y)`` in code is no link)."""
    text = FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def github_slug(heading):
    """GitHub's anchor for a heading: links reduced to their text, inline markup and
    punctuation dropped (letters, digits, ``_``, ``-`` and spaces kept), lower case,
    spaces turned into hyphens."""
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    h = re.sub(r"[^\w\- ]", "", h.lower())
    return h.replace(" ", "-")


def _anchors(path):
    text = FENCE.sub("", _read(path))
    seen, out = {}, set()
    for line in text.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        k = seen.get(slug, 0)
        out.add(slug if k == 0 else f"{slug}-{k}")
        seen[slug] = k + 1
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _links(path):
    for m in LINK.finditer(_strip_code(_read(path))):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto: ...
            continue
        yield target


def _broken_links(path):
    broken = []
    for target in _links(path):
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part \
            else path
        if not os.path.exists(dest):
            broken.append(f"{target}: no file {os.path.relpath(dest, ROOT)}")
        elif anchor:
            if not dest.endswith(".md"):
                broken.append(f"{target}: an anchor into a file that is not markdown")
            elif anchor not in _anchors(dest):
                broken.append(f"{target}: no heading '#{anchor}' in {os.path.relpath(dest, ROOT)}")
    return broken


def test_github_slug():
    assert github_slug("Stability of IVON-PoCo") == "stability-of-ivon-poco"
    assert github_slug("The logistic-regression study (Sec. 5.1)") == \
        "the-logistic-regression-study-sec-51"
    assert github_slug("`backend=` and **AMP**") == "backend-and-amp"


def test_docs_exist():
    for name in ("design.md", "benchmarks.md", "logreg-study.md", "pretraining.md",
                 "lm-study.md"):
        assert os.path.exists(os.path.join(ROOT, "docs", name)), name


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(path):
    broken = _broken_links(path)
    assert not broken, f"{os.path.relpath(path, ROOT)}: " + "; ".join(broken)


def test_link_check_can_fail(tmp_path):
    """Guard: the check above sees a missing file and a missing heading, and ignores
    code (a ``#`` comment in a bash block is no heading, a link in code is no link)."""
    (tmp_path / "a.md").write_text(
        "# Title\n\n## Title\n\n[ok](#title) [ok](#title-1) [bad](#nope) [gone](b.md) "
        "[web](https://example.org) `[code](c.md)`\n```bash\n# not a heading\n```\n")
    p = str(tmp_path / "a.md")
    assert list(_links(p)) == ["#title", "#title-1", "#nope", "b.md"]
    assert _anchors(p) == {"title", "title-1"}
    broken = _broken_links(p)
    assert len(broken) == 2 and broken[0].startswith("#nope") and broken[1].startswith("b.md")
