"""Models by name: `ORG/NAME[@REVISION]` resolved to a local snapshot folder through huggingface_hub.

huggingface_hub's conventions apply unchanged: its cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub`), `HF_HUB_OFFLINE=1` (cache only, no network), and its token (`HF_TOKEN` or
`hf auth login`) for gated and private models. A cached snapshot is used without a download; otherwise
only the files the engine reads are fetched: top-level config / tokenizer / generation files and the
`*.safetensors` weights (`pytorch_model*.bin` only when the repository has no safetensors).

A revision is a branch, a tag or a commit hash; without one, `main`. The model's name (what the
service serves and signs) is the repository id, without the revision: the weights digest pins the bytes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^\s@]+))?$")
_METADATA = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_SAFETENSORS = ["*.safetensors"]
_TORCH_BIN = ["pytorch_model*.bin"]
_NESTED = ["*/*"]  # subfolders (`original/` checkpoints, onnx/, ...): the engine reads the top level only


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    revision: str | None  # branch, tag or commit hash; None: the repository's `main`

    @property
    def spec(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")

    def download_command(self) -> str:
        return f"hf download {self.repo_id}" + (f" --revision {self.revision}" if self.revision else "")


def parse_hub_id(spec: str) -> HubModel | None:
    """`ORG/NAME[@REVISION]` as a HubModel; None when `spec` does not have that form (a path, say)."""
    if spec.startswith((".", "/", "~")) or spec.lower().endswith(".gguf"):
        return None
    match = _HUB_ID.match(spec)
    if match is None:
        return None
    return HubModel(match["repo"], match["revision"])


def hub_snapshot(model: HubModel, *, offline: bool | None = None, cache_dir: Path | None = None) -> Path:
    """The local snapshot folder of `model`, downloaded when it is not cached and the Hub is reachable.

    offline / cache_dir: None keeps huggingface_hub's own setting (HF_HUB_OFFLINE, HF_HUB_CACHE / HF_HOME);
    True / a folder override it. ValueError naming the model and what to do when it cannot be had.
    """
    folder = _snapshot(model, _METADATA + _SAFETENSORS, offline, cache_dir)
    if not any(folder.glob("*.safetensors")) and (folder / "config.json").is_file():
        folder = _snapshot(model, _METADATA + _TORCH_BIN, offline, cache_dir)
    if not (folder / "config.json").is_file():
        gguf = sorted(p.name for p in folder.glob("*.gguf"))
        hint = (f"; it holds GGUF files ({', '.join(gguf[:3])}): download one and pass its path as the model"
                if gguf else "")
        raise ValueError(f"model: Hugging Face model {model.spec!r} has no config.json in {str(folder)!r}{hint}")
    return folder


def _snapshot(model: HubModel, patterns: list[str], offline: bool | None, cache_dir: Path | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = constants.HF_HUB_OFFLINE if offline is None else offline
    where = Path(cache_dir or constants.HF_HUB_CACHE)
    try:
        return Path(snapshot_download(model.repo_id, revision=model.revision, cache_dir=cache_dir,
                                      allow_patterns=patterns, ignore_patterns=_NESTED, local_files_only=offline))
    except HFValidationError as exc:
        raise ValueError(f"model: {model.spec!r} is not a valid Hugging Face model id: {exc}") from None
    except GatedRepoError:
        raise ValueError(f"model: Hugging Face model {model.repo_id!r} is gated: accept its terms on its Hub page, "
                         "then log in (`hf auth login`) or set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model: Hugging Face model {model.repo_id!r} was not found on the Hub (a private one "
                         "needs `hf auth login` or HF_TOKEN); a local folder or .gguf file must exist") from None
    except RevisionNotFoundError:
        raise ValueError(f"model: revision {model.revision!r} of Hugging Face model {model.repo_id!r} does not "
                         "exist on the Hub") from None
    except LocalEntryNotFoundError as exc:
        reason = ("downloads are off (HF_HUB_OFFLINE=1)" if offline
                  else f"the Hub could not be reached ({_cause(exc)})")
        raise ValueError(
            f"model: Hugging Face model {model.spec!r} is not in the cache {str(where)!r} and {reason}; "
            f"download it with `{model.download_command()}` on a machine that reaches the Hub (then copy "
            "that cache here or point HF_HOME / HF_HUB_CACHE at it)"
            + ("" if offline else ", or check the network and proxy settings")
            + ("; or set HF_HUB_OFFLINE=0 to let this machine download it" if offline else "")) from None
    except HfHubHTTPError as exc:
        raise ValueError(f"model: the Hugging Face Hub refused {model.spec!r}: {exc}") from None


def _cause(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    return f"{type(cause).__name__}: {cause}" if cause is not None else type(exc).__name__


def hub_name_of_snapshot(folder: Path) -> str | None:
    """`org/name` for a folder inside a hub cache (`models--org--name/snapshots/<commit>`), else None: a
    snapshot passed as a path is served under its repository id, not its commit hash."""
    parent, repo = folder.parent, folder.parent.parent
    if parent.name == "snapshots" and repo.name.startswith("models--") and repo.name.count("--") >= 2:
        org, _, name = repo.name.removeprefix("models--").partition("--")
        return f"{org}/{name}"
    return None
