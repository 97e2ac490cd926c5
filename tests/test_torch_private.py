"""The private torch APIs the packed loader relies on (`ctseg.data.torch_private`) still exist and
still do what the loader needs, so a torch upgrade that drops or changes one fails here, not in
a training run; and a torch without one gets a one-line error naming the torch to install."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ctseg.data import torch_private
from ctseg.data.loader import _as_batch, build_loader
from ctseg.data.patches import PatchDataset
from ctseg.io import CtsegError

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@pytest.fixture
def fresh_require():
    """`require` caches its answer per process; these tests change what it sees."""
    torch_private.require.cache_clear()
    yield
    torch_private.require.cache_clear()


def test_written_for_the_pinned_torch():
    pin = re.search(r'"torch==([^"]+)"', PYPROJECT.read_text())
    assert pin and pin.group(1) == torch_private.WRITTEN_FOR


def test_every_private_api_the_loader_uses_exists_in_this_torch():
    assert set(torch_private.PRIVATE_APIS) >= {
        torch_private.NEW_SHARED,
        torch_private.GET_ITERATOR,
        torch_private.GETITEMS,
        torch_private.USE_COUNT,
    }
    assert torch_private.missing() == [], torch.__version__


def test_new_shared_storage_is_shared_memory():
    storage = torch.UntypedStorage._new_shared(4096)
    assert storage.is_shared() and storage.nbytes() == 4096


def test_use_count_counts_views_of_a_storage():
    """What `ctseg.data.slots.SlotReturns` reads to know a batch is no longer used."""
    storage = torch.UntypedStorage._new_shared(64)
    count = torch._C._storage_Use_Count
    alone = count(storage._cdata)
    rows = torch.empty(0, dtype=torch.uint8).set_(storage)
    view = rows[8:].numpy()
    assert count(storage._cdata) > alone
    del rows, view
    assert count(storage._cdata) == alone


class _Batches(Dataset):
    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> int:
        raise AssertionError("the fetcher should ask for whole batches")

    def __getitems__(self, indices: list[int]) -> list[int]:
        self.asked.append(list(indices))
        return list(indices)


class _Hooked(DataLoader):
    calls = 0

    def _get_iterator(self):
        type(self).calls += 1
        return super()._get_iterator()


def test_dataloader_asks_for_whole_batches_through_its_iterator_hook():
    """`PackedLoader` overrides `_get_iterator`; `PackedStream` is asked via `__getitems__`."""
    data = _Batches()
    loader = _Hooked(data, batch_size=3, collate_fn=lambda batch: batch)
    assert list(loader) == [[0, 1, 2], [3, 4, 5]]
    assert data.asked == [[0, 1, 2], [3, 4, 5]] and _Hooked.calls == 1


def test_a_missing_private_api_is_one_line_naming_the_torch_to_install(monkeypatch, fresh_require):
    name = torch_private.GET_ITERATOR
    monkeypatch.setitem(
        torch_private.PRIVATE_APIS, name, (lambda: False, torch_private.PRIVATE_APIS[name][1])
    )
    dataset = PatchDataset.__new__(PatchDataset)  # never read: the check comes first
    with pytest.raises(CtsegError) as caught:
        build_loader(dataset, {"workers": 0, "batch_size": 2}, seed=0)
    text = str(caught.value)
    assert "\n" not in text
    assert name in text and "ctseg.data.loader.PackedLoader" in text
    assert f"written for torch {torch_private.WRITTEN_FOR}" in text
    assert f"install torch=={torch_private.WRITTEN_FOR}" in text


def test_a_missing_reference_count_warns_and_the_loader_still_builds(monkeypatch, fresh_require):
    name = torch_private.USE_COUNT
    monkeypatch.setitem(
        torch_private.PRIVATE_APIS, name, (lambda: False, torch_private.PRIVATE_APIS[name][1])
    )
    with pytest.warns(RuntimeWarning, match="copied out of their slots"):
        torch_private.require()


def test_a_fetcher_that_skips_getitems_is_named_not_a_deep_traceback():
    with pytest.raises(CtsegError, match=re.escape("__getitems__")) as caught:
        _as_batch([object()])  # what the fetcher hands collate without `__getitems__`
    assert f"torch=={torch_private.WRITTEN_FOR}" in str(caught.value)
