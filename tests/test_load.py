"""Importing fsdp_native without a usable compiled extension says how to rebuild it."""
import sys

import pytest
import torch

import fsdp_native
from fsdp_native._load import load_extension


def test_extension_records_the_torch_it_was_built_against():
    assert fsdp_native._C.torch_version == torch.__version__


def test_stale_extension_raises_import_error_with_rebuild_command(monkeypatch):
    monkeypatch.setattr(fsdp_native._C, "torch_version", "0.0.0")
    with pytest.raises(ImportError, match=r"built against torch 0\.0\.0, but torch .* is installed\. Rebuild it .*make build"):
        load_extension()


def test_missing_extension_raises_import_error_with_rebuild_command(monkeypatch):
    monkeypatch.delattr(fsdp_native, "_C")
    monkeypatch.setitem(sys.modules, "fsdp_native._C", None)
    with pytest.raises(ImportError, match=r"fsdp_native\._C could not be loaded .*make build"):
        load_extension()
