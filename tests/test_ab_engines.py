"""scripts/ab_engines.py's order and ratios: every method first, last and between the others alike; geometric means."""

import math

import pytest

from conftest import load_script

ab = load_script("ab_engines")


def test_each_method_takes_each_place_equally_often():
    for names in (["x", "y"], ["a", "b", "c"], ["p", "q", "r", "s"]):
        orders = [ab.rotated(names, i) for i in range(2 * len(names))]
        assert all(sorted(o) == names for o in orders)
        for place in range(len(names)):
            assert sorted(o[place] for o in orders) == sorted(names * 2), (names, place)


def test_geometric_ratio_and_its_count():
    ratio, faster = ab.geometric_ratio([2.0, 1.0, 4.0], [1.0, 2.0, 2.0])
    assert ratio == pytest.approx(math.exp((math.log(2) + math.log(0.5) + math.log(2)) / 3), rel=1e-12)
    assert faster == 2
    with pytest.raises(ValueError):
        ab.geometric_ratio([1.0], [])


def test_an_unknown_method_is_one_error_line(capsys):
    assert ab.main(["--methods", "vanilla,medusa_in_vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --methods") and "medusa_in_vllm" in err[0]


@pytest.mark.parametrize("variant, base", [("vllm_hybrid_unspliced", "vllm_hybrid"),
                                           ("vllm_hybrid_unmeasured", "vllm_hybrid"),
                                           ("vllm_selfspec_suffix_unmeasured", "vllm_selfspec_suffix")])
def test_a_variant_without_its_method_is_one_error_line(capsys, variant, base):
    assert ab.main(["--methods", f"vanilla,{variant}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"beside {base} " in err[0]


def test_the_default_decoder_without_heads_is_one_error_line(capsys):
    assert ab.main(["--methods", "selfspec,vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--heads" in err[0]
