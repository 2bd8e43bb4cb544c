import pytest

from skyline.core.config import load_config


def test_defaults_are_consistent():
    cfg = load_config()
    assert cfg.default_tier in cfg.tier_names
    assert cfg.redis.url.startswith("redis://127.0.0.1")  # Redis is local-only by default


def test_file_then_overrides(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(
        'default_tier = "fast"\n'
        "[gateway]\nport = 9000\nmode = \"colocated\"\n"
        "[tiers.fast]\nttft_ms = 100\ntpot_ms = 10\npriority = 0\n"
    )
    cfg = load_config(f, {"gateway": {"port": 9100, "host": None}})
    assert cfg.gateway.port == 9100 and cfg.gateway.mode == "colocated" and cfg.gateway.host == "127.0.0.1"
    assert cfg.tier_names == ("fast",) and cfg.tier("fast").ttft_ms == 100


def test_unknown_options_are_rejected(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text("[gateway]\nprot = 1\n")
    with pytest.raises(ValueError, match="prot"):
        load_config(f)


def test_sample_config_in_deploy_documents_every_option():
    import dataclasses
    import tomllib
    from pathlib import Path

    path = Path(__file__).parents[1] / "deploy" / "skyline.toml"
    cfg = load_config(path)
    assert cfg == load_config()  # the sample spells out the defaults
    data = tomllib.loads(path.read_text())
    for section in ("redis", "engine", "worker", "gateway", "observability", "batch"):
        documented = set(data[section])
        expected = {f.name for f in dataclasses.fields(getattr(cfg, section))}
        # Optional (None-default) fields cannot be written in TOML; they are documented as comments.
        text = path.read_text()
        missing = {n for n in expected - documented if f"# {n} =" not in text}
        assert not missing, f"[{section}] options missing from deploy/skyline.toml: {missing}"
