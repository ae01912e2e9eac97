"""CI runs exactly the README's test command (the developers' guide requires it)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(python3 -m venv[^\n]*pytest[^\n]*)\n```", readme)
    assert len(commands) == 1, f"expected one test command in the README, found {commands}"
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[0] in ci_lines, ".ci/run does not run the README's test command verbatim"
