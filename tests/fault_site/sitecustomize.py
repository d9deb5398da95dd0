"""Test-only: Python imports this module at the start of every process that has this folder on
its path (``faults.install`` puts it there while a test has a fault installed). Where the
environment names a fault, the process's stages commit it (``faults.install_in_this_process``);
elsewhere it does nothing."""

import os

if os.environ.get("PIPEPOOL_TEST_FAULT"):
    import faults

    faults.install_in_this_process()
