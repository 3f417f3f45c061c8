"""Mass budgets in the config: fields, defaults, validation, and a config round trip that
keeps the count budgets' JSON as it was."""

import json
import re

import pytest

from mminfer.errors import ConfigError
from mminfer.sparse.patterns import (KNOWN_MODELS, MASS_DEFAULTS, HeadPattern, HeadPatternConfig,
                                     Pattern, block, default_config, grid, vertical_slash)

QWEN = KNOWN_MODELS["Qwen/Qwen2.5-VL-7B-Instruct"]


def test_mass_fields_and_defaults():
    p = vertical_slash(gamma=0.9)
    assert p.mass and (p.n_vertical, p.n_slash) == (None, None)
    assert (p.min_density, p.max_density) == (MASS_DEFAULTS["min_density"],
                                              MASS_DEFAULTS["max_density"])
    assert p.to_dict() == {"kind": "vertical_slash", "window": 256, "sink": 64, "gamma": 0.9,
                           "min_density": 0.0, "max_density": 0.3}
    b = block(gamma=1, min_density=0.01, max_density=0.2)
    assert b.to_dict() == {"kind": "block", "window": 256, "gamma": 1.0, "min_density": 0.01,
                           "max_density": 0.2}
    # Count budgets write exactly what they wrote before gamma existed.
    assert vertical_slash().to_dict() == {"kind": "vertical_slash", "n_vertical": 1024,
                                          "n_slash": 64, "window": 256, "sink": 64}
    assert block().to_dict() == {"kind": "block", "top_k": 128, "window": 256}
    assert not vertical_slash().mass
    for q in (p, b, grid(fallback=p)):
        assert Pattern.from_dict(json.loads(json.dumps(q.to_dict()))) == q


@pytest.mark.parametrize("kw,message", [
    (dict(gamma=0.9, n_vertical=10), "gamma .* and n_vertical .* are exclusive"),
    (dict(gamma=0.9, n_slash=0), "gamma .* and n_slash .* are exclusive"),
    (dict(max_density=0.2), "max_density bounds a mass budget and needs gamma"),
    (dict(gamma=0.0), "gamma must be > 0"),
    (dict(gamma=1.2), r"gamma must be a number in \[0, 1\]"),
    (dict(gamma="high"), r"gamma must be a number in \[0, 1\]"),
    (dict(gamma=True), r"gamma must be a number in \[0, 1\]"),
    (dict(gamma=0.9, min_density=0.4, max_density=0.3), "min_density 0.4 is above max_density"),
    (dict(gamma=0.9, max_density=-0.1), r"max_density must be a number in \[0, 1\]"),
])
def test_mass_field_errors(kw, message):
    with pytest.raises(ConfigError, match=message):
        vertical_slash(**kw)


def test_mass_fields_only_where_they_mean_something():
    with pytest.raises(ConfigError, match="has no field 'gamma'"):
        Pattern("a_shape", gamma=0.9)
    with pytest.raises(ConfigError, match="gamma .* and top_k .* are exclusive"):
        block(top_k=3, gamma=0.9)
    with pytest.raises(ConfigError, match="unknown field"):
        Pattern.from_dict({"kind": "vertical_slash", "gamma": 0.9, "gama": 1})


def test_config_with_mass_heads_round_trips(tmp_path):
    cfg = default_config(QWEN)
    mass_vs = HeadPattern.single(vertical_slash(gamma=0.95, max_density=0.2), "k")
    mass_q = HeadPattern("q", {"video": grid(fallback=vertical_slash(gamma=0.9)),
                               "text": block(gamma=0.8, min_density=0.01)})
    cfg.layers[3][5] = mass_vs
    cfg.layers[7] = [mass_q] * 28
    path = tmp_path / "c.json"
    cfg.save(path)
    back = HeadPatternConfig.load(path, expect=QWEN)
    assert back.layers == cfg.layers
    assert back.layer(3)[5].patterns["all"].gamma == 0.95
    back.save(tmp_path / "d.json")
    assert (tmp_path / "d.json").read_text() == path.read_text()
    # A typo in a mass field is an error that names where it is.
    d = json.loads(path.read_text())
    name = d["layers"][7]["default"]
    d["patterns"][name]["patterns"]["text"]["max_density"] = 2
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=re.escape(f"patterns.{name}.patterns.text: block "
                                                    f"max_density must be a number")):
        HeadPatternConfig.load(path, expect=QWEN)
