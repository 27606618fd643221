"""infopt's caches: one root, one folder per kind, one INFOPT_CACHE_* naming scheme, sizes bounded oldest-first."""

import os
import warnings

import pytest

from infopt.core import caches


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("INFOPT_CACHE_DIR", "INFOPT_CACHE", "INFOPT_EXTENSIONS_DIR", "INFOPT_AOT_CACHE_MB",
                 "INFOPT_CACHE_AOTI_MB", "INFOPT_CALIBRATION_CACHE", "INFOPT_CACHE_CALIBRATION",
                 "INFOPT_CACHE_CALIBRATION_MB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(caches, "_warned", set())


def test_every_kind_is_a_folder_under_one_root(tmp_path, monkeypatch):
    monkeypatch.setenv("INFOPT_CACHE_DIR", str(tmp_path))
    assert {k: caches.cache_dir(k) for k in caches.KINDS} == {k: tmp_path / k for k in caches.KINDS}
    monkeypatch.delenv("INFOPT_CACHE_DIR")
    assert caches.cache_dir("aoti").parts[-3:] == (".cache", "infopt", "aoti")
    with pytest.raises(ValueError, match="unknown cache kind 'weights'; one of models, aoti"):
        caches.cache_dir("weights")


def test_limits_read_one_variable_per_kind(monkeypatch):
    assert caches.limit_bytes("aoti") == 2048 * 10**6 and caches.limit_bytes("calibration") == 4096 * 10**6
    assert caches.limit_bytes("models") is None  # not bounded
    monkeypatch.setenv("INFOPT_CACHE_CALIBRATION_MB", "1.5")
    assert caches.limit_bytes("calibration") == 1_500_000
    monkeypatch.setenv("INFOPT_CACHE_CALIBRATION_MB", "-3")
    with pytest.raises(ValueError, match="INFOPT_CACHE_CALIBRATION_MB='-3' is negative"):
        caches.limit_bytes("calibration")


@pytest.mark.parametrize(("old", "value", "check"), [
    ("INFOPT_CACHE", "{tmp}", lambda tmp: caches.cache_dir("models") == tmp / "models"),
    ("INFOPT_EXTENSIONS_DIR", "{tmp}/ext", lambda tmp: caches.cache_dir("extensions") == tmp / "ext"),
    ("INFOPT_AOT_CACHE_MB", "3", lambda tmp: caches.limit_bytes("aoti") == 3_000_000),
    ("INFOPT_CALIBRATION_CACHE", "{tmp}/cal",
     lambda tmp: caches.cache_dir("calibration") == tmp / "cal" and caches.calibration_mode() == "disk"),
    ("INFOPT_CALIBRATION_CACHE", "off", lambda tmp: caches.calibration_mode() == "off"),
], ids=["root", "extensions", "aoti-mb", "calibration-folder", "calibration-off"])
def test_earlier_names_still_work_with_a_warning_naming_the_new_one(old, value, check, tmp_path, monkeypatch):
    monkeypatch.setenv(old, value.format(tmp=tmp_path))
    with pytest.warns(FutureWarning, match=f"{old} is deprecated; set INFOPT_CACHE_"):
        assert check(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process
        assert check(tmp_path)


def test_the_new_names_win_over_the_old(tmp_path, monkeypatch):
    monkeypatch.setenv("INFOPT_CACHE", str(tmp_path / "old"))
    monkeypatch.setenv("INFOPT_CACHE_DIR", str(tmp_path / "new"))
    monkeypatch.setenv("INFOPT_CALIBRATION_CACHE", "off")
    monkeypatch.setenv("INFOPT_CACHE_CALIBRATION", "disk")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert caches.cache_dir("models") == tmp_path / "new" / "models"
        assert caches.calibration_mode() == "disk"
    monkeypatch.setenv("INFOPT_CACHE_CALIBRATION", "sometimes")
    with pytest.raises(ValueError, match="INFOPT_CACHE_CALIBRATION='sometimes': use memory"):
        caches.calibration_mode()


def _entry(folder, stem, suffixes, size, when):
    for suffix in suffixes:
        f = folder / f"{stem}{suffix}"
        f.write_bytes(b"x" * size)
        os.utime(f, (when, when))


def test_prune_drops_whole_entries_used_longest_ago(tmp_path, monkeypatch):
    monkeypatch.setenv("INFOPT_CACHE_CALIBRATION_MB", "1")
    _entry(tmp_path, "old", (".safetensors", ".json"), 150_000, 1000)
    _entry(tmp_path, "mid", (".safetensors", ".json"), 150_000, 2000)
    _entry(tmp_path, "new", (".safetensors", ".json"), 150_000, 3000)
    _entry(tmp_path, "kept", (".safetensors", ".json"), 100_000, 10)  # the oldest, but just written
    (tmp_path / ".write.tmp").write_bytes(b"x" * 5_000_000)  # a write in progress: never counted or deleted
    caches.touch(tmp_path / "old.json")  # used now: the newest
    gone = caches.prune(tmp_path, "calibration", keep=(tmp_path / "kept.safetensors",))
    assert sorted(p.name for p in gone) == ["mid.json", "mid.safetensors"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".write.tmp", "kept.json", "kept.safetensors", "new.json", "new.safetensors", "old.json",
                    "old.safetensors"]
    assert caches.prune(tmp_path, "models") == []  # not bounded
