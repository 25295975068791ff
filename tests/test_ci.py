"""CI runs what README.md tells a user to run, in a fresh virtualenv like the user's."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _commands(lines):
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_readme_test_command_word_for_word():
    readme = (REPO / "README.md").read_text()
    block = readme.split("Run the tests, in a fresh virtualenv", 1)[1].split("\n\n")[1]
    documented = _commands(block.splitlines())
    assert documented[0] == "python -m venv .venv && . .venv/bin/activate"
    ci = _commands((REPO / ".ci" / "run").read_text().splitlines())
    assert ci[-len(documented) :] == documented
