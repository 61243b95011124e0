"""End to end with real servers: a hookprof training process, Prometheus loaded with the
shipped rules, Alertmanager, and a webhook receiver. A NaN injected into a known layer pages
with that layer named; killing the trainer pages "exporter down"."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from support.ports import free_port
from support.processes import Processes, read_until
from support.servers import Webhook, binaries, query, start_alertmanager, start_prometheus
from support.waiting import wait_for


@pytest.fixture
def servers_available():
    binaries()  # skips where Prometheus or Alertmanager is not installed


def test_nan_alert_names_rank_layer_and_phase_then_exporter_down(tmp_path, servers_available):
    procs, webhook = Processes(), Webhook()
    try:
        am_port = start_alertmanager(procs, str(tmp_path), webhook.port)
        port = free_port()
        trainer = procs.start(
            # default settings: the NaN lands on an unsampled step, caught by the every-step
            # check and localised by replaying that step's forward
            [
                sys.executable,
                "-m",
                "hookprof.cli",
                "demo",
                "--port",
                str(port),
                "--nan-layer",
                "mlp.0",
                "--step-delay",
                "0.02",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        read_until(trainer.stdout, "serving metrics")
        prom_port = start_prometheus(procs, str(tmp_path), [f"127.0.0.1:{port}"], am_port)
        t0 = time.monotonic()

        # Prometheus must hold the pre-initialised zero before the NaN, as in a real run
        wait_for(
            "two scrapes of hookprof_nonfinite_steps_total == 0",
            lambda: (
                len(
                    query(
                        prom_port,
                        'count_over_time(hookprof_nonfinite_steps_total{phase="forward"}[1m]) >= 2',
                    )
                )
                == 1
            ),
            timeout=60,
        )
        first_scrape_s = time.monotonic() - t0

        os.kill(trainer.pid, signal.SIGUSR1)  # mlp.0 outputs NaN at the next step
        injected_at = time.monotonic()
        line = read_until(trainer.stdout, "outputs NaN at step")
        step = re.search(r"at step (\d+)", line).group(1)

        def nan_alert():
            for _, alert in webhook.alerts("firing"):
                labels = alert["labels"]
                if (
                    labels["alertname"] == "HookprofNonFiniteTraining"
                    and labels.get("phase") == "forward"
                ):
                    return alert
            return None

        alert = wait_for("the NaN alert at the webhook", nan_alert, timeout=90)
        latency = time.monotonic() - injected_at
        labels = alert["labels"]
        assert labels["rank"] == "0" and labels["model"] == "DemoNet"
        assert labels["layer"] == "mlp.0"
        assert labels["step"] == step
        assert "First offending layer: mlp.0 at step " + step in alert["annotations"]["description"]
        # one page per incident: the forward NaN made the backward and the loss non-finite
        # too, and the rule fired once per phase before, each page naming mlp.0
        paged = [
            a["labels"]
            for _, a in webhook.alerts("firing")
            if a["labels"]["alertname"] == "HookprofNonFiniteTraining" and a["labels"].get("layer")
        ]
        assert {tuple(sorted(p.items())) for p in paged} == {tuple(sorted(labels.items()))}, paged
        print(
            f"\nfirst scrape {first_scrape_s:.1f}s after Prometheus started; "
            f"NaN alert at the webhook {latency:.1f}s after the NaN was injected"
        )

        trainer.kill()  # the job dies
        trainer.wait(timeout=10)
        killed_at = time.monotonic()

        def down_alert():
            return next(
                (
                    a
                    for _, a in webhook.alerts("firing")
                    if a["labels"]["alertname"] == "HookprofExporterDown"
                ),
                None,
            )

        down = wait_for("the exporter-down alert", down_alert, timeout=150)
        assert down["labels"]["instance"] == f"127.0.0.1:{port}"
        print(
            f"exporter-down alert {time.monotonic() - killed_at:.1f}s after the kill "
            "(the rule waits 1m)"
        )
        # the NaN alert outlives the crashed job (keep_firing_for)
        assert not any(
            a["labels"]["alertname"] == "HookprofNonFiniteTraining"
            for _, a in webhook.alerts("resolved")
        )
    finally:
        procs.stop_all()
        webhook.close()
