"""Test support shared by tests/exporters and tests/dashboards: synthetic service views and
launchers for the real Prometheus and Alertmanager binaries (Debian packages) on loopback ports.

Loaded by both conftest.py files by path (the test folders are not packages).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import numpy as np
from polling import wait_for  # noqa: F401 (the tests call it as support.wait_for)
from sdcwatch.core import vocabulary as names
from sdcwatch.core.rank_notes import CheckpointMark
from sdcwatch.core.incident import Incident, PipelineView, RunView, ServiceView, Severity
from sdcwatch.detectors.registry import detector_metrics
from sdcwatch.service.hosts import HostVerdict

from sdcwatch.broker import free_port

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"

#: The scalars of every step (the sampled act_max* are not among them) and the per-layer metrics.
SCALARS = tuple(name for name in names.SCALARS if not name.startswith("act_max"))
LAYER_METRICS = names.LAYER_METRICS
#: The every-step scan's and the checksums' per-index metrics (products, blocks).
CHECK_METRICS = names.CHECK_METRICS


def sdc_incident(
    run: str = "r1",
    *,
    rank: int = 5,
    host: str = "h2",
    id: str = "inc-sdc-1",
    opened_at: float = 0.0,
    resolved: bool = False,
) -> Incident:
    """An SDC incident on one rank, as the attribution detector would open it."""
    inc = Incident(
        id=id,
        run=run,
        kind="sdc_suspected",
        severity=Severity.CRITICAL,
        first_step=100,
        last_step=120,
        message=f"loss spike, SDC suspected on rank {rank} (host {host}), layer 1 attention",
        ranks=(rank,),
        hosts=(host,),
        metric="attn_entropy",
        layer=1,
        score=9.5,
        evidence={"robust_z": 12.25, "steps": [100, 110, 120]},
        detector="attribution",
        peak_step=110,
        opened_at=opened_at,
    )
    if resolved:
        inc.resolved_step = 140
        inc.resolved_at = opened_at + 30.0
    return inc


def nonfinite_incident(run: str = "r1", *, rank: int = 2, opened_at: float = 0.0) -> Incident:
    """An open non-finite incident, as the non-finite detector opens it: the every-step scan saw a
    NaN in block 1's output (``stream_max``)."""
    return Incident(
        id=f"{run}:nonfinite:110",
        run=run,
        kind="nonfinite",
        severity=Severity.CRITICAL,
        first_step=110,
        last_step=110,
        message=f"non-finite value at step 110: stream_max of blocks.1 (block 1) = nan on rank {rank}",
        ranks=(rank,),
        hosts=(f"h{rank // 2}",),
        metric="stream_max",
        layer=1,
        layer_name="blocks.1",
        score=float("inf"),
        detector="nonfinite",
        peak_step=110,
        opened_at=opened_at,
    )


def detector_numbers(*, loss, grad_norm, spike_scores, rank_scores, missing_ranks=0) -> dict:
    """What the default detectors declare of a run, as ``RunView(**detector_numbers(...))`` takes it:
    their families (``detector_metrics``) and values (``detector_values``)."""
    values = {
        "sdcwatch_training_loss": loss,
        "sdcwatch_training_grad_norm": grad_norm,
        "sdcwatch_detector_spike_score": spike_scores,
        "sdcwatch_rank_outlier_score": rank_scores,
        "sdcwatch_pipeline_missing_ranks": missing_ranks,
    }
    specs = tuple(spec for spec in detector_metrics() if spec.name in values)
    return {"detector_metrics": specs, "detector_values": values}


def small_view(world: int = 8, layers: int = 2) -> ServiceView:
    """A tiny, fully deterministic view (for exact exposition text)."""
    scores = np.zeros(world)
    scores[5] = 9.5
    scores[2] = 1.0
    run = RunView(
        run="r1",
        world=world,
        last_step=120,
        last_step_wall=1000.0,
        **detector_numbers(
            loss=2.5, grad_norm=1.25, spike_scores={"loss": 7.5, "grad_norm": 0.5}, rank_scores=scores, missing_ranks=0
        ),
        hosts=[f"h{r // 2}" for r in range(world)],
        scalar_stats={"loss": np.array([2.0, 2.25, 2.5, 2.75, 3.0])},
        layer_stats={"attn_entropy": np.arange(layers * 5, dtype=float).reshape(layers, 5)},
        steps_total=120,
        late_ranks=1,
        emitter_dropped=3,
    )
    return ServiceView(
        runs=[run],
        pipeline=PipelineView(
            records_total=960,
            records_per_second=8.0,
            duplicates_total=1,
            dead_letters_total=2,
            consumer_lag=4,
            last_record_wall=999.0,
            late_records_total=3,
            incomplete_steps_total=5,
            dead_letter_reasons={"malformed": 1, "world": 1},
            auth_runs_refused={("job-b", "run_name"): 2},
            auth_redelivered={"job-a": 3},
            state_topic_refused={"older": 1},
            consumer_partitions=4,
            consumer_rebalances_total=2,
            waiting_for_schema=3,
            offset_gaps={"refetched": 2, "filled": 1, "skipped": 0},
            runs_total=1,
            runs_evicted_total={"finished": 3, "idle": 1},
        ),
        incidents=[sdc_incident(opened_at=990.0)],
        incidents_total={("sdc_suspected", "critical"): 1, ("loss_spike", "warning"): 2},
        findings_total={("rank_outlier", "rank_outlier"): 7, ("guard", "guard_skip"): 1},
        checkpoints=[
            CheckpointMark("r1", 80, "/ckpt/80", "after-fault", ("r1:sdc_suspected:50",)),
            CheckpointMark("r1", 40, "/ckpt/40", "clean"),
        ],
        hosts=[  # the ledger's verdicts, worst first: one host flagged across runs, one clean
            HostVerdict("h2", "suspect", 1.75, ("r0", "r1"), ("checksum",), 3, 980.0, ()),
            HostVerdict("h0", "clean", 0.0, (), (), 0, 0.0, ()),
        ],
    )


def large_view(world: int, layers: int = 80, seed: int = 0, incidents: int = 3) -> ServiceView:
    """A realistic view of a big job: every scalar and layer metric, a few multi-rank incidents."""
    rng = np.random.default_rng(seed)
    stats = np.sort(rng.normal(size=(5,)))
    run = RunView(
        run="big",
        world=world,
        last_step=5000,
        last_step_wall=time.time(),
        **detector_numbers(
            loss=2.0,
            grad_norm=1.0,
            spike_scores={"loss": 0.3, "grad_norm": 0.2},
            rank_scores=rng.exponential(size=world),
            missing_ranks=1,
        ),
        hosts=[f"node{r // 8:05d}" for r in range(world)],
        scalar_stats={name: stats.copy() for name in SCALARS},
        layer_stats={name: np.sort(rng.normal(size=(layers, 5)), axis=1) for name in LAYER_METRICS},
        steps_total=5000,
        late_ranks=3,
        emitter_dropped=0,
    )
    incs = [
        sdc_incident("big", rank=int(r), host=f"node{int(r) // 8:05d}", id=f"inc-{i}")
        for i, r in enumerate(rng.choice(world, size=incidents, replace=False))
    ]
    # an incident naming every rank must not create a series per rank
    incs.append(
        Incident(
            id="inc-all",
            run="big",
            kind="optimisation_instability",
            severity=Severity.WARNING,
            first_step=4990,
            last_step=5000,
            message="all ranks alike",
            ranks=tuple(range(world)),
        )
    )
    kinds = [
        "nonfinite",
        "loss_spike",
        "grad_spike",
        "rank_outlier",
        "replica_divergence",
        "straggler",
        "missing_rank",
        "sdc_suspected",
        "optimisation_instability",
        "silent_drift",
    ]
    return ServiceView(
        runs=[run],
        pipeline=PipelineView(records_total=10**9, records_per_second=16384.0),
        incidents=incs,
        incidents_total={(k, s): 1 for k in kinds for s in ("info", "warning", "critical")},
        findings_total={
            (d, k): 1 for d in ("nonfinite", "spike", "rank_outlier", "replica", "attribution") for k in kinds
        },
    )


@dataclass
class TroubledService:
    """A live, changing view in which every alert rule's condition holds, and every dashboard
    panel has data: loss spike, an open SDC incident on rank 5 (host h2), an open non-finite incident,
    a quarantined and a suspect host, missing ranks, a stalled run, a lagging consumer, growing dead letters and state snapshots that
    cannot be written."""

    world: int = 8
    layers: int = 4
    started: float = field(default_factory=time.time)
    scrapes: int = 0

    def __call__(self) -> ServiceView:
        self.scrapes += 1
        n = self.scrapes
        scores = np.linspace(0.0, 1.0, self.world)
        scores[5] = 25.0
        stats = {name: np.array([0.5, 1.0, 1.5, 2.0, 2.5]) for name in SCALARS}
        stats["nonfinite"] = np.array([0.0, 0.0, 0.0, 0.0, 3.0])
        layer = np.tile(np.array([0.5, 1.0, 1.5, 2.0, 2.5]), (self.layers, 1))
        run = RunView(
            run="r1",
            world=self.world,
            last_step=120 + n,
            last_step_wall=self.started - 900.0,
            **detector_numbers(
                loss=2.5 + 0.01 * n,
                grad_norm=1.25,
                spike_scores={"loss": 9.0, "grad_norm": 3.0},
                rank_scores=scores,
                missing_ranks=2,
            ),
            hosts=[f"h{r // 2}" for r in range(self.world)],
            scalar_stats=stats,
            layer_stats={name: layer.copy() for name in LAYER_METRICS + CHECK_METRICS},
            steps_total=120 + n,
            late_ranks=1,
            emitter_dropped=4 * n,
        )
        return ServiceView(
            runs=[run],
            pipeline=PipelineView(
                records_total=1000 * n,
                records_per_second=1000.0,
                duplicates_total=n,
                dead_letters_total=2 * n,
                consumer_lag=500_000,
                last_record_wall=time.time(),
                consumer_partitions=0,
                dead_letter_reasons={"world": n},
                state_write_errors_total=n,
            ),
            incidents=[sdc_incident(opened_at=self.started), nonfinite_incident(opened_at=self.started)],
            incidents_total={
                ("sdc_suspected", "critical"): 1,
                ("nonfinite", "critical"): 1,
                ("loss_spike", "warning"): 1 + n,
            },
            findings_total={("attribution", "sdc_suspected"): n, ("guard", "guard_skip"): n},
            hosts=[  # h2 named by three runs: quarantined; h1 by two: suspect
                HostVerdict("h2", "quarantine", 3.5, ("r0", "r1", "r2"), ("checksum",), 6, self.started, ()),
                HostVerdict("h1", "suspect", 1.75, ("r0", "r1"), ("nonfinite",), 2, self.started, ()),
                HostVerdict("h0", "clean", 0.0, (), (), 0, 0.0, ()),
            ],
        )


# -- a tensor x pipeline x data parallel run, through the real detection pipeline --------------

#: The simulated ranks' layout: 16 ranks, 4 model pieces of 4 data-parallel replicas each.
LAYOUT_3D = "tp=2,pp=2,dp=4"
PIECES_3D = ("pp=0,tp=0", "pp=0,tp=1", "pp=1,tp=0", "pp=1,tp=1")


def piece_scale(coords: dict[str, int]) -> float:
    """Each piece's values sit in their own decade: stage 0 at 10-20, stage 1 at 100-200, so a
    value of one stage in another stage's quantiles cannot go unseen."""
    return 10.0 ** (1 + coords.get("pp", 0)) * (1 + coords.get("tp", 0))


def records_3d(step: int, *, layout: str = LAYOUT_3D, run: str = "r3d") -> list:
    """One step of every rank: the last stage alone has the loss; stage 0 holds 2 layers and
    stage 1 holds 3 (a stage numbers its own layers from 0); replicas differ by noise."""
    from sdcwatch.core.mesh import Layout
    from sdcwatch.core.record_type import Record

    lay = Layout.parse(layout)
    rng = np.random.default_rng([7, step])
    out = []
    for rank in range(lay.world):
        c = lay.coords(rank)
        scale = piece_scale(c)
        scalars = {"grad_norm_local": scale * (1 + 0.05 * rng.standard_normal()), "nonfinite": 0.0}
        if c.get("pp", 0) == lay.sizes.get("pp", 1) - 1:
            scalars["loss"] = 3.0 + 0.01 * rng.standard_normal()
        n_layers = 2 + c.get("pp", 0)
        entropy = scale * np.arange(1, n_layers + 1) * (1 + 0.01 * rng.standard_normal(n_layers))
        out.append(
            Record.make(
                run=run,
                step=step,
                rank=rank,
                world=lay.world,
                host=f"node{rank // 4}",
                time=float(step),
                scalars=scalars,
                layers={  # every per-layer metric the dashboard plots, in the piece's decade
                    "attn_entropy": entropy.tolist(),
                    "q_norm_max": (2 * entropy).tolist(),
                    "k_norm_max": (3 * entropy).tolist(),
                    "attn_logit_max": (4 * entropy).tolist(),
                    "stream_max": (5 * entropy).tolist(),  # a block a layer
                    "gemm_out": (6 * entropy).tolist(),  # a checked product a layer
                    "gemm_fwd": (1e-5 * entropy).tolist(),  # residuals far under their bound
                },
                coords=c,
            )
        )
    return out


def pipeline_view_3d(steps: int = 12, **kw: Any) -> tuple[ServiceView, dict[int, list]]:
    """(the detection pipeline's view after ``steps`` steps of :func:`records_3d`, records by step)."""
    from sdcwatch.service.pipeline import DetectionPipeline

    pipeline = DetectionPipeline()
    sent = {}
    for step in range(steps):
        sent[step] = records_3d(step, **kw)
        pipeline.process(sent[step])
    pipeline.flush()
    return pipeline.view(), sent


# -- the queries of the dashboard and the rules ------------------------------------------------

#: What Grafana would put in place of the template and built-in variables.
SUBSTITUTIONS = {
    "${datasource}": "prometheus",
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "1m",
    "${run}": "r1",
    "$run": "r1",
    "${piece}": ".*",  # All (the variable's all value)
    "$piece": ".*",
}


def substitute(expr: str) -> str:
    for var, value in SUBSTITUTIONS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted variable in {expr!r}"
    return expr


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, expr) for every query in the committed dashboard: panel targets and annotations."""
    model = json.loads((DASHBOARDS / "sdcwatch.json").read_text())
    found = []
    for panel in model["panels"]:
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for annotation in model["annotations"]["list"]:
        if "expr" in annotation:
            found.append((f"annotation {annotation['name']!r}", annotation["expr"]))
    return found


def variable_queries() -> list[tuple[str, str, str]]:
    """(name, series expr, label) of every ``label_values(expr, label)`` template variable."""
    model = json.loads((DASHBOARDS / "sdcwatch.json").read_text())
    out = []
    for var in model["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"])
            assert m, f"variable {var['name']}: unsupported query {var['query']!r}"
            out.append((var["name"], m.group(1), m.group(2)))
    return out


def rule_expressions() -> list[tuple[str, str]]:
    import yaml

    rules = yaml.safe_load((DASHBOARDS / "rules" / "sdcwatch.rules.yml").read_text())
    return [(rule["alert"], rule["expr"]) for group in rules["groups"] for rule in group["rules"]]


# -- real servers -----------------------------------------------------------------------------


class Receiver:
    """An HTTP endpoint on loopback that records every JSON POST (and its path); ``fail_next`` answers 503."""

    def __init__(self) -> None:
        self.bodies: list = []
        self.paths: list[str] = []
        self.fail_next = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    if receiver.fail_next > 0:
                        receiver.fail_next -= 1
                        status = 503
                    else:
                        receiver.bodies.append(json.loads(body))
                        receiver.paths.append(self.path)
                        status = 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def snapshot(self) -> list:
        with self._lock:
            return list(self.bodies)

    def received(self) -> list[tuple[str, dict]]:
        """(path, body) of every POST so far."""
        with self._lock:
            return list(zip(self.paths, self.bodies))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def http_json(url: str, *, data: bytes | None = None, timeout: float = 5.0) -> Any:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 30.0) -> None:
    """Wait until ``url`` answers 200; the child's log goes with the failure when it exits first or never answers."""

    def answered() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200

    try:
        wait_for(answered, timeout, f"{url} to answer", interval=0.1, retry_on=OSError)
    except AssertionError as exc:
        raise RuntimeError(f"{exc}:\n{log.read_text()[-3000:]}") from None


class Server:
    """A child process on a loopback port, stopped (and waited for) by :meth:`stop`."""

    def __init__(self, args: list[str], ready_url: str, base_url: str, log: Path) -> None:
        self.base_url = base_url
        self.log = log
        self._log_file = open(log, "wb")
        self.proc = subprocess.Popen(args, stdout=self._log_file, stderr=subprocess.STDOUT)
        try:
            wait_ready(ready_url, self.proc, log)
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log_file.close()


def require_binary(name: str) -> str:
    import pytest

    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed: apt-get install -y prometheus prometheus-alertmanager")
    return path


def on_free_port(start: Callable[[int], Server], attempts: int = 3) -> Server:
    """``start(port)`` on a port that was free a moment ago; another process may take it between
    the check and the server's bind, so a server that exits on "address already in use" is
    started again on another port."""
    for attempt in range(attempts):
        try:
            return start(free_port())
        except RuntimeError as exc:
            if "address already in use" not in str(exc) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def start_prometheus(
    workdir: Path, scrape_target: str, rule_files: list[Path] = (), alertmanager: str | None = None
) -> Server:
    """Prometheus scraping ``scrape_target`` (host:port) every second, evaluating ``rule_files``
    and sending their alerts to ``alertmanager`` (its base URL) when given."""
    return on_free_port(lambda port: _start_prometheus(workdir, scrape_target, rule_files, alertmanager, port))


def _start_prometheus(
    workdir: Path, scrape_target: str, rule_files: list[Path], alertmanager: str | None, port: int
) -> Server:
    binary = require_binary("prometheus")
    workdir.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{"job_name": "sdcwatch", "static_configs": [{"targets": [scrape_target]}]}],
    }
    if alertmanager is not None:
        target = urllib.parse.urlsplit(alertmanager).netloc
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [target]}]}]}
    cfg = workdir / "prometheus.yml"
    cfg.write_text(json.dumps(config))  # JSON is YAML
    base = f"http://127.0.0.1:{port}"
    return Server(
        [
            binary,
            f"--config.file={cfg}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        f"{base}/-/ready",
        base,
        workdir / "prometheus.log",
    )


def start_alertmanager(workdir: Path, webhook_url: str) -> Server:
    """Alertmanager routing everything to ``webhook_url`` at once (group_wait 0s, interval 1s)."""
    config = {
        "route": {
            "receiver": "test",
            "group_by": ["alertname", "run", "incident"],
            "group_wait": "0s",
            "group_interval": "1s",
            "repeat_interval": "1h",
        },
        "receivers": [{"name": "test", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}],
    }
    return start_alertmanager_with(workdir, config)


def shipped_alertmanager_config(receiver_url: str) -> dict:
    """dashboards/alertmanager.yml as shipped, each receiver's webhooks posting to
    ``receiver_url/<receiver name>`` instead of the example addresses."""
    import yaml

    config = yaml.safe_load((DASHBOARDS / "alertmanager.yml").read_text())
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", ()):
            hook["url"] = f"{receiver_url}/{receiver['name']}"
    return config


def start_alertmanager_with(workdir: Path, config: dict) -> Server:
    """Alertmanager with ``config`` (the parsed YAML)."""
    return on_free_port(lambda port: _start_alertmanager(workdir, config, port))


def _start_alertmanager(workdir: Path, config: dict, port: int) -> Server:
    binary = require_binary("prometheus-alertmanager")
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "alertmanager.yml"
    cfg.write_text(json.dumps(config))
    base = f"http://127.0.0.1:{port}"
    return Server(
        [
            binary,
            f"--config.file={cfg}",
            f"--storage.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ],
        f"{base}/-/ready",
        base,
        workdir / "alertmanager.log",
    )


def prom_query(base: str, expr: str, at: float | None = None) -> list[dict]:
    """Instant query; raises AssertionError with Prometheus's error text if the query fails."""
    params = {"query": expr}
    if at is not None:
        params["time"] = f"{at:.3f}"
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode(params)
    try:
        body = http_json(url)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"query {expr!r} failed: {exc.read().decode()}") from None
    assert body["status"] == "success", f"query {expr!r}: {body}"
    return body["data"]["result"]


def load_generator():
    """dashboards/generate.py as a module (dashboards/ is not a package)."""
    import importlib.util
    import sys

    name = "sdcwatch_dashboard_generate"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, DASHBOARDS / "generate.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
