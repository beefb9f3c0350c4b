"""Put this folder on PYTHONPATH to inject the filesystem faults of `RFT_TEST_FAULTS` into
every Python process started with it (`injector.py` says what a schedule holds). Without
that variable it does nothing."""

import importlib.util
import os
import sys
from pathlib import Path

if os.environ.get("RFT_TEST_FAULTS"):
    # Loaded by file, not imported by name: only this folder is on the path, and the
    # module must not shadow anything the process under test imports.
    _spec = importlib.util.spec_from_file_location("_rft_test_faults",
                                                   Path(__file__).with_name("injector.py"))
    assert _spec is not None and _spec.loader is not None
    _injector = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _injector  # dataclasses look their module up there
    _spec.loader.exec_module(_injector)
    _injector.install_from_environment()
