"""Registries: declarative, duplicates raise, backends lazy so `import draftline.core` stays light."""

import subprocess
import sys

import pytest

from draftline.core.registry import BACKENDS, METHODS, Registry, RegistryError


def test_duplicate_names_raise():
    reg = Registry("thing")
    reg.register("a", object())
    with pytest.raises(RegistryError, match="thing 'a' is already registered"):
        reg.register("a", object())
    with pytest.raises(RegistryError, match="already registered"):
        METHODS.register("dflash", type("Again", (), {}))


def test_unknown_name_lists_known():
    with pytest.raises(RegistryError, match="unknown method 'medusa'; known: .*dflash.*none"):
        METHODS.get("medusa")


def test_backends_resolve_lazily():
    assert BACKENDS.get("reference").__name__ == "ReferenceBackend"


def test_import_core_is_light():
    code = (
        "import sys, draftline.core, draftline.core.spec, draftline.core.engine, draftline.core.machine, draftline.core.sampling, draftline.core.registry\n"
        "draftline.core.registry.METHODS.names()\n"
        "bad = [m for m in ('triton', 'draftline.backends.reference.backend') if m in sys.modules]\n"
        "import torch\n"
        "assert not bad, bad\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
