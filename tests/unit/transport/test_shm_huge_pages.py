"""Transparent-huge-page advice for memory peers read by cross-memory attach (``transport/_huge_pages.py``),
in one process."""

from __future__ import annotations

import sys

import pytest
import torch

# white-box: the huge-page advisor, below the public transport API (no public name)
from phalanx.transport import _huge_pages
from phalanx.transport._huge_pages import MADV_COLLAPSE, MADV_HUGEPAGE

MB = 1 << 20


class _Recorder:
    """Stands in for libc's madvise: records (address, bytes, advice); refuses collapses when told to."""

    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.refuse = refuse

    def __call__(self, addr: int, nbytes: int, advice: int) -> int:
        self.calls.append((addr, nbytes, advice))
        return -1 if self.refuse and advice == MADV_COLLAPSE else 0


def test_runs_coalesce_consecutive_blocks() -> None:
    assert _huge_pages._runs([]) == []
    assert _huge_pages._runs([7, 3, 4, 5, 9, 10]) == [(3, 3), (7, 1), (9, 2)]


def test_each_block_a_tensor_covers_is_advised_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _Recorder()
    monkeypatch.setattr(_huge_pages, "_MADVISE", fake)
    monkeypatch.delenv("PHALANX_SHM_THP", raising=False)
    monkeypatch.setattr(_huge_pages, "SIGHTINGS", 1)
    adv = _huge_pages.Advisor()
    block = _huge_pages.BLOCK
    adv.advise([(10 * block + 100, 3 * block)])  # covers blocks 10, 11, 12 and the start of 13
    assert fake.calls == [(10 * block, 4 * block, MADV_HUGEPAGE), (10 * block, 4 * block, MADV_COLLAPSE)]
    assert (adv.collapsed, adv.refused, adv.calls) == (4, 0, 1)
    fake.calls.clear()
    adv.advise([(11 * block, 2 * block), (100, 4096)])  # already advised; too small to be worth a call
    assert fake.calls == []
    adv.advise([(12 * block, 4 * block)])  # blocks 14, 15 are new
    assert fake.calls == [(14 * block, 2 * block, MADV_HUGEPAGE), (14 * block, 2 * block, MADV_COLLAPSE)]


def test_a_block_is_advised_the_second_time_it_is_covered(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _Recorder()
    monkeypatch.setattr(_huge_pages, "_MADVISE", fake)
    monkeypatch.delenv("PHALANX_SHM_THP", raising=False)
    adv = _huge_pages.Advisor()
    block = _huge_pages.BLOCK
    adv.advise([(4 * block, 2 * block)])  # blocks 4, 5: first sighting
    assert fake.calls == [] and not adv.seen and adv.sighted == {4: 1, 5: 1}
    adv.advise([(5 * block, 2 * block)])  # block 5 again (advised), block 6 first seen
    assert fake.calls == [(5 * block, block, MADV_HUGEPAGE), (5 * block, block, MADV_COLLAPSE)]
    assert adv.seen == {5} and adv.sighted == {4: 1, 6: 1}


def test_refusals_are_counted_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_huge_pages, "_MADVISE", _Recorder(refuse=True))
    monkeypatch.delenv("PHALANX_SHM_THP", raising=False)
    adv = _huge_pages.Advisor()
    for _ in range(_huge_pages.SIGHTINGS):
        adv.advise([(0, 2 * _huge_pages.BLOCK)])
    assert (adv.collapsed, adv.refused, sum(adv.errors.values())) == (0, 2, 1)


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_switch_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    fake = _Recorder()
    monkeypatch.setattr(_huge_pages, "_MADVISE", fake)
    monkeypatch.setenv("PHALANX_SHM_THP", value)
    adv = _huge_pages.Advisor()
    for _ in range(_huge_pages.SIGHTINGS):
        adv.advise([(0, 8 * MB)])
    assert fake.calls == [] and not adv.seen and not adv.sighted


def test_real_advice_keeps_the_contents(monkeypatch: pytest.MonkeyPatch) -> None:
    """On Linux the kernel gets the advice (it may refuse: THP off, an old kernel); the data must not change."""
    if not sys.platform.startswith("linux"):
        pytest.skip("madvise advice is Linux only")
    monkeypatch.delenv("PHALANX_SHM_THP", raising=False)
    t = torch.arange(3 * MB, dtype=torch.float32)  # 12 MB: several whole blocks
    adv = _huge_pages.Advisor()
    for _ in range(_huge_pages.SIGHTINGS):
        adv.advise([(t.data_ptr(), t.numel() * t.element_size())])
    assert adv.calls >= 1 and adv.collapsed + adv.refused == len(adv.seen) >= 6
    assert torch.equal(t, torch.arange(3 * MB, dtype=torch.float32))


def test_at_most_max_blocks_are_advised(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _Recorder()
    monkeypatch.setattr(_huge_pages, "_MADVISE", fake)
    monkeypatch.delenv("PHALANX_SHM_THP", raising=False)
    monkeypatch.setattr(_huge_pages, "SIGHTINGS", 1)
    monkeypatch.setattr(_huge_pages, "MAX_BLOCKS", 3)
    adv = _huge_pages.Advisor()
    block = _huge_pages.BLOCK
    adv.advise([(0, 2 * block), (10 * block, 2 * block)])  # 4 blocks wanted, 3 allowed
    adv.advise([(20 * _huge_pages.BLOCK, 2 * _huge_pages.BLOCK)])
    assert adv.seen == {0, 1, 10} and adv.collapsed == 3
