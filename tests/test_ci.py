"""CI runs exactly the README's test command (the developers' guide requires it)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_test_commands():
    readme = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(python3 -m venv[^\n]*pytest[^\n]*)\n```", readme)


def test_ci_runs_the_readme_test_command():
    commands = _readme_test_commands()
    assert len(commands) == 1, f"expected one test command in the README, found {commands}"
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[0] in ci_lines, ".ci/run does not run the README's test command verbatim"


def test_the_test_command_prints_the_slowest_tests_and_uses_every_core():
    """docs/development.md, "The suite's budget": every run lists its 25 slowest tests, and runs on every core."""
    command = _readme_test_commands()[0]
    pytest_args = command.split("python -m pytest", 1)[1].split()
    assert "--durations=25" in pytest_args and pytest_args[pytest_args.index("-n") + 1] == "auto", command
