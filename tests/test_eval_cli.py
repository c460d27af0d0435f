"""``tokenselect eval`` end to end on a tiny random Llama (conftest's ``tiny_llama``, window 256)."""

from __future__ import annotations

import argparse
import csv
import json
import re

import pytest

from tokenselect.eval.cli import add_parser
from tokenselect.eval.metrics import score
from tokenselect.eval.tasks import MAX_NEW_TOKENS


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tokenselect")
    add_parser(parser.add_subparsers())
    return parser.parse_args(["eval", *argv])


def test_eval_runs_two_policies_and_writes_everything(tiny_llama, tmp_path):
    out = tmp_path / "run"
    argv = ["--model", str(tiny_llama), "--task", "passkey", "--lengths", "1x,512", "--samples", "2",
            "--k", "64", "--n-local", "64", "--n-init", "8", "--kernels", "torch", "--device", "cpu", "--seed", "3",
            "--prompt-cache", str(tmp_path / "prompts")]
    args = parse([*argv, "--attention", "full,full@dynamic:2,tokenselect", "--output", str(out)])
    assert args.func(args) == 0

    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 1 * 2 * 2
    assert {r["policy"] for r in records} == {"full", "full@dynamic:2", "tokenselect"}
    assert sorted({r["depth"] for r in records}) == [0.0, 1.0]
    for r in records:
        assert r["score"] == score(r["task"], r["prediction"], r["answers"])
        # and independently of the metric's code: passkey is 1 exactly when the first number written is the key
        first = re.search(r"\d+", r["prediction"])
        assert r["score"] == float(first is not None and first.group() == r["answers"][0])
        budget = r["target_tokens"] - MAX_NEW_TOKENS[r["task"]]  # the length holds the prompt and the answer
        assert 0.8 * budget <= r["prompt_tokens"] <= budget
    # every policy answered the very same prompts
    by_policy = {}
    for r in records:
        by_policy.setdefault(r["policy"], []).append((r["task"], r["length"], r["sample"], tuple(r["answers"]),
                                                      r["prompt_tokens"]))
    assert len({tuple(v) for v in by_policy.values()}) == 1

    with open(out / "predictions.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["prediction"] for row in rows] == [r["prediction"] for r in records]
    summary = json.loads((out / "summary.json").read_text())
    for policy, tasks in summary["scores"].items():
        for task, by_length in tasks.items():
            for length, value in by_length.items():
                cell = [r["score"] for r in records if (r["policy"], r["task"], r["length"]) == (policy, task, length)]
                assert value == pytest.approx(100 * sum(cell) / len(cell))
    # the Selection Cache's count over tokenselect's decode steps (2 layers; each of the 4 samples decodes at most
    # passkey's 6 tokens, the first from the prefill): every sample's first lookup in a layer finds no entry
    cache = summary["selection_cache"]
    assert list(cache) == ["tokenselect"]
    hits, misses = cache["tokenselect"]["hits"], cache["tokenselect"]["misses"]
    assert 2 * 4 <= misses and hits + misses <= 2 * 4 * 5
    assert cache["tokenselect"]["hit_rate"] == round(hits / (hits + misses), 4)
    pngs = sorted(p.name for p in out.rglob("*.png"))
    assert sum("heatmap" in name for name in pngs) == 3 and sum("score_vs_length" in name for name in pngs) == 2
    table = (out / "table.md").read_text()
    assert table.startswith("# Eval: ") and "| passkey | 1x |" in table and "| full@dynamic:2 |" in table
    assert f"Selection Cache of tokenselect: {hits / (hits + misses):.1%} hits ({hits} of {hits + misses} " in table
    assert all(p.stat().st_size > 1000 for p in out.rglob("*.png"))

    # every sample was timed: its prefill to the first token, its decode to the last
    assert all(r["prefill_s"] > 0 and r["decode_s"] > 0 for r in records)
    # the same command line gives the same predictions (timings aside), from the prompts cached by the first run
    cached = sorted((tmp_path / "prompts").rglob("*.json"))
    assert len(cached) == 2 * 2  # one file per (length, sample); the three policies shared them
    again = parse([*argv, "--attention", "tokenselect", "--output", str(tmp_path / "again")])
    again.func(again)
    assert sorted((tmp_path / "prompts").rglob("*.json")) == cached
    untimed = lambda rows: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]  # noqa: E731
    rerun = [json.loads(line) for line in (tmp_path / "again" / "predictions.jsonl").read_text().splitlines()]
    assert untimed(rerun) == untimed([r for r in records if r["policy"] == "tokenselect"])


@pytest.mark.parametrize("select_dtype, started", [(None, ["full", "tokenselect"]), ("kv", ["full"]),
                                                   ("fp8", ["full"])])
def test_eval_gives_tokenselect_an_engine_of_its_own_where_auto_may_give_it_fp8_keys(tiny_llama, tmp_path,
                                                                                  monkeypatch, select_dtype, started):
    """With select_dtype auto (unset) an engine started with TokenSelect may hold an fp8 copy of the keys that one
    started with full attention would not (``engine.selection_keys_dtype``), so TokenSelect gets its own engine and
    measures what a user starting with it gets; with kv or fp8 every policy gets the same keys from one engine. The
    keys a policy scored are in its settings line when they are a copy."""
    from tokenselect.eval import runner

    engines = []

    class Recorded(runner.LLM):
        def __init__(self, model, attention, **settings):
            engines.append(attention)
            super().__init__(model, attention, **settings)

    monkeypatch.setattr(runner, "LLM", Recorded)
    out = tmp_path / "run"
    argv = ["--model", str(tiny_llama), "--task", "passkey", "--lengths", "512", "--samples", "1", "--k", "64",
            "--n-local", "64", "--n-init", "8", "--kernels", "torch", "--device", "cpu",
            "--attention", "full,tokenselect,streaming", "--output", str(out)]
    args = parse([*argv, *(["--select-dtype", select_dtype] if select_dtype else [])])
    assert args.func(args) == 0
    assert engines == started
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [r["policy"] for r in records] == ["full", "tokenselect", "streaming"]
    table = (out / "table.md").read_text()
    assert ("selection_keys=fp8" in table) is (select_dtype == "fp8")


def test_eval_help_and_bad_names(capsys):
    with pytest.raises(SystemExit):
        parse(["--help"])
    text = capsys.readouterr().out
    assert "niah_multiquery" in text and "4x" in text and "--attention" in text and "--k" in text
    with pytest.raises(ValueError, match="nope"):
        args = parse(["--task", "passkey,nope"])
        args.func(args)
    with pytest.raises(ValueError, match="magic"):
        args = parse(["--attention", "full,magic"])
        args.func(args)


def test_name_lists_are_checked_as_they_are_read():
    """A trailing comma or spaces in --task / --attention are no item, for the check as for the run (``names``);
    an unknown name among them is still refused, with its name."""
    from tokenselect.eval.runner import check_names

    check_names(parse(["--task", "passkey, niah_single_1,", "--attention", " full ,tokenselect:k=64,"]))
    with pytest.raises(ValueError, match=r"^unknown task or policy: nope$"):
        check_names(parse(["--task", "passkey, nope ,"]))
    with pytest.raises(ValueError, match=r"^tokenselect:kk=1: tokenselect takes no setting kk$"):
        check_names(parse(["--attention", "full, tokenselect:kk=1 ,"]))


def test_a_stopped_run_aborts_what_is_unfinished_and_keeps_what_finished(tiny_llama, tmp_path):
    """``generate_all`` with ``stop`` set as the second sample finishes: ``Interrupted`` at the next step, the two
    finished samples recorded (and streamed), the rest aborted with every KV slot back in the pool or the prefix
    cache, and the engine still answering."""
    import threading

    from tokenselect.engine import LLM
    from tokenselect.eval.runner import Interrupted, Results, generate_all, prompts, record
    from tokenselect.models.loader import Checkpoint

    args = parse(["--model", str(tiny_llama), "--task", "passkey", "--lengths", "1x", "--samples", "5",
                  "--prompt-cache", "none", "--chat", "off"])
    checkpoint = Checkpoint(tiny_llama)
    cells = prompts(args, checkpoint.tokenizer(), checkpoint.config.window, tiny_llama, 1)
    llm = LLM(tiny_llama, "full", device="cpu", max_num_seqs=2)
    free = llm.stats()["kv_slots_free"]
    stop, stream = threading.Event(), tmp_path / "deep" / "stream.jsonl"
    results = Results(stream=stream)

    def done(i, out):
        results.add(record("full", cells[i], out.text, len(out.prompt_token_ids), out.prefill_s, out.decode_s), (0, i))
        if len(results.records) == 2:
            stop.set()

    class Progress:
        n = 0

        def update(self, k):
            self.n += k

    progress = Progress()
    with pytest.raises(Interrupted):
        generate_all(llm, cells, progress, done, stop)
    assert len(results.records) == 2 == progress.n
    assert [json.loads(line) for line in stream.read_text().splitlines()] == results.records
    assert [r["sample"] for r in results.ordered()] == sorted(r["sample"] for r in results.records)
    stats = llm.stats()  # every slot is free or holds a cached prompt (the prefix cache keeps them for reuse)
    assert not llm.scheduler.has_work() and stats["kv_slots_free"] + stats["prefix_cache_tokens"] == free
    assert len(generate_all(llm, cells[:1], Progress())) == 1  # the engine goes on


def test_sigterm_ends_the_eval_with_the_finished_samples_written(tiny_llama, tmp_path):
    """A real ``tokenselect eval`` process sent SIGTERM once its first sample is in predictions.jsonl: it exits
    130 after writing every output from the samples it finished, and says so in summary.json and the table."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tokenselect.cli", "eval", "--model", str(tiny_llama), "--task", "passkey",
           "--lengths", "1x", "--samples", "400", "--attention", "full", "--device", "cpu", "--kernels", "torch",
           "--prompt-cache", str(tmp_path / "prompts"), "--workers", "1", "--max-num-seqs", "1",
           "--output", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = out / "predictions.jsonl"
    deadline = time.monotonic() + 240
    while not (lines.exists() and lines.read_text().count("\n") >= 1):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no sample finished in 240 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert 1 <= len(records) < 400
    assert summary["config"]["interrupted"] == {"finished": len(records), "of": 400}
    assert summary["scores"]["full"]["passkey"]["1x"] == pytest.approx(100 * sum(r["score"] for r in records)
                                                                      / len(records))
    assert f"stopped early: {len(records)} of 400 samples" in (out / "table.md").read_text().splitlines()[0]
    assert "SIGTERM: stopping after this step" in stderr and f"stopped: {len(records)} of 400" in stderr
    assert "| passkey | 1x |" in stdout


def test_the_prompt_cache_key_follows_what_the_tokenizer_does_not_its_file(tiny_llama):
    """The same tokenizer serialized otherwise (as another `tokenizers` version writes it; here: padding turned on,
    which changes ``to_str()`` and no prompt) keys the same folder; another vocabulary, chat switch or seed does not."""
    from tokenselect.eval.runner import prompt_cache_key
    from tokenselect.models.loader import Checkpoint

    tokenizer = Checkpoint(tiny_llama).tokenizer()
    key = prompt_cache_key(tokenizer, False, 0)
    serialized = tokenizer.backend_tokenizer.to_str()
    tokenizer.backend_tokenizer.enable_padding(length=3)
    assert tokenizer.backend_tokenizer.to_str() != serialized
    assert prompt_cache_key(tokenizer, False, 0) == key
    assert len({key, prompt_cache_key(tokenizer, True, 0), prompt_cache_key(tokenizer, False, 1)}) == 3
    tokenizer.add_tokens(["zzqqxx"])
    assert prompt_cache_key(tokenizer, False, 0) != key


def test_the_first_signal_asks_to_stop_and_the_second_interrupts(capsys):
    """``stop_on_signals``: a first SIGTERM sets the event (the run ends at its next step) and says so; a second
    interrupts at once, SIGTERM as Ctrl-C; the former handlers come back; a forked child leaves them to the parent."""
    import os
    import signal
    import threading

    from tokenselect.eval.runner import stop_on_signals

    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    stop = threading.Event()
    restore = stop_on_signals(stop)
    try:
        handler = signal.getsignal(signal.SIGTERM)
        assert handler is signal.getsignal(signal.SIGINT) and handler not in before
        pid = os.fork()
        if pid == 0:  # a prompt-building child: the handler does nothing there
            handler(signal.SIGTERM, None)
            handler(signal.SIGTERM, None)
            os._exit(0 if not stop.is_set() else 1)
        assert os.waitpid(pid, 0)[1] == 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.is_set()
        assert "SIGTERM: stopping after this step" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        restore()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def resume_argv(tiny_llama, tmp_path, out) -> list[str]:
    return ["--model", str(tiny_llama), "--task", "passkey", "--lengths", "1x,512", "--samples", "3",
            "--attention", "full,tokenselect", "--k", "64", "--n-local", "64", "--n-init", "8", "--kernels", "torch",
            "--device", "cpu", "--seed", "4", "--prompt-cache", str(tmp_path / "prompts"), "--output", str(out)]


def answers_of(folder) -> list[dict]:
    """Every record of a run but its timings, in the file's order."""
    rows = [json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]


def test_resume_generates_only_what_a_killed_run_left_and_ends_where_a_whole_run_ends(tiny_llama, tmp_path,
                                                                                       monkeypatch):
    from tokenselect.eval import runner

    whole = tmp_path / "whole"
    args = parse(resume_argv(tiny_llama, tmp_path, whole))
    assert args.func(args) == 0
    assert json.loads((whole / "run.json").read_text())["k"] == 64  # the settings kept beside the answers
    # a run killed after 5 of its 12 answers: only its predictions.jsonl lines and run.json remain
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "run.json").write_text((whole / "run.json").read_text())
    lines = (whole / "predictions.jsonl").read_text().splitlines()
    (cut / "predictions.jsonl").write_text("\n".join(lines[:5]) + "\n")
    asked = []
    real = runner.generate_all
    monkeypatch.setattr(runner, "generate_all", lambda llm, cells, *a, **k: (asked.append(len(cells)),
                                                                             real(llm, cells, *a, **k))[1])
    args = parse([*resume_argv(tiny_llama, tmp_path, cut), "--resume"])
    assert args.func(args) == 0
    assert sum(asked) == 12 - 5  # the 5 answers in were not asked for again
    assert sorted(map(json.dumps, answers_of(cut))) == sorted(map(json.dumps, answers_of(whole)))
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["scores"] == json.loads((whole / "summary.json").read_text())["scores"]
    # resuming a finished run asks for nothing and builds no engine
    asked.clear()
    monkeypatch.setattr(runner, "LLM", None)
    args = parse([*resume_argv(tiny_llama, tmp_path, cut), "--resume"])
    assert args.func(args) == 0 and asked == []
    assert len(answers_of(cut)) == 12


def test_resume_refuses_other_settings_unknown_settings_and_cells_it_would_drop(tiny_llama, tmp_path):
    out = tmp_path / "run"
    args = parse(resume_argv(tiny_llama, tmp_path, out))
    assert args.func(args) == 0
    before = (out / "predictions.jsonl").read_text()
    changed = parse([*resume_argv(tiny_llama, tmp_path, out), "--k", "32", "--resume"])
    with pytest.raises(ValueError, match=r"had other settings: k 64 then, 32 now"):
        changed.func(changed)
    fewer = parse([*resume_argv(tiny_llama, tmp_path, out), "--lengths", "1x", "--resume"])
    with pytest.raises(ValueError, match=r"6 earlier answers are for cells this run does not have"):
        fewer.func(fewer)
    (out / "run.json").unlink()
    unknown = parse([*resume_argv(tiny_llama, tmp_path, out), "--resume"])
    with pytest.raises(ValueError, match=r"holds answers but no run.json"):
        unknown.func(unknown)
    assert (out / "predictions.jsonl").read_text() == before  # nothing lost to a refused resume
    # a folder with nothing in it yet is a first run
    fresh = parse([*resume_argv(tiny_llama, tmp_path, tmp_path / "fresh"), "--attention", "full", "--resume"])
    assert fresh.func(fresh) == 0 and len(answers_of(tmp_path / "fresh")) == 6


def test_cell_index_finds_a_record_s_cell_by_what_it_tells_of_its_prompt():
    from tokenselect.eval.runner import cell_index

    cells = [{"task": "passkey", "length": "1x", "sample": s, "target_tokens": 256, "depth": s / 2, "answers": [str(s)],
              "prompt": [s]} for s in range(3)]
    index = cell_index(cells + [dict(cells[1], prompt=[9])])  # a cell equal to another as a record tells it
    record = {k: v for k, v in cells[1].items() if k != "prompt"}
    assert index(dict(record, prediction="1", score=1.0)) == 1  # the first of the equal cells
    assert index(dict(record, depth=1.0)) is None  # another needle depth: another prompt
    assert index(dict(record, answers=["2"])) is None
    assert index(dict(record, sample=0, depth=0.0, answers=["0"])) == 0  # depth 0.0 is the cell's 0 / 2
    assert index({"task": "passkey"}) is None
