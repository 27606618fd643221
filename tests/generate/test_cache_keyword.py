"""infopt passes the KV cache under the name the installed transformers takes (``cache`` from 5.24,
``past_key_values`` before), so its calls raise no deprecation warning, and hooks find a cache under either name."""

import warnings

import torch

import infopt
from infopt.core.compat import CACHE_KWARG, cache_from, transformers_version
from infopt.models import tiny_model


def test_cache_keyword_matches_the_installed_transformers():
    assert CACHE_KWARG == ("cache" if transformers_version() >= (5, 24) else "past_key_values")


def test_cache_found_under_either_name():
    marker = object()
    assert cache_from({"cache": marker}) is marker
    assert cache_from({"past_key_values": marker}) is marker
    assert cache_from({"use_cache": True}) is None


def test_optimized_generate_warns_nothing_about_the_cache_keyword():
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    for steps in ([{"kvcache": "static"}], [{"kvcache": {"kind": "sinks", "num_sink_tokens": 2, "window": 8}}],
                  [{"batching": {}}]):
        m = tiny_model("llama")
        infopt.optimize(m, {"steps": steps})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = m.generate(ids, max_new_tokens=12, do_sample=False)
        assert out.shape == (1, 18)
        named = [str(w.message) for w in caught if "past_key_values" in str(w.message) or "`cache`" in str(w.message)]
        assert not named, f"{steps}: {named[:2]}"
