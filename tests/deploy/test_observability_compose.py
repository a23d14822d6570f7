"""docker/observability-compose.yaml without docker (none on this machine): its structure, that every file it
mounts exists, and that its pieces agree: Prometheus reads the folder the launchers write targets to
(rlfabric.launch.scrape_targets) under the runs folder `rlfabric train` uses, promtool accepts its config,
Grafana's data sources point where Prometheus and Tempo listen, and its dashboard is the chart's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from rlfabric.core.config import load_config
from rlfabric.launch.local import default_run_dir
from rlfabric.launch.scrape_targets import SHARED_FOLDER

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "observability-compose.yaml"
VARIABLE = re.compile(r"\$\{(\w+):-([^}]*)\}")  # ${NAME:-default}


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def mounts(service: dict) -> dict[str, dict]:
    """target -> the long-syntax volume of a service."""
    return {volume["target"]: volume for volume in service["volumes"]}


def host_path(source: str) -> Path:
    """A bind mount's source on the host, as compose resolves it (relative to the compose file's folder), with
    each ${NAME:-default} at its default."""
    return (COMPOSE.parent / VARIABLE.sub(lambda m: m.group(2), source)).resolve()


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1].strip("/"))


def test_the_compose_file_runs_prometheus_grafana_and_tempo_from_pinned_images():
    services = compose()["services"]
    assert set(services) == {"prometheus", "grafana", "tempo"}
    for name, service in services.items():
        image, _, tag = service["image"].rpartition(":")
        assert image and tag and tag != "latest", (name, service["image"])
        assert service["network_mode"] == "host", name  # the services' metrics ports are on the host's loopback
        assert all(volume["type"] == "bind" and volume["read_only"] for volume in service["volumes"]), name
    assert services["grafana"]["depends_on"] == ["prometheus", "tempo"]


def test_every_file_it_mounts_exists():
    for name, service in compose()["services"].items():
        for volume in service["volumes"]:
            if VARIABLE.search(volume["source"]):
                continue  # the runs folder: the next test
            assert host_path(volume["source"]).exists(), (name, volume["source"])


def test_prometheus_watches_the_targets_the_launchers_write_under_the_runs_folder(tmp_path):
    prometheus = compose()["services"]["prometheus"]
    runs_mount = next(v for v in prometheus["volumes"] if VARIABLE.search(v["source"]))
    # By default the runs folder of `rlfabric train` run from the repository root; never created by docker.
    assert host_path(runs_mount["source"]) == ROOT / default_run_dir(load_config()).parent
    assert runs_mount["bind"]["create_host_path"] is False
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in prometheus["command"])
    config_path = Path(flags["config.file"])
    config = yaml.safe_load(host_path(mounts(prometheus)[str(config_path)]["source"]).read_text())
    [job] = config["scrape_configs"]
    assert job["honor_labels"] is True
    [files] = [sd["files"] for sd in job["file_sd_configs"]]
    assert files == [f"{runs_mount['target']}/{SHARED_FOLDER}/*.json"]
    assert "exemplar-storage" in flags["enable-feature"]

    promtool = shutil.which("promtool")
    assert promtool, "promtool not installed: apt-get install prometheus (`make system-deps` does it as root)"
    checked = subprocess.run([promtool, "check", "config", str(host_path(mounts(prometheus)[str(config_path)]["source"]))],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr


def test_grafana_has_the_charts_dashboard_and_data_sources_where_prometheus_and_tempo_listen():
    services = compose()["services"]
    grafana = mounts(services["grafana"])
    sources = yaml.safe_load(host_path(grafana["/etc/grafana/provisioning/datasources/rlfabric.yaml"]["source"])
                             .read_text())["datasources"]
    by_type = {source["type"]: source for source in sources}
    assert set(by_type) == {"prometheus", "tempo"}
    prometheus_flags = dict(arg.removeprefix("--").split("=", 1) for arg in services["prometheus"]["command"])
    assert port_of(by_type["prometheus"]["url"]) == port_of(prometheus_flags["web.listen-address"])
    tempo_mount = mounts(services["tempo"])
    [tempo_config_path] = [arg.split("=", 1)[1] for arg in services["tempo"]["command"] if "config.file" in arg]
    tempo = yaml.safe_load(host_path(tempo_mount[tempo_config_path]["source"]).read_text())
    assert port_of(by_type["tempo"]["url"]) == tempo["server"]["http_listen_port"]
    assert port_of(tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]) == 4317  # OTLP/gRPC
    destinations = by_type["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert destinations == [{"name": "trace_id", "datasourceUid": by_type["tempo"]["uid"]}]

    providers = yaml.safe_load(host_path(grafana["/etc/grafana/provisioning/dashboards/rlfabric.yaml"]["source"])
                               .read_text())["providers"]
    [folder] = [provider["options"]["path"] for provider in providers]
    dashboards = host_path(grafana[folder]["source"])
    assert dashboards == ROOT / "helm" / "rlfabric" / "dashboards"  # the chart's: one copy of the dashboard
    assert json.loads((dashboards / "rlfabric.json").read_text())["uid"] == "rlfabric-run"
