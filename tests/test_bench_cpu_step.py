"""The CPU step benchmark's report: `cpu-step run` writes each side's figures, compared with the baseline, as a
markdown table and every round's raw figures as JSON (it once printed the table and then failed to write either)."""
import argparse
import json

from benchmarks.suites.host import cpu_step


def side(ttft_s: float, decode_s: float) -> dict:
    return {"ttft_s": [ttft_s] * 3, "decode_s_per_token": [decode_s] * 3, "answers": [[1, 2, 3]] * 3}


def test_a_run_writes_its_table_and_every_rounds_figures(tmp_path):
    args = argparse.Namespace(argv=["run", "--baseline-root", "x"], doc_tokens=1840, question_tokens=20,
                              decode_tokens=16, repeats=3, rounds=1, out=str(tmp_path / "cpu_step.md"))
    merged = {"baseline (abc1234)": side(0.150, 0.050), "this tree": side(0.100, 0.050)}
    raw = [{"side": name, "round": 0, **figures} for name, figures in merged.items()]
    cpu_step.write_report(args, [("float32", 1, merged)], raw)
    report = (tmp_path / "cpu_step.md").read_text()
    assert "| float32 | 1 | this tree | 100.0 | 50.0 | 1.50x lower | 1.00x lower |" in report
    assert "baseline (abc1234) = this tree: True" in report
    written = json.loads((tmp_path / "cpu_step.json").read_text())
    assert [s["side"] for s in written["sides"]] == ["baseline (abc1234)", "this tree"]


def test_its_questions_have_exactly_the_tokens_asked_each_its_own():
    """A hit computes the question's tokens, so they must be as many as `--question-tokens` says: padding a short
    question with spaces once gave 9-14 tokens for 24 (a run of spaces is one token)."""
    from kvstrata.engine.model_loader import EMBEDDED_MODEL, load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(EMBEDDED_MODEL))
    for num_tokens in (10, 24, 64):
        questions = cpu_step.question_ids(tokenizer, 7, num_tokens)
        assert [len(q) for q in questions] == [num_tokens] * 7
        assert len({tuple(q[:16]) for q in questions}) == 7, "two questions share their first block"
        assert tokenizer.decode(questions[0]).startswith(" Question:")
