"""Every command line README.md shows (its ```bash blocks) works after the README's install.

Nothing trains here: ``fit`` lines are checked with ``--print_config`` (parsed and resolved as
the run would be), ``sweep`` with ``--dry_run`` (every run's ``fedhet fit`` line parsed),
``bench`` by planning and parsing its cells, ``test``/``validate`` by evaluating a tiny finished
run put where the README's example run directory is named, and the install line by checking the
installed packages against ``setup.cfg``. A new README command without a check here fails.
"""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from fedhet.cli import main
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The example run directory README's lines name; the tests put a tiny finished run there.
EXAMPLE_RUN = "runs/fedproto-20261122-120000-s0"
BRACES = re.compile(r"^(.*?)\{([^{}]*,[^{}]*)\}(.*)$")


def _expand_braces(token: str) -> list[str]:
    """Bash's ``a/{x,y}.yaml`` -> ``a/x.yaml a/y.yaml`` (one level, as README uses it)."""
    match = BRACES.match(token)
    if not match:
        return [token]
    head, options, tail = match.groups()
    return [part for option in options.split(",") for part in _expand_braces(head + option + tail)]


def readme_commands() -> list[list[str]]:
    """The commands of README's ```bash blocks: comments dropped, ``&&`` split, braces expanded."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.splitlines():
            current: list[str] = []
            for token in shlex.split(line, comments=True):
                if token == "&&":
                    commands.append(current)
                    current = []
                else:
                    current += _expand_braces(token)
            if current:
                commands.append(current)
    return commands


COMMANDS = readme_commands()


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def _requirements(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip() and not line.strip().startswith("#")]


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)


@pytest.fixture(scope="module")
def example_run(tmp_path_factory) -> Path:
    """A tiny finished one-round FedProto run (the README's example run directory stands for it)."""
    run_dir = tmp_path_factory.mktemp("readme") / "run"
    config = str(ROOT / "configs/experiments/digits/fedproto.yaml")
    assert main(["fit", "--config", config, *tiny_overrides(), "--rounds=1", f"--run_dir={run_dir}"]) == 0
    return run_dir


def test_readme_shows_the_commands_checked_here():
    """The README's blocks hold the install, the tests and every fedhet subcommand (13+ lines)."""
    firsts = {tuple(c[:2]) if c[0] != "python" else tuple(c[:3]) for c in COMMANDS}
    assert ("pip", "install") in firsts and ("python", "-m", "pytest") in firsts
    subcommands = {c[1] for c in COMMANDS if c[0] == "fedhet"}
    assert {"fit", "test", "validate", "list", "sweep", "bench", "pretrain-generator", "--version"} <= subcommands
    assert len(COMMANDS) >= 14


def _check_install(command: list[str]) -> None:
    """``pip install -e ".[dev]"``: the extra exists, and every requirement it brings is installed here.

    Also that none of them declares ``numpy<2`` (which would downgrade numpy under torch, the
    reason W&B's ``sweeps`` engine is not a requirement).
    """
    assert command[-1] == ".[dev]"
    config = _setup_cfg()
    extras = config["options.extras_require"]
    assert "dev" in extras
    requirements = _requirements(config["options"]["install_requires"]) + _requirements(extras["dev"])
    assert "optuna>=3.0" in requirements and not any(_name(r) == "sweeps" for r in requirements)
    for requirement in requirements:
        name = _name(requirement)
        metadata.version(name)  # raises PackageNotFoundError when the install would lack it
        for dependency in metadata.requires(name) or []:
            if _name(dependency).lower() == "numpy" and "extra ==" not in dependency:
                assert "<2" not in dependency.replace(" ", ""), f"{name} requires {dependency}"


def _check_fedhet(command: list[str], example_run: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # README's paths are relative to the repository root
    argv = [str(example_run) if a == EXAMPLE_RUN else a for a in command[1:]]
    sub = argv[0]
    if sub == "fit":
        if "--resume" in argv:  # a killed run: the finished example without its summary
            killed = tmp_path / "killed"
            shutil.copytree(example_run, killed)
            (killed / "summary.json").unlink()
            argv[argv.index("--resume") + 1] = str(killed)
        with pytest.raises(SystemExit) as exit_info:
            main(argv if "--print_config" in argv else [*argv, "--print_config"])
        assert exit_info.value.code == 0
        config = yaml.safe_load(capsys.readouterr().out)
        assert {"method", "scenario", "rounds", "seed"} <= set(config)
        for flag, value in zip(argv, [*argv[1:], ""], strict=True):  # simple overrides land in the config
            key = flag[2:].split("=", 1)[0]
            value = flag.split("=", 1)[1] if "=" in flag else value
            if flag.startswith("--") and key in ("rounds", "seed"):
                assert config[key] == int(value)
        return
    if sub in ("test", "validate"):
        assert main(argv) == 0
        assert f"evaluated on the {'test' if sub == 'test' else 'validation'} sets" in capsys.readouterr().out
        return
    if sub == "list":  # the registered names, or one method's declared knobs
        names = argv[1:]
        out = (main(argv), capsys.readouterr().out)
        assert out[0] == 0 and ("fedproto" in out[1] if not names else all(f"{n} (" in out[1] for n in names))
        return
    if sub == "--version":
        assert main(argv) == 0 and capsys.readouterr().out.startswith("fedhet ")
        return
    if sub == "pretrain-generator":  # trains a generator: checked to its --help
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--help"])
        assert exit_info.value.code == 0 and "--steps" in capsys.readouterr().out
        return
    if sub == "sweep":  # every run parsed, nothing started
        assert main([*argv, "--dry_run", "--dir", str(tmp_path / "sweep")]) == 0
        assert "runs would start" in capsys.readouterr().out and not (tmp_path / "sweep").exists()
        return
    if sub == "bench":  # bench_command up to starting runs: its arguments, its cells, each parsed
        from fedhet.bench import build_parser, check_recorded, parse_settings, plan, validate_cells

        args = build_parser().parse_args(argv[1:])
        assert all(Path(c).is_file() for c in args.configs) and args.jobs >= 1
        cells = plan(args.configs, args.seeds, parse_settings(args.settings), [])
        check_recorded(cells, tmp_path / "bench")
        validate_cells(cells, tmp_path / "bench")
        assert len(cells) == len(args.configs) * len(args.seeds)
        return
    pytest.fail(f"README shows 'fedhet {sub}', which this test has no check for; add one")


@pytest.mark.parametrize("command", COMMANDS, ids=[shlex.join(c)[:80] for c in COMMANDS])
def test_readme_command_works(command, request, tmp_path, capsys, monkeypatch):
    """Each README command line, checked as the module docstring says."""
    if command[:2] == ["pip", "install"]:
        _check_install(command)
    elif command[:3] == ["python", "-m", "pytest"]:
        assert "pytest" in {_name(r) for r in _requirements(_setup_cfg()["options.extras_require"]["dev"])}
        metadata.version("pytest")
    elif command[0] == "fedhet" or command[:3] == ["python", "-m", "fedhet"]:
        example_run = request.getfixturevalue("example_run")  # trained once, for the lines that name a run
        capsys.readouterr()  # the example run's own output, when it was trained for this test
        _check_fedhet(command if command[0] == "fedhet" else command[2:], example_run, tmp_path, capsys, monkeypatch)
    else:
        pytest.fail(f"README shows {shlex.join(command)!r}, which this test has no check for; add one")
