"""Names and help: registry names accepted everywhere, one-line typos, real commands in hints, a fast list."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fedhet import __version__
from fedhet.catalog import METHODS, list_families
from fedhet.cli import main
from fedhet.config import build_parser, prepare_args
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(ROOT / "configs/experiments/digits/fedproto.yaml")


def _run(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _only_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _parse(args):
    parser = build_parser()
    return parser.parse_args(prepare_args(args))


def test_catalog_matches_the_registries():
    """The static name table is what ``python -m fedhet.catalog --write`` generates from the real registries."""
    import fedhet.catalog as catalog
    from fedhet.algorithms import ALGORITHMS
    from fedhet.models import list_families as real_families

    text = Path(catalog.__file__).read_text(encoding="utf-8")
    stale = "fedhet/catalog.py is stale: run python -m fedhet.catalog --write"
    assert catalog.current_block(text) == catalog.render(), stale
    for name, path in METHODS.items():
        module, _, cls = path.rpartition(".")
        assert getattr(sys.modules[module], cls) is ALGORITHMS[name], name
    assert list_families() == real_families()


def test_the_catalog_command_reports_a_stale_table(tmp_path, monkeypatch, capsys):
    """A table missing a registered method is stale: the check exits 1 and ``--write`` restores the table."""
    import fedhet.catalog as catalog

    copy = tmp_path / "catalog.py"
    source = Path(catalog.__file__).read_text(encoding="utf-8")
    copy.write_text(source.replace('    "fedavg": "fedhet.algorithms.FedAvg",\n', ""), encoding="utf-8")
    monkeypatch.setattr(catalog, "__file__", str(copy))
    assert catalog.main([]) == 1
    assert "python -m fedhet.catalog --write" in capsys.readouterr().err
    assert catalog.main(["--write"]) == 0
    assert copy.read_text(encoding="utf-8") == source


@pytest.mark.parametrize(
    "form", [["--method", "fccl_plus"], ["--method=fccl_plus"], ["--method=FCCLPlus"], ["--method=FCCL_PLUS"]]
)
def test_method_registry_and_class_names_on_the_command_line(form):
    """--method takes the names fedhet list prints (any case) and class names."""
    config = _parse(["--config", DIGITS, *form])
    assert config.method.class_path == "fedhet.algorithms.FCCLPlus"


@pytest.mark.parametrize(
    "method,expected",
    [
        ("fedproto", "fedhet.algorithms.FedProto"),
        ({"class_path": "fd", "init_args": {"gamma": 0.3}}, "fedhet.algorithms.FD"),
    ],
)
def test_method_registry_names_in_yaml(method, expected, tmp_path):
    """method: fedproto and method: {class_path: fd, init_args: ...} work in a config file."""
    base = yaml.safe_load(Path(DIGITS).read_text())
    base["method"] = method
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(base))
    config = _parse(["--config", str(path)])
    assert config.method.class_path == expected
    if isinstance(method, dict):
        assert config.method.init_args.gamma == 0.3


def test_inline_method_dict_with_registry_name():
    """--method '{class_path: fd, init_args: {gamma: 0.4}}' maps the name too."""
    config = _parse(["--config", DIGITS, "--method", "{class_path: fd, init_args: {gamma: 0.4}}"])
    assert config.method.class_path == "fedhet.algorithms.FD" and config.method.init_args.gamma == 0.4


def test_method_typo_is_one_line_with_did_you_mean_and_the_list(tmp_path, capsys):
    """A misspelt method: one line, the closest names and every method, nothing written."""
    run_dir = tmp_path / "run"
    code, _, err = _run(["fit", "--config", DIGITS, "--method", "fccl_pls", f"--run_dir={run_dir}"], capsys)
    line = _only_line(err)
    assert code == 2 and "did you mean fccl_plus" in line and ", ".join(sorted(METHODS)) in line
    assert not run_dir.exists()


def test_method_typo_in_yaml_names_the_file(tmp_path, capsys):
    """method: fedprot in a config: the error names the config file and suggests fedproto."""
    path = tmp_path / "typo.yaml"
    path.write_text(Path(DIGITS).read_text().replace("fedhet.algorithms.FedProto", "fedprot"))
    code, _, err = _run(["fit", "--config", str(path)], capsys)
    line = _only_line(err)
    assert code == 2 and str(path) in line and "did you mean fedproto" in line


def test_yaml_syntax_error_names_the_file_and_line(tmp_path, capsys):
    """A broken second --config: the error names that file and the line."""
    path = tmp_path / "broken.yaml"
    path.write_text("rounds: 3\nmethod: [unclosed\n")
    code, _, err = _run(["fit", "--config", DIGITS, "--config", str(path)], capsys)
    line = _only_line(err)
    assert code == 2 and f"config file '{path}' is not valid YAML at line" in line


def test_missing_config_file_is_one_line(tmp_path, capsys):
    """--config pointing nowhere says so."""
    code, _, err = _run(["fit", "--config", str(tmp_path / "nope.yaml")], capsys)
    assert code == 2 and "not found" in _only_line(err)


def test_model_typo_hint_names_a_real_command():
    """The unknown-model hint names 'fedhet list', which exists."""
    from fedhet.errors import ConfigError
    from fedhet.models import create_model

    with pytest.raises(ConfigError) as info:
        create_model("resnet_huge", num_classes=10)
    assert "fedhet list" in str(info.value) and "fedhet models" not in str(info.value)


def test_version_and_help(capsys):
    """The version flag prints the version; fit --help lists --resume; the usage lists test and validate."""
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fedhet {__version__}"
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    assert "--resume" in capsys.readouterr().out
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert "test" in usage and "validate" in usage and "--version" in usage


def test_resume_flag_is_not_saved_in_configs(tmp_path):
    """--resume is declared for --help only: the resolved config has no resume key."""
    parser = build_parser()
    config = parser.parse_args(prepare_args(["--config", DIGITS]))
    assert "resume" not in yaml.safe_load(parser.dump(config))


def test_list_answers_without_importing_torch():
    """The list command imports neither torch nor the methods, and answers in about the time of --help."""
    code = "import sys; from fedhet.cli import main; main(['list']); print('torch' in sys.modules)"
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    listed_s = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "False"
    assert lines[0].startswith("methods: ") and "fccl_plus" in lines[0] and "model families: " in lines[2]
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fedhet", "--help"], capture_output=True, cwd=ROOT, timeout=120)
    assert listed_s < 3 * (time.perf_counter() - started) + 1.0


def test_unknown_command_suggests(capsys):
    """A misspelt command: one line with the closest command."""
    code, _, err = _run(["tset"], capsys)
    assert code == 2 and "did you mean 'test'" in _only_line(err)


def test_corrupt_checkpoint_hint_proposes_a_command_that_works(tmp_path, capsys):
    """The corrupt-checkpoint error's command starts the run again, and it runs."""
    run_dir = tmp_path / "run"
    code, _, err = _run(["fit", "--config", DIGITS, *tiny_overrides(), "--rounds=1", f"--run_dir={run_dir}"], capsys)
    assert code == 0, err
    (run_dir / "summary.json").unlink()
    (run_dir / "checkpoint.pt").write_bytes(b"\x00garbage")
    code, _, err = _run(["fit", "--resume", str(run_dir)], capsys)
    line = _only_line(err)
    assert code == 2 and "corrupt" in line and "delete" not in line
    code, _, err = _run(["fit", *line.split("fedhet fit ", 1)[1].split()], capsys)
    assert code == 0, err


def test_method_help_takes_a_registry_name(capsys):
    """--method.help fedproto shows FedProto's hyperparameters with their range types."""
    with pytest.raises(SystemExit):
        main(["fit", "--method.help", "fedproto"])
    out = capsys.readouterr().out
    assert "--method.lam" in out and "NonNegativeFloat" in out and "PositiveFloat" in out
