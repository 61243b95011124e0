"""The metrics endpoint's security: loopback by default, TLS and mutual-TLS (client
certificate), with certificates generated here (tests/support/certs.py, the `pki` fixture);
and label values that survive any module name. Hostile clients:
tests/unit/serve/test_hostile_clients.py."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import urllib.error
import urllib.request

import pytest
import torch
from torch import nn

import hookprof
from hookprof import _testing
from support.metrics import parse, samples


def fetch(url, context=None):
    with urllib.request.urlopen(url, timeout=10, context=context) as r:
        assert r.status == 200
        return r.read().decode()


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))


def test_default_bind_is_loopback():
    with hookprof.attach(model(), port=0) as prof:
        assert prof.url.startswith("http://127.0.0.1:")
        assert _testing.http_server(prof).server_address[0] == "127.0.0.1"


def test_tls_scrape_with_a_certificate_made_here(pki):
    cert, key = pki["server"]
    with hookprof.attach(model(), port=0, tls_certfile=cert, tls_keyfile=key) as prof:
        assert prof.url.startswith("https://127.0.0.1:")
        trusting = ssl.create_default_context(cafile=pki["ca"])
        families = parse(fetch(prof.url, trusting))
        assert samples(families, "hookprof_steps", "hookprof_steps_total") == {
            frozenset({"rank": "0"}.items()): 0.0
        }
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            fetch(prof.url, ssl.create_default_context())  # a client that does not trust our CA
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            fetch(prof.url.replace("https://", "http://"))  # plain HTTP gets no metrics


def test_client_certificate_required(pki):
    cert, key = pki["server"]
    with hookprof.attach(
        model(), port=0, tls_certfile=cert, tls_keyfile=key, tls_client_cafile=pki["ca"]
    ) as prof:
        with_cert = ssl.create_default_context(cafile=pki["ca"])
        with_cert.load_cert_chain(*pki["client"])
        assert "hookprof_steps_total" in fetch(prof.url, with_cert)

        without = ssl.create_default_context(cafile=pki["ca"])
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            fetch(prof.url, without)  # refused: no client certificate

        wrong = ssl.create_default_context(cafile=pki["ca"])
        wrong.load_cert_chain(*pki["stranger"])  # signed by a CA the server does not trust
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            fetch(prof.url, wrong)


def test_tls_config_errors_name_the_field(pki, tmp_path):
    cert, key = pki["server"]
    with pytest.raises(hookprof.ConfigError, match="tls_keyfile"):
        hookprof.Config(tls_certfile=cert)
    with pytest.raises(hookprof.ConfigError, match="tls_certfile"):
        hookprof.Config(tls_client_cafile=pki["ca"])
    with pytest.raises(
        hookprof.ConfigError, match="tls_keyfile must be a path to an existing file"
    ):
        hookprof.Config(tls_certfile=cert, tls_keyfile=str(tmp_path / "missing.key"))


WEIRD_NAMES = ['quo"te', "back\\slash", "new\nline", "ünïcødé_層", "tab\tand space", "{brace}=,"]


def test_label_values_survive_any_module_name():
    net = nn.Module()
    for name in WEIRD_NAMES:
        net.add_module(name, nn.Linear(3, 3))

    def forward(x):
        for name in WEIRD_NAMES:
            x = getattr(net, name)(x)
        return x

    net.forward = forward
    with hookprof.attach(net, port=0, sample_every=1, min_sample_interval_s=0.0) as prof:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(3):
            loss = net(torch.randn(2, 3)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        prof.flush()
        text = fetch(prof.url)
    families = parse(text)  # the official parser reads every escaped value back
    layers = {dict(k)["layer"] for k in samples(families, "hookprof_layer_gradient_norm")}
    assert layers == set(WEIRD_NAMES)
    tool = shutil.which("promtool")  # the label checks above stand without it
    if tool is not None:
        result = subprocess.run(
            [tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr
