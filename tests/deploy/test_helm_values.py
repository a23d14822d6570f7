"""`rlfabric helm-values`: a run config as the Helm chart's values.

Each example (and the quickstart) goes through the command, is read back as Helm reads a values file
(YAML 1.1, helm-python-sdk's values_from_yaml), passes the chart's values.schema.json, renders, and the
ConfigMap the services read holds the same run as the file: every key equal after loading, apart from
the keys the chart writes itself (addresses, TLS, token files, run dir, storage root). In process: the
render is Helm's own engine through helm-python-sdk, no binary and no cluster.
"""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import pytest
import yaml

from rlfabric.cli import main
from rlfabric.core.config import config_from_dict, load_config
from rlfabric.tools.helm_values import dump_values, helm_values
from tests.deploy.test_helm import CHART, FULLNAME, parse_manifests, render_chart

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIGS = [*sorted(p.name for p in EXAMPLES.glob("*.yaml")), "quickstart"]
CHART_WRITTEN = {"cluster", "server", "storage", ("trainer", "run_dir"), ("env", "auth_token_file"),
                 ("rollout", "discovery")}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def path_of(name: str) -> Path | None:
    return None if name == "quickstart" else EXAMPLES / name


def helm_reads(text: str) -> dict:
    """The values as `helm install -f` reads them (YAML 1.1: `n:` unquoted would be `false:`)."""
    return helm.values_from_yaml(text)


def without_chart_keys(dumped: dict) -> dict:
    out = {section: dict(body) if isinstance(body, dict) else body for section, body in dumped.items()
           if section not in CHART_WRITTEN}
    for section, key in (k for k in CHART_WRITTEN if isinstance(k, tuple)):
        out[section].pop(key, None)
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_a_config_as_values_is_the_same_run_in_the_chart(chart, name, capsys):
    """The command's stdout, read as Helm reads it, is valid values whose rendered config is the file's run:
    the chart's default config (another model, data, engine) does not leak into it."""
    args = [str(path_of(name))] if path_of(name) else []
    with pytest.raises(SystemExit) as done:
        main(["helm-values", *args])
    assert done.value.code == 0
    text = capsys.readouterr().out
    values = helm_reads(text)
    assert values == yaml.safe_load(text)  # Helm reads what was meant: no key turned into a boolean
    chart.validate_schema(values)
    docs = parse_manifests(render_chart(chart, values))
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{FULLNAME}-config"]
    rendered = config_from_dict(yaml.safe_load(config_map["data"]["config.yaml"]))
    expected = load_config(path_of(name))
    assert without_chart_keys(rendered.model_dump()) == without_chart_keys(expected.model_dump())
    components = {d["metadata"]["labels"]["app.kubernetes.io/component"]
                  for d in docs if d["kind"] in ("StatefulSet", "Deployment")}
    assert components == set(expected.roles_in_use())
    assert not [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"].endswith("-stage")]  # none asked


def test_a_raw_example_under_config_is_what_helm_refused(chart):
    """The mismatch helm-values removes: an example pasted under `config:` has rollout.n, which YAML 1.1 reads
    as the boolean false, a key the schema refuses."""
    text = "config:\n" + "".join(f"  {line}\n" for line in (EXAMPLES / "math_grpo.yaml").read_text().splitlines())
    assert helm_reads(text)["config"]["rollout"]["false"] == 5
    with pytest.raises(helm.HelmError, match="additional properties 'false' not allowed"):
        chart.validate_schema(helm_reads(text))
    values, _ = helm_values(EXAMPLES / "math_grpo.yaml")
    assert "'n': 5" in dump_values(values) and helm_reads(dump_values(values))["config"]["rollout"]["n"] == 5


def test_overrides_roles_and_staging(chart, tmp_path):
    """Overrides apply before conversion; world sizes and replicas become the pods of their roles, a reward
    model the reward role's train image; stage choices render the stage Job, and files off the volume warn."""
    values, warnings = helm_values(EXAMPLES / "hh_rlhf_ppo.yaml", ["actor.world_size=2", "rollout.replicas=3"])
    assert values["roles"] == {"actor": {"replicas": 2}, "rollout": {"replicas": 3},
                               "reward": {"image": {"variant": "train"}}}
    assert any(w.startswith("model.path ") and "not on the data volume (/data)" in w for w in warnings), warnings
    docs = parse_manifests(render_chart(chart, helm_reads(dump_values(values))))
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"] for d in docs if d["kind"] == "StatefulSet"}
    assert replicas[f"{FULLNAME}-actor"] == 2 and replicas[f"{FULLNAME}-rollout"] == 3

    staged, warnings = helm_values(None, stage_model="quickstart", stage_data="synthetic")  # the quickstart
    assert warnings == []
    assert staged["config"]["model"]["path"] == "/data/models/quickstart"
    assert staged["config"]["data"]["val_files"] == ["/data/datasets/synthetic/val.parquet"]
    docs = parse_manifests(render_chart(chart, helm_reads(dump_values(staged))))
    (stage,) = [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"].endswith("-stage")]
    (script,) = stage["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "rlfabric make-tiny-model '/data/models/quickstart' --warm-start" in script
    assert "rlfabric data synthetic --out '/data/datasets/synthetic'" in script
    with pytest.raises(helm.HelmError, match=r"stage.model quickstart writes the model to /data/models/quickstart, but "
                                             r"config.model.path is \"/data/models/mine\""):
        staged["config"]["model"]["path"] = "/data/models/mine"
        render_chart(chart, helm_reads(dump_values(staged)))


def test_a_bad_config_fails_naming_the_key(capsys):
    with pytest.raises(SystemExit) as done:
        main(["helm-values", str(EXAMPLES / "math_grpo.yaml"), "rollout.nn=3"])
    assert done.value.code == 2
    assert "rollout.nn" in capsys.readouterr().err


def test_the_default_run_reads_what_the_stage_job_writes(chart):
    """The chart's defaults: the model and the data on the volume (no hub id), written there by the stage Job,
    which every pod that reads them waits for; the notes say how to follow it."""
    files = render_chart(chart, {})
    docs = parse_manifests(files)
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{FULLNAME}-config"]
    config = config_from_dict(yaml.safe_load(config_map["data"]["config.yaml"]))
    assert config.model.path == "/data/models/smollm2"
    assert config.data.train_files == ["/data/datasets/arithmetic/train.parquet"]
    # `kubectl scale` of the rollout StatefulSet: the coordinator finds its pods through the headless Service
    headless = f"{FULLNAME}-rollout-headless."
    assert config.rollout.discovery.startswith(headless) and config.rollout.discovery.endswith(".svc:50051")
    assert config.cluster.rollout and all(a.split(".", 1)[1] == config.rollout.discovery for a in config.cluster.rollout)
    stage = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == f"{FULLNAME}-stage")
    (script,) = stage["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "rlfabric make-model smollm2 '/data/models/smollm2'" in script
    assert "rlfabric data arithmetic --out '/data/datasets/arithmetic'" in script
    marker = script.splitlines()[-1].split("touch ")[1].strip("'")
    for d in docs:
        if d["kind"] in ("StatefulSet", "Deployment"):
            mounts_data = any(m["name"] == "data" for m in d["spec"]["template"]["spec"]["containers"][0]["volumeMounts"])
            waits = [c["args"][0] for c in d["spec"]["template"]["spec"].get("initContainers", [])]
            assert bool(waits and marker in waits[0]) == mounts_data, d["metadata"]["name"]
    notes = next(t for p, t in files.items() if p.endswith("NOTES.txt"))
    assert f"logs -f job/{FULLNAME}-stage" in notes
