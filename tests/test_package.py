"""The package's shape: the product imports none of the offline tools, and the lazy names reach them."""

import subprocess
import sys


def test_import_sparse_fx_loads_no_offline_tool_and_the_lazy_names_reach_them():
    code = (
        "import sys, sparse_fx\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('sparse_fx.offline'))\n"
        "assert not loaded, loaded\n"
        "from sparse_fx.offline.calibrate import calibrate\n"
        "from sparse_fx.offline.train import train_signatures\n"
        "assert sparse_fx.calibrate is calibrate and sparse_fx.train_signatures is train_signatures\n"
        "try:\n"
        "    sparse_fx.no_such_name\n"
        "except AttributeError as e:\n"
        "    assert 'no_such_name' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
