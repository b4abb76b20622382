"""Narrow kernel signatures: every Triton function of comet.kernels takes few parameters
(argument groups, not long positional lists), and every launch in the package passes its
arguments by keyword (at most a handful positionally). Read from the source with ``ast``."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "comet"

#: Most parameters of any @triton.jit function (entry kernels and role functions alike).
MAX_PARAMS = 16
#: Most arguments a launch ``kernel[grid](...)`` may pass positionally.
MAX_POSITIONAL = 3


def _jit_functions():
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d).startswith("triton.jit") for d in node.decorator_list):
                yield f"{path.stem}.{node.name}", node


def _launches():
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                yield f"{path.relative_to(ROOT.parent)}:{node.lineno}", node


JIT = dict(_jit_functions())
LAUNCHES = dict(_launches())


def test_there_are_kernels_and_launches_to_check():
    assert len(JIT) > 40 and len(LAUNCHES) > 10


@pytest.mark.parametrize("name", sorted(JIT))
def test_triton_functions_take_few_parameters(name):
    n = len(JIT[name].args.args)
    assert n <= MAX_PARAMS, f"{name} takes {n} parameters; group them (named tuples)"


@pytest.mark.parametrize("where", sorted(LAUNCHES))
def test_launches_pass_arguments_by_keyword(where):
    n = len(LAUNCHES[where].args)
    assert n <= MAX_POSITIONAL, f"{where} passes {n} arguments positionally"
