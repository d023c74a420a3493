"""Staging buffers: rounds fit the region, and bytes a transfer did not cover are zeros, never stale."""

from __future__ import annotations

import pytest
import torch

from prefixstore.gpu_staging import StagingBuffer, StagingFull


def test_land_zeroes_what_a_transfer_did_not_cover() -> None:
    staging = StagingBuffer(1024, device="cpu")
    staging.host.fill_(0xAA)  # request A's bytes
    slots = staging.carve([100, 200, 300])
    assert [(s.offset, s.nbytes) for s in slots] == [(0, 100), (100, 200), (300, 300)]
    staging.host[100:300] = 0x42  # request B's transfer filled the middle slot only
    staging.host[300:400] = 0x42  # ... and half of the last one before failing
    assert staging.land(slots, [-1, 200, 100]) == [False, True, False]
    assert (staging.host[:100] == 0).all()
    assert (staging.host[100:300] == 0x42).all()
    assert (staging.host[300:600] == 0).all()  # a partial payload is not trusted either
    assert (staging.host[600:] == 0xAA).all()  # outside the round: never read by it
    assert staging.zeroed_bytes == 400


def test_rounds_fit_the_region_and_name_the_knob() -> None:
    staging = StagingBuffer(1000, device="cpu")
    assert staging.rounds([400, 400, 400, 100, 1000]) == [[0, 1], [2, 3], [4]]
    with pytest.raises(StagingFull, match="staging_bytes"):
        staging.rounds([1001])
    with pytest.raises(StagingFull, match="staging_bytes"):
        staging.carve([600, 600])


def test_the_region_is_allocated_once_on_the_default_device() -> None:
    staging = StagingBuffer(4096)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert staging.region.device.type == expected and staging.region.numel() == 4096
    ptr = staging.host.data_ptr()
    staging.land(staging.carve([4096]), [-1])
    assert staging.host.data_ptr() == ptr
