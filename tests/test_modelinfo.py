"""Model classes read from GGUF metadata, and the tiny generated models a real server runs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest

from kvproxy.server.managed import resolve_model
from kvproxy.server.modelinfo import ModelInfo, model_identity, read_gguf_metadata, read_model_info

from .conftest import RealServer, start_real_server
from .ggufmodels import model_files


def write_metadata_only(path: Path, arch: str, **keys: Any) -> Path:
    """A GGUF with metadata and no tensors: enough for read_model_info."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(4)
    for name, value in keys.items():
        key = f"{arch}.{name.replace('__', '.')}"
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- classification


def test_bundled_gemma3_is_swa_512() -> None:
    info = read_model_info(resolve_model("default"))
    assert info.architecture == "gemma3"
    assert info.model_class == "swa"
    assert info.has_swa and info.n_swa == 512
    assert not info.is_recurrent and not info.is_hybrid
    assert info.restore_reuse() == "none"
    assert info.restore_reuse(swa_full=True) == "prefix"


@pytest.mark.parametrize(
    ("kind", "arch", "model_class", "reuse"),
    [
        ("dense", "llama", "dense", "prefix"),
        ("recurrent", "mamba", "recurrent", "extension"),
        ("hybrid", "lfm2", "hybrid", "extension"),
    ],
)
def test_generated_models_are_classified(
    tiny_models: dict[str, Path], kind: str, arch: str, model_class: str, reuse: str
) -> None:
    info = read_model_info(tiny_models[kind])
    assert info.path == tiny_models[kind]
    assert info.architecture == arch
    assert info.model_class == model_class
    assert info.is_recurrent == (model_class == "recurrent")
    assert info.is_hybrid == (model_class == "hybrid")
    assert not info.has_swa and info.n_swa == 0
    assert info.restore_reuse() == reuse


def test_model_files_are_written_once(tmp_path: Path) -> None:
    first = model_files(tmp_path)
    stamps = {kind: path.stat().st_mtime_ns for kind, path in first.items()}
    again = model_files(tmp_path)
    assert again == first
    assert {kind: path.stat().st_mtime_ns for kind, path in again.items()} == stamps
    assert all(path.stat().st_size < 4_000_000 for path in first.values())
    assert not list(tmp_path.glob(".*.tmp"))


def test_metadata_reader_reads_per_layer_arrays(tiny_models: dict[str, Path]) -> None:
    meta = read_gguf_metadata(tiny_models["hybrid"])
    assert meta["general.architecture"] == "lfm2"
    assert meta["lfm2.attention.head_count_kv"] == [0, 2, 0, 2]
    assert meta["lfm2.shortconv.l_cache"] == 3
    assert meta["tokenizer.ggml.tokens"] is None  # string arrays are skipped
    assert "<|im_start|>" in meta["tokenizer.chat_template"]


@pytest.mark.parametrize(
    ("arch", "keys", "model_class", "n_swa"),
    [
        # gemma2 always has SWA layers; 4096 when the file does not say.
        ("gemma2", {}, "swa", 4096),
        ("gemma3", {}, "dense", 0),
        ("gemma3", {"attention__sliding_window": 1024}, "swa", 1024),
        # a per-layer pattern without any sliding layer means none
        (
            "gemma3",
            {"attention__sliding_window": 512, "attention__sliding_window_pattern": [0] * 4},
            "dense",
            0,
        ),
        ("gpt-oss", {"attention__sliding_window": 128}, "swa", 128),
        # phi3 GGUFs carry the key, but this build disables SWA for them
        ("phi3", {"attention__sliding_window": 2047}, "dense", 0),
        ("llama4", {}, "swa", 8192),
        ("llama4", {"attention__sliding_window": 0}, "dense", 0),
        ("mamba2", {"ssm__state_size": 128}, "recurrent", 0),
        ("rwkv7", {"wkv__head_size": 64}, "recurrent", 0),
        ("granitehybrid", {"ssm__state_size": 128}, "hybrid", 0),
        ("qwen35", {"full_attention_interval": 4}, "hybrid", 0),
        ("lfm2", {"attention__sliding_window": 512}, "hybrid", 512),
        # architectures this table does not know: the keys decide
        ("future-ssm", {"ssm__state_size": 16, "attention__head_count": 0}, "recurrent", 0),
        ("future-hybrid", {"ssm__state_size": 16, "attention__head_count_kv": [0, 8]}, "hybrid", 0),
        ("future-swa", {"attention__sliding_window": 256}, "swa", 256),
        ("future-dense", {"attention__head_count": 8}, "dense", 0),
    ],
)
def test_classification_from_metadata(
    tmp_path: Path, arch: str, keys: dict[str, Any], model_class: str, n_swa: int
) -> None:
    info = read_model_info(write_metadata_only(tmp_path / "m.gguf", arch, **keys))
    assert (info.architecture, info.model_class, info.n_swa) == (arch, model_class, n_swa)
    assert info.has_swa == (n_swa > 0)


def test_unreadable_files_are_unknown(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a model\n")
    empty = tmp_path / "empty.gguf"
    empty.touch()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_models["dense"].read_bytes()[:200])
    no_arch = tmp_path / "noarch.gguf"
    w = gguf.GGUFWriter(no_arch, "llama")
    w.kv_data[0].pop("general.architecture")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    for path in (text, empty, truncated, no_arch, tmp_path / "missing.gguf", tmp_path):
        info = read_model_info(path)
        assert info == ModelInfo(path), path
        assert info.model_class == "unknown"
        assert info.restore_reuse() == "extension"


# --- a real llama-server runs each generated model


def post_json(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    servers: list[RealServer] = []

    def start(model: Path) -> str:
        save_dir = tmp_path / f"slots-{len(servers)}"
        save_dir.mkdir()
        servers.append(
            start_real_server(save_dir, model=model, ctx_per_slot=2048, extra=("--cache-ram", "0"))
        )
        return servers[-1].url

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.mark.real
@pytest.mark.parametrize("kind", ["dense", "recurrent", "hybrid"])
def test_real_server_runs_generated_model(
    serve: Any, tiny_models: dict[str, Path], kind: str
) -> None:
    url = serve(tiny_models[kind])
    status, reply = post_json(
        url + "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "You are a test."},
                {"role": "user", "content": "hello world, what is the cache?"},
            ],
            "max_tokens": 8,
        },
    )
    assert status == 200, reply
    assert isinstance(reply["choices"][0]["message"]["content"], str)
    assert 0 < reply["usage"]["completion_tokens"] <= 8
    # the ChatML template rendered and tokenised: BOS, control tokens and text
    assert reply["timings"]["prompt_n"] + reply["timings"]["cache_n"] > 20


def test_servers_reporting_other_weight_types_at_one_path_have_other_identities() -> None:
    base = {"model_path": "/nowhere/model.gguf", "default_generation_settings": {"n_ctx": 4096}}
    q4 = model_identity({**base, "model_ftype": "Q4_K - Medium"})
    q8 = model_identity({**base, "model_ftype": "Q8_0"})
    assert q4 != q8 and q4 == model_identity({**base, "model_ftype": "Q4_K - Medium"})
    assert model_identity(base) != model_identity({**base, "default_generation_settings": {}})
