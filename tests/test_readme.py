"""README.md and the manual (docs/*.md) stay true: every code block is checked, the install
commands name real distributions and extras, and the generated references are current.

Every fenced block of every one of those files carries an info string, and each kind is
checked its own way (a test id names the file and the block's first line, ``docs/cli.md:12``):

- ```python: runs, each block in a fresh interpreter (its registrations and priorities cannot
  leak into another), from an empty folder, with no VLLM_IR_* variable set. A block that needs
  hardware starts with a marker comment, ``# needs: cuda`` (also ``rocm``, ``xpu``, ``gpu``, or
  the name of an importable module, comma-separated), and is skipped where that is missing.
- ```python no-run: a snippet that needs what a test cannot have (a Hugging Face model
  download, a process group across GPUs; its ``model`` is the reader's). It is compiled (syntax)
  and every name it imports (``import m``, ``from m import x``) and every attribute it reads
  from ``vllm_ir`` or ``torch`` (``vllm_ir.compile``) must exist; nothing is run.
- ```toml: a site config file (``VLLM_IR_CONFIG``): loaded and validated by vllm-ir's own
  loader (`vllm_ir.settings.config`, then ``vllm_ir.reload_env()``, which raises on any problem) in a
  fresh interpreter with the installed providers, and must be valid.
- ```bash: every command ``vllm-ir <verb> ...`` (also in a comment's `backticks`) names a
  verb of the CLI, and every option after it is one that verb's argparse parser accepts (a
  concrete command line is parsed whole; a synopsis with ``[...]`` has its option names checked;
  nothing is run); every ``benchmarks/``, ``scripts/`` or ``examples/`` path exists; every
  ``--vllm-ir-*`` option of ``pytest`` is one the conformance kit registers.
- ```text: shown as is (a directory layout, an output).

Every relative link leads to a file, and an anchor to a heading of it. The settings and CLI
references in docs/ are generated (``scripts/gen_reference.py``) from
`vllm_ir.settings.env.VARIABLES`, the config loader's keys and the argparse parsers; a test fails when
the checked-in text differs from what the generator writes now.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import os
import re
import shlex
import types
from pathlib import Path

import pytest
import torch

import vllm_ir
from tests.python_child import run_python

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
#: Every file whose blocks are checked: the README, then the manual.
DOCS: tuple[Path, ...] = (README, *sorted((REPO / "docs").glob("*.md")))
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
#: The info strings a block may carry (see the module docstring).
INFO_STRINGS = ("python", "python no-run", "toml", "bash", "text")
_NEEDS = re.compile(r"^\s*#\s*needs:\s*(.+)$", re.M)


def blocks(text: str) -> list[tuple[str, int, str]]:
    """(info string, line number of the first code line, code) of every fenced block."""
    return [(m.group(1).strip(), text.count("\n", 0, m.start()) + 2, m.group(2)) for m in _FENCE.finditer(text)]


def python_blocks(text: str, info: str = "python") -> list[tuple[int, str]]:
    """(line number, code) of every block tagged exactly ``info`` (```python: the ones that run)."""
    return [(line, code) for tag, line, code in blocks(text) if tag == info]


def missing(code: str) -> list[str]:
    """What a block's ``# needs:`` markers ask for that this machine lacks."""
    out = []
    for marker in _NEEDS.findall(code):
        for need in (n.strip() for n in marker.split(",")):
            if need == "cuda":
                ok = torch.cuda.is_available() and torch.version.cuda is not None
            elif need == "rocm":
                ok = torch.cuda.is_available() and torch.version.hip is not None
            elif need == "gpu":
                ok = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
            elif need == "xpu":
                ok = hasattr(torch, "xpu") and torch.xpu.is_available()
            else:
                ok = importlib.util.find_spec(need) is not None
            if not ok:
                out.append(need)
    return out


def _name(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def blocks_of(info: str) -> list[tuple[str, int, str]]:
    """(file, line, code) of every block tagged exactly ``info`` in README.md and docs/*.md."""
    return [(_name(path), line, code) for path in DOCS for line, code in python_blocks(path.read_text(), info)]


def _ids(found: list[tuple[str, int, str]]) -> list[str]:
    return [f"{where}:{line}" for where, line, _ in found]


_BLOCKS = blocks_of("python")


def test_the_docs_exist_and_the_readme_has_python_blocks():
    assert len(DOCS) > 1, "the manual lives in docs/*.md"
    assert python_blocks(README.read_text())


@pytest.mark.parametrize(("where", "line", "code"), _BLOCKS, ids=_ids(_BLOCKS))
@pytest.mark.subprocess
def test_python_block_runs(where, line, code, tmp_path):
    lacking = missing(code)
    if lacking:
        pytest.skip(f"{where}:{line} needs {', '.join(lacking)}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_IR_", "VLLM_BATCH"))}
    result = run_python(["-c", code], cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, f"{where}:{line} failed:\n{result.stderr[-3000:]}"


def _declared_extras(distribution: str) -> dict[str, list[str]] | None:
    """The optional dependencies a distribution of this repository declares (None: not ours)."""
    import tomllib

    for pyproject in [REPO / "pyproject.toml", *REPO.glob("providers/*/pyproject.toml")]:
        project = tomllib.loads(pyproject.read_text())["project"]
        if project["name"] == distribution:
            return project.get("optional-dependencies", {})
    return None


def test_triton_declares_the_interpreter_extra():
    """``TRITON_INTERPRET=1`` needs numpy, which Triton does not declare: the ``interpret`` extra does."""
    extras = _declared_extras("vllm-ir-provider-triton")
    assert extras is not None and "interpret" in extras
    assert any(re.match(r"numpy\b", requirement) for requirement in extras["interpret"])


#: ``pip install`` options that take a value (the value is not a distribution).
_PIP_VALUED = {
    "-f",
    "--find-links",
    "-e",
    "--editable",
    "-r",
    "--requirement",
    "-c",
    "--constraint",
    "-i",
    "--index-url",
}
_OURS = re.compile(r"(vllm-ir[a-z0-9-]*)(?:\[([a-z0-9_,-]+)\])?(?:[<>=!~].*)?")


def installed_distributions(text: str) -> list[tuple[str, str]]:
    """(distribution, extras) of every ``vllm-ir*`` requirement a ``pip install`` line of ``text`` names."""
    named = []
    for match in re.finditer(r"pip install ([^\n#`]*)", text):
        try:
            words = shlex.split(match.group(1))
        except ValueError:  # prose with an apostrophe
            words = match.group(1).split()
        skip = False
        for word in words:
            if skip:
                skip = False
            elif word in _PIP_VALUED:
                skip = True
            elif not word.startswith("-"):
                found = _OURS.fullmatch(word)
                if found:
                    named.append((found.group(1), found.group(2) or ""))
    return named


def test_install_commands_name_our_distributions_and_extras():
    every = []
    for path in DOCS:
        for distribution, extras in installed_distributions(path.read_text()):
            every.append(distribution)
            declared = _declared_extras(distribution)
            where = _name(path)
            assert declared is not None, f"{where} installs {distribution}, which no pyproject.toml here builds"
            for extra in filter(None, extras.split(",")):
                assert extra in declared, f"{where} installs {distribution}[{extra}], which it does not declare"
    assert "vllm-ir" in every and any(d.startswith("vllm-ir-provider-") for d in every)
    assert "vllm-ir-provider-triton[interpret]" in "\n".join(p.read_text() for p in DOCS)  # Triton's interpreter


@pytest.mark.parametrize(
    ("line", "named"),
    [
        (
            "pip install --find-links dist vllm-ir vllm-ir-provider-native",
            [("vllm-ir", ""), ("vllm-ir-provider-native", "")],
        ),
        ('pip install "vllm-ir[transformers]"', [("vllm-ir", "transformers")]),
        ("pip install --no-build-isolation -e providers/vllm_c", []),
        ("pip install torch==2.13.0 vllm-ir-provider-vllm-c", [("vllm-ir-provider-vllm-c", "")]),
    ],
)
def test_install_lines_are_read_word_by_word(line, named):
    assert installed_distributions(line) == named


def test_the_install_check_catches_a_distribution_we_do_not_build():
    ((distribution, _),) = installed_distributions("pip install vllm-ir-provider-cuda")
    assert _declared_extras(distribution) is None


# ---------------------------------------------------------------------------------------
# Every block has a known info string; the ones that cannot run are checked without running


_ALL = [(_name(path), tag, line, code) for path in DOCS for tag, line, code in blocks(path.read_text())]


def test_every_block_has_a_known_info_string():
    untagged = [f"{where}:{line}: {tag or '(none)'}" for where, tag, line, _ in _ALL if tag not in INFO_STRINGS]
    assert not untagged, f"tag these blocks with one of {INFO_STRINGS} (see this module's docstring): {untagged}"
    assert {tag for _, tag, _, _ in _ALL} >= {"python", "python no-run", "toml", "bash"}


_NO_RUN = blocks_of("python no-run")
#: Roots whose attributes a no-run snippet may read without importing them (the README's own imports).
_IMPLIED = ("vllm_ir", "torch")


def _top_level_names(module: str) -> set[str] | None:
    """Names a module's source binds at top level, read without importing it (None: no source)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    names: set[str] = set()
    for node in ast.parse(Path(spec.origin).read_text()).body:
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(sub.name)
            elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
            elif isinstance(sub, (ast.Assign, ast.AnnAssign)):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _is_submodule(module: str, name: str) -> bool:
    spec = importlib.util.find_spec(module)
    return bool(spec and spec.submodule_search_locations) and importlib.util.find_spec(f"{module}.{name}") is not None


def _has(module: str, name: str) -> bool:
    """``from module import name`` would work: read from the source first (an optional
    dependency of the module, e.g. transformers, need not be installed or imported), else
    a submodule, else imported."""
    names = _top_level_names(module)
    if names is not None and name in names:
        return True
    return _is_submodule(module, name) or hasattr(importlib.import_module(module), name)


def _attribute_chains(tree: ast.AST) -> list[list[str]]:
    """``a.b.c`` reads (outermost only) as ["a", "b", "c"]."""
    chains, inner = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                inner.add(id(cur.value))
                cur = cur.value
            if isinstance(cur, ast.Name):
                chains.append([cur.id, *reversed(parts)])
    return chains


def _resolve_chain(chain: list[str]) -> str | None:
    """None if ``chain`` (rooted at a module) exists, else the first missing part."""
    obj: object = importlib.import_module(chain[0])
    path = chain[0]
    for part in chain[1:]:
        if isinstance(obj, types.ModuleType) and not hasattr(obj, part):
            if not _is_submodule(path, part) and part not in (_top_level_names(path) or ()):
                return f"{path}.{part}"
            return None  # a submodule not imported yet, or bound in the source: stop here
        if not hasattr(obj, part):
            return f"{path}.{part}"
        obj, path = getattr(obj, part), f"{path}.{part}"
    return None


def test_the_docs_have_no_run_blocks():
    assert _NO_RUN


@pytest.mark.parametrize(("where", "line", "code"), _NO_RUN, ids=_ids(_NO_RUN))
def test_no_run_block_compiles_and_its_names_exist(where, line, code):
    check_no_run(code, line, where)


@pytest.mark.parametrize(
    "code",
    [
        "from vllm_ir.passes import tensor_parallel_fusion\n",  # a misspelt name
        "from vllm_ir.settings.env import no_such_setting\n",
        "import vllm_ir_no_such_module\n",
        "compiled = vllm_ir.compiled(model)\n",
        "x = vllm_ir.ops.rms_norm(\n",  # syntax
    ],
)
def test_the_no_run_check_catches_wrong_names_and_syntax(code):
    with pytest.raises((AssertionError, SyntaxError)):
        check_no_run(code, 0)


def check_no_run(code: str, line: int, where: str = "README.md") -> None:
    """Compile ``code`` and resolve the names it imports and the vllm_ir/torch attributes it reads."""
    at = f"{where}:{line}"
    tree = ast.parse(code, at)
    compile(tree, at, "exec")
    modules = set(_IMPLIED)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert importlib.util.find_spec(alias.name) is not None, f"{at}: no module {alias.name}"
                modules.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module, f"{at}: relative import"
            assert importlib.util.find_spec(node.module) is not None, f"{at}: no module {node.module}"
            for alias in node.names:
                assert _has(node.module, alias.name), f"{at}: {node.module} has no {alias.name!r}"
    for chain in _attribute_chains(tree):
        if chain[0] in modules and importlib.util.find_spec(chain[0]) is not None:
            missing_part = _resolve_chain(chain)
            assert missing_part is None, f"{at}: {'.'.join(chain)}: {missing_part} does not exist"


# ---------------------------------------------------------------------------------------
# ```toml: valid site config files, read by vllm-ir's own loader

_TOML = blocks_of("toml")


@pytest.mark.parametrize(("where", "line", "code"), _TOML, ids=_ids(_TOML))
def test_toml_block_is_a_valid_site_config(where, line, code, tmp_path, monkeypatch):
    """Through ``VLLM_IR_CONFIG`` and ``vllm_ir.reload_env()``, which raises `ConfigError` on
    any problem of the file; provider names are checked against every discovered provider (a
    provider valid but absent here, e.g. vllm_c without its build, is not a problem)."""
    from vllm_ir.settings import config

    path = tmp_path / "site.toml"
    path.write_text(code)
    monkeypatch.setenv("VLLM_IR_CONFIG", str(path))
    try:
        vllm_ir.reload_env()
        site = config.current()
        assert site.path == str(path)
        assert [f.message for f in site.findings if not f.here_only] == [], f"{where}:{line}"
        assert site.priority, f"{where}:{line}: the block's [priority] tables were read"
    finally:
        monkeypatch.delenv("VLLM_IR_CONFIG")
        config.reset()


def test_the_config_loader_rejects_what_the_toml_check_must_catch(tmp_path, monkeypatch):
    """The check above has teeth: a mistyped provider is a ConfigError from the same loader."""
    from vllm_ir import ConfigError
    from vllm_ir.settings import config

    path = tmp_path / "bad.toml"
    path.write_text('[priority]\nrms_norm = ["natve"]\n')
    monkeypatch.setenv("VLLM_IR_CONFIG", str(path))
    try:
        with pytest.raises(ConfigError, match="natve"):
            vllm_ir.reload_env()
    finally:
        monkeypatch.delenv("VLLM_IR_CONFIG")
        config.reset()


# ---------------------------------------------------------------------------------------
# ```bash: CLI verbs and options, files, the conformance kit's options (parsed, never run)

_BASH = blocks_of("bash")
#: ``vllm-ir`` as a command: at a line's start, after a backtick, ``&&``, ``;`` or ``|``.
_COMMAND = re.compile(r"(?:^|`|&&|;|\|)\s*vllm-ir[ \t]+([^`#\n]*)", re.M)
_PATH = re.compile(r"(?<![\w/.-])((?:benchmarks|scripts|examples)/[\w./-]*\w)")
_KIT_OPTION = re.compile(r"--vllm-ir-[a-z-]+")


def _verb_parser(tokens: list[str]) -> tuple[argparse.ArgumentParser, list[str], int]:
    """The parser of the (sub)verb ``tokens`` start with, its name and how many tokens name it."""
    from vllm_ir.tools import cli

    parser: argparse.ArgumentParser = cli.build_parser()
    verb: list[str] = []
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None:
            return parser, verb, len(verb)
        word = tokens[len(verb)] if len(verb) < len(tokens) else None
        if word not in sub.choices and not sub.required:  # `providers` alone is `providers list`
            return parser, verb, len(verb)
        assert word in sub.choices, f"vllm-ir {' '.join(verb)}: {word!r} is not a verb; verbs: {sorted(sub.choices)}"
        verb.append(word)
        parser = sub.choices[word]


def check_command(text: str) -> None:
    """``text`` (what follows ``vllm-ir``) names a verb, and its options are that verb's."""
    tokens = shlex.split(text.replace("\\|", "|"))
    redirect = next((i for i, token in enumerate(tokens) if re.match(r"\d*[<>]", token)), None)
    tokens = tokens[:redirect]  # `> doctor.json` is the shell's, not the verb's
    parser, verb, used = _verb_parser(tokens)
    rest = tokens[used:]
    if any(c in text for c in "[]|") or "..." in text:  # a synopsis: option names only
        for token in rest:
            flag = token.strip("[]").split("=")[0]
            if flag.startswith("-"):
                assert flag in parser._option_string_actions, (
                    f"vllm-ir {' '.join(verb)} has no option {flag}; options: {sorted(parser._option_string_actions)}"
                )
        return
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
        parser.parse_args(rest)
        return
    raise AssertionError(f"vllm-ir {text}: {err.getvalue().strip()}")


def _kit_options() -> set[str]:
    from vllm_ir.testing import pytest_plugin

    names: set[str] = set()

    class Group:
        def addoption(self, *flags, **kwargs):
            names.update(flags)

    class Parser:
        def getgroup(self, *args, **kwargs):
            return Group()

        addoption = Group.addoption

    pytest_plugin.pytest_addoption(Parser())
    return names


def test_the_docs_have_cli_commands():
    assert sum(len(_COMMAND.findall(code)) for _, _, code in _BASH) >= 3


@pytest.mark.parametrize(("where", "line", "code"), _BASH, ids=_ids(_BASH))
def test_bash_block_names_real_verbs_options_and_files(where, line, code):
    joined = re.sub(r"\]\s*\n\s+(?=\[)", "] ", code)  # a synopsis continued on the next line
    for command in _COMMAND.findall(joined):
        try:
            check_command(command.strip())
        except AssertionError as exc:
            raise AssertionError(f"{where}:{line}: {exc}") from None
    for path in _PATH.findall(code):
        assert (REPO / path).exists(), f"{where}:{line}: {path} does not exist"
    if re.search(r"(?:^|\s)pytest\s", code):
        unknown = set(_KIT_OPTION.findall(code)) - _kit_options()
        assert not unknown, f"{where}:{line}: the conformance kit has no option {sorted(unknown)}"


@pytest.mark.parametrize(
    ("command", "ok"),
    [
        ("providers list --json", True),
        ("providers", True),
        ("doctor --json > doctor.json 2>&1", True),
        ("providers --wide", True),
        ("providers lst", False),
        ("bench --quick --plot bench.png", True),
        ("bench [OP ...] [--providers a,b] [--emit-priority]", True),
        ("bench --json", False),  # bench's --json takes FILE
        ("bench [--dtype bfloat16] [--bogus N]", False),
        ("provider list", False),
        ("doctor --quick", False),
    ],
)
def test_the_command_check_catches_wrong_verbs_and_options(command, ok):
    if ok:
        check_command(command)
    else:
        with pytest.raises(AssertionError):
            check_command(command)


def test_the_cli_reference_says_which_verbs_take_json_and_how():
    """``--json`` alone (JSON on stdout) for the verbs whose parser takes it as a flag; ``bench
    --json FILE``: docs/cli.md's sentence names each verb the way its parser takes it."""
    from vllm_ir.tools import cli

    flag, with_file = set(), set()
    top = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in top.choices.items():
        subs = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        leaves = {f"{name} {n}": p for n, p in subs.choices.items()} if subs else {name: parser}
        for verb, leaf in leaves.items():
            action = leaf._option_string_actions["--json"]
            (flag if action.nargs == 0 else with_file).add(verb)
    text = (REPO / "docs" / "cli.md").read_text()
    sentence = re.search(r"\n`vllm-ir` \(or `python -m vllm_ir`\)\. (.*?) take `--json`\n", text)
    assert sentence, "docs/cli.md says which verbs take --json"
    assert set(re.findall(r"`([a-z ]+)`", sentence.group(1))) == flag
    for verb in with_file:
        assert f"`{verb}` takes `--json FILE`" in text


# ---------------------------------------------------------------------------------------
# The generated references (docs/settings.md, docs/cli.md) are what the code makes now


def _generator() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "scripts" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_references_are_current():
    gen = _generator()
    assert gen.stale() == [], f"regenerate them: {gen.COMMAND}"


def test_the_generated_references_cover_every_variable_key_and_option():
    from vllm_ir.settings import config, env
    from vllm_ir.tools import cli

    text = "\n".join((REPO / file).read_text() for file in _generator().SECTIONS)
    for name in env.VARIABLES:
        assert f"| `{name}` |" in text
    for key in config.KEYS:
        assert f"| `{key}` |" in text
    for verb, parser in next(
        a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices.items():
        assert f"`vllm-ir {verb}`" in text
        for option in parser._option_string_actions:
            if option not in ("-h", "--help"):
                assert f"`{option}`" in text, f"vllm-ir {verb} {option}"


def test_a_new_variable_makes_the_references_stale(monkeypatch):
    from vllm_ir.settings import env

    monkeypatch.setitem(env.VARIABLES, "VLLM_IR_NOT_DOCUMENTED", "a boolean")
    assert _generator().stale() == ["docs/settings.md"]


def test_a_config_key_without_a_description_is_an_error(monkeypatch):
    from vllm_ir.settings import config

    monkeypatch.setattr(config, "KEYS", (*config.KEYS, "not_described"))
    with pytest.raises(SystemExit, match="not_described"):
        _generator().config_keys()


# ---------------------------------------------------------------------------------------
# Links between the files lead somewhere: the file exists, and so does the heading an anchor names

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces as -)."""
    text = _FENCE.sub("", text)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def links(path: Path) -> list[str]:
    return [target for target in _LINK.findall(_FENCE.sub("", path.read_text())) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("path", DOCS, ids=[_name(p) for p in DOCS])
def test_links_lead_to_files_and_headings(path):
    for target in links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() and dest.parent == REPO / "docs" / "images":
            continue  # a figure `vllm-ir bench --plot` draws, put there by hand: not checked here
        assert dest.exists(), f"{_name(path)}: link {target}: {file} does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest.read_text()), f"{_name(path)}: link {target}: no heading #{anchor}"


def test_the_link_check_reads_anchors_as_github_does():
    assert anchors("## `vllm-ir bench`\n### What a call can rely on\n# GPU: NVIDIA H200\n") == {
        "vllm-ir-bench",
        "what-a-call-can-rely-on",
        "gpu-nvidia-h200",
    }
    assert links(README) and all(not t.startswith("http") for t in links(README))
