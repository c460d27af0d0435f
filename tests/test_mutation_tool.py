"""tools/mutation.py's fences (what a set mutates) and the conftest hook it adds to a scratch copy's tests."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("mutation_tool", ROOT / "tools" / "mutation.py")
mutation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutation)

SOURCE = '''import torch


def helper(x):
    return x + 1


class State:
    def release(self):
        return 1


class Policy:
    LIMIT = 3

    def __init__(self):
        self.n = 0

    @property
    def size(self):
        return self.n

    def snapshot(self):
        return 2

    def restore(self, state):
        return state
'''


def unfenced(text: str) -> list[str]:
    """The names of the functions outside every no-mutate fence, in order."""
    inside, free = False, []
    for line in text.splitlines():
        if "# pragma: no mutate start" in line:
            inside = True
        elif "# pragma: no mutate end" in line:
            inside = False
        elif not inside and (m := re.match(r"\s*def (\w+)", line)):
            free.append(m.group(1))
    return free


def fenced_copy(tmp_path, **how) -> str:
    path = tmp_path / "module.py"
    path.write_text(SOURCE)
    if "keep" in how:
        mutation.fence_all_but(path, how["keep"])
    else:
        mutation.fence(path, lambda name: name in how["skip"])
    text = path.read_text()
    compile(text, str(path), "exec")  # still Python
    return text


def test_only_keeps_whole_classes_and_single_methods(tmp_path):
    text = fenced_copy(tmp_path, keep=["State", "Policy.snapshot", "Policy.restore"])
    assert unfenced(text) == ["release", "snapshot", "restore"]
    # a decorated method's fence starts at its decorator
    assert "# pragma: no mutate start\n    @property" in text


def test_skip_fences_only_what_it_names(tmp_path):
    text = fenced_copy(tmp_path, skip=["State", "Policy.snapshot", "Policy.restore"])
    assert unfenced(text) == ["helper", "__init__", "size"]


def test_the_infllm_sets_split_its_methods_between_them(tmp_path):
    """policies_infllm, policies_infllm_state and policies_infllm_snapshots mutate disjoint parts of infllm.py that
    together hold every function of the file."""
    source = (ROOT / "tokenselect" / "policies" / "infllm.py").read_text()
    parts = []
    for name in ("policies_infllm", "policies_infllm_state", "policies_infllm_snapshots"):
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        spec = mutation.SETS[name]
        for keep in spec.get("only", {}).values():
            mutation.fence_all_but(path, keep)
        for skip in spec.get("skip", {}).values():
            mutation.fence(path, lambda qualname: qualname in skip)
        parts.append(unfenced(path.read_text()))
    step, state, snapshots = parts
    assert {"snapshot", "restore", "_unref"} <= set(snapshots) and not {"snapshot", "restore"} & set(step + state)
    assert {"memory_list", "close_blocks"} <= set(step) and {"prepare", "_reserve_blocks"} <= set(state)
    assert sorted(step + state + snapshots) == sorted(unfenced(source))


def test_fast_first_is_added_once_and_orders_by_the_recorded_durations(tmp_path, monkeypatch):
    """The hook sorts a mutant's tests by mutmut's recorded durations (a test it has none for first)."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text("import os\n")
    mutation.add_fast_first(tests)
    mutation.add_fast_first(tests)
    text = (tests / "conftest.py").read_text()
    assert text.count("def pytest_collection_modifyitems") == 1
    namespace = {}
    exec(compile(text, "conftest.py", "exec"), namespace)

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    items = [Item("slow"), Item("unknown"), Item("fast")]
    (tmp_path / "mutmut-stats.json").write_text('{"duration_by_test": {"slow": 9.0, "fast": 0.5}}')
    monkeypatch.chdir(tmp_path)  # a mutant's tests run in the scratch copy's mutants/, beside mutmut-stats.json
    namespace["pytest_collection_modifyitems"](None, None, items)
    assert [item.nodeid for item in items] == ["unknown", "fast", "slow"]


KERNEL_SOURCE = '''import triton


def kernel_ref(x):
    return x


@triton.jit
def _kernel(x):
    pass


def launch(x):
    return x


def other(x):
    return x
'''


def test_a_file_fenced_twice_keeps_one_pair_of_pragmas_a_run(tmp_path):
    """A set with ``launchers`` and an ``only`` or ``skip`` on the same kernel file fences it twice: the second
    fence must not nest in the first (mutmut stops at nested pragmas), whichever comes first."""
    for order in ("launchers first", "skip first"):
        path = tmp_path / f"{order.split()[0]}.py"
        path.write_text(KERNEL_SOURCE)
        steps = [mutation.fence_launchers, lambda p: mutation.fence(p, lambda name: name in ("launch", "other"))]
        for step in (steps if order == "launchers first" else steps[::-1]):
            step(path)
        text = path.read_text()
        compile(text, str(path), "exec")
        depth = 0
        for line in text.splitlines():
            depth += line == "# pragma: no mutate start"
            assert depth <= 1, order
            depth -= line == "# pragma: no mutate end"
        assert depth == 0
        assert unfenced(text) == ["kernel_ref", "_kernel"], order
