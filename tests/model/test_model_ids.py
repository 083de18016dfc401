"""Model ids as vLLM takes them (`org/name` through the Hugging Face cache), offline: the cache is
built in the test as the hub lays it out, from a local tiny model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.cli import main as cli_main
from pagedkv.model.hub import looks_like_repo_id, resolve_model

REPO = "tiny-org/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, model_dir: Path, repo: str = REPO, revision: str = REVISION) -> Path:
    """`root` laid out as huggingface_hub's cache holding `model_dir` as `repo` at `revision`
    (refs/main names it)."""
    folder = root / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / revision
    shutil.copytree(model_dir, snapshot)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HF_HUB_OFFLINE=1 and an empty HF_HOME (so nothing real is found)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    return tmp_path / "hf_home"


def test_repo_id_shapes():
    assert looks_like_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    for path in ("/abs/model", "./rel/model", "model", "a/b/c", "~/m/x", "org/na..me"):
        assert not looks_like_repo_id(path), path


def test_id_resolves_from_hf_home_cache(offline, tiny_llama):
    snapshot = hub_cache(offline / "hub", tiny_llama)
    assert Path(resolve_model(REPO)) == snapshot
    assert Path(resolve_model(REPO, revision=REVISION)) == snapshot


def test_llm_takes_an_id_and_download_dir(offline, tiny_llama, tmp_path):
    download_dir = tmp_path / "downloads"
    hub_cache(download_dir, tiny_llama)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    by_id = LLM(REPO, download_dir=str(download_dir), num_gpu_blocks_override=32,
                dtype="float32")
    try:
        got = by_id.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        by_id.shutdown()
    by_path = LLM(str(tiny_llama), num_gpu_blocks_override=32, dtype="float32")
    try:
        want = by_path.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        by_path.shutdown()
    assert got == want and len(got) == 4


def test_uncached_id_offline_is_one_clear_error(offline):
    with pytest.raises(ValueError) as info:
        LLM("nobody-here/no-such-model")
    message = str(info.value)
    assert "'nobody-here/no-such-model' is not a local path" in message
    assert "not in the Hugging Face cache" in message and "HF_HUB_OFFLINE" in message
    assert "hf download nobody-here/no-such-model" in message
    assert "tokenizer.json" not in message and "\n" not in message


def test_unknown_revision_offline(offline, tiny_llama):
    hub_cache(offline / "hub", tiny_llama)
    with pytest.raises(ValueError, match="at revision 'v9'.*not in the Hugging Face cache"):
        resolve_model(REPO, revision="v9")


def test_serve_uncached_id_is_one_cli_line(offline, capsys):
    assert cli_main(["serve", "nobody-here/no-such-model", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not in the Hugging Face cache" in err
    assert "Traceback" not in err


def test_missing_local_path_keeps_its_message(offline, tmp_path, capsys):
    missing = tmp_path / "nope"
    assert resolve_model(str(missing)) == str(missing)
    with pytest.raises(ValueError, match="model directory not found"):
        LLM(str(missing))
    assert cli_main(["serve", str(missing), "--port", "0"]) == 2
    assert "does not exist" in capsys.readouterr().err
