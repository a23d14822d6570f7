"""bench/scale_model.py: the paper model in docs/scale-model.md is the script's, computed from the bench results.

The results file is what the script derives from bench/results now, each limit's crossing is where the fitted
cost meets that limit, and every number the page quotes with a unit is one of the model's (its named figures,
its generated table); tests/docs/test_figures.py checks that the generated table is current."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import scale_model
from bench.figures import FIGURES

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "scale-model.md"
TABLE = ROOT / "docs" / "generated" / "scale-model.md"


@pytest.fixture(scope="module")
def model() -> dict:
    return scale_model.current()


def test_the_results_file_is_what_the_script_derives_now(model):
    assert json.loads(scale_model.OUT.read_text()) == model, "run `python -m bench.scale_model`"


def test_each_crossing_is_where_its_cost_meets_its_limit(model):
    a = model["assumptions"]
    share, per_replica = a["rollout_share"], a["samples_per_replica"]

    def at(fit: dict, gpus: float, per_sample: float = 0.0) -> float:
        replicas = gpus * share  # continuous: the crossing falls between whole replicas
        return fit["a"] + (fit["b"] + per_sample) * replicas * per_replica + fit["c"] * replicas

    fits, crossings = model["fits"], model["crossings_gpus"]
    assert at(fits["cpu_s"], crossings["cpu_saturated"]) == pytest.approx(a["step_s"])
    assert at(fits["rss_mb"], crossings["rss_4gib"]) == pytest.approx(a["rss_limit_mb"])
    assert at(fits["after_last_sample_s"], crossings["after_last_sample_5pct"]) == pytest.approx(
        a["overhead_share"] * a["step_s"]
    )
    removed = model["fits"]["cpu_s"]["b"] - model["data_plane_cpu_s_per_sample"]
    assert at(fits["cpu_s"], crossings["cpu_saturated_data_plane"], -removed) == pytest.approx(a["step_s"])
    # The order the page tells: the critical path, memory, then the CPU.
    assert sorted(crossings, key=crossings.get) == [
        "after_last_sample_5pct",
        "rss_4gib",
        "cpu_saturated",
        "cpu_saturated_data_plane",
    ]


def test_the_rows_follow_the_chart_layout_and_the_fits(model):
    last = model["rows"][-1]
    assert last["gpus"] == 1024 and last["replicas"] == round(1024 * 184 / 256)
    assert last["cpu_s"] == pytest.approx(
        last["cpu_per_sample_s"] + last["cpu_per_replica_s"] + model["fits"]["cpu_s"]["a"]
    )
    assert last["shards_needed"] == 2 and 1 < last["core_share"] < 2


def test_the_page_quotes_the_models_numbers(model):
    page, table = PAGE.read_text(), TABLE.read_text()
    assert '--8<-- "docs/generated/scale-model.md"' in page
    for name, figure in FIGURES.items():
        if name.startswith("scale_model."):
            assert figure.text in page, name
    derived = (
        f"{model['token_share_of_in_process_cpu']:.0%}",
        f"{model['update_request_mb_per_sample'] * 1000:.0f} KB",
    )
    allowed = " ".join([table, *(f.text for f in FIGURES.values()), *derived])
    quoted = re.findall(r"(?<![\d.,])(\d[\d,]*(?:\.\d+)? ?(?:µs|ms|KB|GPUs|%))", page)
    assumptions = {"5%"}  # the target, not a result
    wrong = [q for q in quoted if q not in allowed and q not in assumptions]
    assert quoted and not wrong, wrong
