"""infopt.io: a missing folder is named as missing; saved files get the mode of any file the user writes."""

import os
import stat

import pytest
import torch

import infopt
from infopt.models import tiny_model
from infopt.quantize import Int8WeightOnly


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_load_missing_folder_says_it_does_not_exist(where, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = "no/such/model" if where == "relative" else str(tmp_path / "no" / "model")
    with pytest.raises(FileNotFoundError) as e:
        infopt.load(folder)
    msg = str(e.value)
    assert f"the folder '{folder}' does not exist" in msg and "never downloads" in msg
    assert "infopt_recipe.yaml" not in msg
    if where == "relative":
        assert str(tmp_path / "no" / "such" / "model") in msg


def test_load_a_file_or_an_unoptimized_folder(tmp_path):
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="is a file, not a folder"):
        infopt.load(tmp_path / "f.txt")
    tiny_model("llama").save_pretrained(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="has no infopt_recipe.yaml"):
        infopt.load(tmp_path / "plain")


def _modes(folder):
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file()}


@pytest.fixture(params=[0o022, 0o027], ids=["umask-022", "umask-027"])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_saved_files_get_the_umask_mode(umask, tmp_path, prompt):
    want = 0o666 & ~umask
    m = infopt.optimize(tiny_model("llama"), [Int8WeightOnly()])
    infopt.save_optimized(m, tmp_path / "a")
    m.save_pretrained(tmp_path / "b")  # the save hook
    a, b = _modes(tmp_path / "a"), _modes(tmp_path / "b")
    assert a["infopt_model.safetensors"] == want and b["model.safetensors"] == want
    assert set(a.values()) == {want} and set(b.values()) == {want}, (a, b)
    m2, _ = infopt.load(tmp_path / "b")
    assert torch.equal(m2(prompt).logits, m(prompt).logits)


def test_save_hook_leaves_other_files_alone(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    private = out / "notes.safetensors"  # not written by this save: its mode is the user's choice
    private.write_bytes(b"")
    private.chmod(0o600)
    m = infopt.optimize(tiny_model("llama"), [Int8WeightOnly()])
    m.save_pretrained(out, max_shard_size="100KB")
    modes = _modes(out)
    shards = [n for n in modes if n.startswith("model-")]
    assert len(shards) > 1 and all(modes[n] == modes["config.json"] for n in shards)
    assert modes["notes.safetensors"] == 0o600
