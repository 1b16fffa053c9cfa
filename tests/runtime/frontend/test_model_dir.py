"""Where the frontend reads the tokenizer: the recipe's directory, or for a hub id (TensorRT-LLM fetches such a
model's weights itself) the tokenizer's files alone, fetched through huggingface_hub; a fetch that fails is one
line that names the fix."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc.runtime.frontend.server import TOKENIZER_FILES, model_dir
from hpc.runtime.frontend.tokenizer import TextCodec

pytestmark = pytest.mark.unit


def _manifest(path: str, tokenizer: str | None = None):
    return SimpleNamespace(recipe=SimpleNamespace(model=SimpleNamespace(path=path, tokenizer=tokenizer)))


def test_a_directory_is_read_where_it_is(tmp_path):
    assert model_dir(_manifest(str(tmp_path / "weights"), str(tmp_path / "tok"))) == tmp_path / "tok"
    assert model_dir(_manifest("~/models/x")) == Path("~/models/x").expanduser()


def test_a_hub_id_fetches_only_the_tokenizers_files(tiny, tmp_path, monkeypatch):
    fetched = []

    def snapshot_download(repo_id, allow_patterns=None, **kw):
        fetched.append((repo_id, allow_patterns))
        out = tmp_path / "hub" / repo_id
        out.mkdir(parents=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            shutil.copy(Path(tiny) / name, out / name)
        return str(out)

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    found = model_dir(_manifest("deepseek-ai/DeepSeek-R1"))
    assert fetched == [("deepseek-ai/DeepSeek-R1", TOKENIZER_FILES)]
    assert "model.safetensors" not in TOKENIZER_FILES and "tokenizer.json" in TOKENIZER_FILES
    assert TextCodec(found).encode("hello")  # what was fetched is enough for the frontend


def test_a_hub_id_that_cannot_be_fetched_says_what_to_do(monkeypatch):
    def offline(repo_id, **kw):
        raise OSError("Network is unreachable")

    monkeypatch.setattr("huggingface_hub.snapshot_download", offline)
    with pytest.raises(RuntimeError) as caught:
        model_dir(_manifest("Qwen/Qwen3-30B-A3B"))
    text = str(caught.value)
    assert "'Qwen/Qwen3-30B-A3B'" in text and "Network is unreachable" in text
    assert "set recipe model.tokenizer to a directory the nodes mount that holds tokenizer.json" in text
    assert "\n" not in text
