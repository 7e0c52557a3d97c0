import pytest

from pipeline import config
from pipeline.errors import ConfigError


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_elastic_workers_are_a_min_max_pair():
    cfg = config.load("configs/demo.toml", {"train.num_workers": config.parse_flag_value("[1, 4]")})
    assert cfg.train.workers_range == (1, 4) and cfg.train.workers == 4
    assert config.load("configs/demo.toml", {"train.num_workers": 3}).train.workers_range == (3, 3)


def test_demo_config_loads_and_flags_win():
    cfg = config.load("configs/demo.toml", {"train.epochs": 7, "train.hidden": [4, 2]})
    assert cfg.train.epochs == 7 and cfg.train.hidden == (4, 2)
    assert cfg.data.label == "label"


@pytest.mark.parametrize("text", ["5", "0.25", "true", "[1, 2]", '"quoted"', "bare-word"])
def test_flag_values_are_toml(text):
    expected = {"5": 5, "0.25": 0.25, "true": True, "[1, 2]": [1, 2], '"quoted"': "quoted", "bare-word": "bare-word"}
    assert config.parse_flag_value(text) == expected[text]


@pytest.mark.parametrize("text, needles", [
    ("[train]\nepoch = 3\n", ["unknown config key 'train.epoch'", "did you mean 'train.epochs'"]),
    ("[trian]\nepochs = 3\n", ["unknown config section 'trian'", "did you mean 'train'"]),
    ("[train]\nepochs = 'many'\n", ["train.epochs", "'many'", "integer"]),
    ("[train]\nbatch_size = 0\n", ["train.batch_size", "greater than or equal to 1"]),
    ("[train]\nnum_workers = [3, 1]\n", ["train.num_workers", "1 <= min <= max", "(3, 1)"]),
    ("[train]\nnum_workers = 0\n", ["train.num_workers", "1 <= min <= max"]),
    ("[data]\nnumeric = ['a', 'a']\ncategorical = []\n", ["column 'a' is listed twice in data.numeric"]),
    ("[data]\nnumeric = ['a']\ncategorical = ['a']\n", ["column 'a' is listed twice in data.numeric and data.categorical"]),
    ("[data]\nlabel = ['y', 'y']\n", ["data.label lists a column twice"]),
    ("[data]\nnumeric = ['label']\n", ["'label' is data.label and also listed in data.numeric"]),
    ("[data]\nweight = 'w'\ncategorical = ['w']\n", ["'w' is data.weight and also listed in data.categorical"]),
    ("[data]\ntarget_kind = 'ordinal'\n", ["data.target_kind", "'ordinal'"]),
    ("[data]\ntarget_kind = {other = 'binary'}\n", ["names ['other'], which are not targets"]),
    ("[train]\nuse_gpu = 'yes'\n", ["train.use_gpu", "'auto', 'true' or 'false'"]),
    ("[train\n", ["not valid TOML"]),
])
def test_bad_config_is_one_clear_paragraph(tmp_path, text, needles):
    with pytest.raises(ConfigError) as e:
        config.load(write(tmp_path, text))
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg


def test_unknown_flag_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'train.lrr'.*train.lr"):
        config.load(None, {"train.lrr": 1})
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.toml")


def test_use_gpu_takes_booleans_and_bad_flags_are_blamed_on_the_flag():
    assert config.load(None, {"train.use_gpu": True}).train.use_gpu == "true"
    assert config.load(None, {"train.use_gpu": config.parse_flag_value("false")}).train.use_gpu == "false"
    with pytest.raises(ConfigError, match="flag --train.epochs"):
        config.load("configs/demo.toml", {"train.epochs": "many"})
