import pytest

from infopt.core.availability import is_available, lazy_import, require
from infopt.core.errors import MissingBackendError


def test_is_available_does_not_import():
    import sys

    assert is_available("json")
    assert not is_available("definitely_not_a_package_xyz")
    assert "definitely_not_a_package_xyz" not in sys.modules


def test_require_names_extra(monkeypatch):
    import infopt.core.availability as av

    monkeypatch.setattr(av, "is_available", lambda m: False)
    with pytest.raises(MissingBackendError) as e:
        require("bitsandbytes")
    assert "pip install 'infopt[bnb]'" in str(e.value)
    assert e.value.extra == "bnb"
    assert isinstance(e.value, ImportError)


def test_lazy_import_real_module():
    assert lazy_import("json").loads("[1]") == [1]
