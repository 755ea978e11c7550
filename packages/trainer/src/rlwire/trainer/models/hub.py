"""Hub ids (``org/name``) for models and datasets: a local snapshot through
``huggingface_hub``, downloaded on first use and taken from its cache after that (and only
from there with ``HF_HUB_OFFLINE=1``), or one line saying why not and how to get it."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import RunError

__all__ = ["MODEL_FILES", "snapshot"]

MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
"""What a model's snapshot takes: config, weights (safetensors only) and tokenizer files."""


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def snapshot(repo_id: str, key: str, *, repo_type: str = "model") -> Path:
    """The local folder of the Hub repository ``repo_id`` (named ``key`` in errors)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    kind = "" if repo_type == "model" else f" --repo-type {repo_type}"
    patterns = MODEL_FILES if repo_type == "model" else None
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, allow_patterns=patterns))
    except GatedRepoError:
        raise RunError(
            f"{key}: {repo_id!r} is gated on the Hub; accept its terms on its page and log in "
            "(hf auth login, or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise RunError(
            f"{key}: no {repo_type} {repo_id!r} on the Hub (nor a local path of that name); "
            "check the id, or log in (hf auth login) for a private one"
        ) from None
    except LocalEntryNotFoundError:
        offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE") == "1"
        why = "HF_HUB_OFFLINE=1" if offline else "the Hub cannot be reached"
        raise RunError(
            f"{key}: {repo_id!r} is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) and {why}; download it first: "
            f"hf download {repo_id}{kind}"
        ) from None
    except (HfHubHTTPError, OSError) as err:
        raise RunError(
            f"{key}: cannot fetch {repo_id!r} from the Hub: {_first_line(err)}"
        ) from None
