"""DraftModel names a local folder: a missing one is refused before transformers could read it as a Hub id."""

import pytest

import infopt
from infopt.core.errors import RecipeError
from infopt.core.patch import has_patches
from infopt.models import tiny_model
from infopt.speculative import DraftModel


@pytest.mark.parametrize("draft", ["HuggingFaceTB/SmolLM2-360M-Instruct", "./drafts/small"], ids=["hub-id", "path"])
def test_missing_draft_folder_named_before_transformers(draft, monkeypatch):
    import transformers

    def no_call(*a, **k):
        raise AssertionError("transformers was asked to load the draft")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_call)
    m = tiny_model()
    with pytest.raises(RecipeError) as e:
        infopt.optimize(m, {"steps": [{"speculative": {"method": "draft_model", "draft": draft}}]})
    msg = str(e.value)
    assert f"DraftModel.draft='{draft}': there is no folder at that path" in msg
    assert "infopt never downloads" in msg and "Repo id" not in msg
    assert ("hf download " + draft in msg) == (draft.count("/") == 1 and not draft.startswith("."))
    assert not has_patches(m)


def test_draft_path_that_is_not_a_model_folder(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(RecipeError, match="is a file"):
        DraftModel(str(tmp_path / "weights.bin"))
    with pytest.raises(RecipeError, match="has no config.json"):
        DraftModel(str(tmp_path))


def test_existing_draft_folder_accepted(tmp_path):
    tiny_model(num_layers=1, seed=1).save_pretrained(tmp_path / "draft")
    assert DraftModel(str(tmp_path / "draft"), num_tokens=3).draft == str(tmp_path / "draft")
    assert DraftModel("default").draft == "default"


def test_load_draft_directly_checks_the_folder(monkeypatch):
    import transformers

    from infopt.speculative.api import load_draft

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("transformers was asked")))
    with pytest.raises(RecipeError, match="there is no folder at that path"):
        load_draft("./drafts/missing")
