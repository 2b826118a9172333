"""Every paper name parses to the expected PEConfig; malformed names fail clearly."""

import dataclasses
import re

import numpy as np
import pytest

import jrope
from jrope import pe_config_from_name

L = 1024


def _fields(cfg):
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


EXPECTED = {
    "nope": dict(layout="none", alibi=False),
    "rope": dict(layout="rope", order=1, learn_gamma=False, shear="none", alibi=False),
    "alibi": dict(layout="none", alibi=True),
    "rope_alibi": dict(layout="rope", alibi=True),
    "damped_rope": dict(layout="jordan", order=2, learn_gamma=True, shear="none"),
    "real_jordan": dict(
        layout="jordan", rotate=False, learn_gamma=True, shear="eta", shear_time="bounded"
    ),
    "direct_sum": dict(layout="direct_sum", learn_gamma=True, shear="eta", shear_time="bounded"),
    "jordan_rope": dict(
        layout="jordan",
        order=2,
        learn_gamma=True,
        gamma_min=1e-4,
        init_gamma=1e-4,
        shear="eta",
        shear_time="bounded",
        shear_scale=1.0,
        eta_max=0.1,
        init_eta=0.0,
    ),
    "jordan_no_gamma": dict(learn_gamma=False, shear="eta", shear_time="bounded"),
    "jordan_raw_tau": dict(learn_gamma=True, shear="eta", shear_time="raw", shear_scale=1.0),
    "jordan_m3": dict(order=3, shear="eta", shear_time="bounded"),
    "jordan_m4": dict(order=4, shear="eta", shear_time="bounded"),
    "jordan_eta020": dict(order=2, init_eta=0.02, eta_max=0.1, shear_time="bounded"),
    "jordan_exact_scaled": dict(
        order=2,
        gamma_min=0.0,
        init_gamma=1.0 / L,
        shear="eta",
        shear_time="raw",
        shear_scale=1.0 / L,
        init_eta=0.0,
        eta_max=0.1,
    ),
    "jordan_exact_c150_eta010_alibi": dict(
        init_gamma=1.5 / L,
        gamma_min=0.0,
        init_eta=0.01,
        shear_time="raw",
        shear_scale=1.0 / L,
        alibi=True,
    ),
    "jordan_exact_m3_c010_eta100_eta1": dict(
        order=3, init_gamma=0.1 / L, init_eta=0.1, eta_max=1.0, shear_time="raw"
    ),
    "jordan_exact_m3": dict(order=3, init_gamma=1.0 / L, shear_time="raw"),
    "jordan_jetmix_m4_c150_g050_g030_g020": dict(
        order=4,
        shear="jet",
        jet_gates=(0.5, 0.3, 0.2),
        jet_base=None,
        jet_gate_max=1.0,
        init_gamma=1.5 / L,
        gamma_min=0.0,
        shear_time="bounded",
        shear_scale=1.0 / L,
    ),
    "jordan_jetmixfull_m3_c150_g100_g050_g030": dict(
        order=3, shear="jet", jet_base=1.0, jet_gates=(0.5, 0.3), jet_gate_max=2.0
    ),
    "jordan_rope_alibi": dict(layout="jordan", shear_time="bounded", alibi=True),
    "damped_rope_alibi": dict(layout="jordan", shear="none", alibi=True),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_paper_names_parse_to_the_expected_config(name):
    cfg = jrope.pe_config_from_name(name, train_context=L)
    fields = _fields(cfg)
    for key, value in EXPECTED[name].items():
        assert fields[key] == pytest.approx(value), (name, key)
    assert cfg.name == name
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.order = 7


def test_every_paper_method_parses():
    for name in jrope.PAPER_METHODS:
        jrope.pe_config_from_name(name, train_context=L)


def test_base_settings_pass_through_and_suffixes_override_them():
    base = dict(
        train_context=512, theta=500.0, gamma_min=2e-4, init_gamma=5e-4, eta_max=0.3, init_eta=0.2
    )
    cfg = jrope.pe_config_from_name("jordan_rope", **base)
    assert (cfg.theta, cfg.gamma_min, cfg.init_gamma, cfg.eta_max, cfg.init_eta) == (
        500.0,
        2e-4,
        5e-4,
        0.3,
        0.2,
    )
    # _eta{xyz} overrides init_eta; the base eta_max stays.
    cfg = jrope.pe_config_from_name("jordan_eta050", **base)
    assert (cfg.init_eta, cfg.eta_max) == (0.05, 0.3)
    # The exact family overrides gamma_min/init_gamma from c and L, keeps the base init_eta.
    cfg = jrope.pe_config_from_name("jordan_exact_c200", **base)
    assert (cfg.gamma_min, cfg.init_gamma, cfg.init_eta) == (0.0, 2.0 / 512, 0.2)


def test_translation_invariance_follows_the_group_law():
    invariant = {
        n: jrope.pe_config_from_name(n, train_context=L).is_translation_invariant for n in EXPECTED
    }
    assert {n for n, v in invariant.items() if v} == {
        "nope",
        "rope",
        "alibi",
        "rope_alibi",
        "damped_rope",
        "damped_rope_alibi",
        "jordan_raw_tau",
        "jordan_exact_scaled",
        "jordan_exact_c150_eta010_alibi",
        "jordan_exact_m3_c010_eta100_eta1",
        "jordan_exact_m3",
    }


@pytest.mark.parametrize(
    "name",
    [
        "jordan",
        "Rope",
        "rope_",
        "jordan_exact_c1x0",
        "jordan_exact_foo",
        "jordan_jetmix_m4_g050",
        "jordan_jetmixfull_m3_g100_g050",
        "jordan_m",
        "jordan_etaabc",
        "rope_alibi_alibi",
        "nope_alibi",
        "direct",
        "",
        "jordan_m1",
        "rope_matched_m2_alibi",
    ],
)
def test_malformed_names_raise_with_the_accepted_forms(name):
    with pytest.raises(ValueError) as err:
        jrope.pe_config_from_name(name, train_context=L)
    message = str(err.value)
    assert repr(name) in message
    # Unknown names list what is accepted; valid names with bad values name the fix.
    assert (
        "accepted position-encoding names" in message
        or "eta_max" in message
        or "order m >= 2" in message
    )


def test_bad_base_settings_raise():
    with pytest.raises(ValueError, match="train_context"):
        jrope.pe_config_from_name("rope", train_context=0)
    with pytest.raises(ValueError, match="gamma_min <= init_gamma"):
        jrope.pe_config_from_name("jordan_rope", train_context=L, gamma_min=1e-3, init_gamma=1e-4)
    with pytest.raises(ValueError, match="exceeds eta_max"):
        jrope.pe_config_from_name("jordan_rope", train_context=L, init_eta=0.5)


@pytest.mark.parametrize(
    "name, init_eta, eta_max",
    [
        ("jordan_eta200", 0.1, 0.1),  # the reference starts eta at eta_max
        ("jordan_eta050", 0.05, 0.1),  # below eta_max: as written
        ("jordan_exact_eta200", 0.1, 0.1),
        ("jordan_exact_m3_c010_eta200_eta1", 0.2, 1.0),  # _eta1 raises the bound first
        ("jordan_exact_eta1500_eta1", 1.0, 1.0),
    ],
)
def test_name_eta_above_eta_max_is_clamped_as_the_reference_does(name, init_eta, eta_max):
    cfg = jrope.pe_config_from_name(name, train_context=L)
    assert (cfg.init_eta, cfg.eta_max) == pytest.approx((init_eta, eta_max))


def test_clamped_eta_starts_the_encoding_at_eta_max():
    from jrope.encodings import make_encoding

    cfg = jrope.pe_config_from_name("jordan_eta200", train_context=L)
    encoding = make_encoding(cfg, num_heads=2, head_dim=8)
    eta = encoding.physical_params(encoding.init_params())["eta"]
    # The reference's atanh clamp at 0.999999 of eta_max.
    np.testing.assert_allclose(np.asarray(eta), 0.1 * 0.999999, rtol=1e-6)


@pytest.mark.parametrize(
    "name, kind, order, c",
    [
        ("rope_matched_m2", "rope_matched", 2, None),
        ("rope_matched_m4", "rope_matched", 4, None),
        ("direct_sum_poly_m4", "direct_sum_poly", 4, None),
        ("jordan_scaled_m3_c010", "jordan_scaled", 3, 0.1),
        ("jordan_scaled_m4", "jordan_scaled", 4, 1.0),
    ],
)
def test_probe_baselines_parse_and_are_refused_as_encodings(name, kind, order, c):
    baseline = jrope.pe_config.probe_baseline_from_name(name)
    assert (baseline.kind, baseline.order, baseline.c) == (kind, order, c)
    with pytest.raises(ValueError, match="is a kernel-probe baseline"):
        jrope.pe_config_from_name(name, train_context=L)


def test_probe_baseline_order_too_low_names_the_minimum():
    assert jrope.pe_config.probe_baseline_from_name("jordan_rope") is None
    with pytest.raises(ValueError, match="m >= 2"):
        jrope.pe_config.probe_baseline_from_name("direct_sum_poly_m1")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(shear="bogus"), "pe.shear = 'bogus' is not one of ('none', 'eta', 'jet')."),
        (dict(shear_time="bogus"), "pe.shear_time = 'bogus' is not one of ('bounded', 'raw')"),
        (dict(layout="bogus"), "pe.layout = 'bogus' is not one of"),
        (
            dict(train_context=2.5),
            "pe.train_context must be an integer in [1, 2147483647], got 2.5",
        ),
        (dict(eta_max=float("nan")), "pe.eta_max must be a finite number > 0.0, got nan"),
        (dict(theta="x"), "pe.theta must be a finite number > 1.0, got 'x'"),
    ],
)
def test_every_enumerated_or_numeric_field_is_validated(change, message):
    cfg = pe_config_from_name("jordan_rope", train_context=64)
    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(cfg, **change)


def test_a_non_finite_base_setting_is_refused_by_name():
    with pytest.raises(
        ValueError, match=r"train_context must be an integer in \[1, 2147483647\], got nan"
    ):
        pe_config_from_name("jordan_rope", train_context=float("nan"))


@pytest.mark.parametrize("train_context", [0, 2**40])
def test_a_train_context_outside_int32_or_zero_is_refused_before_any_suffix_divides_by_it(
    train_context,
):
    with pytest.raises(
        ValueError, match=r"^pe\.train_context must be an integer in \[1, 2147483647\]"
    ):
        pe_config_from_name("jordan_exact_scaled", train_context=train_context)


def test_any_name_takes_a_logit_softcap_suffix_and_a_bad_cap_is_refused():
    for name in ("rope", "alibi", "jordan_exact_c150_eta010_alibi", "jordan_jetmix_m3_g050_g030"):
        plain = pe_config_from_name(name, train_context=L, theta=500.0)
        capped = pe_config_from_name(f"{name}_softcap30", train_context=L, theta=500.0)
        assert capped == dataclasses.replace(plain, name=f"{name}_softcap30", logit_softcap=30.0)
    for name in ("rope_softcap0", "rope_softcap", "softcap30", "rope_softcap30_alibi"):
        with pytest.raises(ValueError, match="accepted position-encoding names"):
            pe_config_from_name(name, train_context=L)
    with pytest.raises(
        ValueError, match=r"pe\.logit_softcap must be a finite number >= 0\.0, got -1\.0"
    ):
        dataclasses.replace(pe_config_from_name("rope", train_context=L), logit_softcap=-1.0)
