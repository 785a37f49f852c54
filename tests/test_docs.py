"""The documentation site, checked cheaply (the full check is ``mkdocs build
--strict`` in README's test command): README stays short, every page is in
the nav and every nav entry has its page, the CLI reference covers every
``storyrl`` command, and a page with a table of numbers says what produced
them."""

from __future__ import annotations

import html as html_text
import re
from pathlib import Path

import click
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _nav_files(entries) -> list[str]:
    """Every file a mkdocs ``nav`` names (entries are a path, {title: path}
    or {title: [entries]})."""
    files: list[str] = []
    for entry in entries:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            if isinstance(value, list):
                files.extend(_nav_files(value))
            elif not re.match(r"^[a-z]+://", value):  # external links are not files
                files.append(value)
    return files


def _pages() -> list[str]:
    return sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))


def test_readme_is_short_and_its_links_exist():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move content to docs/ (at most 200)"
    # Its links into docs/ (relative, as GitHub shows them) point at pages that exist.
    links = re.findall(r"\]\((docs/[^)#\s]+)", "\n".join(lines))
    assert links and [link for link in links if not (ROOT / link).is_file()] == [], "README links to missing docs pages"


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_files(config["nav"])
    assert len(nav) == len(set(nav)), f"pages listed twice in the nav: {sorted({f for f in nav if nav.count(f) > 1})}"
    pages = _pages()
    assert sorted(set(pages) - set(nav)) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(set(nav) - set(pages)) == [], "nav entries without their docs/ file"


def _command_paths(command: click.Command, path: tuple[str, ...], ctx: click.Context) -> list[tuple[str, ...]]:
    """Every command under ``command``, as the words that call it; groups
    that build their commands on demand (``storyrl train``) are listed
    through ``list_commands``/``get_command``, as click itself does."""
    paths = [path]
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                paths.extend(_command_paths(sub, (*path, name), click.Context(sub, parent=ctx, info_name=name)))
    return paths


def _cli_reference_html() -> str:
    import markdown

    text = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    # The page's mkdocs-click directive expanded as mkdocs does (mkdocs.yml's
    # markdown_extensions); it must document the whole ``storyrl`` group.
    directive = re.search(r"^::: mkdocs-click\n((?:[ \t]+:\w+:.*\n?)+)", text, re.M)
    assert directive, "docs/reference/cli.md has no mkdocs-click directive"
    options = dict(re.findall(r":(\w+):\s*(.*)", directive.group(1)))
    assert (options.get("module"), options.get("command"), options.get("prog_name")) == ("storyrl.cli", "main", "storyrl")
    return markdown.Markdown(extensions=["attr_list", "mkdocs-click"]).convert(text)


def test_cli_reference_covers_every_command_and_option():
    from storyrl.cli import main

    html = _cli_reference_html()
    headings = {re.sub(r"<[^>]+>", "", h).strip() for h in re.findall(r"<h\d[^>]*>(.*?)</h\d>", html)}
    ctx = click.Context(main, info_name="storyrl")
    paths = _command_paths(main, ("storyrl",), ctx)
    assert ("storyrl", "train", "rl") in paths and ("storyrl", "meta-eval", "pairs") in paths  # the walk reaches nested groups
    missing = [" ".join(p) for p in paths if " ".join(p) not in headings]
    assert missing == [], "commands without a section in the CLI reference"
    # Each command's options are in its own section (the text between its
    # heading and the next).
    sections = re.split(r"<h\d[^>]*>", html)
    by_heading = {re.sub(r"<[^>]+>", "", s.split("</h", 1)[0]).strip(): s for s in sections}
    for path in paths:
        command, sub_ctx = main, ctx
        for name in path[1:]:
            command = command.get_command(sub_ctx, name)
            sub_ctx = click.Context(command, parent=sub_ctx, info_name=name)
        section = by_heading[" ".join(path)]
        for param in command.get_params(sub_ctx):
            if isinstance(param, click.Option) and not param.hidden:
                assert param.opts[0] in section, f"{' '.join(path)}: {param.opts[0]} is not in its CLI reference section"

        # the command's whole help (a trainer's output layout too), not only its one-line summary
        # (as --help prints it: the last paragraph above "Options:")
        description = command.get_help(sub_ctx).split("\nOptions:")[0].strip().split("\n\n")[-1]
        # compared without whitespace: --help wraps (and breaks hyphenated words) where the page does not
        rendered = re.sub(r"\s+", "", html_text.unescape(re.sub(r"<[^>]+>", "", section)))
        assert "".join(description.replace("`", "").split()[-8:]) in rendered, (
            f"{' '.join(path)}: its --help text is not in its CLI reference section")

# A table row whose cells (after the first) hold a measured or computed
# number: 0.1796, 2.9×, 35 min, 14 GiB, 1e-9, 1,172 (a bare small integer
# such as a count of options is left alone).
_NUMBER = re.compile(r"\d+\.\d+|\d+(?:,\d{3})+|\d+\s*(?:×|x\b|%|s\b|ms\b|min\b|GiB|GB|MiB)|\d+e-\d+")
# What produced a number: a command, a script, a config file or a test.
_SOURCE = re.compile(r"storyrl [a-z]|python |bash |benchmarks/\S+\.py|configs/\S+\.ya?ml|tests/test_\w+\.py|\.ci/run")


def _has_number_table(text: str) -> bool:
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        if len(cells) > 1 and not re.fullmatch(r"[\s|:-]+", line) and any(_NUMBER.search(c) for c in cells[1:]):
            return True
    return False


def test_number_tables_name_their_source():
    assert _has_number_table("| n | d_HM |\n|---|---|\n| 586 | 0.1796 |")
    assert not _has_number_table("| extra | brings |\n|---|---|\n| quant | bitsandbytes |")
    unsourced = [page for page in _pages()
                 if _has_number_table(text := (DOCS / page).read_text(encoding="utf-8")) and not _SOURCE.search(text)]
    assert unsourced == [], "pages with a table of numbers that name no command, config or test that produced them"


def test_readme_commands_are_ci_and_quickstart_commands():
    """README's two commands are what .ci/run runs and what the quick start shows."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    quickstart = (DOCS / "quickstart.md").read_text(encoding="utf-8")
    install = 'python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints-cpu.txt -e ".[dev]"'
    tests = ". .venv/bin/activate && python -m pytest -q && mkdocs build --strict"
    for text in (readme, quickstart):
        assert f"{install} && bash examples/run.sh" in text and tests in text
    assert f"{install} ||" in ci  # .ci/run: README (a)'s install, then (b)
    assert re.search(r"^python -m pytest -q$", ci, re.M) and re.search(r"^mkdocs build --strict$", ci, re.M)


def test_no_help_text_shows_an_unset_bound_or_sentinel():
    """Every command's --help (what the CLI reference shows): no "x<=None"
    from an unbounded FloatRange, no click Sentinel default."""
    from storyrl.cli import main

    ctx = click.Context(main, info_name="storyrl")
    for path in _command_paths(main, ("storyrl",), ctx):
        command, sub_ctx = main, ctx
        for name in path[1:]:
            command = command.get_command(sub_ctx, name)
            sub_ctx = click.Context(command, parent=sub_ctx, info_name=name)
        text = command.get_help(sub_ctx)
        assert not re.search(r"[<>]=?None\b|None<=?|Sentinel", text), f"{' '.join(path)} --help: {text}"
