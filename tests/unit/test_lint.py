"""The lint gate: every `noqa` names its rules and says why (pyproject.toml's [tool.ruff]), and
README's test command, which .ci/run runs verbatim, runs ruff before the tests."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOQA = re.compile(r"#\s*noqa\b(?P<rest>.*)$")
WITH_REASON = re.compile(r"^:\s*[A-Z]+[0-9]+(\s*,\s*[A-Z]+[0-9]+)*\s*[ (]\s*\S")


def _python_files() -> list[Path]:
    return [p for d in ("zeroshard", "tests", "bench", "tools", "examples") for p in sorted((REPO / d).rglob("*.py"))
            if "__pycache__" not in p.parts]


def test_every_noqa_names_its_rules_and_says_why() -> None:
    bare = []
    for path in _python_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = NOQA.search(line)
            if m and not WITH_REASON.match(m.group("rest")):
                bare.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not bare, ("a noqa names its rules and the reason, `# noqa: E731  a deferred call beside its "
                      "arguments`:\n" + "\n".join(bare))


def test_the_reason_check_can_fail() -> None:
    assert WITH_REASON.match(": F401  only whether it is installed")
    assert WITH_REASON.match(": N802 (DeepSpeed's name)")
    assert not WITH_REASON.match(": F401") and not WITH_REASON.match("") and not WITH_REASON.match(": E402,F401")


def test_ci_runs_readme_test_command_with_ruff_first() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    quickstart = readme.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    command = quickstart.strip().splitlines()[-1].strip()
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1] == command, f".ci/run must end with README's test command {command!r}, not {ci[-1]!r}"
    assert command.startswith("ruff check ") and command.endswith("python tests/run.py"), command
