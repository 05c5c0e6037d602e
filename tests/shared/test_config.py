"""Config: files, overrides and the errors a user sees for unknown keys and bad values."""
from __future__ import annotations

from pathlib import Path

import pytest

from zclaw import config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load(path: Path) -> None:
    cfg = config.load(str(path))
    assert cfg["run"]["env"].startswith("gym:")


def test_overrides_are_typed_and_applied() -> None:
    cfg = config.load(None, ["learner.lr=0.001", "policy.hidden=[32, 32]", "run.env=gym:Pusher-v5",
                             "log.level=debug"])
    assert cfg["learner"]["lr"] == 0.001
    assert cfg["policy"]["hidden"] == [32, 32]
    assert cfg["run"]["env"] == "gym:Pusher-v5"
    # the epsilon of the policy over options: 0 allowed, just below 1 allowed (1 is not, see below)
    assert config.load(None, ["policy.option_epsilon=0"])["policy"]["option_epsilon"] == 0.0
    assert config.load(None, ["policy.option_epsilon=0.99"])["policy"]["option_epsilon"] == 0.99


@pytest.mark.parametrize(
    "override, needle",
    [
        ("learner.lrr=1", "unknown key learner.lrr"),
        ("nope.x=1", "unknown section [nope]"),
        ("broker.mode=fifo",
         "broker.mode = 'fifo' is not allowed: expected one of 'queue', 'uniform', 'prioritized'"),
        ("worker.envs=0", "worker.envs = 0 is not allowed: expected an integer >= 1"),
        ("learner.epochs=2.5", "learner.epochs = 2.5 is not allowed"),
        ("policy.hidden=[0]", "policy.hidden"),
        ("broker.min_size=100", "exceeds broker.capacity"),
        ("run.env=Reacher-v5", "expected <backend>:<id>"),
        ("policy.option_epsilon=1.0",
         "policy.option_epsilon = 1.0 is not allowed: expected a number in [0, 1)"),
        ("policy.option_epsilon=-0.1", "policy.option_epsilon = -0.1 is not allowed"),
        ("noequals", "expected section.key=value"),
        ("learner.batch_columns=-1", "learner.batch_columns = -1 is not allowed: expected an integer in"),
    ],
)
def test_bad_config_names_key_and_allowed(override: str, needle: str) -> None:
    with pytest.raises(config.ConfigError) as info:
        config.load(None, [override])
    assert needle in str(info.value)


def test_a_batch_in_columns_is_not_bound_by_batch_segments_and_capacity() -> None:
    """learner.batch_segments over broker.capacity can never be served; with learner.batch_columns on it
    is not what sizes the batch, so the pair is accepted."""
    with pytest.raises(config.ConfigError, match="learner.batch_segments = 64 exceeds broker.capacity = 8"):
        config.load(None, ["broker.capacity=8", "broker.min_size=1", "learner.batch_segments=64"])
    cfg = config.load(None, ["broker.capacity=8", "broker.min_size=1", "learner.batch_segments=64",
                             "learner.batch_columns=256"])
    assert cfg["learner"]["batch_columns"] == 256


def test_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[broker]\ncapcity = 3\n")
    with pytest.raises(config.ConfigError, match="unknown key broker.capcity; keys of \\[broker\\]"):
        config.load(str(bad))
    with pytest.raises(config.ConfigError, match="does not exist"):
        config.load(str(tmp_path / "missing.toml"))
    (tmp_path / "broken.toml").write_text("[run\n")
    with pytest.raises(config.ConfigError, match="not valid TOML"):
        config.load(str(tmp_path / "broken.toml"))


def test_to_toml_round_trips() -> None:
    import tomllib

    cfg = config.load(None, ["run.run_dir=a \"quoted\" dir", "learner.tensorboard=false"])
    assert config.from_mapping(tomllib.loads(config.to_toml(cfg))) == cfg


def test_configuration_reference_is_current() -> None:
    doc = (CONFIGS.parent / "docs" / "configuration.md").read_text()
    assert doc.strip() == config.reference_markdown().strip(), (
        "run: zclaw config docs > docs/configuration.md"
    )
    for sec, keys in config.SCHEMA.items():
        for name in keys:
            assert f"| `{name}` |" in doc, f"{sec}.{name} is undocumented"
