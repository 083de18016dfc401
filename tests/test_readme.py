"""The README as a newcomer reads it: one short front door whose links resolve, whose snippets
agree with each other and with the code (the serve line's name is the one the clients send;
every keyword of the Python API snippet is an engine argument), that says nothing of how the
project was made, and whose suite time is the one tests/README.md gives."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from pagedkv.engine.args import EngineArgs

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
MAX_LINES = 200
# How the project was made has no place in it: milestones, people's jobs, machines' load,
# commit hashes.
MAKING = [r"\bstop \d+", r"\bhelpers?\b", r"\bengineers?\b", r"load average", r"\buptime\b",
          r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", r"\bmilestone"]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_it_is_a_front_door_not_a_notebook():
    assert len(README.splitlines()) <= MAX_LINES
    first_screen = "\n".join(README.splitlines()[:60])
    assert "pagedkv serve" in first_screen and "/v1/chat/completions" in first_screen
    assert "from openai import OpenAI" in first_screen


@pytest.mark.parametrize("pattern", MAKING)
def test_it_says_nothing_of_how_the_project_was_made(pattern):
    assert not re.search(pattern, README, flags=re.I), re.search(pattern, README, flags=re.I)


def test_every_relative_link_resolves():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert len(local) > 20  # the feature table's and the docs' links
    missing = [link for link in local if not (ROOT / link).exists()]
    assert missing == []


def test_the_clients_send_the_name_the_server_is_started_with():
    served = re.search(r"pagedkv serve \S+ --served-model-name (\S+)", README).group(1)
    curl = next(b for b in blocks("bash") if "curl" in b)
    assert f'"model": "{served}"' in curl
    client = next(b for b in blocks("python") if "OpenAI(" in b)
    assert f'model="{served}"' in client


def test_the_python_snippets_compile_and_name_real_engine_arguments():
    snippets = blocks("python")
    assert len(snippets) >= 2
    for snippet in snippets:
        compile(snippet, "README.md", "exec")
    api = next(s for s in snippets if "LLM(" in s)
    call = next(node for node in ast.walk(ast.parse(api)) if isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "LLM")
    for node in ast.walk(ast.parse(api)):  # what it imports exists (it runs as written)
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            assert all(hasattr(module, alias.name) for alias in node.names), node.module
    assert "path/to" not in api
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg != "model"}
    assert EngineArgs(model="m", **kwargs).kv_cache_dtype == "int8"  # ValueError if not


def test_the_suite_time_is_the_one_tests_readme_gives():
    stated = re.search(r"the whole suite: about (\d+) minutes", README).group(1)
    tests_readme = (ROOT / "tests" / "README.md").read_text(encoding="utf-8")
    assert re.search(rf"took about {stated} min\b", tests_readme), stated
