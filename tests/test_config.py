import json

import pytest

from dorylus.cli import build_parser
from dorylus.config import TrainConfig, config_from_args
from dorylus.errors import ConfigError


def parse(*argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_defaults_are_the_planetoid_recipe():
    c = parse()
    assert (c.layers, c.hidden, c.dropout, c.lr, c.weight_decay, c.epochs) == (2, 16, 0.5, 0.01, 5e-4, 200)
    assert c.row_normalize_features and c.dataset == "synthetic-small"


def test_file_then_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('hidden = 32\nlr = 0.05\nrow_normalize_features = false\nepochs = 3\n')
    c = parse("--config", str(path), "--lr", "0.1", "--row-normalize-features")
    assert (c.hidden, c.lr, c.row_normalize_features, c.epochs) == (32, 0.1, True, 3)
    json_path = tmp_path / "run.json"
    json_path.write_text(json.dumps({"weight_decay": 0, "seed": 4}))
    c = parse("--config", str(json_path))
    assert c.weight_decay == 0.0 and isinstance(c.weight_decay, float) and c.seed == 4


@pytest.mark.parametrize("content, message", [
    ('hiddn = 3\n', "unknown key(s) hiddn"),
    ('hidden = "wide"\n', "hidden must be int"),
    ('dropout = 1.0\n', "dropout must be in [0, 1)"),
    ('optimizer = "lbfgs"\n', "optimizer='lbfgs' is not one of adam, sgd"),
    ('hidden = \n', "is not valid toml"),
    ('graph_server_instance = "m9.huge"\n', "graph_server_instance='m9.huge' is not in the price table"),
])
def test_bad_config_file_names_file_and_problem(tmp_path, content, message):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        parse("--config", str(path))
    assert message in str(err.value)
    assert "bad.toml" in str(err.value) or "invalid config" in str(err.value) or "is not one of" in str(err.value)


def test_missing_and_unknown_type_config(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse("--config", str(tmp_path / "nope.toml"))
    (tmp_path / "c.yaml").write_text("a: 1")
    with pytest.raises(ConfigError, match="unknown type"):
        parse("--config", str(tmp_path / "c.yaml"))


def test_unknown_flag_is_rejected():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--hiddn", "3"])


def test_round_trip_through_dict():
    c = TrainConfig(hidden=7, run_dir="x")
    assert TrainConfig.from_dict(c.to_dict()) == c


def test_sparse_features_option():
    assert TrainConfig().sparse_features == "auto"
    assert TrainConfig.from_dict({"sparse_features": "on"}).sparse_features == "on"
    with pytest.raises(ConfigError, match="sparse_features='dense' is not one of auto, on, off"):
        TrainConfig.from_dict({"sparse_features": "dense"})
