"""Mutation testing of the modules the selection path rests on, with mutmut (3.x), one module set at a time.

Each set mutates a few files and runs only the test files that exercise them, so that a set finishes on a
2-core machine in minutes (mutmut runs, for each mutant, only the tests that called the mutated function).
A set runs in a scratch copy of the repository (``--work``, default /tmp/tokenselect-mutation/SET): mutmut
writes its ``mutants/`` tree there, never into the checkout.

    python tools/mutation.py                       # every set
    python tools/mutation.py selection_cache rope  # some of them
    python tools/mutation.py --list                # the sets, their files and tests
    python tools/mutation.py kv_cache --resume     # continue a set's run that a deadline cut off

It prints and writes (``--out``, default benchmarks/results/mutation.md) a table: per set the mutants, killed,
survived, timed out (counted as detected), with no test, the score detected / (those some test ran) and mutmut's own
score (the mutants no test reaches counted as surviving), with the names of the
survivors (``mutmut show NAME`` in the set's scratch copy prints a survivor's diff). Run it under
``nice -n 10`` on a shared machine. Needs ``pip install mutmut==3.8.1``.

Kernel files: only the plain-PyTorch references (``*_ref``) and their helpers are mutated; the Triton
kernels (``@triton.jit``: mutmut skips decorated functions) and the launchers are checked against the references
by tests/test_kernels.py and on a GPU by benchmarks/gpu_tests.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# in the kernel files, top-level functions that are neither a reference nor a helper of one (the launchers of the
# Triton kernels) are fenced off with "# pragma: no mutate start/end" in the scratch copy; these stay, as they decide
# what tests pin down (an out tensor refused, the type a product runs in)
KERNEL_KEEP = ("_checked_out", "exact_dot_type", "query_dot_type", "gather_into")

# the tests of the selection path's policies
POLICY_TESTS = ["tests/test_policies.py", "tests/test_baselines.py", "tests/test_selection_cache.py",
                "tests/test_boundaries.py", "tests/test_cli_settings.py", "tests/test_toy_policy.py",
                "tests/test_tail_chunk.py", "tests/test_whole_graphs.py",
                "tests/test_bench_dense.py::test_policy_specs_carry_their_own_settings"]
# two tests through Triton's interpreter: minutes each, for every surviving mutant (benchmarks/gpu_tests.sh runs
# them on a GPU)
INTERPRETER_GRAPH_TESTS = [
    "tests/test_whole_graphs.py::test_full_attention_through_whole_graphs_with_the_triton_kernels",
    "tests/test_whole_graphs.py::test_tokenselect_through_whole_graphs_with_the_triton_kernels"]
INFLLM_SNAPSHOTS = ["InfLLMState", "InfLLM.snapshot", "InfLLM.restore", "InfLLM.release", "InfLLM._unref",
                    "InfLLM.graph_reads", "InfLLM.graph_state", "InfLLM.representatives"]
INFLLM_STEP = ["InfLLM.attend", "InfLLM.memory_list", "InfLLM.count_own_query", "InfLLM.list_positions",
               "InfLLM.count_attention", "InfLLM.close_blocks"]
INFLLM_TESTS = ["tests/test_baselines.py", "tests/test_policies.py", "tests/test_boundaries.py",
                "tests/test_whole_graphs.py"]

SETS: dict[str, dict] = {
    "selection_cache": dict(
        mutate=["tokenselect/policies/selection_cache.py", "tokenselect/kernels/selection_check.py",
                "tokenselect/kernels/selection_update.py"],
        tests=["tests/test_selection_cache.py", "tests/test_boundaries.py",
               "tests/test_kernels.py::test_selection_check_matches_reference",
               "tests/test_kernels.py::test_selection_update_matches_reference"],
        launchers=True),
    "rope": dict(
        mutate=["tokenselect/rope.py"],
        tests=["tests/test_rope.py"]),  # transformers' own RoPE code, no checkpoint (test_models.py: slow per mutant)
    "kv_cache": dict(
        mutate=["tokenselect/kv_cache.py"],
        tests=["tests/test_offload.py", "tests/test_engine.py", "tests/test_boundaries.py"]),
    "kernel_refs": dict(
        mutate=["tokenselect/kernels/topk.py", "tokenselect/kernels/sparse_attention.py",
                "tokenselect/kernels/paged_dot.py", "tokenselect/kernels/head_vote.py",
                "tokenselect/kernels/block_scores.py", "tokenselect/kernels/window_mass.py",
                "tokenselect/kernels/rms_norm.py", "tokenselect/kernels/silu_mul.py",
                "tokenselect/kernels/row_copy.py", "tokenselect/kernels/dot.py"],
        # test_kernels.py less its three largest matrices of Triton-against-reference cases (sparse attention and
        # window mass: minutes in Triton's interpreter, for every surviving mutant); the references' definition
        # tests (against naive loops in fp64) stay
        tests=["tests/test_boundaries.py"] + [f"tests/test_kernels.py::{t}" for t in (
            "test_paged_dot_matches_reference", "test_head_soft_vote_matches_reference",
            "test_head_soft_vote_over_a_live_prefix", "test_head_soft_vote_reads_fp8_keys",
            "test_rms_norm_matches_reference", "test_silu_mul_matches_reference", "test_block_scores_matches_reference",
            "test_paged_dot_reference_is_the_definition", "test_head_soft_vote_reference_is_the_definition",
            "test_topk_matches_reference",
            "test_topk_resolves_every_digit", "test_topk_takes_the_first_of_tied_scores", "test_topk_over_a_live_prefix",
            "test_topk_writes_to_out", "test_topk_of_nothing_live", "test_small_and_odd_head_dims",
            "test_sparse_attention_explicit_softmax_scale_and_fp8_pool", "test_sparse_attention_reference_equals_naive_loop",
            "test_window_mass_mixed_dtypes_and_odd_shapes", "test_window_mass_reference_is_the_definition",
            "test_paged_dot_with_a_whole_chunk_of_rows_per_kv_head", "test_gather_and_scatter_rows_match_reference",
            "test_scatter_rows_writes_kv_pools_in_one_launch", "test_row_copy_of_a_layer_of_a_pool_and_bad_input",
            "test_row_copy_reference_is_the_definition", "test_gather_into_matches_reference",
            "test_every_fp8_value_is_exact_in_both_16_bit_types", "test_exact_dot_type",
            "test_paged_dot_and_argmax_with_every_pair_of_operand_types")],
        launchers=True),
    # the policies after issue #29 (one ``attend`` path of device tensor ops; settings in ``settings.py``), in sets
    # that each finish on 2 cores in well under an hour. tests/test_whole_graphs.py runs the graph path
    # (``graph_ready``, ``graph_state``, the fixed-shape steps) on a CPU too, less its two tests through Triton's
    # interpreter (minutes each, for every surviving mutant; benchmarks/gpu_tests.sh runs them on a GPU)
    "policies_base": dict(
        mutate=["tokenselect/policies/base.py"],
        tests=POLICY_TESTS, deselect=INTERPRETER_GRAPH_TESTS),
    "policies": dict(
        mutate=["tokenselect/policies/__init__.py", "tokenselect/policies/full.py",
                "tokenselect/policies/streaming.py", "tokenselect/policies/tokenselect.py",
                "tokenselect/policies/rows.py"],
        tests=POLICY_TESTS, deselect=INTERPRETER_GRAPH_TESTS),
    "policies_baselines": dict(
        mutate=["tokenselect/policies/reattention.py", "tokenselect/policies/quest.py"],
        tests=["tests/test_policies.py", "tests/test_baselines.py", "tests/test_boundaries.py",
               "tests/test_whole_graphs.py"],
        deselect=INTERPRETER_GRAPH_TESTS),
    # InfLLM in three sets: its step (the list, the block choice, the attention it counts), its per-sequence state
    # (rows, pool blocks, ring), and its snapshots, the only code the prefix-cache tests (two thirds of the time of
    # every test that reaches InfLLM) run for
    "policies_infllm": dict(
        mutate=["tokenselect/policies/infllm.py"],
        only={"tokenselect/policies/infllm.py": INFLLM_STEP},
        tests=INFLLM_TESTS, deselect=INTERPRETER_GRAPH_TESTS),
    "policies_infllm_state": dict(
        mutate=["tokenselect/policies/infllm.py"],
        skip={"tokenselect/policies/infllm.py": INFLLM_STEP + INFLLM_SNAPSHOTS},
        tests=INFLLM_TESTS, deselect=INTERPRETER_GRAPH_TESTS),
    # InfLLM's memory snapshots and their restore (issue #30)
    "policies_infllm_snapshots": dict(
        mutate=["tokenselect/policies/infllm.py"],
        only={"tokenselect/policies/infllm.py": INFLLM_SNAPSHOTS},
        tests=INFLLM_TESTS + ["tests/test_prefix_cache.py"],
        deselect=INTERPRETER_GRAPH_TESTS + [
            # reads benchmarks/, which the scratch copy's mutants tree does not hold
            "tests/test_prefix_cache.py::test_benchmark_script_runs_at_a_tiny_size"]),
    # the request validation: the settings' declared ranges and types (settings.py: a policy's, the engine's and a
    # request's values are checked by ``problem``) and server.py's request parsing (the request models' methods, the
    # Host / API key / body size guard, the prompt, stop-string, unsupported-field and per-request policy checks);
    # the rest of server.py (the engine thread, streaming, the routes) is fenced off
    "server_validation": dict(
        mutate=["tokenselect/settings.py", "tokenselect/server.py"],
        only={"tokenselect/server.py": ["_Request", "CompletionRequest", "ChatRequest", "Guard", "check_text",
                                        "prompt_ids", "check_policy_settings", "check_fields", "resolve_options"]},
        # the tests of the checks (not the server's serving tests: a served model per mutant is slow)
        tests=["tests/test_server_checks.py", "tests/test_cli_settings.py", "tests/test_server_fuzz.py"] + [f"tests/test_server_faults.py::{t}" for t in (
            "test_lone_surrogate_and_a_refusing_chat_template_get_400_and_the_engine_lives",
            "test_token_ids_outside_the_vocabulary_get_400_and_leak_nothing",
            "test_per_request_policy_settings_are_bounded", "test_size_limits_answer_at_once_and_never_stall_a_stream",
            "test_api_key_host_check_and_docs", "test_out_of_range_and_unsupported_parameters_get_400",
            "test_neutral_values_of_unsupported_fields_are_accepted")] + [f"tests/test_server.py::{t}" for t in (
            "test_bad_input_gets_an_error_and_the_server_keeps_serving",
            "test_per_request_policy_settings_equal_an_engine_started_with_them")]),
}

# appended to the scratch copy's tests/conftest.py. With -x a killed mutant stops at its first failing test, so the
# order of its tests decides what a kill costs: fastest first, by the durations mutmut measured in its first (stats)
# run. Each mutant's run also logs its wall time, from which a set's time and a split's are read.
FAST_FIRST = """

# --- added by tools/mutation.py ---
import json as _mutation_json
import time as _mutation_time


def pytest_collection_modifyitems(session, config, items):
    try:
        with open("mutmut-stats.json") as f:
            durations = _mutation_json.load(f)["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return
    items.sort(key=lambda item: durations.get(item.nodeid, 0.0))


def pytest_sessionstart(session):
    session.config._mutation_start = _mutation_time.time()


def pytest_sessionfinish(session, exitstatus):
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    if mutant and mutant not in ("fail", "list_all_tests", "stats"):
        with open("mutant_times.jsonl", "a") as f:
            f.write(_mutation_json.dumps(dict(mutant=mutant, seconds=round(
                _mutation_time.time() - session.config._mutation_start, 2), exit=int(exitstatus))) + "\\n")
"""

COPY = ["tokenselect", "tests", "docs", "pytest.ini", "pyproject.toml"]  # docs: test_cli_settings reads docs/settings.md
# one torch thread: a test's CPU time then equals its wall time (the time limit is in CPU seconds), and the mutants
# run side by side on the machine's cores instead of each spreading over them
ENV = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH="", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def mutmut_config(spec: dict) -> str:
    """The [tool.mutmut] section of one set."""
    lines = ["", "[tool.mutmut]", 'source_paths = ["tokenselect/"]',
             f"only_mutate = {json.dumps(spec['mutate'])}",
             f"pytest_add_cli_args_test_selection = {json.dumps([t for t in spec['tests'] if Path(ROOT, t.split('::')[0]).exists()])}",
             "pytest_add_cli_args = " + json.dumps(["-p", "no:cacheprovider", "-p", "no:benchmark", "-x", "-q"] + [
                 arg for test in spec.get("deselect", []) for arg in ("--deselect", test)]),
             'also_copy = ["pytest.ini", "docs"]',
             # the limit is CPU seconds (RLIMIT_CPU: SIGXCPU, exit -24), which a shared machine does not inflate as
             # it does wall time: mutmut allows 2 x multiplier x (the recorded time of every test that reaches the
             # mutated function + constant), here 3x those tests + 180 s. A surviving mutant runs them all, and also
             # builds the session fixtures (the tiny checkpoints) that the recorded times leave out: at 2x + 10 s, 21
             # of kv_cache's surviving mutants ran past the limit and were counted as detected. A mutant that loops
             # costs the whole limit, so a wide one dominates a set's time (at 8x + 240 s three loops of InfLLM's took
             # 36 of a run's first 45 minutes)
             "timeout_multiplier = 1.5",
             "timeout_constant = 60.0",
             'process_isolation = "forkserver"']
    return "\n".join(lines) + "\n"


def prepare(name: str, work: Path) -> Path:
    scratch = work / name
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    for item in COPY:
        src = ROOT / item
        if src.is_dir():
            shutil.copytree(src, scratch / item, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, scratch / item)
    with open(scratch / "pyproject.toml", "a") as f:
        f.write(mutmut_config(SETS[name]))
    if SETS[name].get("launchers"):
        for path in SETS[name]["mutate"]:
            fence_launchers(scratch / path)
    for path, keep in SETS[name].get("only", {}).items():
        fence_all_but(scratch / path, keep)
    for path, skip in SETS[name].get("skip", {}).items():
        fence(scratch / path, lambda qualname: qualname in skip)
    return scratch


def add_fast_first(tests: Path) -> None:
    """Append FAST_FIRST to a copy of the tests' conftest.py (once)."""
    conftest = tests / "conftest.py"
    if FAST_FIRST not in conftest.read_text():
        with open(conftest, "a") as f:
            f.write(FAST_FIRST)


def fence(path: Path, fenced) -> None:
    """Put the top-level functions and classes, and the methods, of the file for which ``fenced(name)`` holds
    (``name``: ``"f"``, ``"Class"`` or ``"Class.method"``) inside no-mutate pragmas. A class is looked into only
    when it is not fenced whole."""
    import ast

    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    lines = path.read_text().splitlines(keepends=True)
    spans = []
    for node in ast.parse("".join(lines)).body:
        if not isinstance(node, defs):
            continue
        inner = [(f"{node.name}.{n.name}", n) for n in node.body if isinstance(n, defs)] \
            if isinstance(node, ast.ClassDef) else []
        for name, item in ([(node.name, node)] if fenced(node.name) else inner):
            if name == node.name or fenced(name):
                spans.append((min([item.lineno] + [d.lineno for d in item.decorator_list]), item.end_lineno))
    add_fences(path, lines, spans)


START, END = "# pragma: no mutate start\n", "# pragma: no mutate end\n"


def add_fences(path: Path, lines: list[str], spans: list[tuple[int, int]]) -> None:
    """Write ``lines`` to ``path`` with each span (first and last line, 1-based, in ``lines``) inside no-mutate
    pragmas, merged with the fences ``lines`` already has: a file may be fenced twice (a set's ``only``/``skip`` and
    its ``launchers``), and mutmut refuses nested fences, so every fenced run of lines gets one pair."""
    code, fenced, inside, at = [], [], False, {}
    for number, line in enumerate(lines, 1):
        if line.strip() in (START.strip(), END.strip()):
            inside = line.strip() == START.strip()
            continue
        at[number] = len(code)
        code.append(line)
        fenced.append(inside)
    for first, last in spans:
        for number in range(first, last + 1):
            if number in at:
                fenced[at[number]] = True
    out = []
    for i, line in enumerate(code):
        if fenced[i] and (i == 0 or not fenced[i - 1]):
            out.append(START)
        out.append(line)
        if fenced[i] and (i == len(code) - 1 or not fenced[i + 1]):
            out.append(END)
    path.write_text("".join(out))


def fence_all_but(path: Path, keep: list[str]) -> None:
    """Fence everything but ``keep`` (names as in ``fence``; a class named with a method keeps only the methods
    named)."""
    outer = {name.split(".")[0] for name in keep}
    fence(path, lambda name: name not in keep and name not in outer and name.split(".")[0] not in keep)


def fence_launchers(path: Path) -> None:
    """Put the top-level functions of a kernel file that mutmut would mutate (undecorated: mutmut skips the
    @triton.jit ones) and that are not references (``*_ref``) nor in KERNEL_KEEP inside no-mutate pragmas."""
    import ast

    lines = path.read_text().splitlines(keepends=True)
    add_fences(path, lines, [(node.lineno, node.end_lineno) for node in ast.parse("".join(lines)).body
                             if isinstance(node, ast.FunctionDef) and not node.decorator_list
                             and not node.name.endswith("_ref") and node.name not in KERNEL_KEEP])


def run_set(name: str, work: Path, children: int, resume: bool = False) -> dict:
    """Run the set's mutants in a fresh scratch copy, or with ``resume`` continue the last run's copy (mutmut
    tests only the mutants that have no result yet: a run cut off by a deadline picks up where it stopped)."""
    scratch = work / name if resume and (work / name / "mutants").is_dir() else prepare(name, work)
    for tests in (scratch / "tests", scratch / "mutants" / "tests"):  # a fresh copy, or a resumed one's two
        if tests.is_dir():
            add_fast_first(tests)
    start = time.time()
    with open(scratch / "mutmut.log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(children)], cwd=scratch,
                              env=ENV, stdout=log, stderr=subprocess.STDOUT)
    (scratch / "run.json").write_text(json.dumps({"rc": proc.returncode, "seconds": round(time.time() - start)}))
    return summarize(name, work)


def recheck(name: str, work: Path, children: int) -> dict:
    """Run the set's survivors again against the checkout's current tests (after tests were added for them)."""
    scratch = work / name
    survivors = summarize(name, work)["survivors"]
    shutil.copytree(ROOT / "tests", scratch / "tests", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    add_fast_first(scratch / "tests")
    (scratch / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text() + mutmut_config(SETS[name]))
    if survivors:
        with open(scratch / "mutmut.log", "a") as log:
            subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(children), *survivors],
                           cwd=scratch, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    return summarize(name, work)


def at_import(name: str, work: Path, patterns: list[str], tests: list[str] | None = None,
              timeout: float = 600) -> dict:
    """Run mutants again, each in a fresh pytest process that has the mutant switched on from its start.

    mutmut switches a mutant on after the modules are imported, so a function that only runs at import (one that
    builds a settings dataclass's fields, a module constant made of the flags) runs unmutated and its mutants
    survive (or have "no tests") whatever the tests check. Here ``MUTANT_UNDER_TEST`` is set in the environment of
    a new process, so the import itself goes through the mutant. ``patterns``: mutant names or fnmatch patterns
    among the set's survivors and no-test mutants (all of them if empty). The set's current tests run (copied
    into the scratch copy, as ``--recheck`` does), or ``tests`` (those that reach the mutated code: a fresh process
    per mutant pays the imports and the collection each time); the outcomes go to ``at_import.json`` in the scratch copy and
    count in the set's summary (a mutant killed here is detected)."""
    import fnmatch

    scratch = work / name
    res = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=scratch, env=ENV,
                         capture_output=True, text=True)
    candidates = [line.strip().rsplit(":", 1)[0] for line in res.stdout.splitlines()
                  if re.search(r": (survived|no tests)$", line.strip())]
    chosen = [m for m in candidates if not patterns or any(fnmatch.fnmatchcase(m, p) for p in patterns)]
    shutil.copytree(ROOT / "tests", scratch / "mutants" / "tests", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    add_fast_first(scratch / "mutants" / "tests")
    spec = SETS[name]
    tests = [t for t in (tests or spec["tests"]) if Path(ROOT, t.split("::")[0]).exists()]
    args = ["-p", "no:cacheprovider", "-p", "no:benchmark", "-x", "-q"] + [
        arg for test in spec.get("deselect", []) for arg in ("--deselect", test)]
    record_file = scratch / "at_import.json"
    record = json.loads(record_file.read_text()) if record_file.exists() else {}
    for mutant in chosen:
        start = time.time()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", *args, *tests], cwd=scratch / "mutants",
                                  env=dict(ENV, MUTANT_UNDER_TEST=mutant), capture_output=True, timeout=timeout)
            outcome = "survived" if proc.returncode == 0 else "killed"
        except subprocess.TimeoutExpired:
            outcome = "timeout"
        record[mutant] = outcome
        record_file.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{mutant}: {outcome} ({time.time() - start:.0f} s)", flush=True)
    return summarize(name, work)


def summarize(name: str, work: Path) -> dict:
    """The counts and survivors of the set's last run in its scratch copy (mutmut keeps them in mutants/)."""
    scratch = work / name
    if not (scratch / "mutants").is_dir():
        return dict(set=name, score=None, strict_score=None, survivors=[], scratch=str(scratch),
                    mutate=SETS[name]["mutate"], tests=SETS[name]["tests"], not_checked="all")
    subprocess.run([sys.executable, "-m", "mutmut", "export-cicd-stats"], cwd=scratch, env=ENV, capture_output=True)
    stats_file = scratch / "mutants" / "mutmut-cicd-stats.json"
    stats = json.loads(stats_file.read_text()) if stats_file.exists() else {}
    res = subprocess.run([sys.executable, "-m", "mutmut", "results"], cwd=scratch, env=ENV, capture_output=True,
                         text=True)
    survivors = sorted(line.strip().rsplit(":", 1)[0] for line in res.stdout.splitlines()
                       if re.search(r": (survived|suspicious|segfault)$", line.strip()))
    run = json.loads((scratch / "run.json").read_text()) if (scratch / "run.json").exists() else {}
    # mutants run again with the mutant on from the process's start (``at_import``): those killed there move from
    # survived / no tests to killed
    again = json.loads((scratch / "at_import.json").read_text()) if (scratch / "at_import.json").exists() else {}
    no_tests = {line.strip().rsplit(":", 1)[0] for line in res.stdout.splitlines()
                if re.search(r": no tests$", line.strip())}
    caught = {m for m, outcome in again.items() if outcome in ("killed", "timeout")}
    moved_survived = len(caught & set(survivors))
    moved_no_tests = len(caught & no_tests)
    survivors = [m for m in survivors if m not in caught]
    if stats:
        stats = dict(stats, killed=stats.get("killed", 0) + moved_survived + moved_no_tests,
                     survived=stats.get("survived", 0) - moved_survived, no_tests=stats.get("no_tests", 0) - moved_no_tests)
    run["killed_at_import"] = len(caught)
    help_text = [m for m in survivors if only_help_text(mutant_diff(scratch, m))]
    # a mutant whose tests ran past mutmut's time limit (an endless loop, say) counts as detected, as in mutmut's
    # own score
    detected = stats.get("killed", 0) + stats.get("timeout", 0)
    tested = detected + sum(stats.get(key, 0) for key in ("survived", "suspicious", "segfault"))
    checked = tested + sum(stats.get(key, 0) for key in ("no_tests", "skipped"))
    strict = checked - stats.get("skipped", 0)  # mutmut's own score counts a mutant no test reaches as surviving
    return dict(set=name, score=(detected / tested if tested else None), help_text=help_text,
                score_without_help_text=(detected / (tested - len(help_text)) if tested > len(help_text) else None),
                strict_score=(detected / strict if strict else None), survivors=survivors, scratch=str(scratch),
                mutate=SETS[name]["mutate"], tests=SETS[name]["tests"], not_checked=stats.get("total", 0) - checked,
                **run, **stats)


def mutant_diff(scratch: Path, mutant: str) -> list[str]:
    shown = subprocess.run([sys.executable, "-m", "mutmut", "show", mutant], cwd=scratch, env=ENV, capture_output=True,
                           text=True).stdout
    return [line for line in shown.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]


def _without_help(line: str) -> str:
    line = re.sub(r'(help|description)=("[^"]*"|None)', "", line)
    line = re.sub(r'add_argument_group\(("[^"]*"|None)', "add_argument_group(", line)
    return re.sub(r"[\s,]", "", line)


def only_help_text(diff: list[str]) -> bool:
    """A mutant that changes nothing but an argparse help text (a --help screen's words): equivalent."""
    old = [_without_help(line[1:]) for line in diff if line.startswith("-")]
    new = [_without_help(line[1:]) for line in diff if line.startswith("+")]
    return bool(old) and old == new


def report(rows: list[dict]) -> str:
    out = ["| set | mutants | killed | survived | timeout | no tests | not run yet | score | with no-test ones | minutes |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        score = "-" if r["score"] is None else f"{r['score']:.1%}"
        strict = "-" if r.get("strict_score") is None else f"{r['strict_score']:.1%}"
        out.append(f"| {r['set']} | {r.get('total', '-')} | {r.get('killed', '-')} | {r.get('survived', '-')} | "
                   f"{r.get('timeout', '-')} | {r.get('no_tests', '-')} | {r.get('not_checked', '-')} | {score} | {strict} | "
                   f"{'-' if 'seconds' not in r else round(r['seconds'] / 60, 1)} |")
    for r in rows:
        if r.get("help_text"):
            out.append(f"\n{r['set']}: {len(r['help_text'])} of the survivors change only an argparse help text; "
                       f"without them the score is {r['score_without_help_text']:.1%}.")
    for r in rows:
        rest = [s for s in r["survivors"] if s not in r.get("help_text", [])]
        if rest:
            out += ["", f"Survivors in {r['set']}" + (" (besides the help texts)" if r.get("help_text") else "") + ":",
                    ""] + [f"- `{s}`" for s in rest]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sets", nargs="*", help=f"module sets (default: all): {', '.join(SETS)}")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tokenselect-mutation"))
    parser.add_argument("--children", type=int, default=2, help="mutants tested at once (default 2)")
    parser.add_argument("--out", type=Path, default=None, help="write the table here (markdown) and beside it .json")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--collect", action="store_true",
                        help="do not run: report the sets' last runs from their scratch copies")
    parser.add_argument("--resume", action="store_true",
                        help="continue the sets' last runs: test only the mutants not run yet, with the same tests")
    parser.add_argument("--at-import", nargs="*", default=None, metavar="MUTANT",
                        help="run these survivors / no-test mutants (names or fnmatch patterns; all if none given) "
                             "again, each in a process with the mutant on from its start (mutants of code that "
                             "runs at import)")
    parser.add_argument("--tests", nargs="+", default=None, help="with --at-import: run these tests (default: the set's)")
    parser.add_argument("--recheck", action="store_true",
                        help="run only the survivors of the sets' last runs again, against the current tests")
    args = parser.parse_args()
    names = args.sets or list(SETS)
    unknown = [n for n in names if n not in SETS]
    if unknown:
        parser.error(f"unknown set(s) {', '.join(unknown)}; choose from {', '.join(SETS)}")
    if args.list:
        for n in names:
            print(f"{n}:\n  mutate {' '.join(SETS[n]['mutate'])}\n  tests  {' '.join(SETS[n]['tests'])}")
        return 0
    rows = []
    for n in names:
        if args.collect:
            rows.append(summarize(n, args.work))
        elif args.at_import is not None:
            rows.append(at_import(n, args.work, args.at_import, args.tests))
        elif args.recheck:
            rows.append(recheck(n, args.work, args.children))
        else:
            rows.append(run_set(n, args.work, args.children, resume=args.resume))
        print(report(rows[-1:]), flush=True)
    table = report(rows)
    print(table)
    if args.out:
        args.out.write_text(table)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
