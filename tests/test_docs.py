"""The documentation cannot rot: every Python block in README.md, docs/, CONTRIBUTING.md and benchmarks/README.md runs
here (in-process: blocks construct objects, they fit nothing) or is an excerpt of the example file its marker names;
every `train.py` / `plan.py` command shown composes with Hydra (groups, options and keys exist; nothing launches);
every relative link resolves, anchors included; and no page talks about how the project is developed."""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig

ROOT = Path(__file__).parents[1]
USER_PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *ROOT.glob("docs/*.md")])
PAGES = sorted([*USER_PAGES, ROOT / "CONTRIBUTING.md"])  # CONTRIBUTING.md: how the project is developed
CLUSTER_FILES = sorted((ROOT / "examples" / "cluster").glob("*"))
MARKER = re.compile(r"<!-- example: (\S+) -->")
FENCE = re.compile(r"^```(\w*)\s*$")
ELISION = {"...", "# ..."}


def blocks(page: Path) -> list[tuple[str, str, str | None, int]]:
    """(language, text, example file named by a marker on the line before, line number) of each fenced block."""
    found, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if opened is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.search(before)
        found.append((opened.group(1), "\n".join(lines[i + 1 : end]), marker.group(1) if marker else None, i + 1))
        i = end + 1
    return found


def python_blocks() -> list[tuple[str, str, str | None]]:
    return [
        (f"{page.relative_to(ROOT)}:{line}", text, example)
        for page in PAGES
        for language, text, example, line in blocks(page)
        if language == "python"
    ]


def chunks(text: str) -> list[list[str]]:
    """The block split at its elision lines (`# ...`), each chunk dedented."""
    parts: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.strip() in ELISION:
            parts.append([])
        else:
            parts[-1].append(line)
    return [textwrap.dedent("\n".join(part)).splitlines() for part in parts if any(s.strip() for s in part)]


def excerpt_error(text: str, source: str) -> str | None:
    """None when every chunk of `text` is a run of `source`'s lines (indentation aside), in order; else the chunk."""
    lines, start = source.splitlines(), 0
    for chunk in chunks(text):
        n = len(chunk)
        runs = (textwrap.dedent("\n".join(lines[i : i + n])).splitlines() for i in range(start, len(lines) - n + 1))
        at = next((start + k for k, run in enumerate(runs) if run == chunk), None)
        if at is None:
            return "\n".join(chunk)
        start = at + n
    return None


@pytest.mark.parametrize(("where", "text", "example"), python_blocks(), ids=[b[0] for b in python_blocks()])
def test_python_block_runs_or_is_an_example_excerpt(where: str, text: str, example: str | None) -> None:
    if example is not None:
        source = (ROOT / example).read_text()
        missing = excerpt_error(text, source)
        assert missing is None, f"{where}: not in {example} (in this order):\n{missing}"
        return
    exec(compile(text, where, "exec"), {"__name__": "docs_block"})  # noqa: S102 - our own documentation


# ---- train.py / plan.py commands -------------------------------------------------------------------------------------
def command_lines() -> list[tuple[str, list[str]]]:
    """(where, words) of each shell line that runs `train.py` / `plan.py`, in a bash block or a cluster example."""
    sources = [
        (f"{page.relative_to(ROOT)}:{line}", text)
        for page in PAGES
        for language, text, _, line in blocks(page)
        if language in ("bash", "sh", "")
    ]
    sources += [(str(path.relative_to(ROOT)), path.read_text()) for path in CLUSTER_FILES]
    found = []
    for where, text in sources:
        for line in re.sub(r"\\\n\s*", " ", text).splitlines():
            line = "" if line.lstrip().startswith("#") else line.split(" #", 1)[0]
            line = re.sub(r"\$\{?(\w+)\}?", r"\1", line)  # shell variables as plain words
            line = re.split(r";|&&|\||\) ", line)[0] if "train.py" in line or "plan.py" in line else ""
            words = shlex.split(line)
            if any(w in ("train.py", "plan.py") for w in words):
                found.append((where, words))
    return found


def commands() -> list[tuple[str, str, list[str]]]:
    """(where, script, arguments) of each `train.py` / `plan.py` command in a bash block or a cluster example."""
    found = []
    for where, words in command_lines():
        script = next(w for w in words if w in ("train.py", "plan.py"))
        rest = words[words.index(script) + 1 :]
        found.append((where, script, [w for w in rest if w not in ELISION and not w.startswith("$")]))
    return found


def test_a_torchrun_command_gives_train_py_its_process_count() -> None:
    """torchrun's --nproc-per-node must be trainer.devices (Lightning indexes its devices by the local rank: a command
    without it failed on rank 1 with an IndexError)."""
    launched = [
        (where, words)
        for where, words in command_lines()
        if any("torchrun" in w or w == "torch.distributed.run" for w in words)
    ]
    assert len(launched) >= 3, launched
    for where, words in launched:
        nproc = next(w.split("=", 1)[1] for w in words if w.startswith("--nproc-per-node="))
        devices = [w.split("=", 1)[1] for w in words if w.startswith("trainer.devices=")]
        assert devices == [nproc], f"{where}: --nproc-per-node={nproc} but trainer.devices={devices or 'unset (1)'}"


def overrides_of(arguments: list[str]) -> tuple[list[str], str | None]:
    """Hydra overrides a command gives (a sweep's first value of each list) and the launcher it names, if any."""
    result, launcher = [], None
    for word in arguments:
        if word in ("-m", "--multirun"):
            continue
        assert "=" in word, f"{word!r} is not a Hydra override"
        key, value = word.split("=", 1)
        if key == "hydra/launcher":
            launcher = value
            continue
        if key.startswith("hydra.launcher."):
            continue  # the launcher's own keys: its plugin is an optional extra
        if "," in value and not value.startswith(("{", "[", "'")):
            value = value.split(",")[0]
        result.append(f"{key}={value}")
    return result, launcher


@pytest.mark.parametrize(("where", "script", "arguments"), commands(), ids=[c[0] for c in commands()])
def test_train_and_plan_commands_compose(where: str, script: str, arguments: list[str]) -> None:
    overrides, launcher = overrides_of(arguments)
    if launcher is not None:
        assert (ROOT / "conf" / "hydra" / "launcher" / f"{launcher}.yaml").is_file(), f"{where}: no launcher {launcher}"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(script.removesuffix(".py"), overrides=overrides, return_hydra_config=True)
    if script == "train.py":
        check_sizes(where, cfg)


def check_sizes(where: str, cfg: DictConfig) -> None:
    """A mesh strategy's sizes multiply to the processes the command starts (`trainer.devices x trainer.num_nodes`,
    as a dry run plays them): asked of the strategy itself, built alone (no model; nothing launches)."""
    devices, nodes = cfg.trainer.devices, cfg.trainer.num_nodes
    if not hasattr(get_class(cfg.strategy._target_), "resolve_dims") or not isinstance(devices, int) or devices < 1:
        return
    try:
        instantiate(cfg.strategy).resolve_dims(devices * nodes)
    except ValueError as error:
        pytest.fail(f"{where}: {error}")


def test_the_pages_show_commands() -> None:
    """The parser above finds what it should, so the test cannot pass by finding nothing."""
    found = {(where.split(":")[0], script) for where, script, _ in commands()}
    assert ("README.md", "train.py") in found and ("docs/insight-and-planner.md", "plan.py") in found
    assert ("examples/cluster/train.sbatch", "train.py") in found
    assert len(python_blocks()) >= 8 and any(example for _, _, example in python_blocks())


def test_every_benchmark_script_is_described() -> None:
    """benchmarks/README.md names every script there, the measuring ones in its table and their helpers above it."""
    described = (ROOT / "benchmarks" / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py")) if f"`{p.name}`" not in described]
    assert not missing, f"benchmarks/README.md does not describe {missing}"


# ---- links and phrases -----------------------------------------------------------------------------------------------
def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"
        assert resolved.is_relative_to(ROOT), f"{page.relative_to(ROOT)}: {target} leaves the repository"
        if anchor and resolved.suffix == ".md":
            assert anchor in anchors(resolved), f"{page.relative_to(ROOT)}: no heading #{anchor} in {path or 'itself'}"


GAP = re.compile(r"(?<![\w.])\d(?:\.\d+)?e-\d+")  # a tolerance or gap: 1e-5, 2.4e-7


def quoted_gaps() -> list[tuple[str, float, list[str]]]:
    """(page, figure, test files) for each figure like 1e-5 in a paragraph that names the tests it comes from."""
    found = []
    for page in USER_PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
        for paragraph in re.split(r"\n\s*\n|\n- ", text):
            tests = sorted(set(re.findall(r"tests/(test_\w+\.py)", paragraph)))
            found += [(page.name, float(figure), tests) for figure in GAP.findall(paragraph) if tests]
    return found


def test_a_gap_quoted_beside_its_tests_is_one_they_assert() -> None:
    """A measured gap passed off as the tests' bound ("within 5e-7" where they assert 1e-5) is a figure nothing checks:
    quote the bound, or the measurement with the results file it comes from."""
    quoted = quoted_gaps()
    assert len(quoted) >= 10, quoted  # the pattern still finds the pages' figures
    for page, figure, tests in quoted:
        sources = "\n".join((ROOT / "tests" / name).read_text() for name in tests if (ROOT / "tests" / name).is_file())
        asserted = {float(x) for x in GAP.findall(sources)}
        assert figure in asserted, f"{page}: {figure:g} beside {', '.join(tests)}, which hold {sorted(asserted)}"


DEVELOPMENT = [
    r"this machine", r"this session", r"device[- ]time (budget|left|lent)", r"minutes of device time", r"\blent\b",
    r"budgets? of device", r"was available",
    r"no GPU (was|here|in this)", r"not yet run on one", r"\b(commit|main at|git show) [0-9a-f]{7,40}\b",
    r"\bhere \(no", r"checked once by hand", r"ran by hand",
]  # fmt: skip


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_talks_about_how_the_project_is_developed(page: Path) -> None:
    text = page.read_text()
    for phrase in DEVELOPMENT:
        hit = re.search(phrase, text, re.IGNORECASE)
        assert hit is None, f"{page.relative_to(ROOT)}: {text[max(0, hit.start() - 60) : hit.end() + 60]!r}"


def test_the_readme_stays_short_and_answers_the_three_journeys_first() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines"
    first_screen = "\n".join(lines[:25])
    for page in ("#quick-start", "docs/your-model.md", "docs/clusters.md"):
        assert page in first_screen, f"README.md's first screen links no {page}"


def test_no_page_keeps_a_merge_conflict() -> None:
    """A merge's conflict markers once sat in docs/architecture.md for a whole session, unseen."""
    for page in [*PAGES, ROOT / "docs" / "architecture.md"]:
        marked = re.findall(r"^(?:<{7}|={7}|>{7})(?: |$)", page.read_text(), re.MULTILINE)
        assert not marked, f"{page.relative_to(ROOT)}: merge conflict markers {marked}"
