"""Run settings: defaults, then a TOML file, then flags; bad settings fail with one line."""

from pathlib import Path

import pytest

from flows.errors import FlowError
from flows.settings import load_run_settings


def test_file_then_overrides(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        "rounds = 5\n[collect.retry]\nenabled = true\n"
        '[train]\nmode = "r3l"\nlearning_rate = 0.002\n'
    )
    settings = load_run_settings(config, {"rounds": 2, "train.epochs": 3})
    assert settings.rounds == 2 and settings.collect.retry.enabled
    assert settings.train.mode == "r3l" and settings.train.learning_rate == 0.002
    assert settings.train.epochs == 3
    assert settings.collect.temperature == 0.7  # the run's default, under the table's setting
    assert settings.eval_settings().guided_fraction == 0.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rounds = 0\n", "setting rounds: Input should be greater than or equal to 1"),
        ("[train]\nmode = 'ppo'\n", "setting train.mode: Input should be 'grpo', 'r3l'"),
        ("[train]\nlearning_rat = 1\n", "setting train.learning_rat: Extra inputs"),
        ("rounds = \n", "cannot read config"),
        ("reviewer_url = 'http://h'\n", "reviewer_url and reviewer_model go together"),
        ("replicas = ['http://h:8000']\n", "replicas serve versions as LoRA adapters"),
        ("revise = true\n", "setting revise: moved to collect.revise.enabled"),
        ("library = true\n", "setting library: moved to library.enabled"),
        ("[collect.revise]\nblinded = true\n", "setting collect.revise.blinded: Extra inputs"),
        ("[collect]\ngroup_size = 1\n", "setting collect.group_size: Input should be greater"),
    ],
)
def test_bad_settings_name_the_setting(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "run.toml"
    config.write_text(text)
    with pytest.raises(FlowError, match=message) as raised:
        load_run_settings(config, {})
    assert "\n" not in str(raised.value)


def test_a_methods_switch_and_table_load_from_flags_and_file(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[library]\nk = 2\n[collect.revise]\nrevisions = 3\n")
    flags = {"library.enabled": 1, "collect.revise.enabled": 1, "collect.strategy.enabled": 0}
    settings = load_run_settings(config, flags)
    assert settings.library.enabled and settings.library.k == 2
    assert settings.collect.revise.enabled and settings.collect.revise.revisions == 3
    assert not settings.collect.strategy.enabled and settings.collect.group_size == 4
