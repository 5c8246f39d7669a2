"""The house's rules, read off the source with `ast` and `tokenize`: imports run one way (the runtime does not import
the lab; the model and the kernels import no loop or command), one module reads the environment, comments state
reasons and leave run numbers, device timings and commits to docs/results/, and the README stays short."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "lattice_mlx"
SOURCES = sorted(PKG.rglob("*.py"))
COMMANDS = {"generate", "server", "chat", "convert", "cache_prompt", "doctor", "cli", "variants", "bench"}
LOOPS = {"speculative", "decode", "traces", "prompt_cache"}


def module_of(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The lattice_mlx modules a file imports (relative imports resolved; `from x import name` counts x.name too)."""
    mod = module_of(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("lattice_mlx"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("lattice_mlx"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)
    return out


def floor(name: str) -> str:
    """lattice_mlx.<first part>: the room a module belongs to."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_run_one_way(path):
    mod = module_of(path)
    room = floor(mod)
    targets = {floor(t) for t in imports(path)} - {room, ""}
    if room != "bench":
        assert "bench" not in targets, f"{mod} imports the lab (lattice_mlx.bench)"
    if room in ("models", "metal"):
        assert not targets & (LOOPS | COMMANDS), f"{mod} imports a loop or a command: {sorted(targets & (LOOPS | COMMANDS))}"
    if room == "metal":
        assert targets <= {"settings"}, f"{mod} imports {sorted(targets)}: metal/ imports nothing above it"


def test_only_settings_reads_the_environment():
    readers = [str(p.relative_to(PKG)) for p in SOURCES
               if p.name != "settings.py" and re.search(r"\bos\.(environ|getenv|putenv)\b", p.read_text())]
    assert readers == [], f"read the environment through lattice_mlx.settings: {readers}"


RUN = re.compile(r"\b[Rr]uns? \d+\b|\bH[12]00\b")
TIMING = re.compile(r"\b\d+(?:\.\d+)? ?(?:us|ms)\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring in a file."""
    text = path.read_text()
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def test_comments_cite_no_run_timing_or_commit():
    found = [f"{p.relative_to(PKG)}:{line}: {m.group(0)!r}" for p in SOURCES for line, text in prose(p)
             for rule in (RUN, TIMING, COMMIT) for m in [rule.search(text)] if m]
    assert found == [], "state the reason in the comment and the measurement in docs/results/: " + "; ".join(found)


def test_the_rule_finds_what_it_should():
    assert RUN.search("measured in run 19 on the H200") and TIMING.search("took 23.2 us per launch")
    assert COMMIT.search("fixed in b257909") and not COMMIT.search("a 0x0F0F0F0F mask, deadline, 1000000")


def test_readme_is_short_and_keeps_the_quick_start():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for command in ('pip install -e ".[cpu]" && python -m lattice_mlx.generate --mtp --max-tokens 64',
                    'pip install -e ".[cpu,test]" && python -m pytest -q -n auto'):
        assert f"```bash\n{command}\n```" in readme
    assert (ROOT / "docs" / "results" / "README.md").exists()


SCRIPT_ROOMS = {"bench", "demo", "device"}
NAMED_PATH = re.compile(r"\b(?:scripts|tests)/[\w./-]+\.(?:py|sh|h)\b")


def test_scripts_live_in_rooms_by_purpose():
    """scripts/ holds no loose file: benchmarks and profiles in bench/, the demo's training and evaluation in demo/,
    the device machine's runner and checks in device/."""
    loose = [p.name for p in (ROOT / "scripts").iterdir() if p.is_file()]
    assert loose == []
    assert {p.name for p in (ROOT / "scripts").iterdir() if p.is_dir() and p.name != "__pycache__"} == SCRIPT_ROOMS


def test_tests_mirror_src():
    """A test folder is named after the package room it tests (src/lattice_mlx/<room>/), or after scripts/."""
    rooms = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {"scripts"}
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= rooms, folders - rooms
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names))  # pytest imports test files by base name


def test_every_named_file_exists():
    """A script or test path named in the README, docs/ (the archive keeps the paths of its day), tests, src/ or scripts/
    names a file that is there."""
    texts = [ROOT / "README.md", *(ROOT / "tests").rglob("*.py"), *SOURCES, *(ROOT / "scripts").rglob("*.*"),
             *(p for p in (ROOT / "docs").rglob("*.md") if "archive" not in p.relative_to(ROOT / "docs").parts)]
    missing = {(str(t.relative_to(ROOT)), m) for t in texts if t.suffix in {".py", ".md", ".sh"}
               for m in NAMED_PATH.findall(t.read_text()) if not (ROOT / m).exists()}
    assert missing == set()


def test_device_runner_modes_are_few_and_documented():
    """gpu_run.sh: at most 20 modes, each named in the header by what it measures, none named after a run."""
    text = (ROOT / "scripts" / "device" / "gpu_run.sh").read_text()
    modes = re.findall(r"^  ([a-z0-9-]+)\)", text, re.M)
    header = text.split("\nset -u", 1)[0]
    assert 0 < len(modes) <= 20 and len(set(modes)) == len(modes)
    assert [m for m in modes if not re.search(rf"^#   {re.escape(m)}\b", header, re.M)] == []
    assert [m for m in modes if re.search(r"run\d|^r\d|issue|fix", m)] == []
