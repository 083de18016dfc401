"""The command line before anything loads: a mistake in the flags answers with one line and
exit code 2 without importing torch or the server (so at once), `--help` and `--version` import
no subcommand, `--model` stands for the positional model, and `--chat-template` takes a file or
the template itself (checked before the model loads). The access log's scrape filter, unit by
unit. The running server's side (banner, access log) is in test_serve_startup.py."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from pagedkv.cli import COMMANDS, build_parser
from pagedkv.commands.chat_template import load_chat_template
from pagedkv.commands.early_checks import check_architecture, check_machine, gpu_driver_present
from pagedkv.commands.engine_flags import model_argument
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.kv_setup import GiB, host_memory_bytes
from pagedkv.http.access_log import ACCESS_LOGGER, SCRAPE_PATHS, ScrapesAtDebug, request_path
from pagedkv.model.registry_names import MODELS

REPO_ROOT = Path(__file__).resolve().parents[2]
# Generous for a loaded 2-core machine; idle, each of these answers in about 0.5 s. The
# import check below is what pins the cause (no torch, no server) exactly.
ANSWER_BOUND_S = 10.0
HEAVY_MODULES = ("torch", "uvicorn", "fastapi", "transformers", "pagedkv.engine.llm_engine")

# Runs `pagedkv` in a fresh interpreter and reports its exit code and the heavy modules it
# imported, as JSON on the last line of stdout.
_PROBE = """
import json, sys
from pagedkv.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = [m for m in HEAVY_MODULES if m in sys.modules]
print(json.dumps({"code": code, "heavy": heavy}))
""".replace("HEAVY_MODULES", repr(HEAVY_MODULES))


def run_cli(*argv: str) -> tuple[dict, str, str, float]:
    """(the probe's report, stdout before it, stderr, seconds) of `pagedkv ARGV...`."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    *out, report = proc.stdout.rstrip("\n").split("\n")
    return json.loads(report), "\n".join(out), proc.stderr, elapsed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory the flag checks accept as a model (they never read it)."""
    return tmp_path_factory.mktemp("model")


@pytest.mark.parametrize("argv, message", [
    (("serve", "--bogus", "M"), "pagedkv serve: error: unrecognized arguments: --bogus"),
    (("--bogus",), "pagedkv: error: unrecognized arguments: --bogus"),
    (("serve", "M", "--device", "cuda:1"), "pagedkv serve: error: argument --device: invalid"),
    (("serve", "--block-size", "-3", "M"), "block_size must be a positive integer, got -3"),
    (("serve", "M", "--port", "70000"), "--port must be in [0, 65535], got 70000"),
    (("serve", "M", "--dtype", "float8"), "argument --dtype: invalid choice"),
    (("serve", "/no/such/model"), "model directory '/no/such/model' does not exist"),
    (("serve",), "no model given: pagedkv serve MODEL_DIR (or --model MODEL_DIR)"),
    (("serve", "M", "--model", "/elsewhere"), "the model is given twice"),
    (("serve", "M", "--chat-template", "no-such.jinja"), "'no-such.jinja' looks like a path"),
    (("serve", "M", "--chat-template", "{% if %}"), "not a valid Jinja template"),
    (("generate", "M", "--prompt", "x", "--max-num-seqs", "0"), "max_num_seqs must be"),
])
def test_a_flag_mistake_is_one_line_before_any_heavy_import(argv, message, model_dir):
    argv = tuple(str(model_dir) if a == "M" else a for a in argv)
    report, out, err, elapsed = run_cli(*argv)
    assert report["code"] == 2, (out, err)
    assert report["heavy"] == [], f"imported before the flags were checked: {report['heavy']}"
    assert message in err, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()  # no usage dump before it (sixty lines for serve)
    assert len(lines) == 1 and lines[0].startswith("pagedkv") and "error:" in lines[0], err
    assert elapsed < ANSWER_BOUND_S


@pytest.mark.skipif(gpu_driver_present(), reason="this machine has a GPU driver")
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_what_the_machine_cannot_have_is_one_line_before_any_heavy_import(command, model_dir):
    """A CUDA device with no GPU driver, a KV cache over the machine's memory: at once."""
    total, _ = host_memory_bytes()
    prompt = ("--prompt", "x") if command == "generate" else ()
    for flags, message in ((("--device", "cuda"), "CUDA is not available"),
                           (("--kv-cache-memory-bytes", str(2 * total)),
                            f"--kv-cache-memory-bytes asks for a {2 * total / GiB:.1f} GiB")):
        report, out, err, elapsed = run_cli(command, str(model_dir), *prompt, *flags)
        assert report["code"] == 2 and report["heavy"] == [], (out, err)
        assert err.strip().count("\n") == 0 and message in err, err
        assert elapsed < ANSWER_BOUND_S


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_an_architecture_not_run_here_is_one_line_before_any_heavy_import(command, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2", "n_layer": 2}))
    prompt = ("--prompt", "x") if command == "generate" else ()
    report, out, err, elapsed = run_cli(command, str(tmp_path), *prompt)
    assert report["code"] == 2 and report["heavy"] == [], (out, err)
    assert err.strip() == (f"pagedkv {command}: error: architecture 'GPT2LMHeadModel' is not "
                           f"supported; supported: {', '.join(MODELS)}"), err
    assert elapsed < ANSWER_BOUND_S


def test_a_config_without_architectures_is_left_to_the_loader(tmp_path):
    check_architecture(str(tmp_path))  # no config.json
    (tmp_path / "config.json").write_text("{}")
    check_architecture(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    check_architecture(str(tmp_path))


def test_machine_checks_name_the_flag_and_leave_what_fits():
    ok = EngineArgs(model="m", device="cpu", kv_cache_memory_bytes=1 << 20)
    check_machine(ok, paths=())
    with pytest.raises(ValueError, match="'cuda' \\(--device\\)"):
        check_machine(EngineArgs(model="m", device="cuda"), paths=())
    check_machine(EngineArgs(model="m", device="auto"), paths=(__file__,))  # a "driver"
    too_big = host_memory_bytes()[0] + GiB
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes"):
        check_machine(EngineArgs(model="m", device="auto", kv_cache_memory_bytes=too_big),
                      paths=())
    # on a GPU the KV cache is the GPU's to hold: checked when the engine starts
    check_machine(EngineArgs(model="m", device="auto", kv_cache_memory_bytes=too_big),
                  paths=(__file__,))


def test_version_is_the_package_metadata_and_imports_nothing_heavy():
    report, out, err, _ = run_cli("--version")
    assert (report["code"], report["heavy"]) == (0, [])
    assert out.strip() == version("pagedkv"), (out, err)


def test_help_lists_every_command_without_importing_one():
    report, out, _, _ = run_cli("--help")
    assert (report["code"], report["heavy"]) == (0, [])
    for name, summary in COMMANDS.items():
        assert name in out and " ".join(summary.split()[:3]) in " ".join(out.split())


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_commands_own_summary_is_the_one_help_shows(command):
    """`pagedkv --help` shows COMMANDS' summaries without loading the commands: each module's
    own `help=` must say the same."""
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    shown = {a.dest: a.help for a in sub._choices_actions}
    assert shown[command] == COMMANDS[command]


def test_serve_help_is_light():
    report, out, _, _ = run_cli("serve", "--help")
    assert (report["code"], report["heavy"]) == (0, [])
    assert "--model MODEL_DIR" in out and "--chat-template" in out


@pytest.mark.parametrize("argv, expected", [
    (("serve", "m"), "m"),
    (("serve", "--model", "m"), "m"),
    (("serve", "m", "--model", "m"), "m"),
    (("generate", "--model", "m", "--prompt", "x"), "m"),
])
def test_model_is_positional_or_the_model_flag(argv, expected):
    assert model_argument(build_parser(argv[0]).parse_args(list(argv))) == expected


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    inline = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(inline + "\n", encoding="utf-8")
    assert load_chat_template(str(path)) == inline + "\n"
    assert load_chat_template(inline) == inline
    with pytest.raises(ValueError, match="no-such.jinja"):
        load_chat_template(str(tmp_path / "no-such.jinja"))
    with pytest.raises(ValueError, match=r"line 2"):
        load_chat_template("ok\n{% for %}")


def _access_record(path: str, level: int = logging.INFO) -> logging.LogRecord:
    """A record as uvicorn's access logger makes one."""
    return logging.LogRecord(ACCESS_LOGGER, level, __file__, 0, '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5", "GET", path, "1.1", 200), None)


@pytest.fixture
def access_level():
    """Sets uvicorn's access logger's level (setLevel: it clears the logger's cache), then
    restores it."""
    access = logging.getLogger(ACCESS_LOGGER)
    before = access.level
    yield access.setLevel
    access.setLevel(before)


@pytest.mark.parametrize("path", sorted(SCRAPE_PATHS) + ["/metrics?name[]=vllm:x"])
def test_scrapes_are_debug_lines(path, access_level):
    access_level(logging.INFO)
    assert request_path(_access_record(path)) == path.split("?")[0]
    assert not ScrapesAtDebug().filter(_access_record(path))
    access_level(logging.DEBUG)
    record = _access_record(path)
    assert ScrapesAtDebug().filter(record)
    assert (record.levelno, record.levelname) == (logging.DEBUG, "DEBUG")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize",
                                  "/dashboard", "/dashboard/api/request/r1", "/healthz"])
def test_requests_stay_info_lines(path, access_level):
    access_level(logging.INFO)
    record = _access_record(path)
    assert ScrapesAtDebug().filter(record)
    assert record.levelno == logging.INFO
