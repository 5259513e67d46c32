"""Where a --model value points on disk, told without importing the model code (start-up checks run
before torch loads): a local directory, or a Hugging Face Hub id whose snapshot is in the local
Hugging Face cache (HF_HUB_CACHE / HF_HOME), as vLLM users name models. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path


def model_dir(model: str) -> Path | None:
    """The directory `model` names (a path, or a cached Hub id's snapshot at revision main); None if
    there is none on disk."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


MISSING_MODEL = ("no such directory, nor a model id in the local Hugging Face cache (HF_HUB_CACHE / HF_HOME; "
                 "nothing is downloaded): pass a local Hugging Face directory, a cached model id such as "
                 "org/name, or builtin:<name>")
