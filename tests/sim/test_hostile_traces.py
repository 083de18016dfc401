"""`pagedkv simulate` on hostile traces (issue 43): every malformed row ends the run with one
line `pagedkv simulate: error: FILE:LINE: reason` and exit 2 (no traceback, no memory blow-up),
and a row too long for the model is sized and refused before any token is made for it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pagedkv.cli import main
from pagedkv.sim import traces

pytestmark = pytest.mark.timeout(120, method="thread")

ROW = {"timestamp": 0, "input_length": 40, "output_length": 4, "hash_ids": [1, 2, 3]}
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_ROW = "2023-11-16 18:15:46.6805900,374,44\n"


def mooncake(tmp_path: Path, bad_line: str) -> Path:
    """A trace whose third line is `bad_line`, the others good rows."""
    good = json.dumps(ROW)
    path = tmp_path / "trace.jsonl"
    path.write_text(f"{good}\n{good}\n{bad_line}\n{good}\n", encoding="utf-8")
    return path


def simulate(capsys, path: Path, *flags: str) -> tuple[int, str, str]:
    code = main(["simulate", str(path), "--latency", "linear", *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line(capsys, path: Path, line: int, says: str, *flags: str) -> None:
    code, _, err = simulate(capsys, path, *flags)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert re.match(rf"pagedkv simulate: error: {re.escape(str(path))}:{line}: ", lines[0]), err
    assert says in lines[0], err


@pytest.mark.parametrize(("field", "value", "says"), [
    ("input_length", "1e400", "input_length must be an integer, got inf"),
    ("input_length", "12.5", "input_length must be an integer"),
    ("output_length", "true", "output length must be an integer"),
    ("timestamp", "1" + "0" * 400, "too large"),
    ("hash_ids", '"abc"', "hash_ids must be a list"),
    ("hash_ids", "[1e400]", "a hash id must be an integer"),
    ("session_id", "5", "session_id must be a string, got 5"),
])
def test_a_malformed_mooncake_field_is_one_line_naming_file_and_line(tmp_path, capsys, field,
                                                                      value, says):
    row = json.dumps({k: v for k, v in ROW.items() if k != field})
    bad = row[:-1] + f', "{field}": {value}}}'
    assert_one_line(capsys, mooncake(tmp_path, bad), 3, says, "--instances", "2",
                    "--policy", "session")


def test_deeply_nested_json_is_one_line(tmp_path, capsys):
    deep = "[" * 100_000 + "]" * 100_000
    assert_one_line(capsys, mooncake(tmp_path, deep), 3, "nested too deeply")
    # On the first line the format sniffer reads it: the same line.
    path = tmp_path / "first.jsonl"
    path.write_text("{\"a\": " + deep + "}\n", encoding="utf-8")
    assert_one_line(capsys, path, 1, "nested too deeply")


def test_binary_junk_is_one_line_naming_file_and_line(tmp_path, capsys):
    path = mooncake(tmp_path, "placeholder")
    data = path.read_bytes().replace(b"placeholder", b"\xff\xfe\x00junk\x80")
    path.write_bytes(data)
    assert_one_line(capsys, path, 3, "not UTF-8")
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    assert_one_line(capsys, path, 1, "not UTF-8")


def test_an_azure_field_past_the_csv_limit_is_one_line(tmp_path, capsys):
    path = tmp_path / "azure.csv"
    path.write_text(AZURE_HEADER + AZURE_ROW + AZURE_ROW.replace("374", "3" * 131_073)
                    + AZURE_ROW, encoding="utf-8")
    assert_one_line(capsys, path, 3, "field larger than field limit")
    path.write_text(AZURE_HEADER + AZURE_ROW + "2023-11-16 18:15:47,1e400,4\n",
                    encoding="utf-8")
    assert_one_line(capsys, path, 3, "ContextTokens must be an integer")
    path.write_text(AZURE_HEADER + AZURE_ROW + "2023-11-16 18:15:47\n", encoding="utf-8")
    assert_one_line(capsys, path, 3, "must be an integer, got None")
    path.write_bytes((AZURE_HEADER + AZURE_ROW).encode() + b"\xc3\x28,1,1\n")
    assert_one_line(capsys, path, 3, "not UTF-8")


def test_a_request_log_row_is_checked_as_strictly(tmp_path, capsys):
    good = {"arrival": 0.0, "prompt_tokens": 40, "output_tokens": 4, "block_size": 16,
            "prefix_block_hashes": ["ab"]}
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(good)[:-1] + ', "block_size": 1e400}\n',
                    encoding="utf-8")
    assert_one_line(capsys, path, 2, "block_size must be an integer")


def test_a_prompt_past_max_model_len_is_refused_before_any_token_is_made(tmp_path, capsys,
                                                                          monkeypatch):
    made: list[int] = []
    real = traces.prompt_token_ids

    def counting(request, vocab_size, unique_id):
        made.append(request.input_length)
        if request.input_length > 1_000_000:  # fail fast rather than fill the memory
            raise AssertionError(f"tokens made for a {request.input_length}-token prompt")
        return real(request, vocab_size, unique_id)

    monkeypatch.setattr("pagedkv.sim.simulator.prompt_token_ids", counting)
    monkeypatch.setattr("pagedkv.sim.lazy_request.prompt_token_ids", counting)
    huge = json.dumps({**ROW, "input_length": 3_000_000_000, "hash_ids": list(range(9))})
    path = mooncake(tmp_path, huge)
    out_json = tmp_path / "s.json"
    code, _, err = simulate(capsys, path, "--instances", "2", "--json", str(out_json))
    assert code == 0, err
    summary = json.loads(out_json.read_text())
    assert summary["requests"] == 4 and summary["rejected"] == 1 and summary["finished"] == 3
    assert 3_000_000_000 not in made and len(made) >= 3  # the others' tokens were made
