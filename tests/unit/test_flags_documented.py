"""The README's flag tables and the commands' --help agree: every flag a table names exists, and every flag
--help lists is in its table (`specmesh serve`'s, and the services' under "Run the services yourself")."""

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")
SERVICES = ("verify", "draft", "gateway")


def readme_table(heading: str, header: str) -> list[list[str]]:
    """The cells of the first table under `heading` whose header row is `header`."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading) :]
    lines = section[section.index(header) :].splitlines()[2:]  # past the header and the |---| row
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def help_entries(parse) -> list[tuple[str, ...]]:
    """The option names of each entry --help shows (a name, its aliases, its --no- form), from the text."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse()
    entries = []
    for line in out.getvalue().splitlines():
        if re.match(r"^  -", line):  # an option's invocation; help text lines are indented further
            invocation = re.split(r"\s{2,}", line.strip())[0]
            names = tuple(n for n in FLAG.findall(invocation) if n != "--help")
            if names:
                entries.append(names)
    return entries


def undocumented(entries: list[tuple[str, ...]], documented: set[str]) -> list[str]:
    """Names --help shows that the table does not; a table that names `--x` or `--no-x` covers both."""
    missing = []
    for names in entries:
        for name in names:
            pair = name.replace("--no-", "--", 1) if name.startswith("--no-") else "--no-" + name[2:]
            if name not in documented and not (pair in names and pair in documented):
                missing.append(name)
    return missing


def service_help(role: str):
    module = {"verify": "verify_service", "draft": "draft_service", "gateway": "gateway"}[role]
    main = __import__(f"{module}.__main__", fromlist=["parse_args"])
    return lambda: main.parse_args(["--help"])


@pytest.fixture(autouse=True)
def wide_help(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one invocation a line, whatever the terminal


def test_serve_table_matches_its_help():
    from specmesh.cli import parser

    entries = help_entries(lambda: parser().parse_args(["serve", "--help"]))
    # the flag and SGLang's spellings; the last column only describes
    documented = {
        name for row in readme_table("## One command", "| flag |") for name in FLAG.findall(" ".join(row[:2]))
    }
    shown = {name for names in entries for name in names}
    assert undocumented(entries, documented) == [], "in `specmesh serve --help`, not in the README's table"
    assert sorted(documented - shown) == [], "in the README's table, not in `specmesh serve --help`"


@pytest.mark.parametrize("role", SERVICES)
def test_service_table_matches_its_help(role):
    entries = help_entries(service_help(role))
    documented = set()
    for row in readme_table("## Run the services yourself", "| service | flag |"):
        roles = SERVICES if row[0] == "all" else {r.strip() for r in re.split(r"[,/]", row[0])}
        assert set(roles) <= set(SERVICES), row
        if role in roles:
            documented |= set(FLAG.findall(row[1]))
    shown = {name for names in entries for name in names}
    assert undocumented(entries, documented) == [], f"in `python -m {role} --help`, not in the README's table"
    assert sorted(documented - shown) == [], f"in the README's table for {role}, not in its --help"
