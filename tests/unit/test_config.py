"""Config: validation names the field, environment variables are parsed in one place."""

from __future__ import annotations

import dataclasses

import pytest

import hookprof
from hookprof import Config, ConfigError
from hookprof.config import DEFAULT_PORT, read_env
from support.hooks_left import forward_pre_hooks
from support.models import DeepNet, seeded


def test_defaults_are_documented_values():
    c = Config()
    assert (c.port, c.addr, c.sample_every, c.min_sample_interval_s) == (
        DEFAULT_PORT,
        "127.0.0.1",
        10,
        2.0,
    )
    assert not 9100 <= DEFAULT_PORT <= 9999  # outside the Prometheus exporter port range


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("sample_every", 0, "sample_every must be >= 1, got 0"),
        ("sample_every", 2.5, "sample_every must be of type int, got 2.5"),
        ("sample_every", True, "sample_every must be of type int, got True"),
        ("port", 70000, "port must be an integer in [0, 65535], got 70000"),
        ("port", "9000", "port must be of type int, got '9000'"),
        ("min_sample_interval_s", -1.0, "min_sample_interval_s must be >= 0, got -1.0"),
        ("max_layers", 0, "max_layers must be >= 1, got 0"),
        (
            "publish_interval_s",
            0,
            "publish_interval_s must be >= 0.05 (seconds: a thread waking more often "
            "takes a share of a core of its own), got 0",
        ),
        ("exploding_grad_norm", -1.0, "exploding_grad_norm must be a finite number > 0, got -1.0"),
        ("rank", -1, "rank must be >= 0 or None, got -1"),
        ("addr", " ", "addr must be a non-empty host address, got ' '"),
        (
            "on_nonfinite",
            "explode",
            "on_nonfinite must be one of ('record', 'warn', 'raise', 'dump', 'skip'), got 'explode'",
        ),
        ("nonfinite_check", "none", "nonfinite_check must be one of ('all', 'loss'), got 'none'"),
        ("http_max_requests", 0, "http_max_requests must be >= 1, got 0"),
        (
            "http_max_connections",
            40,
            "http_max_connections must be above http_max_requests (40), got 40",
        ),
        ("http_header_timeout_s", 0, "http_header_timeout_s must be > 0, got 0"),
        ("http_idle_timeout_s", -1.0, "http_idle_timeout_s must be > 0, got -1.0"),
        ("http_write_timeout_s", 0.0, "http_write_timeout_s must be > 0, got 0.0"),
        ("peak_flops", 0.0, "peak_flops must be > 0 or None, got 0.0"),
        ("update_norm_max_bytes", -1, "update_norm_max_bytes must be >= 0, got -1"),
        (
            "capsule_dir",
            "  ",
            "capsule_dir must be a directory path, or None for no capsule, got '  '",
        ),
        ("capsule_max_count", 0, "capsule_max_count must be >= 1, got 0"),
        ("capsule_max_bytes", -1, "capsule_max_bytes must be >= 0, got -1"),
    ],
)
def test_invalid_values_name_the_field(field, value, message):
    with pytest.raises(ConfigError) as info:
        Config(**{field: value})
    assert str(info.value) == message
    assert info.value.field == field and info.value.value == value


def test_environment_variables_fill_every_field():
    env = {
        "HOOKPROF_PORT": "9001",
        "HOOKPROF_ADDR": "0.0.0.0",
        "HOOKPROF_SERVE": "false",
        "HOOKPROF_SAMPLE_EVERY": "7",
        "HOOKPROF_MIN_SAMPLE_INTERVAL_S": "0.5",
        "HOOKPROF_MAX_LAYERS": "20",
        "HOOKPROF_MAX_LAYER_SERIES": "240",
        "HOOKPROF_DETAILED_LAYERS": "12",
        "HOOKPROF_SDC_CHECK_INTERVAL_S": "300",
        "HOOKPROF_SDC_REPLICA_GROUP": "stage1",
        "HOOKPROF_ACTIVATION_STATS": "0",
        "HOOKPROF_RANK": "3",
        "HOOKPROF_LOCAL_RANK": "none",
        "HOOKPROF_PUBLISH_INTERVAL_S": "2",
        "HOOKPROF_NONFINITE_CHECK": "loss",
        "HOOKPROF_ON_NONFINITE": "dump",
        "HOOKPROF_DUMP_DIR": "/tmp/reports",
        "HOOKPROF_INCIDENT_STEPS": "5",
        "HOOKPROF_CAPSULE_DIR": "/tmp/capsules",
        "HOOKPROF_CAPSULE_MAX_COUNT": "2",
        "HOOKPROF_CAPSULE_MAX_BYTES": "4096",
        "HOOKPROF_MAX_SKIPPED_STEPS": "3",
        "HOOKPROF_VANISHING_GRAD_NORM": "1e-8",
        "HOOKPROF_ACTIVATION_INTERVAL_S": "0.25",
        "HOOKPROF_EXPLODING_GRAD_NORM": "100",
        "HOOKPROF_DISABLE": "no",
        "HOOKPROF_SYSTEM_METRICS": "off",
        "HOOKPROF_GPU_METRICS": "false",
        "HOOKPROF_SYSTEM_INTERVAL_S": "0.5",
        "HOOKPROF_TLS_CERTFILE": __file__,  # any existing file: only existence is checked here
        "HOOKPROF_TLS_KEYFILE": __file__,
        "HOOKPROF_TLS_CLIENT_CAFILE": __file__,
        "HOOKPROF_HTTP_MAX_REQUESTS": "8",
        "HOOKPROF_HTTP_MAX_CONNECTIONS": "32",
        "HOOKPROF_HTTP_HEADER_TIMEOUT_S": "2.5",
        "HOOKPROF_HTTP_IDLE_TIMEOUT_S": "30",
        "HOOKPROF_HTTP_WRITE_TIMEOUT_S": "4",
        "HOOKPROF_NAME": "student",
        "HOOKPROF_SUMMARY_AT_EXIT": "off",
        "HOOKPROF_NONFINITE_SYNC": "1",
        "HOOKPROF_STALL_DETECTION": "off",
        "HOOKPROF_STALL_FACTOR": "3",
        "HOOKPROF_STALL_MIN_S": "12.5",
        "HOOKPROF_STALL_MAX_S": "60",
        "HOOKPROF_STALL_WARMUP_STEPS": "9",
        "HOOKPROF_FLOP_COUNTING": "0",
        "HOOKPROF_PEAK_FLOPS": "9.89e14",
        "HOOKPROF_UPDATE_NORMS": "off",
        "HOOKPROF_UPDATE_NORM_MAX_BYTES": "1048576",
        "HOOKPROF_UPDATE_NORM_INTERVAL_S": "0.5",
        "HOOKPROF_PORT_CONFLICT": "off",
        "HOOKPROF_SPIKE_DETECTION": "off",
        "HOOKPROF_SPIKE_REPLAY": "no",  # (it needs spike detection)
        "HOOKPROF_SPIKE_WINDOW": "500",
        "HOOKPROF_LOSS_SPIKE_Z": "6.5",
        "HOOKPROF_GRAD_NORM_SPIKE_Z": "20",
        "HOOKPROF_UPDATE_RATIO_JUMP_Z": "15",
        "UNRELATED": "x",
    }
    c = Config.from_env(env)
    assert c == Config(
        port=9001,
        addr="0.0.0.0",
        serve=False,
        sample_every=7,
        min_sample_interval_s=0.5,
        max_layers=20,
        max_layer_series=240,
        detailed_layers=12,
        sdc_check_interval_s=300.0,
        sdc_replica_group="stage1",
        activation_stats=False,
        rank=3,
        local_rank=None,
        publish_interval_s=2.0,
        disable=False,
        nonfinite_check="loss",
        on_nonfinite="dump",
        dump_dir="/tmp/reports",
        capsule_dir="/tmp/capsules",
        capsule_max_count=2,
        capsule_max_bytes=4096,
        incident_steps=5,
        max_skipped_steps=3,
        vanishing_grad_norm=1e-8,
        exploding_grad_norm=100.0,
        activation_interval_s=0.25,
        system_metrics=False,
        gpu_metrics=False,
        system_interval_s=0.5,
        tls_certfile=__file__,
        tls_keyfile=__file__,
        tls_client_cafile=__file__,
        http_max_requests=8,
        http_max_connections=32,
        http_header_timeout_s=2.5,
        http_idle_timeout_s=30.0,
        http_write_timeout_s=4.0,
        name="student",
        summary_at_exit=False,
        nonfinite_sync=True,
        stall_detection=False,
        stall_factor=3.0,
        stall_min_s=12.5,
        stall_max_s=60.0,
        stall_warmup_steps=9,
        flop_counting=False,
        peak_flops=9.89e14,
        update_norms=False,
        update_norm_max_bytes=2**20,
        update_norm_interval_s=0.5,
        port_conflict="off",
        spike_detection=False,
        spike_replay=False,
        spike_window=500,
        loss_spike_z=6.5,
        grad_norm_spike_z=20.0,
        update_ratio_jump_z=15.0,
    )
    # every field has a variable: a new field without one fails here
    assert {f.name for f in dataclasses.fields(Config)} == {
        k[len("HOOKPROF_") :].lower() for k in env if k.startswith("HOOKPROF_")
    }


def test_explicit_fields_win_over_environment():
    assert Config.from_env({"HOOKPROF_SAMPLE_EVERY": "7"}, sample_every=3).sample_every == 3


@pytest.mark.parametrize(
    "env, message",
    [
        ({"HOOKPROF_PORT": "http"}, "HOOKPROF_PORT must be an integer, got 'http'"),
        ({"HOOKPROF_SAMPLE_EVERY": "0"}, "sample_every must be >= 1, got 0"),
        (
            {"HOOKPROF_SERVE": "maybe"},
            "HOOKPROF_SERVE must be one of 1/0/true/false/yes/no/on/off, got 'maybe'",
        ),
    ],
)
def test_bad_environment_values_are_clear_errors(env, message):
    with pytest.raises(ConfigError, match="^" + message.replace("/", ".").replace("(", ".")):
        Config.from_env(env)


def test_read_env_ignores_unset_fields():
    assert read_env({}) == {}


def test_attach_reads_environment(monkeypatch):
    monkeypatch.setenv("HOOKPROF_SAMPLE_EVERY", "4")
    monkeypatch.setenv("HOOKPROF_PORT", "0")
    with hookprof.attach(seeded(DeepNet)) as prof:
        assert prof.config.sample_every == 4


def test_kill_switch_returns_a_profiler_that_does_nothing(monkeypatch):
    monkeypatch.setenv("HOOKPROF_DISABLE", "1")
    model = seeded(DeepNet)
    hooks_before = len(forward_pre_hooks(model.stem))
    prof = hookprof.attach(model, port=0, sample_every=1)
    assert not prof.enabled and prof.url is None
    assert len(forward_pre_hooks(model.stem)) == hooks_before
    prof.step(1.0)
    assert prof.snapshot().step == 0
    prof.detach()
    with pytest.raises(hookprof.DetachedError):
        prof.step()


def test_unknown_override_is_a_clear_error():
    with pytest.raises(TypeError, match="unknown hookprof config field.*'sample_evry'") as info:
        hookprof.attach(seeded(DeepNet), sample_evry=3)
    # issue 32: the field meant, not a list of every field
    assert "'sample_evry' (did you mean 'sample_every'?)" in str(info.value)
    assert "max_layer_series" not in str(info.value)
    with pytest.raises(TypeError, match=r"'on_nonfinit' \(did you mean 'on_nonfinite'\?\)"):
        Config.from_env({}, on_nonfinit="raise")


def test_a_misspelt_variable_is_warned_about_with_the_setting_meant():
    environ = {
        "HOOKPROF_SMAPLE_EVERY": "3",
        "HOOKPROF_PORT": "0",
        "HOOKPROF_ROOT": "/srv",
    }  # far from every setting: someone else's, left alone
    with pytest.warns(UserWarning) as caught:
        config = Config.from_env(environ)
    assert [str(w.message) for w in caught] == [
        "HOOKPROF_SMAPLE_EVERY is not a hookprof setting and is ignored (did you mean HOOKPROF_SAMPLE_EVERY?)"
    ]
    assert (config.sample_every, config.port) == (Config().sample_every, 0)


def test_port_conflict_is_validated_and_read_from_the_environment():
    assert Config().port_conflict == "free"
    assert read_env({"HOOKPROF_PORT_CONFLICT": "raise"}) == {"port_conflict": "raise"}
    with pytest.raises(
        ConfigError, match=r"port_conflict must be one of \('free', 'off', 'raise'\), got 'stop'"
    ):
        Config(port_conflict="stop")
