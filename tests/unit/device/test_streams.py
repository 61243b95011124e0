"""The current-stream lookup that event records use (hookprof/device/streams.py). Without a GPU the
torch calls are stand-ins that say which stream is current and count the Stream objects
built; on a GPU (`-m cuda`) the same is checked against torch.cuda.current_stream()."""

from __future__ import annotations

import pytest
import torch

from hookprof import _testing
from hookprof.device.streams import MAX_KNOWN, StreamLookup


class FakeCudaStreams:
    """A current stream per device, as torch._C._cuda_getCurrentStream reports it."""

    def __init__(self):
        self.device = 0
        self.current = {0: 100, 1: 200}  # device -> stream id
        self.built: list[tuple] = []

    def query(self, device_index: int) -> tuple:
        return (self.current[device_index], device_index, 1)

    def build(self, data: tuple) -> object:
        self.built.append(data)
        return ("stream", *data)

    def lookup(self) -> StreamLookup:
        return StreamLookup(query=self.query, build=self.build, current_device=lambda: self.device)


def test_the_stream_object_is_built_once_and_the_current_stream_read_every_time_no_gpu():
    fake = FakeCudaStreams()
    lookup = fake.lookup()
    first = lookup()
    assert first == ("stream", 100, 0, 1)
    assert all(lookup() is first for _ in range(5))
    assert fake.built == [(100, 0, 1)]  # one Stream object for six lookups
    fake.current[0] = 101  # `with torch.cuda.stream(s)`: another stream is current
    assert lookup() == ("stream", 101, 0, 1)
    fake.current[0] = 100
    assert lookup() is first
    assert len(fake.built) == 2


def test_a_device_index_selects_that_devices_stream_no_gpu():
    fake = FakeCudaStreams()
    lookup = fake.lookup()
    assert lookup(1) == ("stream", 200, 1, 1)  # not the current device's
    fake.device = 1
    assert lookup() is lookup(1)


def test_the_cache_is_bounded_no_gpu():
    fake = FakeCudaStreams()
    lookup = fake.lookup()
    for sid in range(3 * MAX_KNOWN):
        fake.current[0] = sid
        assert lookup() == ("stream", sid, 0, 1)
    assert len(_testing.known_streams(lookup)) <= MAX_KNOWN


@pytest.mark.cuda
def test_lookup_equals_torch_current_stream():
    from hookprof.device.streams import current_stream

    assert current_stream() == torch.cuda.current_stream()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current_stream() == side == torch.cuda.current_stream()
        assert current_stream(torch.cuda.current_device()) == side
    assert current_stream() == torch.cuda.current_stream()


@pytest.mark.cuda
def test_a_copy_on_a_side_stream_is_complete_when_its_event_is():
    """The transfer's event is recorded on the stream the copy was issued on."""
    from hookprof.device.transfer import to_host, wait_ready

    side = torch.cuda.Stream()
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    side.wait_stream(torch.cuda.current_stream())  # x is written before the copy reads it
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)  # keep the side stream busy, so an early event would show
        host, ready = to_host(x)
    wait_ready(ready)
    assert torch.equal(host, x.cpu())
