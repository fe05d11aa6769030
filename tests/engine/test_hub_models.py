"""Models by Hugging Face id (engine/hub.py through engine/loader.py), offline, on a hub cache laid out on
disk as huggingface_hub writes it (tests/hub_cache.py), holding real tiny Llama models."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.hub import HubModel, hub_name_of_snapshot, parse_hub_id
from engine.loader import load_model_source
from tests.hub_cache import add_commit, tiny_llama

REPO = "verbatim-test/tiny-llama"
MAIN = "a" * 40
V2 = "b" * 40


@pytest.fixture(scope="module")
def hub(tmp_path_factory, smollm2_source) -> dict[str, Path]:
    """A hub cache with REPO at two commits: MAIN (refs/main) and V2 (tag v2), whose weights differ."""
    root = tmp_path_factory.mktemp("hub")
    cache = root / "cache"
    main = add_commit(cache, REPO, MAIN, tiny_llama(root / "m", smollm2_source.tokenizer, seed=1), refs=("main",))
    v2 = add_commit(cache, REPO, V2, tiny_llama(root / "v", smollm2_source.tokenizer, seed=2), refs=("v2",))
    return {"cache": cache, "main": main, "v2": v2, "main_source": root / "m"}


def load(spec: str, hub: dict[str, Path]):
    return load_model_source(spec, hub_offline=True, hub_cache=hub["cache"])


def test_id_resolves_to_the_cached_main_snapshot(hub) -> None:
    source = load(REPO, hub)
    assert source.info.name == REPO  # the id the user gave, not the commit hash
    assert source.folder == hub["main"]
    # the digest keeps its meaning: the same tensors loaded from a plain folder give the same digest
    assert source.info.weights_digest == load_model_source(hub["main_source"]).info.weights_digest


@pytest.mark.parametrize(("revision", "commit"), [("main", MAIN), ("v2", V2), (V2, V2), (MAIN, MAIN)])
def test_revision_selects_the_snapshot(hub, revision: str, commit: str) -> None:
    source = load(f"{REPO}@{revision}", hub)
    assert source.info.name == REPO and source.folder.name == commit
    assert source.info.weights_digest == load_model_source(hub["main" if commit == MAIN else "v2"]).info.weights_digest


def test_revisions_with_other_weights_have_other_digests(hub) -> None:
    assert load(f"{REPO}@v2", hub).info.weights_digest != load(REPO, hub).info.weights_digest


@pytest.mark.parametrize(("spec", "command"), [
    ("verbatim-test/not-cached", "`hf download verbatim-test/not-cached`"),
    (f"{REPO}@v3", f"`hf download {REPO} --revision v3`"),
])
def test_not_cached_offline_names_the_id_and_what_to_do(hub, spec: str, command: str) -> None:
    with pytest.raises(ValueError) as error:
        load(spec, hub)
    message = str(error.value)
    assert message.startswith(f"model: Hugging Face model {spec!r} is not in the cache {str(hub['cache'])!r}")
    assert "HF_HUB_OFFLINE=1" in message and command in message and "HF_HUB_OFFLINE=0" in message


def test_snapshot_folder_given_as_a_path_is_named_by_its_repository(hub) -> None:
    source = load_model_source(hub["v2"])
    assert source.info.name == REPO and source.folder == hub["v2"]
    assert hub_name_of_snapshot(hub["v2"]) == REPO and hub_name_of_snapshot(hub["main_source"]) is None


def test_existing_local_folder_wins_over_a_hub_id(hub, tmp_path: Path, monkeypatch) -> None:
    shutil.copytree(hub["main_source"], tmp_path / "verbatim-test" / "tiny-llama")
    monkeypatch.chdir(tmp_path)
    source = load(REPO, hub)
    assert source.folder == Path(REPO) and source.info.name == "tiny-llama"


def test_hub_repo_without_config_is_refused(hub, tmp_path: Path) -> None:
    gguf_only = tmp_path / "files"
    gguf_only.mkdir()
    (gguf_only / "model-Q4.gguf").write_bytes(b"GGUF")
    add_commit(hub["cache"], "verbatim-test/gguf-only", "c" * 40, gguf_only, refs=("main",))
    with pytest.raises(ValueError, match=r"^model: Hugging Face model 'verbatim-test/gguf-only' has no config.json"
                                         r".*GGUF files \(model-Q4.gguf\): download one and pass its path"):
        load("verbatim-test/gguf-only", hub)


@pytest.mark.parametrize(("spec", "parsed"), [
    ("org/name", HubModel("org/name", None)),
    ("org/name@v1.0", HubModel("org/name", "v1.0")),
    ("org/name@refs/pr/3", HubModel("org/name", "refs/pr/3")),
    ("meta-llama/Llama-3.1-8B-Instruct", HubModel("meta-llama/Llama-3.1-8B-Instruct", None)),
    ("./org/name", None), ("/abs/path", None), ("~/models/x", None), ("org/name.gguf", None),
    ("name", None), ("a/b/c", None), ("org/name@", None),
])
def test_parse_hub_id(spec: str, parsed: HubModel | None) -> None:
    assert parse_hub_id(spec) == parsed


def test_missing_path_that_is_no_id_keeps_the_path_message(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^model: path .*nothing-here' does not exist .*ORG/NAME\[@REVISION\]"):
        load_model_source(str(tmp_path / "nothing-here"))
