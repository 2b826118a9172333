"""The typed positional-encoding configuration, and the paper-name parser.

`PEConfig` is the library's own vocabulary: every variant of
docs/mathematics.md, section 4, is a point in it. The paper and its reference code name variants
with strings such as `jordan_exact_c150_eta010_alibi`; `pe_config_from_name`
is the one place that translates those names, with the reference code's
override rules (the keyword arguments are the base settings, the name's
suffixes override them).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from absl import logging

from jrope import pe_math
from jrope.fields import PARAMETERS, Declared, did_you_mean, problems, setting

Layout = Literal["none", "rope", "jordan", "direct_sum"]
Shear = Literal["none", "eta", "jet"]
ShearTime = Literal["bounded", "raw"]

# The methods of the paper's synthetic experiment and kernel probe.
PAPER_METHODS = (
    "nope",
    "rope",
    "alibi",
    "rope_alibi",
    "damped_rope",
    "direct_sum",
    "jordan_rope",
    "jordan_no_gamma",
    "jordan_raw_tau",
    "jordan_exact_scaled",
)

ACCEPTED_NAMES = """\
accepted position-encoding names:
  nope | rope | alibi | rope_alibi | damped_rope | real_jordan | direct_sum | rope_temperature
  jordan_rope | jordan_no_gamma | jordan_raw_tau | jordan_m{m} | jordan_eta{xyz}
  jordan_exact[_scaled][_c{100c}][_eta{1000 eta0}][_m{m}][_eta1]
  jordan_jetmix[_m{m}][_c{100c}]_g{100 g1}..._g{100 g(m-1)}
  jordan_jetmixfull[_m{m}][_c{100c}]_g{100 alpha0}_g{100 g1}..._g{100 g(m-1)}
  any name but alibi/rope_alibi may end in _alibi (adds the ALiBi bias)
  any name may end in _softcap{cap} (logits cap * tanh(logits / cap), cap >= 1, as Gemma 2)
  e.g. jordan_exact_c150_eta010_alibi, jordan_exact_m3_c010_eta100_eta1,
       jordan_jetmix_m4_c150_g050_g030_g020, jordan_eta020, jordan_m3
  an _eta{xyz} above eta_max is clamped to eta_max, as the reference code does
kernel-probe baselines (features only, no encoding; the probe configs accept them):
  rope_matched_m{m} | direct_sum_poly_m{m} | jordan_scaled_m{m}[_c{100c}]"""

# The names of ACCEPTED_NAMES without a pattern, for a misspelt name's nearest.
_PLAIN_NAMES = [name.strip() for line in ACCEPTED_NAMES.splitlines() for name in line.split(" | ")
                if re.fullmatch(r"\s*\w+", name)]  # fmt: skip

# One name of every family of ACCEPTED_NAMES: the conformance tests run each through every
# attention kernel, against the float64 oracle or refused by name (tests/test_conformance.py).
FAMILY_EXAMPLES = (
    "nope",
    "rope",
    "alibi",
    "rope_alibi",
    "damped_rope",
    "real_jordan",
    "direct_sum",
    "jordan_rope",
    "jordan_no_gamma",
    "jordan_raw_tau",
    "jordan_m3",
    "jordan_eta020",
    "jordan_exact_c150_eta010_alibi",
    "jordan_exact_m3_c010_eta100_eta1",
    "jordan_jetmix_m3_c150_g050_g030",
    "jordan_jetmixfull_m3_c150_g100_g050_g030",
    "rope_temperature",
    "jordan_rope_softcap3",
)

# The reference code's probe-only baselines (its causal_delta_features), with its defaults.
_PROBE_BASELINE = re.compile(r"(rope_matched|direct_sum_poly|jordan_scaled)_m(\d+)(?:_c(\d+))?")
_PROBE_MIN_ORDER = {"rope_matched": 1, "direct_sum_poly": 2, "jordan_scaled": 2}


class UnknownEncodingName(ValueError):
    """A position-encoding name that is not one of ACCEPTED_NAMES (the message lists them)."""


@dataclasses.dataclass(frozen=True)
class ProbeBaseline:
    """A kernel-probe baseline of the reference code: a feature set with no encoding behind it
    (its features: jrope.experiments.kernel_probe's docstring).

    kind: 'rope_matched', 'direct_sum_poly' or 'jordan_scaled'; order: m of the name; c: the
    damping constant of 'jordan_scaled' (gamma = c/L; 1 when the name has no _c token), None for
    the others.
    """

    name: str
    kind: str
    order: int
    c: float | None = None


def probe_baseline_from_name(name: str) -> ProbeBaseline | None:
    """The ProbeBaseline a name denotes, or None when it is no probe baseline.

    Raises ValueError for a baseline name whose order is too low for its kind.
    """
    match = _PROBE_BASELINE.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        return None
    kind, order, c = match.group(1), int(match.group(2)), match.group(3)
    if c is not None and kind != "jordan_scaled":
        return None
    if order < _PROBE_MIN_ORDER[kind]:
        raise ValueError(
            f"probe baseline {name!r} needs m >= {_PROBE_MIN_ORDER[kind]}, got m = {order}."
        )
    if kind == "jordan_scaled":
        return ProbeBaseline(name, kind, order, 1.0 if c is None else int(c) / 100.0)
    return ProbeBaseline(name, kind, order)


def _name_eta(name: str, init_eta: float, eta_max: float) -> float:
    """A name's _eta{xyz} initial shear, clamped into [-eta_max, eta_max] as the reference does.

    The reference initialises eta through atanh(init_eta / eta_max) clamped
    near +-1, so an eta above eta_max starts at eta_max.
    """
    if abs(init_eta) <= eta_max:
        return init_eta
    clamped = eta_max if init_eta > 0 else -eta_max
    logging.warning(
        "%s: initial eta %g exceeds eta_max %g and is clamped to %g, as the reference code "
        "clamps it (the _eta1 suffix of jordan_exact names raises eta_max to 1).",
        *(name, init_eta, eta_max, clamped),
    )
    return clamped


@dataclasses.dataclass(frozen=True)
class PEConfig(Declared):
    """A positional encoding, fully specified.

    Attributes:
      name: the name it was parsed from (informational).
      layout: 'none' (no rotation: NoPE, ALiBi), 'rope' (full-head RoPE),
        'jordan' (order-m Jordan blocks on [nb, m, 2]), 'direct_sum' (RoPE on
        the first half of the head, an order-2 real Jordan block on the second).
      train_context: L, the training length (bounded shear time and c/L scale).
      theta: base of the rotary frequencies.
      order: m, the Jordan chain length (1 for RoPE).
      rotate: False sets omega = 0 (real Jordan blocks).
      learn_gamma: learned damping gamma = gamma_min + softplus(raw); False: gamma = 0.
      gamma_min, init_gamma: floor and initial value of gamma.
      shear: 'none' (eta = 0), 'eta' (coefficients (eta s)^r / r!, eta =
        eta_max tanh(raw)), 'jet' (gated coefficients g_r s^r / r!).
      shear_time: s(p) before scaling: 'bounded' tau(p) = p/(1+|p|/L) or 'raw' p.
      shear_scale: s(p) = shear_scale * time(p) (1, or 1/L for the scaled variants).
      eta_max, init_eta: bound and initial value of eta.
      jet_gates: initial g_1..g_{m-1} of the jet-mix chain.
      jet_base: initial learned alpha_0 (jetmixfull), or None for a fixed c_0 = 1.
      jet_gate_max: gates and alpha_0 are jet_gate_max * tanh(raw).
      alibi: add the ALiBi bias -slope_h * max(i - j, 0).
      learn_temperature: a learned logit temperature per head: queries times e^{t_h}, t_h from 0.
      logit_softcap: cap > 0 maps the scaled logits to cap * tanh(logits / cap); 0: no cap.
    """

    section = "pe"

    name: str = setting(defines=PARAMETERS)
    layout: Layout
    train_context: int = setting(ge=1, defines=PARAMETERS)
    theta: float = setting(10000.0, gt=1.0, defines=PARAMETERS)
    order: int = setting(2, ge=1)
    rotate: bool = True
    learn_gamma: bool = False
    gamma_min: float = setting(1e-4, defines=PARAMETERS)
    init_gamma: float = setting(1e-4, defines=PARAMETERS)
    shear: Shear = "none"
    shear_time: ShearTime = "bounded"
    shear_scale: float = setting(1.0, gt=0.0)
    eta_max: float = setting(0.1, gt=0.0, defines=PARAMETERS)
    init_eta: float = setting(0.0, defines=PARAMETERS)
    jet_gates: tuple[float, ...] = ()
    jet_base: float | None = None
    jet_gate_max: float = setting(1.0, gt=0.0)
    alibi: bool = False
    learn_temperature: bool = False
    logit_softcap: float = setting(0.0, ge=0.0)

    def __post_init__(self):
        super().__post_init__()  # each field against its declaration; below, the variant's rules

        def fail(msg):
            raise ValueError(f"PEConfig {self.name!r}: {msg}")

        if self.layout == "jordan" and self.order < 2:
            fail("a jordan layout needs order m >= 2")
        if self.learn_gamma and not 0 <= self.gamma_min <= self.init_gamma:
            fail(
                f"need 0 <= gamma_min <= init_gamma, got gamma_min={self.gamma_min}, "
                f"init_gamma={self.init_gamma}"
            )
        if self.shear == "eta" and not abs(self.init_eta) <= self.eta_max:
            fail(
                f"|init_eta|={abs(self.init_eta)} exceeds eta_max={self.eta_max}; "
                "raise eta_max (e.g. the _eta1 suffix) or lower init_eta"
            )
        if self.shear == "jet":
            if len(self.jet_gates) != self.order - 1:
                fail(
                    f"order {self.order} needs {self.order - 1} jet gates, got {len(self.jet_gates)}"
                )
            bound = [abs(g) for g in self.jet_gates] + (
                [abs(self.jet_base)] if self.jet_base is not None else []
            )
            if max(bound, default=0.0) > self.jet_gate_max:
                fail(
                    f"jet gates {self.jet_gates} / base {self.jet_base} exceed jet_gate_max={self.jet_gate_max}"
                )
        if self.jet_base is not None and self.jet_base == 0.0:
            fail("jet_base (alpha_0) must be nonzero: it is inverted in the query map")

    @property
    def head_block(self) -> int:
        """The width that must divide a head's dimension: a RoPE pair, an order-m Jordan block's
        2m real dims, or the direct sum's two halves of 4-dim blocks."""
        return {"none": 1, "rope": 2, "jordan": 2 * self.order, "direct_sum": 8}[self.layout]

    @property
    def clock(self) -> pe_math.ShearTime | None:
        """The shear's time s(p) / eta (pe_math.ShearTime), None without a shear."""
        if self.shear == "none":
            return None
        return pe_math.ShearTime(self.shear_time == "bounded", self.shear_scale, self.train_context)

    @property
    def is_translation_invariant(self) -> bool:
        """True when logits depend on positions only through i - j (the group law holds)."""
        return self.shear == "none" or (self.shear == "eta" and not self.clock.bounded)


def _parse_exact(name: str, tokens: list[str], base: dict) -> dict | None:
    """jordan_exact[_scaled][_c..][_eta...][_m..][_eta1]: raw shear scaled by 1/L; None where a
    token is unknown."""
    c, order, name_eta, eta_max = 1.0, 2, None, base["eta_max"]
    for token in tokens:
        if token == "scaled":
            continue
        if token == "eta1":
            eta_max = 1.0
        elif m := re.fullmatch(r"c(\d+)", token):
            c = int(m.group(1)) / 100.0
        elif m := re.fullmatch(r"eta(\d{3,})", token):
            name_eta = int(m.group(1)) / 1000.0
        elif m := re.fullmatch(r"m(\d+)", token):
            order = int(m.group(1))
        else:
            return None
    # Only the name's eta is clamped; a base init_eta above eta_max stays an error.
    init_eta = base["init_eta"] if name_eta is None else _name_eta(name, name_eta, eta_max)
    shear = dict(shear="eta", shear_time="raw", eta_max=eta_max, init_eta=init_eta)
    return dict(_scaled_jordan(order, c, base["train_context"]), **shear)


def _scaled_jordan(order: int, c: float, L: int) -> dict:
    """An order-`order` Jordan block learning gamma from c/L, its shear time in units of L."""
    scaled = dict(gamma_min=0.0, init_gamma=c / L, shear_scale=1.0 / L)
    return dict(layout="jordan", order=order, learn_gamma=True, **scaled)


def _parse_jetmix(tokens: list[str], base: dict, full: bool) -> dict | None:
    """jordan_jetmix[full][_m..][_c..]_g..: gated bounded-time jets, gamma init c/L; None where a
    token is unknown or the gates are not one per jet."""
    c, order, gates = 1.0, 4, []
    for token in tokens:
        if m := re.fullmatch(r"c(\d+)", token):
            c = int(m.group(1)) / 100.0
        elif m := re.fullmatch(r"m(\d+)", token):
            order = int(m.group(1))
        elif m := re.fullmatch(r"g(\d+)", token):
            gates.append(int(m.group(1)) / 100.0)
        else:
            return None
    if len(gates) != (order if full else order - 1):
        return None
    jets = dict(jet_base=gates[0] if full else None, jet_gates=tuple(gates[1:] if full else gates))
    jets.update(shear="jet", shear_time="bounded", jet_gate_max=2.0 if full else 1.0)
    return dict(_scaled_jordan(order, c, base["train_context"]), **jets)


def _parse_base(name: str, base: dict) -> dict | None:
    """Settings for a name without its _alibi suffix; None if unknown."""
    stabilized = dict(layout="jordan", learn_gamma=True, shear="eta", shear_time="bounded")
    fixed = {
        "nope": dict(layout="none"),
        "rope": dict(layout="rope", order=1),
        "rope_temperature": dict(layout="rope", order=1, learn_temperature=True),
        "damped_rope": dict(layout="jordan", learn_gamma=True),
        "real_jordan": dict(stabilized, rotate=False),
        "direct_sum": dict(stabilized, layout="direct_sum"),
        "jordan_rope": stabilized,
        "jordan_no_gamma": dict(stabilized, learn_gamma=False),
        "jordan_raw_tau": dict(stabilized, shear_time="raw"),
    }
    if name in fixed:
        return fixed[name]
    if m := re.fullmatch(r"jordan_m(\d+)", name):
        return dict(stabilized, order=int(m.group(1)))
    if m := re.fullmatch(r"jordan_eta(\d+)", name):
        return dict(stabilized, init_eta=_name_eta(name, int(m.group(1)) / 1000.0, base["eta_max"]))
    tokens = name.split("_")
    if tokens[:2] == ["jordan", "exact"]:
        return _parse_exact(name, tokens[2:], base)
    if tokens[:2] == ["jordan", "jetmix"]:
        return _parse_jetmix(tokens[2:], base, full=False)
    if tokens[:2] == ["jordan", "jetmixfull"]:
        return _parse_jetmix(tokens[2:], base, full=True)
    return None


def pe_config_from_name(
    name: str,
    *,
    train_context: int,
    theta: float = 10000.0,
    gamma_min: float = 1e-4,
    init_gamma: float = 1e-4,
    eta_max: float = 0.1,
    init_eta: float = 0.0,
) -> PEConfig:
    """Parses a paper/reference name (docs/mathematics.md, section 4) into a PEConfig.

    The keyword arguments are the base settings; the name's suffixes override
    them as in the reference code (e.g. `_c150` sets gamma_min = 0 and
    init_gamma = 1.5 / L; `_eta010` sets init_eta = 0.01, clamped to eta_max
    as the reference clamps it; `_eta1` sets eta_max = 1).

    Raises:
      UnknownEncodingName (a ValueError): for an unknown or malformed name,
        listing the accepted forms.
      ValueError: for settings the variant cannot take (e.g. |init_eta| > eta_max).
    """
    base = dict(
        train_context=train_context, theta=theta, gamma_min=gamma_min, init_gamma=init_gamma
    )
    base.update(eta_max=eta_max, init_eta=init_eta)
    if found := problems(PEConfig, base):  # before a suffix divides by train_context
        raise ValueError("\n".join(found))
    if softcap := re.fullmatch(r"(.+)_softcap([1-9]\d*)", name):  # any encoding takes the cap
        settings = pe_config_from_name(softcap.group(1), **base)
        return dataclasses.replace(settings, name=name, logit_softcap=float(softcap.group(2)))
    core = {"alibi": "nope", "rope_alibi": "rope"}.get(name, name.removesuffix("_alibi"))
    alibi = core != name
    # alibi and rope_alibi are ALiBi's only spellings on nope and rope
    doubled = name in ("nope_alibi", "alibi_alibi", "rope_alibi_alibi")
    if probe_baseline_from_name(name) is not None:
        raise UnknownEncodingName(
            f"{name!r} is a kernel-probe baseline, no encoding: use it in a probe config "
            f"(configs/kernel_probe*.py, configs/structured_probe*.py).\n{ACCEPTED_NAMES}"
        )
    settings = None if doubled else _parse_base(core, base)
    if settings is None:
        hint = did_you_mean(name, _PLAIN_NAMES)
        raise UnknownEncodingName(
            f"unknown position-encoding name {name!r}{hint}\n{ACCEPTED_NAMES}"
        )
    return PEConfig(name=name, **{**base, **settings, "alibi": alibi})
