"""Every figure lives in one place: the named figures of bench/figures.py are read from bench/results/*.json,
their generated tables and the README's generated block are current, and no page of the README or the docs
quotes a figure of a topic (a ratio next to "TRL", say) with a value none of its figures has."""

from __future__ import annotations

from pathlib import Path

from bench.figures import FIGURES, TOPICS, generated_files, quoted_figures

ROOT = Path(__file__).resolve().parents[2]


def doc_pages() -> list[Path]:
    """The README and every markdown page of the docs site, generated ones included."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_generated_figures_are_current():
    stale = [str(path.relative_to(ROOT)) for path, text in generated_files().items()
             if not path.exists() or path.read_text() != text]
    assert not stale, f"run `python -m bench.figures` (make docs): {stale} differ from bench/results"


def test_every_named_figure_reads_from_its_results_file():
    for name, figure in FIGURES.items():
        assert figure.text and any(ch.isdigit() for ch in figure.text), name


def test_no_page_quotes_a_figure_with_another_value():
    wrong = []
    for path in doc_pages():
        for topic, value, sentence in quoted_figures(path.read_text()):
            allowed = topic.allowed()
            if value not in allowed:
                wrong.append(f"{path.relative_to(ROOT)}: {value} near {topic.near!r} is none of {sorted(allowed)}: "
                             f"{sentence[:160]}")
    assert not wrong, "\n".join(wrong)


def test_a_second_value_of_a_figure_is_caught():
    """The issue's case: the TRL comparison quoted as 0.68x in one place and 0.65x in another."""
    text = ("The step takes 0.68x TRL's time on the real model.\n\n"
            f"The step takes {FIGURES['trl.real_model.step_ratio'].text} TRL's time on the real model.")
    values = {value for _, value, _ in quoted_figures(text)}
    assert values == {"0.68x", FIGURES["trl.real_model.step_ratio"].text}
    assert "0.68x" not in TOPICS[0].allowed()


def test_an_async_ratio_not_in_its_tables_is_caught():
    async_topic = next(topic for topic in TOPICS if "async.md" in topic.in_tables)
    (quoted,) = quoted_figures("With async k = 1 the step was 1.95x faster.")
    assert quoted[0] is async_topic and quoted[1] not in async_topic.allowed()
    assert FIGURES["async.multi_turn.k1.step_speedup"].text in async_topic.allowed()


def test_targets_and_bounds_are_not_figures():
    assert quoted_figures("A step at most 0.9x of TRL's (target <= 0.8x, bound 1.41x).") == []
