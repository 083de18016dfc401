"""`make demo` ends with a short live run and prints the dashboard's URL (issue 23)."""

from __future__ import annotations

import re

import pytest

from pagedkv.demo import run_dashboard_demo

pytestmark = pytest.mark.timeout(120)


def test_demo_prints_the_dashboard_url_of_a_live_run(tiny_llama, capsys):
    run_dashboard_demo(str(tiny_llama), keep_serving=False, port=0)
    out = capsys.readouterr().out
    match = re.search(r"live dashboard: (http://127\.0\.0\.1:\d+)/dashboard", out)
    assert match, out
    assert "make demo DASHBOARD=1" in out
