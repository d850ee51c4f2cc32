"""The serve configuration: defaults, layering (file < env < flags), errors that name the key."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import tomllib
from sdcwatch.core.errors import ConfigError

from sdcwatch.config import (
    AlertsConfig,
    BusConfig,
    MetricsConfig,
    ServeConfig,
    add_serve_arguments,
    config_from_args,
    env_name,
    flag_name,
    load_config,
    overrides_from_args,
)
from sdcwatch.config.schema import SECTIONS, hints

EXAMPLE = Path(__file__).resolve().parents[2] / "sdcwatch" / "serve.example.toml"


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "serve.toml"
    path.write_text(text)
    return path


def parser() -> argparse.ArgumentParser:
    return add_serve_arguments(argparse.ArgumentParser(prog="sdcwatch serve"))


# ---------------------------------------------------------------------------------------------
# defaults and layering


def test_defaults_without_file_env_or_flags():
    cfg = load_config(env={})
    assert cfg == ServeConfig()
    assert cfg.bus.bootstrap_servers == ["localhost:9092"]
    assert cfg.bus.telemetry_topic == "sdcwatch.telemetry"
    assert cfg.metrics.address == "127.0.0.1" and cfg.metrics.port == 9400 and cfg.metrics.enabled
    assert cfg.alerts.alertmanager_url == "" and cfg.alerts.log is True
    assert cfg.state.dir == Path("sdcwatch-state")
    assert cfg.bus.security == {}


# (dotted key, file value as TOML, env text, flag value, expected parsed env, expected flag)
LAYERED = [
    ("metrics.port", "1111", "2222", "3333", 2222, 3333),
    ("bus.bootstrap", '"file:1"', "env:2", "flag:3", "env:2", "flag:3"),
    ("alerts.log", "false", "yes", False, True, False),
    ("alerts.timeout_s", "1.5", "2", "3.25", 2.0, 3.25),
    ("state.dir", '"from-file"', "from-env", "from-flag", Path("from-env"), Path("from-flag")),
    ("metrics.top_k", "2", "4", 5, 4, 5),
    ("detectors.resolve_after_steps", "2", "4", 5, 4, 5),
]


@pytest.mark.parametrize("dotted, file_value, env_text, flag_value, env_expected, flag_expected", LAYERED)
def test_precedence_file_then_env_then_flags(
    tmp_path, dotted, file_value, env_text, flag_value, env_expected, flag_expected
):
    section, key = dotted.split(".")
    path = write_toml(tmp_path, f"[{section}]\n{key} = {file_value}\n")
    file_expected = load_config(path, env={}).__dict__[section].__dict__[key]
    assert file_expected == tomllib.loads(f"{key} = {file_value}")[key] or isinstance(file_expected, Path)
    assert file_expected != getattr(ServeConfig().__dict__[section], key)

    env = {env_name(dotted): env_text}
    assert getattr(getattr(load_config(path, env=env), section), key) == env_expected
    cfg = load_config(path, env=env, overrides={dotted: flag_value})
    assert getattr(getattr(cfg, section), key) == flag_expected
    # A None override (an argparse flag not given) does not hide the lower layers.
    assert getattr(getattr(load_config(path, env=env, overrides={dotted: None}), section), key) == env_expected


def test_nested_overrides_and_config_path_from_environment(tmp_path):
    path = write_toml(tmp_path, "[metrics]\nport = 0\n")
    cfg = load_config(env={"SDCWATCH_CONFIG": str(path)}, overrides={"detectors": {"resolve_after_steps": 7}})
    assert cfg.metrics.port == 0 and not cfg.metrics.enabled
    assert cfg.detectors.resolve_after_steps == 7


def test_bootstrap_shortcut_and_its_precedence():
    assert load_config(env={"SDCWATCH_BOOTSTRAP": "a:1,b:2"}).bus.bootstrap_servers == ["a:1", "b:2"]
    both = {"SDCWATCH_BOOTSTRAP": "a:1", "SDCWATCH_BUS_BOOTSTRAP": "c:3"}
    assert load_config(env=both).bus.bootstrap == "c:3"


def test_emitter_variables_are_not_serve_settings():
    # every variable the emitter reads: a job's environment exported in the shell that starts serve
    env = {
        "SDCWATCH_RUN": "llama-7b",
        "SDCWATCH_HOST": "h1",
        "SDCWATCH_WIRE": "v1",
        "SDCWATCH_MESH": "pp=2,dp=4,tp=2",
        "SDCWATCH_COORDS": "pp=1,dp_replicate=3,tp=0",
        "SDCWATCH_BENCH_DIR": "/src/sdcwatch/bench",  # sdcwatch bench's, exported in the same shell
        "PATH": "/bin",
    }
    assert load_config(env=env) == ServeConfig()


@pytest.mark.parametrize(
    "var, meant",
    [
        ("SDCWATCH_ALERT_ALERTMANAGER_URL", "SDCWATCH_ALERTS_ALERTMANAGER_URL"),  # misspelt section
        ("SDCWATCH_METRIC_PORT", "SDCWATCH_METRICS_PORT"),
    ],
)
def test_a_misspelt_section_in_the_environment_is_an_error_naming_the_variable(var, meant):
    with pytest.raises(ConfigError) as err:
        load_config(env={var: "9401", "SDCWATCH_RUN": "r"})
    assert err.value.key == var and f"did you mean {meant}?" in str(err.value)
    with pytest.raises(ConfigError, match="SDCWATCH_WHATEVER: unknown sdcwatch environment variable"):
        load_config(env={"SDCWATCH_WHATEVER": "x"})


def test_no_error_shows_a_secret(tmp_path):
    url = "http://ops:hunter2@alertmanager:99999"
    with pytest.raises(ConfigError) as err:
        load_config(env={"SDCWATCH_ALERTS_ALERTMANAGER_URL": url})
    assert "hunter2" not in str(err.value) and "ops:***@alertmanager" in str(err.value)
    path = write_toml(
        tmp_path,
        """
        [bus.security]
        security_protocol = "SASL_SSL"
        sasl_mechanism = "PLAIN"
        sasl_plain_username = "u"
        sasl_plain_password = 31415926
    """,
    )
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert err.value.key == "bus.security.sasl_plain_password" and "31415926" not in str(err.value)


def test_security_entries_merge_across_layers_and_are_redacted(tmp_path):
    path = write_toml(
        tmp_path,
        '[bus.security]\nsecurity_protocol = "SASL_PLAINTEXT"\nsasl_mechanism = "SCRAM-SHA-512"\n'
        'sasl_plain_username = "sdc"\n',
    )
    env = {"SDCWATCH_BUS_SECURITY_SASL_PLAIN_PASSWORD": "s3cret", "SDCWATCH_BUS_SECURITY_SSL_CHECK_HOSTNAME": "no"}
    cfg = load_config(path, env=env)
    assert cfg.bus.security == {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "sdc",
        "sasl_plain_password": "s3cret",
        "ssl_check_hostname": False,
    }


# ---------------------------------------------------------------------------------------------
# every error names the key (and where the bad value came from)

FILE_ERRORS = [
    ("[alerts]\nalertmanger_url = 'http://am:9093'\n", "alerts.alertmanger_url", "did you mean alertmanager_url?"),
    ("[metric]\nport = 1\n", "metric", "did you mean metrics?"),
    ("[metrics]\nport = '9400'\n", "metrics.port", "must be an integer, got string '9400'"),
    ("[metrics]\nport = true\n", "metrics.port", "must be an integer"),
    ("[metrics]\nport = 70000\n", "metrics.port", "in [0, 65535]"),
    ("[metrics]\naddress = 'not an address!'\n", "metrics.address", "neither an IP address nor a host name"),
    ("[alerts]\nlog = 'yes'\n", "alerts.log", "must be true or false"),
    ("[alerts]\nwebhook_url = 'ftp://hooks'\n", "alerts.webhook_url", "http:// or https://"),
    ("[alerts]\nalertmanager_url = 'http://am:notaport'\n", "alerts.alertmanager_url", "not a valid URL"),
    ("[alerts]\ntimeout_s = 0\n", "alerts.timeout_s", "must be a number > 0, got 0.0"),
    ("[alerts]\ntimeout_s = inf\n", "alerts.timeout_s", "finite"),
    ("[bus]\nbootstrap = 'localhost'\n", "bus.bootstrap", "not host:port"),
    ("[bus]\nbootstrap = ' , '\n", "bus.bootstrap", "at least one"),
    ("[bus]\nanomalies_topic = 'sdcwatch.telemetry'\n", "bus.anomalies_topic", "also bus.telemetry_topic"),
    ("[bus]\ntelemetry_topic = 'bad topic'\n", "bus.telemetry_topic", "not a Kafka topic name"),
    ("[bus]\ngroup = ' '\n", "bus.group", "must not be empty"),
    ("bus = 3\n", "bus", "must be a table"),
    ("[bus]\nsecurity = 'SSL'\n", "bus.security", "must be a table"),
    ("[bus.security]\nsasl_mechansim = 'PLAIN'\n", "bus.security.sasl_mechansim", "did you mean sasl_mechanism?"),
    ("[bus.security]\nsecurity_protocol = 'TLS'\n", "bus.security.security_protocol", "must be one of PLAINTEXT, SSL,"),
    ("[bus.security]\nsasl_mechanism = 'PLAIN'\n", "bus.security.sasl_mechanism", "needs security_protocol SASL_"),
    (
        "[bus.security]\nsecurity_protocol = 'SASL_SSL'\n",
        "bus.security.sasl_mechanism",
        "required by security_protocol",
    ),
    (
        "[bus.security]\nsecurity_protocol = 'SASL_SSL'\nsasl_mechanism = 'PLAIN'\nsasl_plain_username = 'u'\n",
        "bus.security.sasl_plain_password",
        "required by sasl_mechanism PLAIN",
    ),
    ("[bus.security]\nssl_cafile = '/nonexistent/ca.pem'\n", "bus.security.ssl_cafile", "no such file"),
    ("[bus.security]\nssl_check_hostname = 'true'\n", "bus.security.ssl_check_hostname", "must be true or false"),
    ("[state]\nsnapshot_interval_s = -5\n", "state.snapshot_interval_s", "must be a number > 0, got -5.0"),
    ("[metrics]\ntop_k = -1\n", "metrics.top_k", ">= 0"),
    ("[metrics]\nmax_layers = 0\n", "metrics.max_layers", ">= 1"),
    ("[metrics]\nmax_runs = 0\n", "metrics.max_runs", "must be an integer >= 1, got 0"),
    ("[metrics]\nmax_pieces = 0\n", "metrics.max_pieces", ">= 1"),
    ("[detectors]\nresolve_after_steps = 2.5\n", "detectors.resolve_after_steps", "must be an integer"),
    ("[detectors]\nalign_timeout_s = 'soon'\n", "detectors.align_timeout_s", "must be a number"),
    ("[detectors]\nresolve_after_steps = 0\n", "detectors.resolve_after_steps", "must be an integer >= 1, got 0"),
    ("[detectors]\nalign_timeout_s = 0\n", "detectors.align_timeout_s", "must be a number > 0, got 0.0"),
    ("[detectors]\nstage = 'all'\n", "detectors.stage", "must be one of both, spatial, temporal, got 'all'"),
    ("[detectors]\nwarmup = 3\n", "detectors.warmup", "unknown key"),
    ("[metrics\nport = 1\n", "config", "not valid TOML"),
]


@pytest.mark.parametrize("text, key, fragment", FILE_ERRORS, ids=[e[1] + ":" + e[2][:20] for e in FILE_ERRORS])
def test_file_errors_name_the_key_and_the_file(tmp_path, text, key, fragment):
    path = write_toml(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert err.value.key == key
    assert str(err.value).startswith(f"{key}: ")
    assert fragment in str(err.value)
    assert str(path) in str(err.value)


def test_exact_message_for_a_misspelt_key(tmp_path):
    path = write_toml(tmp_path, "[alerts]\nalertmanger_url = 'http://am:9093'\n")
    with pytest.raises(ConfigError, match=r"^alerts\.alertmanger_url: unknown key \(did you mean alertmanager_url\?\)"):
        load_config(path, env={})


def test_missing_file_names_the_config_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^config: no such file: .*absent\.toml"):
        load_config(tmp_path / "absent.toml", env={})


def test_state_dir_that_is_a_file(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"^state\.dir: .* is not a folder"):
        load_config(env={"SDCWATCH_STATE_DIR": str(blocker)})


ENV_ERRORS = [
    ({"SDCWATCH_METRICS_PORT": "abc"}, "metrics.port", "must be an integer, got 'abc'"),
    ({"SDCWATCH_METRICS_PORT": "-1"}, "metrics.port", "in [0, 65535]"),
    ({"SDCWATCH_ALERTS_LOG": "maybe"}, "alerts.log", "must be true or false"),
    ({"SDCWATCH_ALERTS_TIMEOUT_S": "nan"}, "alerts.timeout_s", "finite"),
    ({"SDCWATCH_BOOTSTRAP": "kafka"}, "bus.bootstrap", "not host:port"),
    (
        {"SDCWATCH_ALERTS_ALERTMANGER_URL": "http://am"},
        "alerts.alertmanger_url",
        "did you mean SDCWATCH_ALERTS_ALERTMANAGER_URL?",
    ),
    (
        {"SDCWATCH_BUS_SECURITY_SASL_PLAIN_PASWORD": "x"},
        "bus.security.sasl_plain_pasword",
        "did you mean SDCWATCH_BUS_SECURITY_SASL_PLAIN_PASSWORD?",
    ),
]


@pytest.mark.parametrize("env, key, fragment", ENV_ERRORS, ids=[e[1] for e in ENV_ERRORS])
def test_environment_errors_name_the_key_and_the_variable(env, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(env=env)
    assert err.value.key == key
    assert fragment in str(err.value)
    assert next(iter(env)) in str(err.value)


FLAG_ERRORS = [
    ({"metrics.port": "x"}, "metrics.port", "--metrics-port"),
    ({"metrics.port": 65536}, "metrics.port", "--metrics-port"),
    ({"alerts.webhook_url": "hooks.example.com"}, "alerts.webhook_url", "--alerts-webhook-url"),
    ({"alerts.webhok_url": "http://x"}, "alerts.webhok_url", "did you mean webhook_url?"),
    ({"detector": {"top_k": 1}}, "detector", "did you mean detectors?"),
]


@pytest.mark.parametrize("overrides, key, fragment", FLAG_ERRORS, ids=[e[1] for e in FLAG_ERRORS])
def test_override_errors_name_the_key_and_the_flag(overrides, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(env={}, overrides=overrides)
    assert err.value.key == key
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "build, key",
    [
        (lambda: MetricsConfig(port=True), "metrics.port"),
        (lambda: MetricsConfig(port="80"), "metrics.port"),
        (lambda: AlertsConfig(log=1), "alerts.log"),
        (lambda: BusConfig(security={"sasl_plain_password": 5}), "bus.security.sasl_plain_password"),
        (lambda: ServeConfig(metrics=AlertsConfig()), "metrics"),
    ],
)
def test_sections_built_in_code_are_checked_too(build, key):
    with pytest.raises(ConfigError) as err:
        build()
    assert err.value.key == key


# ---------------------------------------------------------------------------------------------
# flags


def test_flags_override_only_what_was_given(tmp_path):
    p = parser()
    assert overrides_from_args(p.parse_args([])) == {}
    ns = p.parse_args(
        [
            "--bootstrap",
            "k1:9092,k2:9092",
            "--metrics-port",
            "0",
            "--no-alerts-log",
            "--alertmanager-url",
            "http://am:9093",
            "--state-dir",
            str(tmp_path / "st"),
        ]
    )
    assert overrides_from_args(ns) == {
        "bus.bootstrap": "k1:9092,k2:9092",
        "metrics.port": "0",
        "alerts.log": False,
        "alerts.alertmanager_url": "http://am:9093",
        "state.dir": str(tmp_path / "st"),
    }
    cfg = config_from_args(ns, env={"SDCWATCH_METRICS_PORT": "1234", "SDCWATCH_METRICS_TOP_K": "9"})
    assert cfg.bus.bootstrap_servers == ["k1:9092", "k2:9092"]
    assert cfg.metrics.port == 0  # the flag beats the environment
    assert cfg.metrics.top_k == 9  # the environment beats the default
    assert cfg.alerts.log is False
    assert cfg.state.dir == tmp_path / "st"


def test_config_flag_reads_the_file(tmp_path):
    path = write_toml(tmp_path, "[detectors]\nalign_timeout_s = 0.5\n")
    cfg = config_from_args(parser().parse_args(["--config", str(path)]), env={})
    assert cfg.detectors.align_timeout_s == 0.5


def test_help_lists_every_setting_with_its_environment_variable():
    text = parser().format_help()
    from sdcwatch.config.loaders import all_keys

    for dotted in all_keys():
        if not dotted.startswith("bus.security."):  # a table of Kafka settings: no flag each
            assert flag_name(dotted) in text
            assert env_name(dotted) in text.replace("\n", "").replace(" ", "")


# ---------------------------------------------------------------------------------------------
# settings defined once: by the component they configure


def test_the_detectors_section_is_the_pipelines_settings():
    """[detectors] is PipelineSettings (its keys, defaults and bounds), plus the stage, the schema
    wait and one table per detector; the pipeline's fixed settings have no key."""
    from dataclasses import fields

    from sdcwatch.service.pipeline import DetectionPipeline, PipelineSettings

    from sdcwatch.config.loaders import all_keys

    cfg = load_config(env={"SDCWATCH_DETECTORS_ALIGN_TIMEOUT_S": "7", "SDCWATCH_DETECTORS_RESOLVE_AFTER_STEPS": "9"})
    assert isinstance(cfg.detectors, PipelineSettings)
    pipe = DetectionPipeline(cfg.detectors)
    assert (pipe.aligner.timeout, pipe.book.quiet_steps) == (7.0, 9)
    for f in fields(PipelineSettings):
        assert getattr(ServeConfig().detectors, f.name) == getattr(PipelineSettings(), f.name)
        assert (f"detectors.{f.name}" in all_keys()) == (not f.metadata.get("fixed"))
    with pytest.raises(ConfigError, match=r"^detectors\.run_end_expiry_s: must be a number > 0, got 0$"):
        PipelineSettings(run_end_expiry_s=0)


def test_the_metrics_section_takes_the_exporters_defaults_and_bounds():
    from sdcwatch.exporters import (
        DEFAULT_MAX_LAYERS,
        DEFAULT_MAX_PIECES,
        DEFAULT_METRICS_ADDRESS,
        DEFAULT_METRICS_PORT,
        DEFAULT_TOP_K,
    )

    m = MetricsConfig()
    assert (m.address, m.port, m.top_k, m.max_layers, m.max_pieces) == (
        DEFAULT_METRICS_ADDRESS,
        DEFAULT_METRICS_PORT,
        DEFAULT_TOP_K,
        DEFAULT_MAX_LAYERS,
        DEFAULT_MAX_PIECES,
    )
    # top_k = 0 is a choice (per-rank series only for the ranks an open incident names), as in the collector
    assert load_config(env={"SDCWATCH_METRICS_TOP_K": "0"}).metrics.top_k == 0


# ---------------------------------------------------------------------------------------------
# the example file


def test_example_file_loads_and_documents_every_key():
    cfg = load_config(EXAMPLE, env={})
    assert cfg == ServeConfig()  # the example claims to show the defaults: it must not drift
    data = tomllib.loads(EXAMPLE.read_text())
    shown = {f"{s}.{k}" for s, table in data.items() for k in table}
    expected = {f"{s}.{k}" for s, cls in SECTIONS.items() for k in hints(cls) if k != "security"}
    assert shown == expected
    assert "[bus.security]" in EXAMPLE.read_text()


def test_example_security_block_is_valid_once_uncommented(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    text = EXAMPLE.read_text().replace("# [bus.security]", "[bus.security]")
    for key in (
        "security_protocol",
        "sasl_mechanism",
        "sasl_plain_username",
        "sasl_plain_password",
        "ssl_cafile",
        "ssl_check_hostname",
    ):
        text = text.replace(f"# {key} ", f"{key} ")
    text = text.replace("/etc/kafka/ca.pem", str(ca))
    cfg = load_config(write_toml(tmp_path, text), env={})
    assert cfg.bus.security["sasl_mechanism"] == "SCRAM-SHA-512"
    assert cfg.bus.security["ssl_check_hostname"] is True


# ---------------------------------------------------------------------------------------------
# the detectors' own settings: [detectors.<name>], from each detector's Config


def test_every_default_detector_has_its_own_section_with_its_config():
    from sdcwatch.detectors.registry import default_classes

    cfg = ServeConfig()
    for cls in default_classes():
        assert getattr(cfg.detectors, cls.name) == cls.Config()
    assert set(cfg.detectors.detector_configs()) == {cls.name for cls in default_classes()}


def test_detector_settings_from_file_env_and_flags_reach_the_detectors(tmp_path):
    from sdcwatch.detectors.registry import default_detectors

    path = write_toml(
        tmp_path, "[detectors.spike]\nwarmup = 20\n[detectors.rank_outlier]\nscalars = ['loss']\nthreshold = 30\n"
    )
    env = {"SDCWATCH_DETECTORS_SPIKE_GRAD_NORM_Z_ON": "7", "SDCWATCH_DETECTORS_STRAGGLER_WINDOW": "12"}
    cfg = load_config(path, env=env, overrides={"detectors.missing_rank.after": "9"})
    dets = {d.name: d for d in default_detectors(cfg.detectors.detector_configs())}
    assert dets["spike"].warmup == 20 and dets["spike"].window == 9
    # a sub-section keeps its own defaults: the gradient-norm series' min_ratio is 4, not the class default
    assert (dets["spike"].grad_norm.z_on, dets["spike"].grad_norm.min_ratio) == (7.0, 4.0)
    assert dets["rank_outlier"].scalars == ("loss",) and dets["rank_outlier"].threshold == 30.0
    assert dets["straggler"].window == 12 and dets["missing_rank"].after == 9


@pytest.mark.parametrize(
    "text, key, problem",
    [
        ("[detectors.spike]\nwarmup = 0\n", "detectors.spike.warmup", "positive"),
        ("[detectors.spike.loss]\nz_off = 9\n", "detectors.spike.loss.z_off", "below z_on"),
        ("[detectors.straggler]\nmin_ratio = 0.5\n", "detectors.straggler.min_ratio", "> 1"),
        ("[detectors.spike]\nwarmpu = 3\n", "detectors.spike.warmpu", "did you mean warmup?"),
        ("[detectors.nonfinit]\nlimit = 3\n", "detectors.nonfinit", "unknown key"),
    ],
)
def test_bad_detector_setting_names_its_full_key_and_file(tmp_path, text, key, problem):
    with pytest.raises(ConfigError) as err:
        load_config(write_toml(tmp_path, text), env={})
    assert err.value.key == key and problem in str(err.value) and "serve.toml" in str(err.value)


def test_detector_settings_have_flags():
    ns = parser().parse_args(["--detectors-spike-warmup", "30", "--detectors-rank-outlier-scalars", "loss,grad_cosine"])
    cfg = config_from_args(ns, env={})
    assert cfg.detectors.spike.warmup == 30
    assert cfg.detectors.rank_outlier.scalars == ("loss", "grad_cosine")


def test_the_unknown_variable_error_does_not_call_every_other_variable_the_emitters():
    """SDCWATCH_CONFIG is the loader's and SDCWATCH_VENV dev.sh's: the list says whose they are."""
    with pytest.raises(ConfigError) as err:
        load_config(env={"SDCWATCH_WHATEVER": "x"})
    text = str(err.value)
    assert "the emitter's own are" not in text
    assert (
        "SDCWATCH_RUN" in text
        and "SDCWATCH_CONFIG" in text
        and "(the emitter's, --config's, sdcwatch bench's and dev.sh's)" in text
    )
