"""The generated reference pages (docs/usage/engine-args.md, cli.md) match their declaration."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pagedkv.cli import COMMANDS
from pagedkv.commands import options_doc
from pagedkv.engine.args import EngineArgs

DOCS_USAGE = Path(__file__).resolve().parents[1] / "docs" / "usage"


def test_checked_in_pages_match_the_code():
    stale = options_doc.stale_pages(DOCS_USAGE)
    assert stale == [], ("regenerate with `python -m pagedkv.commands.options_doc --write`: "
                         f"{stale}")


def test_every_engine_field_has_a_row_with_its_flag_and_default():
    page = options_doc.render("engine-args.md")
    rows = {line.split("|")[1].split("<br>")[0].strip(): line for line in page.splitlines()
            if line.startswith("| `")}
    for field in dataclasses.fields(EngineArgs):
        row = rows[f"`{field.name}`"]
        if field.name != "model":
            assert f"`--{field.name.replace('_', '-')}" in row
        if field.default is not None and field.name != "model":
            assert f"`{field.default}`" in row


def test_every_subcommand_has_a_section():
    page = options_doc.render("cli.md")
    for name in COMMANDS:
        assert f"## `pagedkv {name}`" in page
    assert "### `pagedkv bench serve`" in page
    assert "| `--backend` |" in page  # a router flag, from the router's own parser


def test_a_stale_page_is_reported(tmp_path):
    assert options_doc.main(["--dir", str(tmp_path), "--write"]) == 0
    assert options_doc.stale_pages(tmp_path) == []
    page = tmp_path / "engine-args.md"
    page.write_text(page.read_text().replace("`--block-size`", "`--blocksize`"))
    assert options_doc.stale_pages(tmp_path) == [str(page)]
    assert options_doc.main(["--dir", str(tmp_path), "--check"]) == 1


def test_pages_do_not_depend_on_the_environment(monkeypatch):
    clean = options_doc.render("cli.md")
    monkeypatch.setenv("PAGEDKV_API_KEY", "secret-key-from-env")
    monkeypatch.setenv("COLUMNS", "40")
    assert options_doc.render("cli.md") == clean
