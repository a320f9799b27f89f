"""The line vLLM's first start prints on an empty compile cache (tens of seconds to minutes of
silence otherwise), and none once the cache holds kernels. Needs no vLLM."""

from __future__ import annotations

import warnings

from tether.rl.engines.vllm_engine import cold_start_note, inductor_cache_dir, vllm_quietly


def test_a_cold_cache_is_named_and_a_warm_one_is_quiet(tmp_path, monkeypatch):
    missing, empty, warm = tmp_path / "missing", tmp_path / "empty", tmp_path / "warm"
    empty.mkdir()
    (warm / "fxgraph").mkdir(parents=True)
    for cold in (missing, empty):
        note = cold_start_note(cold)
        assert note is not None and str(cold) in note and "first start" in note
    assert cold_start_note(warm) is None
    # the cache torch inductor uses is the one TORCHINDUCTOR_CACHE_DIR names
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(warm))
    assert inductor_cache_dir() == warm


def test_vllms_deprecations_are_quiet_and_others_are_not():
    def warn_from(module: str, category: type[Warning]) -> None:
        exec(compile("import warnings\nwarnings.warn('old', category)", module, "exec"),
             {"__name__": module, "category": category})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with vllm_quietly():
            warn_from("vllm.triton_utils.dispatcher", FutureWarning)
            warn_from("vllm", DeprecationWarning)
            warn_from("user_code", FutureWarning)  # the user's own: still shown
            warn_from("vllm.config", UserWarning)  # not a deprecation: still shown
    assert sorted(w.category.__name__ for w in caught) == ["FutureWarning", "UserWarning"]
