"""benchmarks/needle_recall.py: the share of the needle's tokens among what a policy attends, per layer."""

from __future__ import annotations

from benchmark_scripts import load


def needle_recall():
    return load("needle_recall")


def run(tmp_path, policy: str, *settings: str) -> list[dict]:
    args = ["--model", "embedded", "--policy", policy, "--lengths", "700", "--depths", "3", "--styles",
            "ruler_noise,prose", "--out", str(tmp_path)]
    for s in settings:
        args += ["--set", s]
    result = needle_recall().main(args)
    assert (tmp_path / "needle_recall.md").read_text().startswith("# Selection recall of the needle")
    return result["rows"]


def test_full_attention_sees_the_whole_needle_at_every_layer(tmp_path):
    rows = run(tmp_path, "full")
    assert len(rows) == 6 and all(r["needle_tokens"] >= 1 for r in rows)
    for r in rows:
        assert r["last_chunk"] == [1.0] * 8  # the embedded model's 8 layers, each attending every token
        assert r["decode"] and all(v == 1.0 for step in r["decode"] for v in step)


def test_streaming_sees_the_needle_only_inside_its_window(tmp_path):
    """Sinks of 4 and a window of 64, from the start (dense_until 0, inside the model's window too): the needle at
    depth 0 or 0.5 of a 700-token prompt is outside both at every layer; at depth 1 it sits just before the
    question, inside the last chunk's window."""
    rows = run(tmp_path, "streaming", "n_init=4", "n_local=64", "dense_until=0")
    for r in rows:
        expect = 1.0 if r["depth"] == 1.0 else 0.0
        assert r["last_chunk"] == [expect] * 8, (r["style"], r["depth"])


def test_a_word_setting_reaches_the_policy_and_each_sample_is_saved(tmp_path, monkeypatch):
    """--set selector=hard_vote is passed as the word (ints and floats as numbers), and the JSON on disk holds every
    sample measured so far after each one (a run cut off by a time limit keeps them)."""
    import json

    module = needle_recall()
    assert [module.setting_value(v) for v in ("4096", "0.9", "hard_vote")] == [4096, 0.9, "hard_vote"]
    saved = []
    real_run = module.run

    def spy_run(args, save=None):
        def spying_save(result):
            save(result)
            saved.append(len(json.loads((tmp_path / "needle_recall.json").read_text())["rows"]))
        return real_run(args, spying_save)

    monkeypatch.setattr(module, "run", spy_run)
    result = module.main(["--model", "embedded", "--policy", "tokenselect", "--lengths", "700", "--depths", "2",
                          "--styles", "prose", "--set", "selector=hard_vote", "--set", "k=64", "--out", str(tmp_path)])
    assert result["settings"]["selector"] == "hard_vote" and result["settings"]["k"] == 64
    assert saved[:2] == [1, 2]


def test_a_cut_off_runs_rest_draws_the_very_samples_the_whole_run_would(tmp_path):
    """--depths 3:1-2 runs the second and third of 3 spread depths with the seeds the whole run gives them (the same
    prompts, so the same answers and recall); a range outside the depths is refused."""
    whole = {(r["style"], r["depth"]): r for r in run(tmp_path / "whole", "full")}
    args = ["--model", "embedded", "--policy", "full", "--lengths", "700", "--depths", "3:1-2", "--styles",
            "ruler_noise,prose", "--out", str(tmp_path / "rest")]
    rest = needle_recall().main(args)["rows"]
    assert [r["depth"] for r in rest] == [0.5, 1.0, 0.5, 1.0]
    for r in rest:
        assert r["answer"] == whole[(r["style"], r["depth"])]["answer"]
        assert r["tokens"] == whole[(r["style"], r["depth"])]["tokens"]
    assert needle_recall().depth_plan("20:9-19")[0] == (9, 9 / 19)
    for bad in ("3:2-3", "3:2-1"):
        try:
            needle_recall().depth_plan(bad)
        except ValueError as e:
            assert "are not among the 3 depths" in str(e)
        else:
            raise AssertionError(f"{bad} was accepted")
